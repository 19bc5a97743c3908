"""A changed configuration written back as the keys of the files it was read from.

Each option goes back to the key it was read from (``Reading.origins``); an option that no file
held goes where the trainer reads it (TrainingArguments' key in the arguments file, DeepSpeed's in
its JSON, a new ``ds_config.json`` or ``adapter_config.json`` when the change adds one). Values are
written as the trainer takes them: transformers' ``optim`` names (``planner.optim``'s ``hf_optim``
and the arguments beside it), peft's ``LoraConfig`` fields, DeepSpeed's config keys.
"""

from __future__ import annotations

from typing import Any

from planner.check import files as kinds
from planner.check.reading import ATTENTION, Reading
from planner.check.result import KeyChange
from planner.config import ALL_LINEAR, TrainConfig
from planner.request import ADAPTER_RECIPE

#: where a change that adds DeepSpeed or an adapter writes the new file (beside the arguments file)
NEW_DEEPSPEED, NEW_ADAPTER, NEW_BNB = "ds_config.json", "adapter_config.json", "bnb_config.json"
#: a setting that lives in the user's training script, not in any file read
SCRIPT = "(your training script)"
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class _Diff:
    def __init__(self, reading: Reading) -> None:
        self.reading = reading
        self.changes: list[KeyChange] = []
        args = reading.by_kind(kinds.TRAINING_ARGS)
        accel = reading.by_kind(kinds.ACCELERATE)
        self.args = args
        self.main = args or accel
        self.trl = reading.schema.startswith("TRL ")
        ds = [f for f in reading.files if f.kind == kinds.DEEPSPEED]
        self.ds = ds[0] if ds else None
        self.accel = accel

    def put(self, file: str, key: str, old: Any, new: Any, *, new_file: bool = False) -> None:
        if old != new or new_file:
            self.changes.append(KeyChange(file=file, key=key, old=old, new=new, new_file=new_file))

    def origin(self, option: str, old: Any, new: Any, *, fallback_key: str) -> None:
        origin = self.reading.origins.get(option)
        if origin is not None:
            self.put(origin.file, origin.key, old if origin.value is None else origin.value, new)
        else:
            self.put(self.main.path if self.main else SCRIPT, fallback_key, old, new)

    def value_in(self, file, dotted: str) -> Any:
        data: Any = file.data
        for part in dotted.split("."):
            data = data.get(part) if isinstance(data, dict) else None
        return data


def key_changes(reading: Reading, old: TrainConfig, new: TrainConfig, *, sharding) -> tuple[KeyChange, ...]:
    """The keys to change in ``reading``'s files so that they say ``new`` instead of ``old``.
    ``sharding``: config -> (zero stage or FSDP scheme, offload) (the one reader of those fields)."""
    d = _Diff(reading)
    for option, key in (("micro_batch", "per_device_train_batch_size"), ("grad_accum", "gradient_accumulation_steps")):
        before, after = getattr(old, option), getattr(new, option)
        if before != after:
            d.origin(option, before, after, fallback_key=key)
            ds_key = "train_micro_batch_size_per_gpu" if option == "micro_batch" else "gradient_accumulation_steps"
            if d.ds is not None and isinstance(d.ds.data.get(ds_key), int) and reading.origins[option].file != d.ds.path:
                d.put(d.ds.path, ds_key, d.ds.data[ds_key], after)  # a number there must equal the Trainer's
    if old.grad_ckpt != new.grad_ckpt:
        d.origin("grad_ckpt", old.grad_ckpt, new.grad_ckpt, fallback_key="activation_checkpointing")
    if old.optimizer != new.optimizer:
        _optimizer(d, old, new)
    if old.method != new.method or (new.method.uses_adapters and (old.lora_r, old.lora_targets) != (new.lora_r, new.lora_targets)):
        _method(d, old, new)
    if old.precision != new.precision:
        _precision(d, old, new)
    if sharding(old) != sharding(new):
        _sharding(d, sharding(old), sharding(new))
    elif d.ds is not None and new.sharding.zero and old.sharding.buffers is not None and new.sharding.buffers is None:
        _buckets(d, d.ds.path, new.sharding.zero)
    if old.attention != new.attention:
        name = {v: k for k, v in ATTENTION.items() if k}[str(new.attention)]
        d.put(d.args.path if d.trl and d.args else SCRIPT, "attn_implementation", None, name)
    return tuple(d.changes)


