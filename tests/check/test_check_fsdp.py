"""``planner check`` of an FSDP setup: TrainingArguments' ``fsdp``/``fsdp_config`` (inline, a JSON
file it names, or the legacy option string) and accelerate's ``distributed_type: FSDP`` section are
read as transformers 5 and accelerate read them, planned as the scheme they run (FSDP1 or FSDP2,
with its CPU offload and checkpointing), and a change is searched within that scheme and written
back in the file's own keys."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")  # the suite's TRL schema reads the arguments of the TRL cases

from planner.check import check, read_texts  # noqa: E402
from planner.config import TrainConfig  # noqa: E402
from planner.emit import settings  # noqa: E402

MODEL = "mistralai/Mistral-7B-v0.1"

EMITTED = [
    TrainConfig(method="full", precision="bf16-mixed", gpus=4, zero=None, sharding="fsdp2", grad_ckpt=True, micro_batch=2),
    TrainConfig(method="full", precision="bf16-mixed", gpus=2, zero=None, sharding="fsdp2", offload="optimizer+params",
                micro_batch=1),
    TrainConfig(method="lora", precision="fp16", gpus=2, zero=None, sharding="fsdp1", grad_ckpt=True, micro_batch=4),
]


@pytest.mark.parametrize("config", EMITTED, ids=lambda c: c.label())
def test_what_emit_writes_for_fsdp_is_read_back_as_the_same_sharding(config):
    """The files ``planner emit`` writes for an FSDP plan (the scheme's own ``fsdp_config`` in the
    Trainer's arguments, and accelerate's section) are read back to the plan's scheme, offload and
    checkpointing, each from its key."""
    args = {"model_name_or_path": MODEL, **settings.training_arguments(config, on_cpu=False)}
    from_args = read_texts({"training_args.json": json.dumps(args)})
    accel = read_texts({"accelerate.yaml": json.dumps(settings.accelerate_config(config, on_cpu=False)),
                        "training_args.json": json.dumps({"model_name_or_path": MODEL, "per_device_train_batch_size": 1})})
    for reading in (from_args, accel):
        assert reading.options["sharding"] == str(config.sharding.scheme)
        assert reading.options["offload"] == str(config.sharding.offload)
        assert reading.options.get("grad_ckpt", False) == config.grad_ckpt
    assert from_args.origins["sharding"].key == "fsdp_config.version"
    assert accel.origins["sharding"].key == "fsdp_config.fsdp_version"
    assert accel.origins["offload"].key == "fsdp_config.fsdp_offload_params"


def test_transformers_defaults_to_fsdp2_and_accelerate_to_fsdp1():
    """transformers 5: ``fsdp_config.get("version", 2)``; accelerate's plugin: FSDP_VERSION "1"."""
    args = read_texts({"a.json": json.dumps({"model_name_or_path": MODEL, "fsdp": True})})
    assert (args.options["sharding"], args.options["offload"]) == ("fsdp2", "none")
    assert not args.origins["sharding"].given
    accel = read_texts({"a.yaml": "distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_offload_params: false\n",
                        "t.json": json.dumps({"model_name_or_path": MODEL, "per_device_train_batch_size": 1})})
    assert accel.options["sharding"] == "fsdp1" and accel.gpus == 2


def test_the_legacy_option_string_and_a_named_json_file_are_read_as_transformers_reads_them():
    """``fsdp: "full_shard auto_wrap offload"`` turns the CPU offload on unless fsdp_config says
    otherwise (transformers' setdefault); the offload is then said where fsdp_config's own key goes:
    the JSON file the arguments name."""
    texts = {"args.json": json.dumps({"model_name_or_path": MODEL, "fsdp": "full_shard auto_wrap offload",
                                      "fsdp_config": "fsdp.json"}),
             "fsdp.json": json.dumps({"fsdp_transformer_layer_cls_to_wrap": "MistralDecoderLayer"})}
    reading = read_texts(texts)
    assert (reading.options["sharding"], reading.options["offload"]) == ("fsdp2", "optimizer+params")
    origin = reading.origins["offload"]
    assert (origin.file, origin.key, origin.given) == ("fsdp.json", "cpu_offload", False)
    assert any(f.path == "fsdp.json" for f in reading.files)
    texts["fsdp.json"] = json.dumps({"cpu_offload": False})  # the file's own value wins over the option
    assert read_texts(texts).options["offload"] == "none"


@pytest.mark.parametrize("args, words", [
    ({"fsdp": "hybrid_shard", "fsdp_config": {"version": 1}}, "fsdp 'hybrid_shard' is not modelled"),
    ({"fsdp": True, "fsdp_config": {"reshard_after_forward": False}}, "reshard_after_forward False is not modelled"),
    ({"fsdp": True, "fsdp_config": {"xla": True}}, "fsdp_config.xla (PyTorch/XLA's FSDP on TPUs) is not modelled"),
    ({"fsdp": "full_shard sideways"}, "fsdp option 'sideways' is not one of transformers'"),
    ({"fsdp": True, "fsdp_config": {"cpu_offload": "maybe"}}, "fsdp_config.cpu_offload must be true or false"),
])
def test_what_the_memory_model_has_not_is_one_line_naming_the_key(args, words):
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match=None) as info:
        read_texts({"a.json": json.dumps({"model_name_or_path": MODEL, **args})})
    assert words in str(info.value) and "\n" not in str(info.value)


