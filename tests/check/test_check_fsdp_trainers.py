"""``planner check`` of axolotl's and LLaMA-Factory's own FSDP settings.

axolotl (the version the shipped schema stands for; its rules read from its source, cited in
planner/check/axolotl.py): ``fsdp_version`` at the top or in ``fsdp_config`` (``version`` its
alias), FSDP1 where ``fsdp_config`` names none, ``fsdp_config``'s keys with or without the ``fsdp_``
prefix, keys its ``FSDPConfig`` has not dropped, the legacy ``fsdp`` list read as transformers reads
it (axolotl hands it on), ``offload_params`` the CPU offload. LLaMA-Factory's YAML holds the HF
TrainingArguments' ``fsdp``/``fsdp_config``, read as the HF arguments file's. Each is planned as the
planner's ``fsdp1``/``fsdp2`` scheme; what ``write`` (``planner emit --for``, a change's keys) says
is read back as the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from planner.check import check, read_texts  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.errors import InvalidConfigError, PlannerError, UnsupportedError  # noqa: E402

MODEL = "meta-llama/Llama-3.1-8B"
#: the least of an axolotl config beside the keys under test (AxolotlInputConfig requires base_model)
AXOLOTL = dict(base_model=MODEL, datasets=[{"path": "tatsu-lab/alpaca", "type": "alpaca"}], learning_rate=1e-5,
               micro_batch_size=4, gradient_accumulation_steps=2, sequence_len=2048, bf16=True,
               optimizer="adamw_torch_fused")
#: LLaMA-Factory's: its FinetuningArguments' keys and the HF arguments it holds
LLAMA_FACTORY = dict(model_name_or_path=MODEL, stage="sft", do_train=True, finetuning_type="full", dataset="alpaca_en_demo",
                     template="default", per_device_train_batch_size=4, gradient_accumulation_steps=2, cutoff_len=2048,
                     bf16=True, pure_bf16=True, output_dir="out")


def axolotl(**keys) -> dict:
    return read_texts({"axolotl.yml": yaml.safe_dump({**AXOLOTL, **keys})})


def planned(reading) -> tuple:
    o = reading.options
    return o.get("sharding"), o.get("offload"), o.get("grad_ckpt")


@pytest.mark.parametrize("keys, plan, origins", [
    # axolotl 0.19's spelling (docs/multi-gpu.qmd): the version at the top, the fields unprefixed
    (dict(fsdp_version=2, fsdp_config=dict(offload_params=True, activation_checkpointing=True, reshard_after_forward=True)),
     ("fsdp2", "optimizer+params", True), {"sharding": ("fsdp_version", True), "offload": ("fsdp_config.offload_params", True),
                                           "grad_ckpt": ("fsdp_config.activation_checkpointing", True)}),
    # the FSDP1-era spelling: the prefix, the version inside fsdp_config
    (dict(fsdp_config=dict(fsdp_version=2, fsdp_offload_params=False)),
     ("fsdp2", "none", False), {"sharding": ("fsdp_config.fsdp_version", True), "offload": ("fsdp_config.fsdp_offload_params", True)}),
    (dict(fsdp_config=dict(version=2)), ("fsdp2", "none", False), {"sharding": ("fsdp_config.version", True)}),
    # no version: axolotl pins FSDP1 where fsdp_config holds anything (transformers' own default is 2)
    (dict(fsdp_config=dict(fsdp_offload_params=False, fsdp_state_dict_type="FULL_STATE_DICT")),
     ("fsdp1", "none", False), {"sharding": ("fsdp_version", False)}),
    # the legacy list is handed to transformers, whose "offload" turns the CPU offload on
    (dict(fsdp=["full_shard", "auto_wrap", "offload"], fsdp_config=dict(fsdp_transformer_layer_cls_to_wrap="LlamaDecoderLayer")),
     ("fsdp1", "optimizer+params", False), {"offload": ("fsdp_config.offload_params", False)}),
    # the list with an empty fsdp_config: nothing is pinned, transformers' FSDP2 runs
    (dict(fsdp=["full_shard", "auto_wrap"], fsdp_config={}), ("fsdp2", "none", False), {"sharding": ("fsdp_version", False)}),
    # the model's checkpointing under FSDP is read as ever
    (dict(gradient_checkpointing=True, fsdp_version=2, fsdp_config=dict(offload_params=False)),
     ("fsdp2", "none", True), {"grad_ckpt": ("gradient_checkpointing", True)}),
])
def test_axolotl_fsdp_is_read_as_axolotl_hands_it_on(keys, plan, origins):
    reading = axolotl(**keys)
    assert planned(reading) == plan
    for option, (key, given) in origins.items():
        assert (reading.origins[option].key, reading.origins[option].given) == (key, given), option


def test_what_axolotl_drops_or_leaves_off_is_said():
    """FSDPConfig drops a key it has no field for (the FSDP1 examples' fsdp_sharding_strategy,
    fsdp_limit_all_gathers): FSDP1 then runs accelerate's FULL_SHARD; fsdp_version alone turns nothing on."""
    reading = axolotl(fsdp_config=dict(fsdp_sharding_strategy="FULL_SHARD", fsdp_limit_all_gathers=True,
                                       fsdp_offload_params=False))
    assert planned(reading) == ("fsdp1", "none", False)
    note = next(n for n in reading.notes if "not fields of axolotl's FSDPConfig, which drops them" in n)
    assert "fsdp_config.fsdp_sharding_strategy" in note and "fsdp_config.fsdp_limit_all_gathers" in note
    assert "offload" not in note and "FSDP1 runs accelerate's default, FULL_SHARD" in note
    alone = axolotl(fsdp_version=2)
    assert "sharding" not in alone.options and "fsdp_version without fsdp_config: axolotl runs no FSDP" in alone.notes


