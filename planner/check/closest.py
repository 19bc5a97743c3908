"""The closest change: ``planner suggest``'s search at the file's global batch, then narrowed back
towards the file.

1. Search (``planner.planning.make_plan``, the use case behind ``planner suggest``) at the file's
   global batch, sequence length, GPU count and recipe settings, first with the file's method and
   precision fixed, then with its method alone, then over every method: the first search with a
   plan that meets the goal answers. The goal: fit without being near the edge (over 5% OOM risk)
   when the file's configuration does not; else be faster by more than the ranking's 2% tie.
2. Of the plans that meet it, the one that changes the least of the file (``DISTANCE``: a method
   weighs more than a precision, which weighs more than a batch split), the fastest of those; a
   faster change keeps an optimizer at least as preferred as the file's (``_keeps_the_optimizer``).
3. Each option that plan changed is put back to the file's value, one at a time, largest first,
   and kept back when the configuration, estimated again (``planner.estimation``), still meets the
   goal: the diff holds only what the goal needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from planner.errors import NothingFitsError, PlannerError, UnsupportedError
from planner.ranking import SPEED_TIE
from planner.request import ADAPTER, ADAPTER_RECIPE, recipe_of

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.check.reading import Reading
    from planner.check.result import Change
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec

#: how much each changed option weighs in the distance from the file's configuration: what a user
#: gives up (the method, the numerics) before how the step is arranged (sharding, checkpointing, split);
#: the adapter's recipe settings (its dropout) change only with the method, and weigh least
DISTANCE = {"method": 16, "precision": 8, "optimizer": 4, "zero": 3, "offload": 3, "lora_r": 2, "lora_targets": 2,
            "attention": 2, "grad_ckpt": 1, "micro_batch": 1, **{f.name: 1 for f in ADAPTER_RECIPE}}
#: options put back together: the split keeps the global batch
_TOGETHER = {"micro_batch": ("micro_batch", "grad_accum"), "zero": ("zero", "offload"),
             "method": ("method", *ADAPTER)}
#: plans kept per search: more than suggest shows, so that a plan close to the file is among them
TOP_K = 10
#: a faster change must be faster by more than the ranking's tie
FASTER_BY = SPEED_TIE


def _fields(config: "TrainConfig") -> dict[str, Any]:
    from planner.check.building import options_of

    return options_of(config)


def distance(a: "TrainConfig", b: "TrainConfig") -> int:
    fa, fb = _fields(a), _fields(b)
    return sum(weight for name, weight in DISTANCE.items() if fa.get(name) != fb.get(name))


def _meets(estimate: Mapping[str, Any], goal: str, base_speed: float) -> bool:
    safe = estimate["fits"] and not estimate["near_edge"]
    if goal == "fit":
        return bool(safe)
    return bool(safe) and estimate["throughput"]["tokens_per_s"] > base_speed * (1 + FASTER_BY)


def closest_change(reading: "Reading", *, spec: "ModelSpec", device: "GPUSpec", config: "TrainConfig",
                   estimate: Mapping[str, Any], calibration: "Calibration | None", cpu_mem_bytes: int | None,
                   gpu_mem_bytes: int | None) -> "tuple[Change | None, list[str]]":
    """(the change, advice): the advice is ``planner suggest``'s when nothing fits."""
    from planner.check.building import sharding, spellable, spelled_schemes, train_config
    from planner.check.diff import key_changes
    from planner.check.trainers import key_changes as trainer_key_changes
    from planner.check.result import Change
    from planner.estimation import estimate_configuration
    from planner.planning import SuggestRequest, make_plan
    from planner.tradeoffs import near_edge

    goal = "faster" if estimate["fits"] and not estimate["near_edge"] else "fit"
    speed = estimate["throughput"]["tokens_per_s"]
    advice: list[str] = []
    refused: list[str] = []
    base = dict(model=spec.id, gpu=device.name, target_batch=config.global_batch, seq_len=config.seq_len,
                gpus=config.gpus, gpu_mem_bytes=gpu_mem_bytes, cpu_mem_bytes=cpu_mem_bytes, top_k=TOP_K,
                schemes=spelled_schemes(reading.trainer, config), **recipe_of(config))
    tiers = [(str(config.method), str(config.precision)), (str(config.method), "auto"), ("auto", "auto")]
    for method, precision in dict.fromkeys(tiers):
        try:
            request = SuggestRequest(**base, method=method, precision=precision)
            planned = make_plan(request, spec=spec, calibration=calibration)
        except NothingFitsError as exc:
            advice = [str(exc)]
            continue
        except PlannerError as exc:  # a tier the search refuses (a recipe setting it does not take)
            refused.append(str(exc))
            continue
        pool = [c for c in (*planned.result.plans, planned.result.alternative) if c is not None]
        capacity = planned.device.memory_bytes
        # the search's own estimate of each plan (the same model as estimate's) picks the closest;
        # the chosen one is estimated again below, as planner estimate would
        found = [(distance(config, c.config), -c.throughput.tokens_per_s, c.config) for c in pool
                 if c.fits and not near_edge(c.config, c.memory, capacity=capacity)
                 and (goal == "fit" or c.throughput.tokens_per_s > speed * (1 + FASTER_BY))]
        found += _with_the_files_adapter(config, pool, goal=goal, speed=speed, spec=spec, device=device)
        found = [f for f in found if spellable(reading.trainer, f[2]) and _keeps_the_optimizer(config, f[2], goal)]
        if found:
            best = min(found, key=lambda t: t[:2])[2]
            try:
                data, _ = estimate_configuration(spec=spec, gpu=device, seq_len=config.seq_len, **_fields(best))
            except PlannerError:
                continue
            if not _meets(data, goal, speed):
                continue
            def make(options: Mapping[str, Any]) -> "TrainConfig":
                made = train_config(spec, device, seq_len=config.seq_len, options=options)
                if not spellable(reading.trainer, made):
                    raise UnsupportedError(f"{reading.trainer} cannot say {made.label()}")
                return made

            best, data = _narrow(config, best, data, goal=goal, speed=speed, spec=spec, device=device, make=make)
            # one YAML file holds the run of axolotl, LLaMA-Factory or torchtune: its trainer writes the keys
            keys = (trainer_key_changes if reading.trainer else key_changes)(reading, config, best, sharding=sharding)
            return Change(goal=goal, config=best, keys=keys, estimate=data), []
    # every tier refused: say why no change was searched (the first refusal: the file's own tier's)
    return None, advice or ([f"no change searched: {refused[0]}"] if len(refused) == len(dict.fromkeys(tiers)) else [])


