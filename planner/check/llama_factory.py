"""A LLaMA-Factory YAML (``llamafactory-cli train config.yaml``), read with the five argument
dataclasses it parses a YAML into, as shipped (planner/data/trainers/llama_factory.json), and a
configuration written as their keys.

LLaMA-Factory's rules, cited where they are used: gradient checkpointing is on unless
``disable_gradient_checkpointing`` (model/model_utils/checkpointing.py
``prepare_model_for_training``); the model is loaded in the compute dtype (``bf16``/``pure_bf16``:
bfloat16, ``fp16``: float16; hparams/parser.py) and the trainable parameters are cast to fp32
unless ``pure_bf16`` (model/adapter.py ``init_adapter``): full fine-tuning is bf16-mixed, pure bf16
with ``pure_bf16``, LoRA a 16-bit base with fp32 adapters; ``quantization_bit: 4`` is QLoRA;
``packing`` unset packs for pre-training only (parser.py); ``lora_target: all`` adapts every linear.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from planner.check.files import ConfigFile
from planner.check.trainers import read_spelled, read_switches, refuse_unknown, schema_of, shipped
from planner.errors import InvalidConfigError, UnsupportedError
from planner.request import trainer_values, unexpressible

if TYPE_CHECKING:  # pragma: no cover
    from planner.check.reading import Reading
    from planner.check.schemas import Schema
    from planner.config import TrainConfig

KIND = "LLaMA-Factory config"
MODULE = "llama_factory"
#: how LLaMA-Factory runs a config (README "Quickstart"); FORCE_TORCHRUN=1 for several GPUs
LAUNCH = "llamafactory-cli train {file}"
#: the key of the model's own checkpointing (``trainers.key_changes``: an FSDP file's may be FSDP's instead)
CHECKPOINTING = "disable_gradient_checkpointing"
#: flash_attn (extras/constants.py ``AttentionFunction``) -> the planner's attention
ATTENTION = {"auto": "sdpa", "sdpa": "sdpa", "fa2": "flash", "disabled": "eager"}
UNMODELLED = {"use_unsloth": "Unsloth's kernels", "use_dora": "DoRA's magnitude vectors",
              "additional_target": "fully trained module copies", "use_galore": "GaLore", "use_apollo": "APOLLO",
              "use_badam": "BAdam", "use_llama_pro": "LLaMA Pro", "enable_liger_kernel": "Liger's kernels (only its fused "
              "cross-entropy is modelled)", "neat_packing": "packing without cross-attention",
              "freeze_vision_tower": None, "use_adam_mini": "Adam-mini", "use_muon": "Muon"}


def owns(data: Mapping[str, Any]) -> bool:
    return "finetuning_type" in data or "stage" in data


def schema() -> "Schema":
    return schema_of(MODULE, shipped(MODULE)["keys"])


def default(data: Mapping[str, Any], key: str) -> Any:
    return schema().defaults.get(key)


def read(reading: "Reading", file: ConfigFile) -> None:
    """The options of a LLaMA-Factory config."""
    from planner.check.reading import Origin, _count, _refuse_unmodelled, read_optimizer, sharding_arguments

    s = schema()
    data = file.data
    refuse_unknown(reading, file.path, s, data)
    value = lambda key: s.value(data, key)  # noqa: E731
    given = lambda key: key in data  # noqa: E731
    problems = [f"{key} ({why} not modelled)" for key, why in UNMODELLED.items() if why and value(key)]
    if value("stage") not in ("sft", "pt"):
        problems.append(f"stage {value('stage')} (only supervised fine-tuning and pre-training are modelled: sft, pt)")
    if problems:
        raise UnsupportedError(f"{file.path}: {'; '.join(problems)}")
    _refuse_unmodelled(file, value)  # the HF TrainingArguments keys it holds (auto_find_batch_size, ...)
    reading.schema = s.name
    reading.trainer = "llama-factory"
    if not value("model_name_or_path"):
        raise InvalidConfigError(f"{file.path}: no model_name_or_path: name the model")
    reading.model = str(value("model_name_or_path"))
    reading.origins["model"] = Origin(file=file.path, key="model_name_or_path", value=reading.model, given=True)
    for option, key in (("micro_batch", "per_device_train_batch_size"), ("grad_accum", "gradient_accumulation_steps")):
        reading.set(option, _count(file, key, value(key)), file=file, key=key, given=given(key))
    reading.seq_len = _count(file, "cutoff_len", value("cutoff_len"))
    reading.origins["seq_len"] = Origin(file=file.path, key="cutoff_len", value=reading.seq_len, given=given("cutoff_len"))
    packing = value("packing") if value("packing") is not None else value("stage") == "pt"
    reading.set("packing", bool(packing), file=file, key="packing", given=given("packing"))
    reading.set("grad_ckpt", not value("disable_gradient_checkpointing"), file=file, key="disable_gradient_checkpointing",
                raw=value("disable_gradient_checkpointing"), given=given("disable_gradient_checkpointing"))
    read_optimizer(reading, file, "optim", value, given)
    read_switches(reading, file, "llama-factory", value, given)
    attention = str(value("flash_attn"))
    if attention not in ATTENTION:
        raise UnsupportedError(f"{file.path}: flash_attn {attention} is not modelled: use {', '.join(ATTENTION)}")
    reading.set("attention", ATTENTION[attention], file=file, key="flash_attn", raw=attention, given=given("flash_attn"))
    _method(reading, file, value, given)
    _precision(reading, file, value, given)
    if value("rope_scaling"):
        reading.model_rules.append(lambda r, spec, seq: _rope_scaling(r, file, str(value("rope_scaling")), spec, seq))
    # its TrainingArguments' deepspeed or fsdp/fsdp_config, which it hands to the HF Trainer as they are
    # (hparams/parser.py reads nothing of them; model/model_utils/quantization.py stores QLoRA's 4-bit codes
    # in the compute dtype, "crucial for fsdp+qlora", as the plan's FSDP QLoRA does)
    sharding_arguments(reading, file, value)


def _method(reading: "Reading", file: ConfigFile, value, given) -> None:
    from planner.check.reading import _targets

    kind, bits = value("finetuning_type"), value("quantization_bit")
    if kind not in ("full", "lora"):
        raise UnsupportedError(f"{file.path}: finetuning_type {kind} is not modelled: full or lora")
    if bits not in (None, 4) or (bits == 4 and kind != "lora"):
        raise UnsupportedError(f"{file.path}: quantization_bit {bits} with finetuning_type {kind} is not modelled: "
                               "4 with lora (QLoRA), or none")
    method = "qlora" if bits == 4 else kind
    key = "quantization_bit" if bits == 4 else "finetuning_type"
    reading.set("method", method, file=file, key=key, raw=value(key), given=given(key))
    if method == "qlora":
        # LLaMA-Factory prepares a k-bit model itself, without peft's prepare_model_for_kbit_training
        # (model/model_utils/checkpointing.py prepare_model_for_training): the non-4-bit parameters stay
        # in the compute dtype, only the norms' weights are upcast under upcast_layernorm, planned as
        # peft's whole upcast (an fp32 stream: the bound above it)
        upcast = bool(value("upcast_layernorm"))
        reading.set("kbit_upcast", upcast, file=file, key="upcast_layernorm", given=given("upcast_layernorm"))
    if kind != "lora":
        return
    reading.set("lora_r", value("lora_rank"), file=file, key="lora_rank", given=given("lora_rank"))
    target = str(value("lora_target"))
    targets = ("all-linear",) if target == "all" else _targets([t.strip() for t in target.split(",") if t.strip()])
    reading.set("lora_targets", targets, file=file, key="lora_target", raw=target, given=given("lora_target"))
    read_spelled(reading, file, "llama-factory", value, given)


def _rope_scaling(reading: "Reading", file: ConfigFile, kind: str, spec, seq: int) -> None:
    """LLaMA-Factory's RoPE scaling: ``rope_scaling`` names the type (extras/constants.py ``RopeScaling``) and
    the factor is its own, ceil(cutoff_len / the model's length) where cutoff_len is longer, else it disables
    the scaling (model/model_utils/rope.py l.52-63 at ff6d4d1; the same rule in 2024's model/patcher.py
    ``_configure_rope``). The model's length is its max_position_embeddings (``ModelSpec.max_seq_len``;
    LLaMA-Factory reads a config's rope_scaling.original_max_position_embeddings first, l.44-47, which a model
    extended already has: planned from its max_position_embeddings)."""
    import math

    if seq <= spec.max_seq_len:
        reading.notes.append(f"rope_scaling {kind}: cutoff_len {seq} is within {spec.id}'s {spec.max_seq_len} positions, "
                             "so LLaMA-Factory disables the scaling (model/model_utils/rope.py)")
        return
    factor = math.ceil(seq / spec.max_seq_len)
    reading.set("rope_scaling", f"{kind}:{factor}", file=file, key="rope_scaling", raw=kind)


def _precision(reading: "Reading", file: ConfigFile, value, given) -> None:
    bf16, fp16, pure = bool(value("bf16")), bool(value("fp16")), bool(value("pure_bf16"))
    if bf16 and fp16:
        raise InvalidConfigError(f"{file.path}: bf16 and fp16 are both true: keep one (the Trainer refuses both)")
    method = str(reading.options["method"])
    if pure and method != "full":
        raise UnsupportedError(f"{file.path}: pure_bf16 with {method} is not modelled: it applies to full fine-tuning")
    half = "bf16" if bf16 or pure else "fp16" if fp16 else None
    if method == "lora" and half is None:
        raise UnsupportedError(f"{file.path}: LoRA without bf16 or fp16 loads the base in the dtype LLaMA-Factory "
                               "infers from the GPU: write bf16: true (or fp16: true)")
    if method == "full":
        precision = "bf16" if pure else f"{half}-mixed" if half else "fp32"
    else:
        precision = half if method == "lora" else f"{half}-mixed" if half else "fp32"
    key = "pure_bf16" if pure else "bf16" if bf16 or not fp16 else "fp16"
    reading.set("precision", precision, file=file, key=key, raw=value(key), given=given(key))


def write(config: "TrainConfig", *, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keys of a LLaMA-Factory config that say ``config`` (the model, data and schedule apart); ``like`` (the
    file read): a file read keeps its own checkpointing key (``trainers.key_changes``)."""
    from planner.optim import OPTIMIZERS

    method, precision = str(config.method), str(config.precision)
    half = precision.split("-")[0] if precision != "fp32" else None
    spelled = {"full": ("fp32", "bf16-mixed", "fp16-mixed", "bf16"), "lora": ("bf16", "fp16"),
               "qlora": ("fp32", "bf16-mixed", "fp16-mixed")}[method]
    if precision not in spelled:
        raise UnsupportedError(f"LLaMA-Factory has no spelling for {method} in {precision}: {', '.join(spelled)}")
    out: dict[str, Any] = {"finetuning_type": "full" if method == "full" else "lora",
                           "quantization_bit": 4 if method == "qlora" else None}
    if config.method.uses_adapters:
        targets = "all" if config.lora_all_linear else ",".join(config.lora_targets)
        out.update(lora_rank=config.lora_r, lora_target=targets)
    out.update(trainer_values(config, "llama-factory", adapters=config.method.uses_adapters))
    attention = {v: k for k, v in reversed(ATTENTION.items())}[str(config.attention)]
    out.update(per_device_train_batch_size=config.micro_batch, gradient_accumulation_steps=config.grad_accum,
               cutoff_len=config.seq_len, packing=config.packing, disable_gradient_checkpointing=not config.grad_ckpt,
               optim=OPTIMIZERS[config.optimizer].hf_optim, **OPTIMIZERS[config.optimizer].hf_args,
               bf16=half == "bf16" and precision != "bf16" or (method == "lora" and half == "bf16"),
               fp16=half == "fp16", pure_bf16=method == "full" and precision == "bf16", flash_attn=attention)
    if config.rope_scaling:  # the type: LLaMA-Factory derives the factor from cutoff_len (``_rope_scaling``)
        out["rope_scaling"] = config.rope_scaling.split(":")[0]
    if missing := unexpressible(config, "llama-factory"):
        raise UnsupportedError(f"LLaMA-Factory has no key for {', '.join(missing)}")
    spec = config.sharding.spec
    if hasattr(spec, "fsdp_settings"):  # its TrainingArguments' fsdp keys, as the HF arguments file's (transformers 5)
        out.update(fsdp=True, fsdp_config=spec.fsdp_settings(config))
        if like is None:  # a new file checkpoints with FSDP's wrapper alone (the model's too gathers twice: issue 30404)
            out["disable_gradient_checkpointing"] = True
    return out


__all__ = ["KIND", "LAUNCH", "default", "owns", "read", "schema", "write"]
