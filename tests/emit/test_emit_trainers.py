"""``planner emit --for trl|axolotl|llama-factory|torchtune``: each trainer's config for a plan,
loaded back with the trainer's schema (TRL's own parser; axolotl's, LLaMA-Factory's and
torchtune's as shipped, planner/data/trainers/) and checked back (``planner check``) to the same
configuration; a configuration a trainer cannot say is refused with the way out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from planner.check import check
from planner.emit.trainers import FILE_NAMES, trainer_files
from planner.errors import UnsupportedError
from planner.estimation import build_config, resolve

MODEL = "meta-llama/Llama-3.2-1B"
SPEC, GPU = resolve(model=MODEL, gpu="a10g")


def _config(**options):
    return build_config(SPEC, GPU, seq_len=1024, **options)


#: each trainer with configurations it can say: the methods, precisions, optimizers, sharding and splits
CASES = {
    "full pure bf16, adamw, checkpointing": dict(method="full", precision="bf16", optimizer="adamw", micro_batch=2,
                                                 grad_accum=4, grad_ckpt=True),
    "lora bf16 r16 all-linear dropout": dict(method="lora", precision="bf16", lora_r=16, lora_targets="all-linear",
                                             lora_dropout=0.05, micro_batch=4, grad_accum=2, compile=True),
    "qlora q,v paged 8-bit": dict(method="qlora", precision="bf16-mixed", lora_r=8, lora_targets="q_proj,v_proj",
                                  optimizer="paged_adamw_8bit", micro_batch=1, grad_accum=8, grad_ckpt=True),
    "full bf16-mixed zero2 on 2 GPUs": dict(method="full", precision="bf16-mixed", optimizer="adamw_8bit", gpus=2, zero=2,
                                            micro_batch=1, grad_accum=4, grad_ckpt=True, attention="flash"),
    "full bf16, optimizer in backward, 8 loss chunks": dict(method="full", precision="bf16", optimizer="paged_adamw_8bit",
                                                            micro_batch=2, grad_ckpt=True, optimizer_in_bwd=True,
                                                            loss_chunks=8),
}
#: what each trainer has no spelling for, by case
#: (axolotl loads the model in the training dtype: no fp32 master weights; torchtune trains in one
#: dtype, and its single-device recipes have no sharding; only torchtune steps the optimizer in
#: backward and chunks the loss)
CANNOT = {("axolotl", "full bf16-mixed zero2 on 2 GPUs"), ("torchtune", "full bf16-mixed zero2 on 2 GPUs"),
          *((t, "full bf16, optimizer in backward, 8 loss chunks") for t in ("trl", "axolotl", "llama-factory"))}


def _emit(target: str, config, folder: Path) -> tuple[list[Path], str]:
    files, launch = trainer_files(target, config=config, spec=SPEC, model=MODEL, dataset=None, on_cpu=False)
    for name, text in files.items():
        (folder / name).write_text(text)
    main = folder / FILE_NAMES[target]
    others = [folder / n for n in files if n == "accelerate_config.yaml"]
    return [main, *others], launch


@pytest.mark.parametrize("target", ["trl", "axolotl", "llama-factory", "torchtune"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_emitted_trainer_config_checks_back_to_the_same_configuration(target, case, tmp_path):
    config = _config(**CASES[case])
    if (target, case) in CANNOT:
        with pytest.raises(UnsupportedError, match=f"--for {target}: .* or emit --for hf"):
            _emit(target, config, tmp_path)
        return
    paths, launch = _emit(target, config, tmp_path)
    assert FILE_NAMES[target] in launch
    gpus = None if target == "trl" else config.gpus  # TRL's accelerate config says the processes
    again = check(paths, gpu="a10g", model=MODEL, gpus=gpus)
    # axolotl, LLaMA-Factory and torchtune train QLoRA's non-4-bit parameters 16-bit whatever the plan
    # (no k-bit upcast; TRL runs peft's): their file reads back so, which needs less than the plan
    expected = config.replace(kbit_upcast=False) if str(config.method) == "qlora" and target != "trl" else config
    assert again.config == expected, (again.config.label(), expected.label())
    if config.sharding.payload().get("zero"):
        assert json.loads((tmp_path / "ds_config.json").read_text())["zero_optimization"]["stage"] == 2


def test_torchtune_writes_the_optimizer_in_backward_and_the_loss_chunks_and_the_hf_trainer_refuses_them(tmp_path):
    from planner.emit import settings

    config = _config(**CASES["full bf16, optimizer in backward, 8 loss chunks"])
    (path, *_), _launch = _emit("torchtune", config, tmp_path)
    data = yaml.safe_load(path.read_text())
    assert data["optimizer_in_bwd"] is True and data["gradient_accumulation_steps"] == 1
    assert data["loss"] == {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss", "num_output_chunks": 8}
    with pytest.raises(UnsupportedError, match="the HF Trainer has no optimizer_in_bwd, loss_chunks"):
        settings.training_arguments(config, on_cpu=False)
    lora = yaml.safe_load(_emit("torchtune", _config(**CASES["lora bf16 r16 all-linear dropout"]), tmp_path)[0][0].read_text())
    assert "optimizer_in_bwd" not in lora  # the LoRA recipe reads no such key


def test_the_trl_file_is_parsed_by_trls_own_parser_as_trl_sft_parses_it(tmp_path):
    trl = pytest.importorskip("trl")
    (path, *_), launch = _emit("trl", _config(**CASES["qlora q,v paged 8-bit"]), tmp_path)
    assert launch.endswith("-m trl.scripts.sft --config sft.yaml")
    parser = trl.TrlParser((trl.ScriptArguments, trl.SFTConfig, trl.ModelConfig))
    data = yaml.safe_load(path.read_text())
    data.pop("bf16")  # the Trainer refuses bf16 on a machine without a GPU (this test's)
    script, sft, model = parser.parse_dict({**data, "use_cpu": True})
    assert (sft.per_device_train_batch_size, sft.gradient_accumulation_steps, sft.max_length) == (1, 8, 1024)
    assert (model.use_peft, model.load_in_4bit, model.lora_r, model.lora_target_modules) == (True, True, 8, ["q_proj", "v_proj"])
    assert script.dataset_name == "trl-lib/Capybara"


def test_a_torchtune_config_names_the_builder_tokenizer_and_checkpointer_torchtune_ships_for_the_model(tmp_path):
    (path, *_), launch = _emit("torchtune", _config(**CASES["lora bf16 r16 all-linear dropout"]), tmp_path)
    data = yaml.safe_load(path.read_text())
    assert data["model"]["_component_"] == "torchtune.models.llama3_2.lora_llama3_2_1b"
    assert data["model"]["lora_attn_modules"] == ["q_proj", "k_proj", "v_proj", "output_proj"] and data["model"]["apply_lora_to_mlp"]
    assert data["tokenizer"]["_component_"] == "torchtune.models.llama3.llama3_tokenizer"
    assert data["checkpointer"]["checkpoint_dir"] == "/tmp/Llama-3.2-1B-Instruct/"
    assert launch == ("tune download meta-llama/Llama-3.2-1B --output-dir /tmp/Llama-3.2-1B-Instruct && "
                      "tune run lora_finetune_single_device --config torchtune.yaml")


def test_cli_emit_for_a_trainer_writes_its_config_and_prints_its_launch_line(cli, tmp_path):
    db = f"sqlite:///{tmp_path / 'p.db'}"
    # axolotl loads the model in the training dtype: a plan in a precision it has (the auto
    # search's #1 here is bf16-mixed, fp32 weights, which emit --for axolotl refuses in one line)
    made = cli("suggest", "-m", MODEL, "--gpu", "a10g", "-b", "8", "--seq-len", "1024", "--method", "lora",
               "--precision", "bf16", "--db", db)
    assert made.code == 0, made
    plan_id = made.out.split("plan id: ")[1].split()[0]
    out = cli("emit", plan_id, str(tmp_path / "ax"), "--for", "axolotl", "--db", db)
    assert out.code == 0, out
    assert f"run: cd {tmp_path / 'ax'} && axolotl train axolotl.yaml" in out.out
    again = check([tmp_path / "ax" / "axolotl.yaml"], gpu="a10g")
    assert str(again.config.method) == "lora" and again.config.global_batch == 8
    bad = cli("emit", plan_id, str(tmp_path / "x"), "--for", "unsloth", "--db", db)
    assert bad.code == 2 and "--for must be one of hf, trl, axolotl, llama-factory, torchtune" in bad.err