def test_an_fsdp_file_no_arguments_name_is_refused():
    from planner.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="fsdp.json is an FSDP config that no arguments file names"):
        read_texts({"fsdp.json": json.dumps({"fsdp_version": 2, "reshard_after_forward": True}),
                    "a.json": json.dumps({"model_name_or_path": MODEL})})


def test_an_fsdp2_file_is_planned_as_estimate_plans_it_and_its_change_keeps_fsdp(tmp_path):
    """The peak is ``planner estimate --sharding fsdp2``'s for the same settings; the change the
    search finds is within FSDP2 and is written in the arguments' own keys (FSDP's checkpointing in
    fsdp_config, the split in the Trainer's)."""
    from planner.estimation import estimate_configuration, resolve

    path = tmp_path / "args.json"
    path.write_text(json.dumps({"model_name_or_path": "meta-llama/Llama-3.1-8B", "per_device_train_batch_size": 4,
                                "gradient_accumulation_steps": 2, "bf16": True, "fsdp": True,
                                "fsdp_config": {"fsdp_version": 2, "fsdp_activation_checkpointing": True}}))
    result = check([path], gpu="a100-80gb", gpus=4, seq_len=2048)
    c = result.config
    assert (str(c.sharding.scheme), str(c.offload), c.grad_ckpt, c.gpus) == ("fsdp2", "none", True, 4)
    spec, device = resolve(model="meta-llama/Llama-3.1-8B", gpu="a100-80gb")
    data, _ = estimate_configuration(spec=spec, gpu=device, seq_len=2048, method="full", precision="bf16-mixed",
                                     optimizer="adamw_fused", micro_batch=4, grad_accum=2, gpus=4, grad_ckpt=True,
                                     sharding="fsdp2")
    assert result.peak_bytes == data["memory"]["process_total_bytes"]
    assert result.origins["grad_ckpt"]["key"] == "fsdp_config.fsdp_activation_checkpointing"
    change = result.change
    assert change is not None and str(change.config.sharding.scheme) == "fsdp2"
    # a faster change keeps AdamW: SGD's freed moments would let it drop checkpointing, and was offered before
    # closest._keeps_the_optimizer (an optimizer is what the run learns with, not how its step is arranged)
    assert str(change.config.optimizer) in ("adamw_fused", "adamw")
    keys = {k.key for k in change.keys}
    assert keys and not any(k.startswith(("zero_optimization", "deepspeed")) for k in keys)
    if change.config.grad_ckpt != c.grad_ckpt:
        assert "fsdp_config.fsdp_activation_checkpointing" in keys


def test_an_fsdp1_setup_is_searched_within_fsdp1(tmp_path):
    """FSDP1 is chosen by name only (the search leaves it out unasked); a file that runs it is
    searched within it (``planner.sharding.search_axis``'s ``schemes``): fms-hf-tuning's Mistral-7B
    LoRA on two A100s, pure fp16 as it runs, finds a faster split or checkpointing within FSDP1."""
    args, accel = tmp_path / "args.json", tmp_path / "accelerate.yaml"
    args.write_text(json.dumps({"model_name_or_path": MODEL, "per_device_train_batch_size": 4, "bf16": False,
                                "gradient_checkpointing": True, "model_init_kwargs": {"torch_dtype": "float16"},
                                "use_peft": True, "lora_r": 16, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}))
    accel.write_text("distributed_type: FSDP\nnum_processes: 2\nmixed_precision: 'no'\nfsdp_config:\n"
                     "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_offload_params: false\n")
    result = check([args, accel], gpu="a100-80gb", seq_len=4096, trainer="trl")
    assert (str(result.config.sharding.scheme), str(result.config.precision), result.config.gpus) == ("fsdp1", "fp16", 2)
    assert result.fits and result.change is not None
    assert str(result.change.config.sharding.scheme) == "fsdp1"
    assert result.change.estimate["throughput"]["tokens_per_s"] > result.estimate["throughput"]["tokens_per_s"] * 1.02


def test_the_search_axis_takes_a_named_scheme_only_where_the_search_takes_none_of_them():
    """ZeRO's schemes are searched as ever when named; FSDP1, which the search never takes unasked,
    is tried when it is the one named."""
    from planner.sharding import search_axis

    zero = ("none", "zero1", "zero2", "zero3")
    assert search_axis(allow_offload=True, gpus=2, schemes=zero) == \
        tuple(s for s in search_axis(allow_offload=True, gpus=2) if str(s.scheme) in zero)
    assert [str(s.scheme) for s in search_axis(allow_offload=True, gpus=2)].count("fsdp1") == 0
    assert [(str(s.scheme), str(s.offload)) for s in search_axis(allow_offload=True, gpus=2, schemes=("fsdp1",))] == \
        [("fsdp1", "none")]


def test_a_change_to_fit_may_change_the_optimizer_and_one_to_be_faster_may_not_give_it_up():
    from planner.check.closest import _keeps_the_optimizer

    adamw = TrainConfig(method="full", optimizer="adamw_fused")
    for other, faster in (("adamw", True), ("adamw_8bit", False), ("adafactor", False), ("sgd", False), ("lion_8bit", False)):
        changed = TrainConfig(method="full", optimizer=other)
        assert _keeps_the_optimizer(adamw, changed, "faster") is faster, other
        assert _keeps_the_optimizer(adamw, changed, "fit")
    # from 8-bit AdamW, the 32-bit one is no loss
    assert _keeps_the_optimizer(TrainConfig(optimizer="adamw_8bit"), adamw, "faster")