@pytest.mark.parametrize("keys, error, words", [
    (dict(fsdp_version=2, fsdp_config=dict(reshard_after_forward=False)), UnsupportedError,
     "fsdp_config.reshard_after_forward False is not modelled: FSDP is planned fully sharded"),
    (dict(fsdp=["shard_grad_op"], fsdp_config=dict(fsdp_version=2)), UnsupportedError, "fsdp 'shard_grad_op' is not modelled"),
    (dict(fsdp=["hybrid_shard", "auto_wrap"], fsdp_config=dict(fsdp_version=1)), UnsupportedError,
     "fsdp 'hybrid_shard' is not modelled"),
    (dict(fsdp_version=1, fsdp_config=dict(reshard_after_forward=True)), InvalidConfigError,
     "fsdp_config.reshard_after_forward is FSDP2's (true or false): with fsdp_version 1 remove it"),
    (dict(fsdp=["full_shard", "auto_wrap"]), InvalidConfigError, "fsdp without fsdp_config: axolotl reads FSDP's settings"),
    (dict(fsdp="full_shard auto_wrap", fsdp_config=dict(fsdp_version=2)), InvalidConfigError,
     "fsdp must be a list of transformers' options"),  # transformers takes the string; axolotl's schema does not
    (dict(fsdp_version=2, fsdp_config=dict(offload_params=False), deepspeed="ds.json"), InvalidConfigError,
     "fsdp_config and deepspeed are both set: keep one"),
    (dict(fsdp_version=3, fsdp_config=dict(offload_params=False)), InvalidConfigError, "fsdp_version must be 1 or 2, got 3"),
    (dict(fsdp_version=2, fsdp_config=dict(offload_params="maybe")), InvalidConfigError,
     "fsdp_config.offload_params must be true or false"),
])
def test_what_axolotl_runs_and_the_model_has_not_is_one_line_naming_the_key(keys, error, words):
    with pytest.raises(error) as info:
        axolotl(**keys)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_llama_factory_fsdp_is_read_as_the_hf_arguments_are():
    """Its YAML's TrainingArguments ``fsdp``/``fsdp_config`` go to the HF Trainer as they are: the same
    reader, transformers 5's defaults (FSDP2), the legacy option string, deepspeed refused beside it."""
    def read(**keys):
        return read_texts({"lf.yaml": yaml.safe_dump({**LLAMA_FACTORY, **keys})})

    reading = read(fsdp=True, fsdp_config=dict(activation_checkpointing=True, cpu_offload=True))
    assert planned(reading) == ("fsdp2", "optimizer+params", True)
    assert reading.origins["offload"].key == "fsdp_config.cpu_offload" and not reading.origins["sharding"].given
    assert planned(read(fsdp="full_shard auto_wrap", fsdp_config=dict(fsdp_version=1), disable_gradient_checkpointing=True)) == \
        ("fsdp1", "none", False)
    with pytest.raises(PlannerError, match="fsdp and deepspeed are both set"):
        read(fsdp=True, deepspeed="ds.json")
    with pytest.raises(UnsupportedError, match="fsdp 'shard_grad_op' is not modelled"):
        read(fsdp="shard_grad_op", fsdp_config=dict(version=1))
    unused = read(fsdp_config=dict(cpu_offload=True))
    assert "sharding" not in unused.options and "fsdp_config without fsdp: transformers runs no FSDP" in unused.notes[-1]


