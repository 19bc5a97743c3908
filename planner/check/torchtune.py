"""A torchtune recipe config (``tune run lora_finetune_single_device --config FILE``), read with
what torchtune reads as shipped (planner/data/trainers/torchtune.json): the top-level keys the
recipe's code reads, and each ``_component_``'s signature for its section's keys.

torchtune's rules, cited where they are used: the whole model is trained in ``dtype`` (no autocast:
torchtune/training/precision.py ``get_dtype``, the recipes' ``_setup_model`` load it so), so bf16 is
pure bf16 (LoRA: a bf16 base); a ``qlora_*`` builder or ``quantize_base`` stores the base in NF4;
``lora_attn_modules`` name the attention projections (``output_proj`` is HF's ``o_proj``) and
``apply_lora_to_mlp`` adds the MLP's w1/w2/w3 (HF's gate/down/up projections); the sequence
length is the tokenizer's ``max_seq_len``. Only the single-device recipes are read (the
distributed ones shard with FSDP2, which ``planner check`` does not spell yet).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from planner.check.files import ConfigFile
from planner.check.trainers import dotted, read_spelled, refuse_unknown, schema_of, shipped
from planner.errors import InvalidConfigError, UnsupportedError
from planner.request import trainer_keys, trainer_values, unexpressible

if TYPE_CHECKING:  # pragma: no cover
    from planner.check.reading import Reading
    from planner.check.schemas import Schema
    from planner.config import TrainConfig

KIND = "torchtune config"
MODULE = "torchtune"
LAUNCH = "tune run {recipe} --config {file}"
#: torchtune's LoRA module names (torchtune/modules/peft/_utils.py LORA_ATTN_MODULES) -> HF's (peft's)
ATTN_MODULES = {"q_proj": "q_proj", "k_proj": "k_proj", "v_proj": "v_proj", "output_proj": "o_proj"}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
#: torch's and bitsandbytes' optimizers -> the planner's (planner.optim)
OPTIMIZERS = {"torch.optim.AdamW": "adamw", "bitsandbytes.optim.PagedAdamW8bit": "paged_adamw_8bit",
              "bitsandbytes.optim.AdamW8bit": "adamw_8bit", "torch.optim.SGD": "sgd"}
#: torch.optim.AdamW with ``fused: True`` (torchtune's LoRA configs set it) is the planner's fused AdamW
_ADAMW, _ADAMW_FUSED = "torch.optim.AdamW", "adamw_fused"
DTYPES = {"bf16": "bf16", "fp32": "fp32"}
#: the sections whose ``_component_`` signature the planner checks the keys of
SECTIONS = ("model", "optimizer")


def owns(data: Mapping[str, Any]) -> bool:
    return isinstance(data.get("model"), Mapping) and "_component_" in data["model"]


def recipe_of(data: Mapping[str, Any]) -> str:
    """The single-device recipe a config is for: LoRA's when its model builder is a LoRA one."""
    builder = str(dotted(data, "model._component_") or "").rsplit(".", 1)[-1]
    return "lora_finetune_single_device" if builder.startswith(("lora_", "qlora_")) else "full_finetune_single_device"


def schema(recipe: str = "lora_finetune_single_device") -> "Schema":
    data = shipped(MODULE)["recipes"][recipe]
    keys = {**{k: None for k in data["config_keys"]}, **data["keys"]}
    return schema_of(MODULE, keys, part=f"recipe {recipe}")


def required(recipe: str) -> list[str]:
    """The keys the recipe reads with no default (``cfg.key``)."""
    return list(shipped(MODULE)["recipes"][recipe]["required"])


def component(path: str) -> "Schema":
    components = shipped(MODULE)["components"]
    if path not in components:
        raise UnsupportedError(f"_component_ {path} is not one the planner reads: a torchtune model builder "
                               f"(torchtune.models...) or one of {', '.join(OPTIMIZERS)}")
    return schema_of(MODULE, {"_component_": path, **components[path]}, part=path)


def default(data: Mapping[str, Any], key: str) -> Any:
    if "." not in key:
        return schema(recipe_of(data)).defaults.get(key)
    section, name = key.split(".", 1)
    path = dotted(data, f"{section}._component_")
    return component(path).defaults.get(name) if path in shipped(MODULE)["components"] else None


