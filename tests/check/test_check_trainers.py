"""``planner check`` on an axolotl YAML, a LLaMA-Factory YAML and a torchtune recipe config
(tests/data/check/<trainer>/, each the trainer's own example file), read with the trainer's
schema as shipped (planner/data/trainers/, written by bench/trainer_schemas.py from the released
trainer); a config that does not fit gets a change that does, verified by applying the change to
a copy of the file and checking the copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from planner.check import check
from planner.check.trainers import MODULES, shipped, trainer
from planner.errors import InvalidConfigError, UnsupportedError

DATA = Path(__file__).resolve().parents[1] / "data" / "check"
AXOLOTL = DATA / "axolotl" / "llama3_qlora.yml"
LLAMA_FACTORY = DATA / "llama_factory" / "llama3_lora_sft.yaml"
TORCHTUNE = DATA / "torchtune" / "1B_lora_single_device.yaml"
TORCHTUNE_MODEL = "meta-llama/Llama-3.2-1B-Instruct"  # what the config's `tune download` comment fetches


def apply(change, folder: Path) -> None:
    """Write each key of the change into the files of ``folder`` (dotted keys as nested ones)."""
    for key in change.keys:
        path = folder / Path(key.file).name
        is_json = path.suffix == ".json"
        data: dict[str, Any] = {}
        if path.exists():
            data = json.loads(path.read_text()) if is_json else yaml.safe_load(path.read_text())
        node = data
        *parents, last = key.key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = key.new
        path.write_text(json.dumps(data) if is_json else yaml.safe_dump(data))


def copy(path: Path, tmp_path: Path) -> Path:
    shutil.copy(path, tmp_path / path.name)
    return tmp_path / path.name


def test_each_shipped_schema_says_its_trainer_version_and_source_and_holds_the_examples_keys():
    for module in MODULES.values():
        data = shipped(module)
        assert data["version"] and data["source"] and data["generated_by"] == "bench/trainer_schemas.py"
    axolotl = trainer("axolotl").schema()
    assert axolotl.name == "axolotl 0.19.0 AxolotlInputConfig" and axolotl.defaults["sequence_len"] == 512
    assert axolotl.defaults["model_type"] is None  # an alias pydantic takes for type_of_model
    lf = trainer("llama-factory").schema()
    assert lf.defaults["cutoff_len"] == 2048 and lf.defaults["lora_target"] == "all" and "warmup_ratio" in lf.defaults
    assert "transformers 5.6.0" in shipped("llama_factory")["source"]  # LLaMA-Factory 0.9.5 caps transformers at 5.6.0
    tt = trainer("torchtune")
    assert "enable_activation_checkpointing" in tt.schema("lora_finetune_single_device").defaults
    assert tt.component("torchtune.models.llama3_2.lora_llama3_2_1b").defaults["lora_rank"] == 8


def test_axolotl_qlora_example_is_read_with_its_keys_and_gets_a_change_that_fits(tmp_path):
    result = check([AXOLOTL], gpu="a10g")
    c = result.config
    assert result.schema == "axolotl 0.19.0 AxolotlInputConfig"
    assert (str(c.method), str(c.precision), str(c.optimizer), str(c.attention)) == ("qlora", "bf16-mixed", "paged_adamw_8bit", "flash")
    assert (c.micro_batch, c.grad_accum, c.seq_len, c.lora_r, c.lora_targets, c.grad_ckpt, c.packing) == \
        (2, 4, 4096, 32, ("all-linear",), True, True)
    assert result.origins["seq_len"]["key"] == "sequence_len" and result.origins["method"]["key"] == "adapter"
    assert any("debug: not a key of axolotl 0.19.0" in n for n in result.notes)  # named, not dropped
    assert any("bf16: auto is on on a10g" in n for n in result.notes)
    assert not result.fits
    change = result.change
    assert change.goal == "fit" and {k.key for k in change.keys} >= {"micro_batch_size", "gradient_accumulation_steps"}
    copied = copy(AXOLOTL, tmp_path)
    apply(change, tmp_path)
    again = check([copied], gpu="a10g")
    # axolotl casts the norms, embeddings and head back to torch_dtype after the k-bit preparation:
    # no k-bit upcast (the search planned peft's, which needs more)
    assert result.config.kbit_upcast is False and again.config.kbit_upcast is False
    assert again.fits and again.config == change.config.replace(kbit_upcast=False)


def test_llama_factory_lora_sft_example_near_the_edge_gets_the_change_that_fits_safely(tmp_path):
    # an A10G of which another process holds half a GiB (22 GiB left): LLaMA-Factory's Llama-3-8B LoRA
    # example fits there at an OOM risk of 9.6% (near the edge: over 5%)
    room = 22 * 1024**3
    result = check([LLAMA_FACTORY], gpu="a10g", gpu_mem_bytes=room)
    c = result.config
    assert result.schema.startswith("llama-factory 0.9.5 ModelArguments")
    # LLaMA-Factory: LoRA in bf16 is a bf16 base with fp32 adapters; checkpointing on by default;
    # lora_target all = every linear; optim: transformers' default adamw_torch_fused, the fused AdamW
    assert (str(c.method), str(c.precision), str(c.optimizer), c.grad_ckpt) == ("lora", "bf16", "adamw_fused", True)
    assert (c.micro_batch, c.grad_accum, c.seq_len, c.lora_r, c.lora_targets, c.packing) == (1, 8, 2048, 8, ("all-linear",), False)
    assert result.origins["grad_ckpt"] == {"file": str(LLAMA_FACTORY), "key": "disable_gradient_checkpointing",
                                           "value": False, "given": False}
    assert result.fits and result.estimate["near_edge"]
    change = result.change
    assert change.goal == "fit"
    # the most faithful plan that fits safely keeps 16-bit LoRA (QLoRA ranks after it) on the attention's
    # projections only: one key of the file
    assert [(k.key, k.old, k.new) for k in change.keys] == [("lora_target", "all", "q_proj,k_proj,v_proj,o_proj")]
    copied = copy(LLAMA_FACTORY, tmp_path)
    apply(change, tmp_path)
    again = check([copied], gpu="a10g", gpu_mem_bytes=room)
    # the file read back is the change's plan, which fits with its risk under 5%
    assert again.fits and not again.estimate["near_edge"] and again.config == change.config
    assert again.estimate["oom_probability"] < 0.05 < result.estimate["oom_probability"]


def test_torchtune_lora_recipe_config_is_read_through_its_recipe_and_components(tmp_path):
    result = check([TORCHTUNE], gpu="a10g", model=TORCHTUNE_MODEL)
    c = result.config
    assert result.schema == "torchtune 0.6.1+cpu recipe lora_finetune_single_device"
    # output_proj is HF's o_proj; apply_lora_to_mlp adds the MLP's three projections
    assert c.lora_targets == ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (str(c.method), str(c.precision), str(c.optimizer), c.lora_r, c.micro_batch, c.grad_accum, c.grad_ckpt) == \
        ("lora", "bf16", "adamw_fused", 64, 4, 8, False)  # torch.optim.AdamW with fused: True
    assert not result.fits and result.change.goal == "fit"
    assert all(k.file == str(TORCHTUNE) for k in result.change.keys)
    copied = copy(TORCHTUNE, tmp_path)
    apply(result.change, tmp_path)
    again = check([copied], gpu="a10g", model=TORCHTUNE_MODEL)
    assert again.fits and again.config == result.change.config


def test_torchtune_qlora_builder_keeps_the_stream_16_bit(tmp_path):
    data = yaml.safe_load(TORCHTUNE.read_text())
    data["model"]["_component_"] = data["model"]["_component_"].replace(".lora_", ".qlora_")
    path = tmp_path / TORCHTUNE.name
    path.write_text(yaml.safe_dump(data))
    result = check([path], gpu="a100-80gb", model=TORCHTUNE_MODEL)
    c = result.config
    assert (str(c.method), str(c.precision), c.kbit_upcast) == ("qlora", "bf16-mixed", False)
    assert result.origins["kbit_upcast"]["given"] is False


TORCHTUNE_FULL = DATA / "torchtune" / "8B_full_single_device.yaml"
TORCHTUNE_FULL_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: bf16 gradients of Llama-3.1-8B (8,030,261,248 parameters) less the largest one alone, the
#: embedding's or the head's 128256 x 4096: what the optimizer in backward never holds
IN_BWD_SAVES = 2 * (8_030_261_248 - 128256 * 4096)


@pytest.mark.parametrize("gpu", ["rtx4090", "a100-80gb"])
def test_torchtune_full_recipe_steps_the_optimizer_in_backward_over_chunked_logits(gpu, tmp_path):
    """torchtune's flagship single-device full recipe (optimizer_in_bwd, PagedAdamW8bit, the loss
    over 8 chunks, checkpointing) is read and planned, not refused: its keys are named where the
    fields come from, and setting optimizer_in_bwd false costs every gradient but the largest at
    the end of backward, so the peak rises by at most that (tests/memory/test_torchtune_fields.py
    holds the end of backward to exactly that)."""
    result = check([TORCHTUNE_FULL], gpu=gpu, model=TORCHTUNE_FULL_MODEL)
    c = result.config
    assert (c.optimizer_in_bwd, c.loss_chunks, str(c.optimizer), c.grad_accum, c.grad_ckpt) == \
        (True, 8, "paged_adamw_8bit", 1, True)
    payload = result.to_dict()
    assert payload["estimate"]["config"]["optimizer_in_bwd"] is True and payload["estimate"]["config"]["loss_chunks"] == 8
    assert payload["read"]["optimizer_in_bwd"]["key"] == "optimizer_in_bwd" and payload["read"]["optimizer_in_bwd"]["given"]
    assert payload["read"]["loss_chunks"]["key"] == "loss.num_output_chunks"  # CEWithChunkedOutputLoss' default, 8
    assert not any("CEWithChunkedOutputLoss" in note for note in result.notes)
    if not result.fits:  # the search holds no accumulation at 1: it says so rather than propose a change
        assert result.change is None and "no change searched: the search does not take --optimizer-in-bwd" in result.advice[0]
    data = yaml.safe_load(TORCHTUNE_FULL.read_text())
    plain = tmp_path / "plain.yaml"
    plain.write_text(yaml.safe_dump({**data, "optimizer_in_bwd": False}))
    without = check([plain], gpu=gpu, model=TORCHTUNE_FULL_MODEL)
    assert not without.config.optimizer_in_bwd
    assert 0 < without.peak_bytes - result.peak_bytes <= IN_BWD_SAVES
    # the recipe refuses accumulation with it, as the planner does
    plain.write_text(yaml.safe_dump({**data, "gradient_accumulation_steps": 2}))
    with pytest.raises(InvalidConfigError, match="--grad-accum 1"):
        check([plain], gpu=gpu, model=TORCHTUNE_FULL_MODEL)


def test_a_key_no_trainer_schema_has_is_named_and_an_unmodelled_one_is_refused_by_name(tmp_path):
    data = yaml.safe_load(AXOLOTL.read_text())
    bad = tmp_path / "a.yml"
    bad.write_text(yaml.safe_dump({**data, "micro_batch_sise": 4}))
    with pytest.raises(InvalidConfigError, match="micro_batch_sise is not a key of axolotl 0.19.0"):
        check([bad], gpu="a10g")
    bad.write_text(yaml.safe_dump({**data, "fsdp": ["full_shard"]}))  # FSDP's settings are fsdp_config's
    with pytest.raises(InvalidConfigError, match="fsdp without fsdp_config"):
        check([bad], gpu="a10g")
    # axolotl 0.19's attention key, and its legacy flags refused beside it (as axolotl refuses them)
    modern = {**data, "flash_attention": None, "attn_implementation": "eager"}
    bad.write_text(yaml.safe_dump(modern))
    assert str(check([bad], gpu="a10g").config.attention) == "eager"
    bad.write_text(yaml.safe_dump({**data, "attn_implementation": "sdpa"}))
    with pytest.raises(InvalidConfigError, match="flash_attention, attn_implementation: give one attention"):
        check([bad], gpu="a10g")
    lf = yaml.safe_load(LLAMA_FACTORY.read_text())
    bad = tmp_path / "lf.yaml"
    bad.write_text(yaml.safe_dump({**lf, "use_unsloth": True}))
    with pytest.raises(UnsupportedError, match="use_unsloth"):
        check([bad], gpu="a10g")
    tt = yaml.safe_load(TORCHTUNE.read_text())
    tt["model"]["lora_rnak"] = 8
    bad = tmp_path / "tt.yaml"
    bad.write_text(yaml.safe_dump(tt))
    with pytest.raises(InvalidConfigError, match="model: lora_rnak is not a key of torchtune"):
        check([bad], gpu="a10g", model=TORCHTUNE_MODEL)


def test_trainer_option_reads_a_file_without_its_telltale_key_as_that_trainer(tmp_path):
    data = {k: v for k, v in yaml.safe_load(LLAMA_FACTORY.read_text()).items() if k not in ("stage", "finetuning_type")}
    path = tmp_path / "lf.yaml"
    path.write_text(yaml.safe_dump(data))
    result = check([path], gpu="a10g", trainer="llama-factory")
    assert result.schema.startswith("llama-factory") and str(result.config.method) == "lora"  # FinetuningArguments' default


def test_cli_check_on_an_axolotl_config_prints_the_diff_and_exits_3():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "planner", "check", str(AXOLOTL), "--gpu", "a10g"], capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 3, run.stderr
    assert "axolotl 0.19.0 AxolotlInputConfig" in run.stdout and "micro_batch_size: 2 -> 1" in run.stdout


#: the keys each reader reads, set to values of the wrong type: one line naming the key, never a traceback
ODD = {AXOLOTL: ("micro_batch_size", "gradient_accumulation_steps", "sequence_len", "lora_r", "lora_target_modules",
                 "lora_dropout", "optimizer", "adapter", "attn_implementation", "base_model", "deepspeed"),
       LLAMA_FACTORY: ("per_device_train_batch_size", "cutoff_len", "lora_rank", "lora_target", "lora_dropout", "optim",
                       "finetuning_type", "quantization_bit", "flash_attn", "model_name_or_path"),
       TORCHTUNE: ("batch_size", "gradient_accumulation_steps", "dtype", "model", "optimizer", "tokenizer")}


@pytest.mark.parametrize("path", list(ODD), ids=lambda p: p.parent.name)
def test_values_of_the_wrong_type_are_one_line_errors(path, tmp_path):
    from planner.errors import PlannerError

    original = yaml.safe_load(path.read_text())
    if path == AXOLOTL:  # the lora keys are read with lora_target_linear off
        original["lora_target_linear"] = None
    for key in ODD[path]:
        for odd in ([1], {"a": [1]}, -3):
            changed = tmp_path / path.name
            changed.write_text(yaml.safe_dump({**original, key: odd}))
            try:
                check([changed], gpu="a10g", model=TORCHTUNE_MODEL if path == TORCHTUNE else None)
            except PlannerError as exc:
                assert "\n" not in str(exc)


def test_the_python_api_checks_a_trainers_config_given_as_a_mapping():
    import oom_planner as op

    data = yaml.safe_load(LLAMA_FACTORY.read_text())
    as_mapping = op.check(data, gpu="a10g")
    assert as_mapping.schema.startswith("llama-factory 0.9.5") and as_mapping.config == check([LLAMA_FACTORY], gpu="a10g").config