PLANS = [
    TrainConfig(method="full", precision="bf16", gpus=4, zero=None, sharding="fsdp2", grad_ckpt=True, micro_batch=2),
    TrainConfig(method="full", precision="bf16", gpus=2, zero=None, sharding="fsdp2", offload="optimizer+params", micro_batch=1),
    TrainConfig(method="lora", precision="bf16", gpus=2, zero=None, sharding="fsdp1", grad_ckpt=True, micro_batch=4),
    # QLoRA under FSDP: axolotl skips peft's k-bit preparation (loaders/model.py _prepare_model_for_quantization)
    TrainConfig(method="qlora", precision="bf16-mixed", gpus=2, zero=None, sharding="fsdp2", grad_ckpt=True, micro_batch=4,
                kbit_upcast=False),
]


@pytest.mark.parametrize("target", ["axolotl", "llama-factory"])
@pytest.mark.parametrize("config", PLANS, ids=lambda c: c.label())
def test_what_emit_writes_for_an_fsdp_plan_is_read_back_as_the_plan(target, config):
    """``planner emit --for`` writes the scheme in the trainer's own keys (FSDP's checkpointing, the
    model's off), and ``check`` reads the file back to the same scheme, offload and checkpointing."""
    from planner.emit.trainers import trainer_files
    from planner.estimation import resolve

    spec, _ = resolve(model=MODEL, gpu="a100-80gb")
    files, _ = trainer_files(target, config=config, spec=spec, model=MODEL, dataset=None, on_cpu=False)
    name, text = next(iter(files.items()))
    data = yaml.safe_load(text)
    if target == "axolotl":
        assert data["fsdp_version"] == int(str(config.sharding.scheme)[-1]) and data["gradient_checkpointing"] is False
        assert data["fsdp_config"]["offload_params"] is (str(config.offload) != "none")
        assert "reshard_after_forward" not in data["fsdp_config"] or str(config.sharding.scheme) == "fsdp2"
    else:
        assert data["fsdp"] is True and data["disable_gradient_checkpointing"] is True
    reading = read_texts({name: text})
    assert planned(reading) == (str(config.sharding.scheme), str(config.offload), config.grad_ckpt)
    assert reading.options["method"] == str(config.method)


#: an 8B full fine-tuning in pure bf16 on 4 A100s with checkpointing, as each trainer's file turns it on
CHECKPOINTED = [
    ("axolotl", {**AXOLOTL, "fsdp_config": dict(fsdp_version=2, fsdp_activation_checkpointing=True)},
     "fsdp_config.fsdp_activation_checkpointing"),
    ("axolotl", {**AXOLOTL, "gradient_checkpointing": True, "fsdp_version": 2, "fsdp_config": dict(offload_params=False)},
     "gradient_checkpointing"),
    ("llama-factory", {**LLAMA_FACTORY, "disable_gradient_checkpointing": True, "fsdp": True,
                       "fsdp_config": dict(activation_checkpointing=True)}, "fsdp_config.activation_checkpointing"),
    ("llama-factory", {**LLAMA_FACTORY, "fsdp": True}, "disable_gradient_checkpointing"),
]


@pytest.mark.parametrize("target, data, key", CHECKPOINTED, ids=lambda v: v if isinstance(v, str) else "")
def test_a_change_to_an_fsdp_file_is_written_where_the_file_says_it(target, data, key, tmp_path):
    """The search keeps the file's FSDP2; the checkpointing a faster change drops goes back to the
    key the file turned it on with (fsdp_config's, prefixed as the file writes it, or the model's),
    and the file with the change applied checks back as the change's plan."""
    from test_check_trainers import apply

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    result = check([path], gpu="a100-80gb", gpus=4)
    assert (str(result.config.sharding.scheme), result.config.grad_ckpt, result.fits) == ("fsdp2", True, True)
    change = result.change
    assert change is not None and str(change.config.sharding.scheme) == "fsdp2"
    keys = {k.key: (k.old, k.new) for k in change.keys}
    assert all(k.file == str(path) for k in change.keys) and not any(k.startswith("deepspeed") for k in keys)
    # mb2x4 without checkpointing is faster; the model's own key is said only where the file checkpoints with it
    own = "gradient_checkpointing" if target == "axolotl" else "disable_gradient_checkpointing"
    off = (False, True) if key == "disable_gradient_checkpointing" else (True, False)  # (old, new) of the key
    assert not change.config.grad_ckpt and keys[key] == off
    assert (own in keys) == (key == own)
    apply(change, tmp_path)
    assert check([Path(path)], gpu="a100-80gb", gpus=4).config == change.config