def _keeps_the_optimizer(original: "TrainConfig", changed: "TrainConfig", goal: str) -> bool:
    """A change made to be faster keeps an optimizer at least as preferred as the file's
    (``OptimizerSpec.preference``: AdamW, then its 8-bit states, then Adafactor, SGD, Lion): the
    optimizer is part of what the run learns, and trading it for speed (SGD's freed moments let a
    plan drop checkpointing) is not a change of arrangement. To fit, any optimizer may be offered."""
    from planner.optim import OPTIMIZERS

    return goal == "fit" or OPTIMIZERS[changed.optimizer].preference <= OPTIMIZERS[original.optimizer].preference


def _with_the_files_adapter(config: "TrainConfig", pool, *, goal: str, speed: float, spec, device) -> list:
    """The search's plans of the file's method with the file's own adapter (rank, targets, dropout)
    in place of the searched ones, estimated again: the search tries its own ranks and target sets,
    and a file's narrower adapter (peft's default q_proj,v_proj) is cheaper and faster than any of
    them, so a change of split or checkpointing alone would otherwise be missed."""
    from planner.check.building import train_config
    from planner.estimation import estimate_configuration

    if not config.method.uses_adapters:
        return []
    mine = {n: v for n, v in _fields(config).items() if n in ADAPTER}
    out = []
    for candidate in pool:
        if candidate.config.method != config.method:
            continue
        try:
            changed = train_config(spec, device, seq_len=config.seq_len, options={**_fields(candidate.config), **mine})
            data, _ = estimate_configuration(spec=spec, gpu=device, seq_len=config.seq_len, **_fields(changed))
        except PlannerError:
            continue
        if _meets(data, goal, speed):
            out.append((distance(config, changed), -data["throughput"]["tokens_per_s"], changed))
    return out


def _narrow(original: "TrainConfig", best: "TrainConfig", data: Mapping[str, Any], *, goal: str, speed: float,
            spec, device, make) -> "tuple[TrainConfig, Mapping[str, Any]]":
    """Put each option ``best`` changed back to ``original``'s value where the goal still holds."""
    from planner.estimation import estimate_configuration

    mine = _fields(original)
    for name in sorted(DISTANCE, key=lambda n: -DISTANCE[n]):
        current = _fields(best)
        group = _TOGETHER.get(name, (name,))
        if all(current.get(n) == mine.get(n) for n in group):
            continue
        trial = {**current, **{n: mine.get(n) for n in group}}
        try:
            config = make(trial)
            trial_data, _ = estimate_configuration(spec=spec, gpu=device, seq_len=original.seq_len, **_fields(config))
        except PlannerError:
            continue
        if _meets(trial_data, goal, speed):
            best, data = config, trial_data
    return best, data


__all__ = ["DISTANCE", "TOP_K", "closest_change", "distance"]
