"""How sure a plan's memory is: a stated central interval of its peak and the probability that it
runs out of memory, from the memory model's measured error.

The error is the model's own against published GPU measurements: ``bench/published.py`` scores
every row of ``bench/published_rows.json`` on the counter the source measured and
``python bench/published.py --uncertainty`` prints ``MEMORY_ERROR`` below, the quantiles of
ln(measured / predicted) by method, rows whose settings are all stated apart from rows with a
guessed setting (their error is the guess's as much as the model's: wider), and one GPU's runs apart
from one rank of several (the sharding's and the collectives' error too: wider). A method with fewer
than 8 rows of a kind, or rows of one harness, takes the pooled median and the pooled interval widened
to hold its rows. The quantiles are order statistics rounded outward,
so the central interval covers at least its share of the rows it came from
(tests/memory/test_uncertainty.py checks it on the bench).

The distribution of x = ln(measured / predicted) is a split normal: its median, and below and
above it the normal scales that put the 5% and 95% quantiles where the table has them. So
``peak_interval`` is [predicted * e^q05, predicted * e^q95] and

    oom_probability = P(x > ln(capacity / predicted process total))

is 5% exactly where the interval's upper end meets the device. A device calibrated on its own runs
(``Spread.from_residuals``: at least 8 measured ln ratios) uses their spread where it is narrower.

What it is not: the chance a particular run fails. The rows are 148 measurements from 8 sources, the
counters measure parts of the process total (allocated, reserved, NVML used) and are pooled, and
the interval says how far the model has been from measurements like these, not what a new
library version, driver or data loader adds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

#: (method or "all", guessed, several GPUs): (rows, q05, median, q95) of ln(measured / predicted) over
#: the scored rows of bench/published.py (bench/published_rows.json), every counter together; printed by
#: ``python bench/published.py --uncertainty`` (2026-11-28, 148 scored rows of 155 from 8 sources; 44 of
#: them one rank of a 2-GPU FSDP1 run, fms-acceleration's, kept apart as "several GPUs").
MEMORY_ERROR: dict[tuple[str, bool, bool], tuple[int, float, float, float]] = {
    ("all", False, False): (53, -0.0235, 0.0088, 0.0944),
    ("all", False, True): (44, -0.0501, 0.0034, 0.1827),
    ("all", True, False): (51, -0.4224, 0.0308, 0.3206),
    ("full", False, False): (17, -0.0156, 0.0335, 0.1906),
    ("full", False, True): (8, -0.0501, 0.0034, 0.1827),
    ("full", True, False): (22, -0.1502, 0.0192, 0.0896),
    ("lora", False, False): (8, -0.0235, 0.0088, 0.0944),
    ("lora", False, True): (16, -0.0574, 0.0034, 0.1827),
    ("lora", True, False): (15, -0.4224, -0.008, 0.194),
    ("qlora", False, False): (28, -0.0424, 0.0088, 0.0944),
    ("qlora", False, True): (20, -0.0501, 0.0034, 0.2367),
    ("qlora", True, False): (14, -0.4238, 0.3113, 0.4613),
}

#: The central interval's share: 90%, so its upper end is the 95th percentile.
CENTRAL = 0.90
#: The standard normal's 95th percentile (the 90% central interval's half width in sigmas).
_Z95 = 1.6448536269514722
#: A plan is near the edge when its probability of running out of memory exceeds 5%: where the
#: device's capacity falls inside the plan's 90% interval. One plan in twenty is the rate at which
#: a verification run that OOMs costs more than the few percent of speed a smaller micro-batch
#: gives up (the safe split of a near-the-edge plan is typically within 10% of its speed); it also
#: makes "near the edge" and "the interval reaches past the device" the same statement.
NEAR_EDGE_PROBABILITY = 0.05
#: A device's own residuals narrow its spread from this many runs on (as many as a method's entry).
MIN_RUNS = 8


class Spread(NamedTuple):
    """The quantiles of ln(measured / predicted) a plan's memory is read with."""

    q05: float
    median: float
    q95: float
    source: str

    @classmethod
    def from_residuals(cls, residuals: Sequence[float], source: str) -> Spread | None:
        """A device's spread from its own runs' ln(measured / predicted), None with fewer than
        MIN_RUNS (the same outward-rounded order statistics as the bench's table)."""
        if len(residuals) < MIN_RUNS:
            return None
        xs = sorted(residuals)
        at_lo, at_hi = 0.05 * (len(xs) - 1), 0.95 * (len(xs) - 1)
        mid = len(xs) // 2
        median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return cls(xs[math.floor(at_lo)], median, xs[math.ceil(at_hi)], source)


def spread(method: str, *, guessed: bool = False, gpus: int = 1, calibrated: Spread | None = None) -> Spread:
    """The spread of a plan of ``method`` (full, lora, qlora) on ``gpus`` GPUs: the method's entry of
    MEMORY_ERROR for one GPU or for one rank of several, else the pooled one of that kind, else (no
    measured run of the kind: settings guessed on several GPUs) the one-GPU pooled one; a device
    calibration's own spread when it is the narrower."""
    several = gpus > 1
    key = next((k for k in ((str(method), guessed, several), ("all", guessed, several), ("all", guessed, False))
                if k in MEMORY_ERROR))
    rows, q05, median, q95 = MEMORY_ERROR[key]
    kind = ", settings guessed" * guessed + ", one rank of several GPUs" * key[2]
    stated = Spread(q05, median, q95, f"{rows} published runs ({key[0]}{kind})")
    if calibrated is not None and calibrated.q95 - calibrated.q05 < q95 - q05:
        return calibrated
    return stated


def peak_interval(total: int, s: Spread) -> tuple[int, int]:
    """The CENTRAL interval of a predicted ``total`` in bytes: [total * e^q05, total * e^q95]."""
    return int(total * math.exp(s.q05)), math.ceil(total * math.exp(s.q95))


def oom_probability(total: int, capacity: int, s: Spread) -> float:
    """P(measured > capacity) for a predicted process ``total``: the split normal's tail past
    ln(capacity / total). 1 when the prediction alone is past the device."""
    if total <= 0:
        return 0.0
    if capacity <= 0:
        return 1.0
    t = math.log(capacity / total)
    if t >= s.median:
        scale = (s.q95 - s.median) / _Z95
        return 0.5 * math.erfc((t - s.median) / (scale * math.sqrt(2))) if scale > 0 else 0.0
    scale = (s.median - s.q05) / _Z95
    return 1.0 - 0.5 * math.erfc((s.median - t) / (scale * math.sqrt(2))) if scale > 0 else 1.0


def safe_total(capacity: int, s: Spread) -> int:
    """The largest process total whose probability of running out of memory is at most
    NEAR_EDGE_PROBABILITY (5%: the interval's upper end at the device)."""
    return int(capacity * math.exp(-s.q95))


__all__ = ["CENTRAL", "MEMORY_ERROR", "NEAR_EDGE_PROBABILITY", "Spread", "oom_probability", "peak_interval",
           "safe_total", "spread"]