@pytest.mark.parametrize("target", ["axolotl", "llama-factory"])
@pytest.mark.parametrize("config", [c for c in PLANS if str(c.sharding.scheme) == "fsdp2"], ids=lambda c: c.label())
def test_the_fsdp2_keys_emit_writes_build_the_plans_plugin_in_transformers_and_accelerate(target, config, monkeypatch):
    """The real libraries take what each trainer hands on: LLaMA-Factory's fsdp/fsdp_config go to
    TrainingArguments as they are; axolotl passes fsdp_config (with its fsdp_version) as the
    arguments' and sets FSDP_OFFLOAD_PARAMS / FSDP_ACTIVATION_CHECKPOINTING from offload_params and
    activation_checkpointing (utils/trainer.py setup_fsdp_envs), which accelerate's plugin reads where
    transformers passes nothing. The plugin built on the CPU is the plan's FSDP2."""
    pytest.importorskip("accelerate")
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    from planner.emit.trainers import trainer_files
    from planner.estimation import resolve

    spec, _ = resolve(model=MODEL, gpu="a100-80gb")
    files, _ = trainer_files(target, config=config, spec=spec, model=MODEL, dataset=None, on_cpu=False)
    data = yaml.safe_load(next(iter(files.values())))
    for variable in ("FSDP_OFFLOAD_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_VERSION"):
        monkeypatch.delenv(variable, raising=False)
    settings = dict(data["fsdp_config"])
    if target == "axolotl":
        settings["fsdp_version"] = data["fsdp_version"]
        for key, variable in (("offload_params", "FSDP_OFFLOAD_PARAMS"), ("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING")):
            if settings.get(key):
                monkeypatch.setenv(variable, "true")
    args = TrainingArguments(output_dir="out", fsdp=data.get("fsdp") or True, fsdp_config=settings)
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    assert (plugin.fsdp_version, plugin.reshard_after_forward, plugin.activation_checkpointing) == (2, True, config.grad_ckpt)
    assert (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") == (str(config.offload) != "none")


def test_an_offload_an_axolotl_fsdp_file_needs_is_written_in_its_own_key(tmp_path):
    """8B full fine-tuning with FSDP2 on one A100 does not fit; FSDP's CPU offload does, said in the
    file's own (prefixed) offload key, and the file with it checks back as the change's plan."""
    from test_check_trainers import apply

    path = tmp_path / "axolotl.yml"
    path.write_text(yaml.safe_dump({**AXOLOTL, "fsdp_config": dict(fsdp_version=2, fsdp_offload_params=False)}))
    result = check([path], gpu="a100-80gb", gpus=1)
    assert not result.fits and result.change.goal == "fit" and str(result.change.config.offload) == "optimizer+params"
    keys = [(k.key, k.old, k.new) for k in result.change.keys]
    assert ("fsdp_config.fsdp_offload_params", False, True) in keys  # not a new unprefixed offload_params beside it
    assert not any(k[0] in ("fsdp_config.offload_params", "fsdp_version") or k[0].startswith("deepspeed") for k in keys)
    apply(result.change, tmp_path)
    assert check([path], gpu="a100-80gb", gpus=1).config == result.change.config


def test_axolotl_qlora_under_fsdp2_is_planned_as_estimate_plans_fsdp_qlora(tmp_path):
    """axolotl skips peft's k-bit preparation under FSDP (loaders/model.py _prepare_model_for_quantization):
    the plan is the FSDP-QLoRA recipe without the upcast, and its peak is planner estimate's for it."""
    from planner.estimation import estimate_configuration, resolve

    path = tmp_path / "axolotl.yml"
    path.write_text(yaml.safe_dump({**AXOLOTL, "base_model": "meta-llama/Llama-3.1-70B", "adapter": "qlora",
                                    "load_in_4bit": True, "lora_r": 8, "lora_target_linear": True, "micro_batch_size": 1,
                                    "sequence_len": 512, "gradient_checkpointing": True, "fsdp_version": 2,
                                    "fsdp_config": dict(offload_params=False, state_dict_type="FULL_STATE_DICT")}))
    result = check([path], gpu="a100-80gb", gpus=2)
    c = result.config
    assert (str(c.method), str(c.precision), str(c.sharding.scheme), c.kbit_upcast) == ("qlora", "bf16-mixed", "fsdp2", False)
    spec, device = resolve(model="meta-llama/Llama-3.1-70B", gpu="a100-80gb")
    data, _ = estimate_configuration(spec=spec, gpu=device, seq_len=512, method="qlora", precision="bf16-mixed", lora_r=8,
                                     lora_targets="all-linear", optimizer="adamw_fused", micro_batch=1, grad_accum=2, gpus=2,
                                     grad_ckpt=True, sharding="fsdp2", kbit_upcast=False, lora_dropout=0.0, packing=False)
    assert result.peak_bytes == data["memory"]["process_total_bytes"]
