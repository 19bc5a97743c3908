"""The largest sequence length, or micro-batch, that one configuration fits (``--max-seq``).

"How long a context can I train?" is asked of a configuration, not of a search: the method,
precision, optimizer, checkpointing and attention stay as given and one size grows. Each answer is
the largest value whose full estimate (timeline and allocator replay, as ``planner estimate``
makes it) fits the usable memory, and the largest that is also not near the edge: its probability
of running out of memory (the model's measured error, ``planner.uncertainty``) is at most 5%.
The second is the one to train with; the first is where the model's central estimate says the
device is full.

Both are found by bisection on the full estimate, which assumes the process total never falls as
the size grows (every term of ``planner.memory`` is non-decreasing in the sequence length and in
the micro-batch); a size at which the estimate is refused (a sequence past the model's maximum)
bounds the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.results import MemoryEstimate

#: The largest micro-batch the solver tries: past it a request is a typo, not a plan (the search's
#: own bound on a global batch is planner.search.MAX_TARGET_BATCH).
MAX_MICRO_BATCH = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class Solved:
    """The largest value of one size that fits, and the largest that fits safely."""

    size: str
    """"seq_len" or "micro_batch"."""
    fits: int
    """Largest value whose process total is within the usable memory (0: not even 1)."""
    safe: int
    """Largest value that fits and is not near the edge (probability of running out <= 5%)."""
    limit: int
    """The largest value the search could try (the model's context limit, ``planner.config.context_limit``: with
    its RoPE scaling, less the eval pass's generated tokens where its prompt is the training length; MAX_MICRO_BATCH)."""
    fits_total: int | None
    """Process total at ``fits`` (None when nothing fits)."""
    safe_total: int | None
    """Process total at ``safe`` (None when nothing is safe)."""
    usable: int
    estimates: int
    """Full estimates made."""

    def to_dict(self) -> dict:
        return {"size": self.size, "fits": self.fits, "safe": self.safe, "limit": self.limit,
                "fits_process_total_bytes": self.fits_total, "safe_process_total_bytes": self.safe_total,
                "usable_bytes": self.usable, "estimates": self.estimates}


def longest_seq_len(*, spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig") -> Solved:
    """The longest sequence ``config`` (its micro-batch and everything else as given) fits on ``gpu``.
    Where the eval pass's prompt is the training length (an eval batch without ``eval_seq_len``), the
    eval sequence is that length plus the tokens it generates, which must stay within the model's
    context as well (``planner.request.check_for_model``): the search stops ``generate_tokens`` short
    of the context limit, and the eval moment is part of every estimate it makes."""
    from planner.config import context_limit

    limit = context_limit(spec, config) - eval_tokens_past_seq_len(config)
    return _solve("seq_len", spec=spec, gpu=gpu, config=config, limit=limit)


def eval_tokens_past_seq_len(config: "TrainConfig") -> int:
    """The tokens the eval sequence holds beyond ``seq_len`` when its prompt grows with it (no
    ``eval_seq_len``): the generated ones; 0 when the run does not evaluate or its prompt is fixed."""
    return config.generate_tokens if config.evaluates and config.eval_seq_len is None else 0


def largest_micro_batch(*, spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig") -> Solved:
    """The largest micro-batch ``config`` (at its sequence length) fits on ``gpu`` (no accumulation
    changes the peak: it is planned as the micro-batch alone)."""
    return _solve("micro_batch", spec=spec, gpu=gpu, config=config, limit=MAX_MICRO_BATCH)


def _solve(size: str, *, spec: "ModelSpec", gpu: "GPUSpec", config: "TrainConfig", limit: int) -> Solved:
    from planner.memory import estimate_memory
    from planner.search import safety_margin
    from planner.tradeoffs import near_edge

    usable = gpu.memory_bytes - safety_margin(gpu.memory_bytes)
    seen: dict[int, "MemoryEstimate"] = {}

    def estimate(value: int) -> "MemoryEstimate":
        if value not in seen:
            sized = config.replace(seq_len=value) if size == "seq_len" else config.with_split(
                micro_batch=value, grad_accum=config.grad_accum)
            seen[value] = estimate_memory(model=spec, config=sized, gpu=gpu, budget=usable)
        return seen[value]

    def fits(value: int) -> bool:
        return estimate(value).process_total_bytes <= usable

    def safe(value: int) -> bool:
        return fits(value) and not near_edge(config, estimate(value), capacity=gpu.memory_bytes)

    largest = _largest(fits, limit)
    largest_safe = _largest(safe, largest) if largest else 0
    return Solved(size=size, fits=largest, safe=largest_safe, limit=limit,
                  fits_total=estimate(largest).process_total_bytes if largest else None,
                  safe_total=estimate(largest_safe).process_total_bytes if largest_safe else None,
                  usable=usable, estimates=len(seen))


def _largest(ok: Callable[[int], bool], limit: int) -> int:
    """The largest value in 1..limit for which ``ok`` holds (0 if none), ``ok`` being true up to a
    point and false after it: doubling from 1, then bisection."""
    if limit < 1 or not ok(1):
        return 0
    lo = 1
    hi = 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)  # hi: the first value known (or taken) not to hold
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["MAX_MICRO_BATCH", "Solved", "eval_tokens_past_seq_len", "largest_micro_batch", "longest_seq_len"]
