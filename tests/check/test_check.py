"""``planner check FILE``: real config files of each supported format (tests/data/check/), each
read into the TrainConfig fields the file says and answered with a diff of the file's own keys;
a change that makes a config fit is planned again by applying the diff and checking the result.
Bad files: one line, exit 2."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")  # the test extra installs it: TRL's own SFTConfig reads the TRL fixture

from planner.check import check  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "check"
TRL = DATA / "trl" / "sft_llama2_full.yaml"
HF = DATA / "hf" / "training_args.json"
ACCEL_ARGS, ACCEL = DATA / "accelerate" / "training_args.yaml", DATA / "accelerate" / "accelerate_config.yaml"


def test_trl_sft_yaml_is_read_with_trls_defaults_and_a_full_7b_on_a10g_gets_the_change_that_fits(tmp_path):
    result = check([TRL], gpu="a10g")
    c = result.config
    assert result.schema.startswith("TRL ")
    # the file's keys, and TRL's defaults where it says nothing: bf16 on unless fp16
    # (trl/trainer/base_config.py), the model loaded in ModelConfig's dtype float32 -> bf16-mixed;
    # optim: TrainingArguments' default adamw_torch_fused, planned as the fused AdamW
    assert (str(c.method), str(c.precision), str(c.optimizer)) == ("full", "bf16-mixed", "adamw_fused")
    assert (c.micro_batch, c.grad_accum, c.gpus, c.seq_len, c.grad_ckpt, c.packing) == (4, 8, 1, 2048, True, True)
    assert result.origins["seq_len"]["key"] == "max_length"
    # 7B full fine-tuning with AdamW: 16 bytes a parameter of states alone (fp32 weights, grads,
    # two moments) = 108 GB > the A10G's 24 GB
    assert not result.fits and result.peak_bytes > 100 * 2**30 and result.oom_probability > 0.99
    change = result.change
    assert change is not None and change.goal == "fit" and str(change.config.method) == "qlora"
    diff = {k.key: (k.old, k.new) for k in change.keys}
    assert diff == {"use_peft": (False, True), "load_in_4bit": (False, True), "lora_r": (16, 16),
                    "lora_target_modules": (None, "all-linear")} or diff.keys() >= {"use_peft", "load_in_4bit"}
    assert all(k.file == str(TRL) for k in change.keys)
    # the diff applied to the file plans a configuration that fits
    import yaml

    data = yaml.safe_load(TRL.read_text())
    data.update({k.key: k.new for k in change.keys})
    changed = tmp_path / "sft.yaml"
    changed.write_text(yaml.safe_dump(data))
    again = check([changed], gpu="a10g")
    assert again.fits and again.config == change.config


def test_hf_training_args_json_with_its_deepspeed_json_and_the_adapter_config_beside_it():
    result = check([HF], gpu="a10g", seq_len=1024)
    c = result.config
    assert result.schema.startswith("transformers ")  # no TRL-only key: TrainingArguments' defaults
    assert set(result.files) == {str(HF), str(HF.parent / "adapter_config.json"), str(HF.parent / "ds_config.json")}
    assert (str(c.method), c.lora_r, c.lora_targets, c.lora_dropout) == ("lora", 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 0.05)
    assert (c.micro_batch, c.grad_accum, c.grad_ckpt, str(c.precision)) == (2, 16, True, "bf16-mixed")
    assert (c.zero, str(c.offload)) == (2, "optimizer")
    assert result.origins["zero"] == {"file": str(HF.parent / "ds_config.json"), "key": "zero_optimization.stage",
                                      "value": 2, "given": True}
    assert result.fits
    change = result.change
    assert change is not None and change.goal == "faster"
    assert change.estimate["throughput"]["tokens_per_s"] > result.estimate["throughput"]["tokens_per_s"] * 1.02
    assert change.estimate["fits"] and not change.estimate["near_edge"]
    # 0.5B with LoRA has room: the change arranges the step (a larger micro-batch with the same
    # global batch, or no recompute; the kernel throughput model picks the former today) and
    # keeps the method, the adapter and the numerics
    keys = {k.key for k in change.keys}
    assert keys and keys <= {"per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
                             "zero_optimization.reduce_bucket_size"}
    # the file leaves the reduce bucket out, so DeepSpeed's 5e8 elements (1 GB in bf16) hold today
    # (counted in result.estimate); the changed plan is the planner's, "auto" for the Trainer to fill
    assert result.config.sharding.buffers == ()
    assert [(k.file, k.new) for k in change.keys if k.key.startswith("zero_optimization.")] == \
        [(str(HF.parent / "ds_config.json"), "auto")]
    assert all(k.file == str(HF) for k in change.keys if not k.key.startswith("zero_optimization."))
    page = result._repr_html_()  # Jupyter's table: the verdict and the diff
    assert "<table>" in page and sorted(keys)[0] in page and "faster" in page


def test_accelerate_config_with_its_deepspeed_json_and_the_training_arguments():
    result = check([ACCEL_ARGS, ACCEL], gpu="a10g", seq_len=1024)
    c = result.config
    assert (c.gpus, c.zero, str(c.offload), c.micro_batch, c.grad_accum, c.grad_ckpt) == (4, 3, "none", 4, 2, False)
    assert result.origins["gpus"]["key"] == "num_processes"
    assert not result.fits
    keys = {(k.file, k.key, k.old, k.new) for k in result.change.keys}
    # the change is written where each setting was read: checkpointing in the arguments file
    # (transformers 5's name), ZeRO's offload in the DeepSpeed JSON the accelerate config names
    assert (str(ACCEL_ARGS), "activation_checkpointing", False, True) in keys
    assert any(f == str(DATA / "accelerate" / "ds_zero3.json") and k.startswith("zero_optimization.") for f, k, _, _ in keys)
    assert result.change.estimate["fits"]


def test_a_mapping_and_a_training_arguments_object_are_read_alike():
    from planner.check import check_arguments

    args = json.loads(HF.read_text())
    del args["deepspeed"]
    from_mapping = check_arguments(args, gpu="a10g", seq_len=512)
    assert (str(from_mapping.config.method), from_mapping.config.micro_batch) == ("full", 2)


@pytest.mark.parametrize("text, suffix, message", [
    ('{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "per_device_batch": 4}', ".json",
     "per_device_batch is not a key of"),
    ("{not json", ".json", "is not valid JSON (line 1"),
    ("a: [1, 2", ".yaml", "is not valid YAML"),
    ('{"model_name_or_path": "gpt2", "fsdp": "shard_grad_op"}', ".json", "'shard_grad_op' is not modelled: FSDP is planned fully sharded"),
    ('{"model_name_or_path": "gpt2", "fsdp": "full_shard", "fsdp_config": {"version": 3}}', ".json",
     "fsdp_config.version must be 1 or 2, got 3"),
    ('{"model_name_or_path": "gpt2", "fsdp": "full_shard", "fsdp_config": "missing.json"}', ".json",
     "fsdp_config names missing.json, which is not a file here"),
    ('{"model_name_or_path": "gpt2", "fsdp": "full_shard", "deepspeed": {"zero_optimization": {"stage": 2}}}', ".json",
     "fsdp and deepspeed are both set: keep one"),
    ('{"model_name_or_path": "gpt2", "deepspeed": "missing.json"}', ".json", "deepspeed names missing.json"),
    ('{"output_dir": "x"}', ".json", "no file names the model"),
    ("[1, 2]", ".json", "does not hold a mapping"),
    ("[" * 100_000, ".json", "nests its values too deeply"),  # found by tests/cli/test_fuzz_cli.py
    ("[" * 100_000, ".yaml", "nests its values too deeply"),
])
def test_bad_files_get_one_line_and_exit_2(text, suffix, message, tmp_path, cli):
    path = tmp_path / f"args{suffix}"
    path.write_text(text)
    r = cli("check", str(path), "--gpu", "a10g")
    assert r.code == 2, r
    assert r.err.count("\n") == 1 and r.err.startswith("error: ") and message in r.err, r.err
    assert "Traceback" not in r.err


def test_the_cli_prints_the_verdict_and_the_diff_and_exits_3_when_it_does_not_fit(cli, tmp_path):
    shutil.copy(TRL, tmp_path / "sft.yaml")
    r = cli("check", str(tmp_path / "sft.yaml"), "--gpu", "a10g")
    assert r.code == 3, r
    assert "does NOT fit" in r.out and "closest change that makes it fit" in r.out and "load_in_4bit: False -> True" in r.out
    j = cli("check", str(HF), "--gpu", "a10g", "--seq-len", "1024", "--json")
    assert j.code == 0, j
    data = json.loads(j.out)
    assert data["fits"] and data["change"]["goal"] == "faster" and data["peak_phase"]
    assert {d["key"] for d in data["change"]["diff"]} == {k.key for k in check([HF], gpu="a10g", seq_len=1024).change.keys}


@pytest.mark.parametrize("data, message", [
    ({"model_name_or_path": "gpt2", "max_length": "long"}, "max_length must be a whole number"),
    ({"model_name_or_path": "gpt2", "use_peft": True, "lora_dropout": "0.1"}, "lora_dropout must be a number"),
    ({"model_name_or_path": "gpt2", "use_peft": True, "lora_target_modules": 5}, "target modules must be a list"),
    ({"model_name_or_path": "gpt2", "dtype": ["bfloat16"]}, "dtype ['bfloat16'] is not read by the planner"),
    ({"model_name_or_path": "gpt2", "max_length": 512, "deepspeed": {"zero_optimization": {"offload_optimizer": "cpu"}}},
     "zero_optimization.offload_optimizer must be a mapping"),
])
def test_values_of_the_wrong_type_are_one_line_not_a_crash(data, message, tmp_path, cli):
    path = tmp_path / "sft.json"
    path.write_text(json.dumps(data))
    r = cli("check", str(path), "--gpu", "a10g", "--trainer", "trl")
    assert r.code == 2 and message in r.err and r.err.count("\n") == 1, r


def test_a_trl_qlora_without_target_modules_gets_peft_s_default_and_a_t4_refuses_trls_default_bf16(tmp_path, cli):
    path = tmp_path / "qlora.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-2-7b-hf\nuse_peft: true\nload_in_4bit: true\nmax_length: 1024\n"
                    "per_device_train_batch_size: 2\n")
    # TRL turns bf16 on unless fp16 (trl/trainer/base_config.py): a T4 has none, and the line says where it came from
    r = cli("check", str(path), "--gpu", "t4")
    assert r.code == 2 and "no bf16 support" in r.err and f"[read from {path}: bf16 (the trainer's default" in r.err, r
    path.write_text(path.read_text() + "fp16: true\n")
    result = check([path], gpu="t4")
    c = result.config
    # peft's table for llama (peft/utils/constants.py): q_proj and v_proj; TRL's lora_dropout 0.05
    assert (str(c.method), str(c.precision), c.lora_targets, c.lora_dropout, c.packing) == \
        ("qlora", "fp16-mixed", ("q_proj", "v_proj"), 0.05, False)
    assert result.fits


@pytest.mark.parametrize("dtype, upcast", [(None, True), ("float32", True), ("bfloat16", False)])
def test_a_trl_qlora_keeps_its_unquantised_weights_in_the_load_dtype(dtype, upcast, tmp_path):
    """TRL's SFTTrainer wraps a 4-bit model with get_peft_model alone (no prepare_model_for_kbit_training:
    trl 1.16 sft_trainer.py), so the norms, embeddings and head stay in ModelConfig's dtype: float32 (its
    default) is what peft's upcast gives, bfloat16 keeps them 16-bit, and the peak follows."""
    path = tmp_path / "qlora.yaml"
    path.write_text("model_name_or_path: meta-llama/Llama-3.1-8B\nuse_peft: true\nload_in_4bit: true\nmax_length: 2048\n"
                    "per_device_train_batch_size: 2\nlora_target_modules: all-linear\n" + (f"dtype: {dtype}\n" if dtype else ""))
    result = check([path], gpu="a10g")
    assert result.config.kbit_upcast is upcast
    assert (result.origins["kbit_upcast"]["key"], result.origins["kbit_upcast"]["given"]) == ("dtype", dtype is not None)
    # the 16-bit load holds the 128k x 4096 embedding and head (and every norm) at 2 bytes, not 4: over 2 GiB less
    if not upcast:
        path.write_text(path.read_text().replace("dtype: bfloat16", "dtype: float32"))
        assert check([path], gpu="a10g").peak_bytes - result.peak_bytes > 2 * 2**30