def read(reading: "Reading", file: ConfigFile) -> None:
    """The options of a torchtune recipe config."""
    from planner.check.reading import Origin, _count

    data = file.data
    recipe = recipe_of(data)
    s = schema(recipe)
    refuse_unknown(reading, file.path, s, data)
    missing = [k for k in required(recipe) if k not in data]
    if missing:  # read as cfg.key: OmegaConf raises ConfigAttributeError, the run stops there
        raise InvalidConfigError(f"{file.path}: {', '.join(missing)} missing: recipe {recipe} reads "
                                 f"{'it' if len(missing) == 1 else 'them'} with no default")
    sections = {name: component(str(dotted(data, f"{name}._component_"))) for name in SECTIONS}
    for name, comp in sections.items():
        refuse_unknown(reading, file.path, comp, data[name], where=f"{name}: ")
    value = lambda key: s.value(data, key)  # noqa: E731
    given = lambda key: dotted(data, key) is not None  # noqa: E731
    if value("enable_activation_offloading"):
        raise UnsupportedError(f"{file.path}: enable_activation_offloading not modelled: set it false")
    reading.schema, reading.trainer = s.name, "torchtune"
    reading.notes.append(f"read as recipe {recipe} ({LAUNCH.format(recipe=recipe, file=file.path)})")
    folder = dotted(data, "checkpointer.checkpoint_dir")
    # the HF checkpointer reads its config.json; files sent to the service name no folder of its disk
    if folder and reading.resolve is None and (Path(str(folder)) / "config.json").is_file():
        reading.model = str(Path(str(folder)) / "config.json")
        reading.origins["model"] = Origin(file=file.path, key="checkpointer.checkpoint_dir", value=folder, given=True)
    reading.set("micro_batch", _count(file, "batch_size", value("batch_size")), file=file, key="batch_size")
    reading.set("grad_accum", _count(file, "gradient_accumulation_steps", value("gradient_accumulation_steps") or 1),
                file=file, key="gradient_accumulation_steps", given=given("gradient_accumulation_steps"))
    seq = dotted(data, "tokenizer.max_seq_len")
    if seq is not None:
        reading.seq_len = _count(file, "tokenizer.max_seq_len", seq)
        reading.origins["seq_len"] = Origin(file=file.path, key="tokenizer.max_seq_len", value=seq, given=True)
    reading.set("packing", bool(dotted(data, "dataset.packed")), file=file, key="dataset.packed", given=given("dataset.packed"))
    reading.set("grad_ckpt", bool(value("enable_activation_checkpointing")), file=file, key="enable_activation_checkpointing",
                given=given("enable_activation_checkpointing"))
    optimizer = str(dotted(data, "optimizer._component_"))
    if optimizer not in OPTIMIZERS:
        raise UnsupportedError(f"{file.path}: optimizer {optimizer} is not modelled: use one of {', '.join(OPTIMIZERS)}")
    if optimizer == _ADAMW and dotted(data, "optimizer.fused"):
        reading.set("optimizer", _ADAMW_FUSED, file=file, key="optimizer.fused", raw=True)
    else:
        reading.set("optimizer", OPTIMIZERS[optimizer], file=file, key="optimizer._component_", raw=optimizer)
    reading.set("attention", "sdpa", file=file, key="model._component_", given=False)  # torchtune's attention is SDPA
    _model(reading, file, sections["model"])
    _recipe_settings(reading, file, recipe)


def _recipe_settings(reading: Reading, file: ConfigFile, recipe: str) -> None:
    """The request fields torchtune spells by a key of the recipe or of its loss
    (``RequestField.trainers``; the adapters' are read with the model's arguments): a switch where
    the recipe reads its key (the optimizer in backward: the full recipe; its LoRA one has none), and the
    chunks of a ``CEWithChunkedOutputLoss`` (the recipe's ``setup`` gives them to the model:
    ``set_num_output_chunks(loss_fn.num_output_chunks)``); any other loss is the whole logits'."""
    from planner.check.reading import _count

    data, s = file.data, schema(recipe)
    chunked = str(dotted(data, "loss._component_")).endswith("CEWithChunkedOutputLoss")
    for field, key in trainer_keys("torchtune"):
        given = dotted(data, key) is not None
        if field.type is bool and key in s.defaults:
            raw = s.value(data, key)
            if not isinstance(raw, bool):
                raise InvalidConfigError(f"{file.path}: {key} must be true or false, got {raw!r}")
            reading.set(field.name, raw, file=file, key=key, given=given)
        elif field.type is int and key.startswith("loss.") and chunked:
            raw = dotted(data, key) if given else default(data, key)
            reading.set(field.name, _count(file, key, raw), file=file, key=key, given=given)