def _optimizer(d: _Diff, old: TrainConfig, new: TrainConfig) -> None:
    from planner.optim import OPTIMIZERS

    spec = OPTIMIZERS[new.optimizer]
    d.origin("optimizer", OPTIMIZERS[old.optimizer].hf_optim, spec.hf_optim, fallback_key="optim")
    target = d.reading.origins["optimizer"].file if "optimizer" in d.reading.origins else SCRIPT
    for key, value in spec.hf_args.items():  # the arguments the optimizer's recipe sets beside optim
        d.put(target, key, d.value_in(d.args, key) if d.args else None, value)


def _targets(config: TrainConfig) -> Any:
    if config.lora_targets is None:
        return None
    return ALL_LINEAR if config.lora_all_linear else list(config.lora_targets)


def _method(d: _Diff, old: TrainConfig, new: TrainConfig) -> None:
    adapter = d.reading.by_kind(kinds.ADAPTER)
    if d.trl and d.args is not None and adapter is None:
        path = d.args.path
        if old.method.uses_adapters != new.method.uses_adapters:
            d.put(path, "use_peft", old.method.uses_adapters, new.method.uses_adapters)
        if (str(old.method) == "qlora") != (str(new.method) == "qlora"):
            d.put(path, "load_in_4bit", str(old.method) == "qlora", str(new.method) == "qlora")
        if new.method.uses_adapters:
            d.put(path, "lora_r", old.lora_r, new.lora_r)
            d.put(path, "lora_target_modules", _targets(old), _targets(new))
            # the adapter's recipe settings by their TRL keys (planner.request), written out: TRL's
            # ModelConfig default (a dropout of 0.05) is not the plan's when the file had no adapter
            for f in ADAPTER_RECIPE:
                before = getattr(old, f.name) if old.method.uses_adapters else d.args.data.get(f.trl)
                d.put(path, f.trl, before, getattr(new, f.name))
        return
    base = str(_folder(d)) + "/"
    if new.method.uses_adapters and adapter is None:
        d.put(base + NEW_ADAPTER, "r", None, new.lora_r, new_file=True)
        d.put(base + NEW_ADAPTER, "target_modules", None, _targets(new), new_file=True)
        for f in ADAPTER_RECIPE:  # by their PEFT keys
            d.put(base + NEW_ADAPTER, f.peft, None, getattr(new, f.name), new_file=True)
    elif new.method.uses_adapters and adapter is not None:
        d.put(adapter.path, "r", old.lora_r, new.lora_r)
        d.put(adapter.path, "target_modules", _targets(old), _targets(new))
    elif adapter is not None:  # back to full fine-tuning: the adapter is dropped
        d.put(adapter.path, "(the whole file)", "present", "remove it")
    bnb = d.reading.by_kind(kinds.BNB)
    if str(new.method) == "qlora" and bnb is None:
        d.put(base + NEW_BNB, "load_in_4bit", None, True, new_file=True)
    elif str(new.method) != "qlora" and bnb is not None:
        d.put(bnb.path, "(the whole file)", "present", "remove it")


def _folder(d: _Diff):
    from pathlib import Path

    return Path(d.main.path).parent if d.main is not None else Path(".")


def _precision(d: _Diff, old: TrainConfig, new: TrainConfig) -> None:
    """TrainingArguments' autocast flags, and the dtype the model is loaded in for pure 16-bit
    (TRL's ``dtype``; else the script's ``from_pretrained(dtype=...)``)."""
    target = d.args.path if d.args is not None else d.accel.path if d.accel is not None else SCRIPT
    new_p, old_p = str(new.precision), str(old.precision)
    flag = lambda p: p.split("-")[0] if p.endswith("-mixed") or (str(new.method) == "qlora" and p != "fp32") else None  # noqa: E731
    if d.args is None and d.accel is not None:
        mixed = lambda p: p.split("-")[0] if p.endswith("-mixed") or p == "fp8" else "no"  # noqa: E731
        d.put(target, "mixed_precision", mixed(old_p), mixed(new_p))
    else:
        for name in ("bf16", "fp16"):
            d.put(target, name, flag(old_p) == name, flag(new_p) == name)
    pure = lambda p: p if p in ("bf16", "fp16") else "fp32"  # noqa: E731
    if pure(old_p) != pure(new_p):
        dtype_file = d.args.path if d.trl and d.args is not None else SCRIPT
        d.put(dtype_file, "dtype", _DTYPE_NAMES[pure(old_p)], _DTYPE_NAMES[pure(new_p)])