def test_a_deepspeed_json_whose_numbers_differ_from_the_trainers_is_refused_as_the_trainer_refuses_it(tmp_path, cli):
    # transformers integrations/deepspeed.py fill_match: a value that is not "auto" must equal the Trainer's
    shutil.copy(HF.parent / "adapter_config.json", tmp_path / "adapter_config.json")
    args = json.loads(HF.read_text())
    (tmp_path / "args.json").write_text(json.dumps(args))
    for ds, words in (({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}},
                       "train_micro_batch_size_per_gpu 4 differs from per_device_train_batch_size 2"),
                      ({"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}, "bf16.enabled false differs from bf16")):
        (tmp_path / "ds_config.json").write_text(json.dumps(ds))
        r = cli("check", str(tmp_path / "args.json"), "--gpu", "a10g")
        assert r.code == 2 and words in r.err, r


def test_emitted_recipe_settings_read_back_through_the_same_library_keys():
    """``planner emit`` writes the recipe's settings under the keys their entries declare
    (``planner.request``: TrainingArguments' ``use_cache`` and Liger's switch, PEFT's dropout), and
    ``planner check`` reads the emitted files back to the same values."""
    from planner.check import read_texts
    from planner.config import TrainConfig
    from planner.emit import settings
    from planner.request import ADAPTER_RECIPE, TRAINING_ARGS

    spec = type("Spec", (), {"is_encoder": False, "is_encoder_decoder": False})
    # the eval pass is refused with the fused loss (planner.config): one config for each
    for config in (TrainConfig(method="lora", fused_ce=True, use_cache=True, lora_dropout=0.1, micro_batch=2),
                   TrainConfig(method="lora", use_cache=True, lora_dropout=0.1, micro_batch=2, eval_batch=4)):
        args = {"model_name_or_path": "gpt2", **settings.training_arguments(config, on_cpu=False)}
        reading = read_texts({"training_args.json": json.dumps(args),
                              # as PEFT saves it: LoraConfig's fields with the peft_type
                              "adapter_config.json": json.dumps({"peft_type": "LORA",
                                                                 **settings.lora_config(config, spec=spec)})})
        # the eval pass the plan holds runs (eval_strategy), and its batch is read back
        assert args["eval_strategy"] == ("steps" if config.eval_batch else "no")
        for f in (*TRAINING_ARGS, *ADAPTER_RECIPE):
            # no evaluation: not read (eval_strategy "no"); a switch is read only when on
            if (f.evaluation and not config.eval_batch) or (f.switch and not getattr(config, f.name)):
                assert f.name not in reading.options
                continue
            assert reading.options[f.name] == getattr(config, f.name), f.name
            assert reading.origins[f.name].key in (f.training_args, f.peft)
        assert (reading.options["use_cache"], reading.options.get("fused_ce", False), reading.options["lora_dropout"]) \
            == (True, config.fused_ce, 0.1)


@pytest.mark.parametrize("args, eval_batch, given", [
    ({"eval_strategy": "steps", "per_device_eval_batch_size": 16}, 16, True),
    ({"eval_strategy": "epoch"}, 8, False),  # TrainingArguments' default per_device_eval_batch_size
    ({"eval_strategy": "no", "per_device_eval_batch_size": 16}, None, None),  # no evaluation: nothing to plan
    ({"per_device_eval_batch_size": 16}, None, None),  # eval_strategy's default is "no"
])
def test_the_eval_batch_is_read_where_the_file_evaluates(args, eval_batch, given, tmp_path):
    from planner.check import check

    path = tmp_path / "training_args.json"
    path.write_text(json.dumps({"model_name_or_path": "gpt2", "output_dir": "out", "bf16": True,
                                "per_device_train_batch_size": 2, **args}))
    result = check([path], gpu="a10g", seq_len=256)
    assert result.config.eval_batch == eval_batch
    if eval_batch is None:
        assert "eval_batch" not in result.origins and not result.estimate["memory"]["peak_phase"].startswith("eval")
    else:
        assert result.origins["eval_batch"] == {"file": str(path), "key": "per_device_eval_batch_size",
                                                "value": eval_batch, "given": given}
        assert any(note.startswith(f"eval_strategy {args['eval_strategy']}: the plan holds the eval pass at "
                                   f"per_device_eval_batch_size {eval_batch}") for note in result.notes)


def test_check_prints_no_library_warnings(tmp_path):
    """A real `planner check` process: transformers imports bitsandbytes, whose CPU backend warned
    on this machine (AVX512-BF16) that its optional Hub kernel could not load; reading keys runs no
    kernel, so stderr holds nothing but what the planner says."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "planner", "check", str(HF), "--gpu", "a10g", "--seq-len", "1024"],
                          capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert "kernels-community" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_config_near_the_edge_is_offered_a_change_that_takes_it_off_the_edge(cli, tmp_path):
    """It fits (2 x 3840 tokens on a 4090) but at an OOM risk over 5% (19%): the change is one
    that fits with a margin, and the line says so instead of "that makes it fit"."""
    path = tmp_path / "axolotl.yml"
    path.write_text("base_model: meta-llama/Llama-3.1-8B\nload_in_4bit: true\nadapter: qlora\nlora_r: 32\n"
                    "lora_alpha: 16\nlora_target_linear: true\nsequence_len: 3840\nmicro_batch_size: 2\n"
                    "gradient_accumulation_steps: 4\noptimizer: paged_adamw_8bit\nbf16: true\n"
                    "gradient_checkpointing: true\nflash_attention: true\n")
    result = check([path], gpu="rtx4090")
    assert result.fits and result.estimate["near_edge"] and result.change.goal == "fit"
    assert result.change.estimate["fits"] and not result.change.estimate["near_edge"]
    r = cli("check", str(path), "--gpu", "rtx4090")
    assert r.code == 0, r
    assert "fits: " in r.out and "near the edge" in r.out
    assert "closest change that makes it fit with an OOM risk <= 5%:" in r.out
    assert "closest change that makes it fit with" in result._repr_html_()  # the notebook view