def _model(reading: "Reading", file: ConfigFile, comp: "Schema") -> None:
    data = file.data["model"]
    value = lambda key: comp.value(data, key)  # noqa: E731
    builder = str(data["_component_"]).rsplit(".", 1)[-1]
    lora = "lora_rank" in comp.defaults
    method = "qlora" if builder.startswith("qlora_") or value("quantize_base") else "lora" if lora else "full"
    reading.set("method", method, file=file, key="model._component_", raw=data["_component_"])
    if method == "qlora":
        # torchtune's QLoRA keeps every parameter but the NF4 base in the recipe's dtype (the model is
        # built under training.set_default_dtype(self._dtype); no k-bit upcast): a 16-bit stream at bf16
        reading.set("kbit_upcast", False, file=file, key="model._component_", raw=data["_component_"], given=False)
    if value("use_dora") or value("apply_lora_to_output"):
        raise UnsupportedError(f"{file.path}: model use_dora/apply_lora_to_output not modelled: set them false")
    if lora:
        reading.set("lora_r", value("lora_rank"), file=file, key="model.lora_rank", given="lora_rank" in data)
        modules = value("lora_attn_modules") or []
        if not isinstance(modules, list):
            raise InvalidConfigError(f"{file.path}: model.lora_attn_modules must be a list of {', '.join(ATTN_MODULES)}")
        unknown = [str(m) for m in modules if not isinstance(m, str) or m not in ATTN_MODULES]
        if unknown:
            raise InvalidConfigError(f"{file.path}: model.lora_attn_modules {', '.join(unknown)}: use {', '.join(ATTN_MODULES)}")
        targets = tuple(ATTN_MODULES[m] for m in modules) + (MLP_MODULES if value("apply_lora_to_mlp") else ())
        full = set(targets) == set(ATTN_MODULES.values()) | set(MLP_MODULES)
        reading.set("lora_targets", ("all-linear",) if full else targets, file=file, key="model.lora_attn_modules",
                    raw=modules)
        # its model component's arguments: the declared keys are dotted under model.
        read_spelled(reading, file, "torchtune", lambda key: value(key.removeprefix("model.")),
                     lambda key: key.removeprefix("model.") in data)
    dtype = str(file.data.get("dtype") or "fp32")  # the recipes' default: training.get_dtype(None) is float32
    if dtype not in DTYPES:
        raise UnsupportedError(f"{file.path}: dtype {dtype} is not modelled: bf16 or fp32")
    precision = DTYPES[dtype] if method != "qlora" else f"{dtype}-mixed" if dtype != "fp32" else "fp32"
    reading.set("precision", precision, file=file, key="dtype", raw=dtype, given="dtype" in file.data)


def write(config: "TrainConfig", *, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The keys of a torchtune single-device recipe config that say ``config``; with ``like`` (a
    config of the same model), its builder for the method too (the ``lora_``/``qlora_`` variant of
    the same model's builder: torchtune.models' naming)."""
    method, precision = str(config.method), str(config.precision)
    expected = {"full": ("bf16", "fp32"), "lora": ("bf16", "fp32"), "qlora": ("bf16-mixed", "fp32")}[method]
    if precision not in expected:
        raise UnsupportedError(f"torchtune trains the whole model in one dtype: {method} in {precision} has no spelling "
                               f"there ({', '.join(expected)} have)")
    if config.sharding.payload() != {"zero": 0, "offload": "none"} or config.gpus > 1:
        raise UnsupportedError("the single-device torchtune recipes have no sharding or offload")
    names = {v: k for k, v in OPTIMIZERS.items()} | {_ADAMW_FUSED: _ADAMW}
    if str(config.optimizer) not in names:
        raise UnsupportedError(f"torchtune configs name torch or bitsandbytes optimizers: {config.optimizer} has none here")
    out: dict[str, Any] = {}
    builder = dotted(like or {}, "model._component_")
    if builder:
        module, _, name = str(builder).rpartition(".")
        prefix = {"full": "", "lora": "lora_", "qlora": "qlora_"}[method]
        out["model._component_"] = f"{module}.{prefix}{name.removeprefix('qlora_').removeprefix('lora_')}"
        component(out["model._component_"])  # a builder torchtune has
    if config.method.uses_adapters:
        targets = set(ATTN_MODULES.values()) | set(MLP_MODULES) if config.lora_all_linear else set(config.lora_targets)
        if not targets <= set(ATTN_MODULES.values()) | set(MLP_MODULES) or \
                bool(targets & set(MLP_MODULES)) and not set(MLP_MODULES) <= targets:
            raise UnsupportedError(f"torchtune adapts attention projections and the whole MLP: {sorted(targets)} has "
                                   "no spelling there")
        out.update({"model.lora_attn_modules": [k for k, v in ATTN_MODULES.items() if v in targets],
                    "model.apply_lora_to_mlp": set(MLP_MODULES) <= targets, "model.lora_rank": config.lora_r})
    out.update(trainer_values(config, "torchtune", adapters=config.method.uses_adapters))
    out.update({"batch_size": config.micro_batch, "gradient_accumulation_steps": config.grad_accum,
                "tokenizer.max_seq_len": config.seq_len, "dataset.packed": config.packing,
                "enable_activation_checkpointing": config.grad_ckpt, "optimizer._component_": names[str(config.optimizer)],
                "dtype": precision.split("-")[0]})
    if out["optimizer._component_"] == _ADAMW:
        out["optimizer.fused"] = str(config.optimizer) == _ADAMW_FUSED
    if str(config.attention) != "sdpa" or unexpressible(config, "torchtune"):
        raise UnsupportedError("torchtune's recipes run SDPA attention and their own loss and loop")
    return out


__all__ = ["KIND", "LAUNCH", "component", "default", "owns", "read", "recipe_of", "required", "schema", "write"]
