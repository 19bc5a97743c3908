"""What would change a plan that does not fit, or fits only near the edge: which of the planner's
own options would, each with the memory it saves on the closest try (issue 20, item 5).

Each option is tried on the configuration the search came closest with, through the same fast
path the search screens with (``planner.search.totals_by_split``), so a saving is what the planner
itself would predict; an option that saves nothing, or that the configuration cannot take, is not
said. More GPUs are said only when they lower the per-device memory (ZeRO-3 shards the model
states over them), a bigger GPU only when one in the catalog holds the closest try.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.config import Method, TrainConfig
from planner.errors import PlannerError
from planner.request import RECIPE, check_for_model
from planner.sharding import NONE, Offload, Sharding
from planner.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.search import SearchSpace

#: A saving smaller than this share of the closest try is not worth a line.
MIN_SAVING = 0.01


def _total(model: "ModelSpec", config: TrainConfig, gpu: "GPUSpec", _memo: None = None) -> int:
    from planner.search import totals_by_split

    [(total, _host)] = totals_by_split(model=model, config=config, gpu=gpu,
                                        splits=[(config.micro_batch, config.grad_accum)])
    return total


#: The sharding a recipe setting is tried with where the planned scheme does not take it (ZeRO-3
#: and the fused cross-entropy: ``ShardingSpec.partial_head``): ZeRO-2 with optimizer offload.
_FALLBACK_SHARDING = Sharding("zero2", Offload.OPTIMIZER)
#: The sharding "twice the GPUs" is tried with: ZeRO-3, which partitions everything.
_MOST_SHARDED = Sharding("zero3")


def _with(model: "ModelSpec", gpu: "GPUSpec", setting: dict, configs: list[TrainConfig]) -> int | None:
    """The least process total of ``configs`` with the recipe ``setting``, each as it is or, under a
    scheme that does not take it (ZeRO-3 and a fused cross-entropy), with ZeRO-2 and optimizer
    offload; None when none can take it."""
    best = None
    for config in configs:
        for changes in (setting, {**setting, "sharding": _FALLBACK_SHARDING}):
            try:
                total = _total(model, config.replace(**changes), gpu)
            except PlannerError:
                continue
            best = total if best is None else min(best, total)
    return best


def advice(*, model: "ModelSpec", gpu: "GPUSpec", config: TrainConfig, total: int, target: int,
           space: "SearchSpace", others: tuple[TrainConfig, ...] = ()) -> list[str]:
    """One clause per option that lowers ``config``'s process ``total`` (the closest try), each
    with what it saves and whether that brings it under ``target`` (the usable memory, or the
    largest total that is not near the edge). ``others``: the other families' closest tries,
    which --fused-ce may bring lower than ``config`` (it takes LoRA and QLoRA at ZeRO <= 2)."""
    tries: list[tuple[str, dict]] = []
    lines = []
    for f in RECIPE:  # the recipe settings that lower memory, which the search never tries (planner.request)
        if f.advised is None or getattr(space, f.name) == f.advised:
            continue
        setting = {f.name: f.advised}
        try:
            check_for_model(model_id=model.id, is_encoder=model.is_encoder, values=setting)
        except PlannerError:  # not a setting this model takes
            continue
        best = _with(model, gpu, setting, [config, *others])  # a try that does not take it is skipped
        if best is not None and total - best > MIN_SAVING * total:
            lines.append(_line(f.flag.split("/")[0], total - best, best, target))
    if config.seq_len >= 256:
        tries.append((f"--seq-len {config.seq_len // 2}", {"seq_len": config.seq_len // 2}))
    if config.method is not Method.QLORA and Method.QLORA not in space.methods:
        tries.append(("--method qlora", {"method": Method.QLORA, "sharding": NONE,
                                         "lora_r": config.lora_r if config.method.uses_adapters else None,
                                         "lora_targets": config.lora_targets if config.method.uses_adapters else None}))
    for name, changes in tries:
        try:
            changed = config.replace(**changes)
            saved = total - _total(model, changed, gpu, None)
        except PlannerError:
            continue
        if saved > MIN_SAVING * total:
            lines.append(_line(name, saved, total - saved, target))
    lines += _more_gpus(model=model, gpu=gpu, config=config, total=total, target=target)
    bigger = _bigger_gpu(model=model, gpu=gpu, config=config)
    if bigger:
        lines.append(bigger)
    return lines


def _line(name: str, saved: int, after: int, target: int) -> str:
    return f"{name} saves {format_bytes(saved)}" + (" (enough)" if after <= target else "")


def _more_gpus(*, model: "ModelSpec", gpu: "GPUSpec", config: TrainConfig, total: int, target: int) -> list[str]:
    """Twice the GPUs with ZeRO-3, when that lowers the per-device total: at micro-batch 1 with
    the states already small, more GPUs cannot help (each still holds one sequence's activations)."""
    from planner.limits import MAX_GPUS_PER_NODE

    gpus = config.gpus * 2
    if gpus > MAX_GPUS_PER_NODE:
        return []
    try:
        sharded = config.replace(gpus=gpus, sharding=_MOST_SHARDED)
        after = _total(model, sharded, gpu, None)
    except PlannerError:
        return []
    if total - after <= MIN_SAVING * total:
        return []
    return [_line(f"--gpus {gpus} (ZeRO-3 shards the model states)", total - after, after, target)]


def _bigger_gpu(*, model: "ModelSpec", gpu: "GPUSpec", config: TrainConfig) -> str | None:
    """The catalog GPU with the least memory, more than this one's, that holds the closest try
    without being near the edge (``planner.uncertainty.safe_total``)."""
    from planner.gpus import list_gpus
    from planner.uncertainty import safe_total, spread

    for other in sorted((g for g in list_gpus() if not g.is_cpu and g.name != gpu.name
                         and g.memory_bytes > gpu.memory_bytes), key=lambda g: g.memory_bytes):
        try:
            if not other.supports(config.precision):
                continue
            need = _total(model, config, other)
        except PlannerError:
            continue
        if need <= safe_total(other.memory_bytes, spread(config.method, gpus=config.gpus)):
            return f"a bigger GPU: --gpu {other.name} ({format_bytes(other.memory_bytes)}) holds it"
    return None


__all__ = ["advice"]