def sharding_changes(reading: Reading, file, old: tuple[int | str, str], new: tuple[int | str, str]) -> list[KeyChange]:
    """The sharding change of a trainer whose ``file`` names its DeepSpeed JSON under ``deepspeed``
    (axolotl, LLaMA-Factory), as the HF arguments file does."""
    d = _Diff(reading)
    d.args = d.main = file
    _sharding(d, old, new)
    return d.changes


def _sharding(d: _Diff, old: tuple[int | str, str], new: tuple[int | str, str]) -> None:
    (old_zero, old_off), (new_zero, new_off) = old, new
    if isinstance(old_zero, str):  # FSDP: the search keeps the file's scheme (``spelled_schemes``), so the offload
        assert old_zero == new_zero, f"{old_zero} -> {new_zero}: check's search keeps an FSDP file's scheme"
        d.origin("offload", old_off != "none", new_off != "none", fallback_key="fsdp_config.cpu_offload")
        return
    devices = lambda off: ("cpu" if off != "none" else "none", "cpu" if off == "optimizer+params" else "none")  # noqa: E731
    accel_inline = d.accel is not None and d.ds is None and str(d.accel.data.get("distributed_type", "")).upper() == "DEEPSPEED"
    if d.ds is not None:
        path = d.ds.path
        d.put(path, "zero_optimization.stage", old_zero, new_zero)
        for part, before, after in zip(("offload_optimizer", "offload_param"), devices(old_off), devices(new_off)):
            d.put(path, f"zero_optimization.{part}.device", before, after)
        if new_zero:
            _buckets(d, path, new_zero)
        return
    if accel_inline:
        path = d.accel.path
        d.put(path, "deepspeed_config.zero_stage", old_zero, new_zero)
        for part, before, after in zip(("offload_optimizer_device", "offload_param_device"), devices(old_off), devices(new_off)):
            d.put(path, f"deepspeed_config.{part}", before, after)
        return
    if new_zero == 0:
        return
    new_file = str(_folder(d)) + "/" + NEW_DEEPSPEED
    if d.args is not None:
        d.put(d.args.path, "deepspeed", None, NEW_DEEPSPEED)
    if d.accel is not None:
        d.put(d.accel.path, "distributed_type", d.accel.data.get("distributed_type"), "DEEPSPEED")
        d.put(d.accel.path, "deepspeed_config.deepspeed_config_file", None, NEW_DEEPSPEED)
    d.put(new_file, "zero_optimization.stage", None, new_zero, new_file=True)
    opt, param = devices(new_off)
    if opt != "none":
        d.put(new_file, "zero_optimization.offload_optimizer.device", None, opt, new_file=True)
    if param != "none":
        d.put(new_file, "zero_optimization.offload_param.device", None, param, new_file=True)
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16.enabled", "fp16.enabled"):
        d.put(new_file, key, None, "auto", new_file=True)  # the Trainer fills "auto" from its own arguments
    _buckets(d, new_file, new_zero, new_file=True)


def _buckets(d: _Diff, path: str, zero: int, *, new_file: bool = False) -> None:
    """The bucket keys the plan assumes, "auto" for the Trainer to fill from the model's hidden size
    (transformers integrations/deepspeed.py l.204-240), where the DeepSpeed JSON leaves them out:
    there DeepSpeed's 5e8-element reduce bucket would hold 1 GB of 16-bit gradients the changed
    plan does not count (planner/sharding/zero.py zero_buckets). A number the file sets is the
    user's, and stays."""
    from planner.sharding.zero import auto_bucket_keys

    zero_section = {} if new_file or d.ds is None else (d.ds.data.get("zero_optimization") or {})
    for key in auto_bucket_keys(zero):
        if key not in zero_section:
            d.put(path, f"zero_optimization.{key}", None, "auto", new_file=new_file)


__all__ = ["NEW_ADAPTER", "NEW_BNB", "NEW_DEEPSPEED", "SCRIPT", "key_changes", "sharding_changes"]
