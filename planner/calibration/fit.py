"""Fit the device constants the model cannot derive from measured runs. Pure: no I/O.

**Step time.** For one run the throughput model's step is (``planner.throughput.step_breakdown``)

    t = M / mfu[dtype] + B / e + C

with M its matmul seconds at 100% of the device's peak (compute, attention, recompute; each GEMM
on its roofline at the unit rates, so ``mfu`` is the large-GEMM efficiency), B its memory-bound
seconds at 100% of the datasheet bandwidth (elementwise work, QLoRA dequantisation, the on-device
optimizer update), C the parts no constant here scales (host overhead, collectives, offload
copies, host-side Adam). It is linear in x_d = 1/mfu[d] and y = 1/e, so the constants are fitted by least squares on
the relative errors (t_pred - t_meas) / t_meas (a run of 10 ms weighs as much as one of 10 s),
bounded to physical ranges: ``BOUNDS`` (an efficiency cannot exceed 1; one below 1% means the
model misses a term, not that the device is slow). With at most four unknowns the bounded problem
is solved exactly by trying every face of the box (each unknown free, at its lower or at its
upper bound: 3^4 = 81 small solves) and keeping the feasible solution of least cost. A weak pull
toward the defaults (``PULL``, in units of a relative change of the constant) keeps the fit
defined when two parts always come in the same ratio (every run the same model, say); its effect
on a well-posed fit is below 0.1%.

A constant is fitted only from runs where its part is at least ``MIN_SHARE`` of the step predicted
with the defaults, and only with ``MIN_RUNS`` such runs; the others keep their defaults.

**Memory.** On CUDA the caching allocator is replayed (``planner.memory.allocator``); what the
model cannot derive is the memory the process holds outside it: the CUDA context, cuBLAS/cuDNN
handles, NCCL buffers. A run measures it as its process total less its peak reserved
(``workers.probes.CudaProbe``: device used - free - reserved before the measured step), less what
the model itself puts on the device outside the allocator (NCCL's buffers, the paged optimizer
states it keeps resident: ``planner.calibration.runs``). The fit is the median over
the runs (robust to one odd run), bounded to [0, 8 GiB]. The reserve itself is not fitted: the
replay models it, and a residual there is a modelling error to find, not a constant (no fudge
factors); it is reported beside the fit. The CPU has neither context nor caching allocator: its
memory is checked, not fitted.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from planner.calibration.values import MFU_KEYS, CalibrationValues
from planner.units import GiB

#: The fewest runs that inform a constant before it is fitted (three: one odd run cannot move a
#: median of three, and a least-squares fit of one constant has two degrees of freedom left).
MIN_RUNS = 3
#: A run informs a constant when the constant's part is at least this share of its step
#: predicted with the defaults.
MIN_SHARE = 0.10
#: Physical ranges: (lowest, highest).
BOUNDS = {"mfu": (0.01, 1.0), "bandwidth_efficiency": (0.01, 1.0), "cuda_context_bytes": (0, 8 * GiB)}
#: Weight of the pull toward the defaults, per unknown, against a sum of squared relative errors.
PULL = 1e-6
_BANDWIDTH = "bandwidth_efficiency"
_CONTEXT = "cuda_context_bytes"


@dataclass(frozen=True, kw_only=True)
class StepRun:
    """One measured step, split into the parts each constant scales."""

    id: str
    dtype: str
    """``matmul_dtype`` of the run's precision: the MFU it runs at."""
    matmul_s: float
    """Matmul seconds at 100% of the peak FLOP/s."""
    memory_s: float
    """Memory-bound seconds at 100% of the datasheet bandwidth."""
    fixed_s: float
    """Seconds no constant here scales."""
    measured_s: float

    def __post_init__(self) -> None:
        if self.dtype not in MFU_KEYS:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(MFU_KEYS)}")
        if min(self.matmul_s, self.memory_s, self.fixed_s) < 0 or not self.measured_s > 0:
            raise ValueError(f"run {self.id}: times must be >= 0 and the measured step > 0")


@dataclass(frozen=True, kw_only=True)
class MemoryRun:
    """One measured peak with the model's prediction of it (uncalibrated)."""

    id: str
    predicted_allocated: int
    measured_allocated: int
    predicted_reserved: int | None = None
    """The replayed reserve; None where there is no caching allocator (the CPU)."""
    measured_reserved: int | None = None
    predicted_outside: int = 0
    """Bytes the model puts on the device outside the allocator besides the context (NCCL's
    buffers, the resident part of paged optimizer states)."""
    measured_total: int | None = None
    """Process total (nvidia-smi's view); None where the run could not see it."""

    @property
    def outside_measured(self) -> int | None:
        """The context as this run measured it: total - reserved - the model's other outside bytes."""
        if self.measured_total is None or self.measured_reserved is None or self.predicted_reserved is None:
            return None
        return self.measured_total - self.measured_reserved - self.predicted_outside


@dataclass(frozen=True, kw_only=True)
class ErrorStats:
    """Relative errors (predicted - measured) / measured over some runs, in percent."""

    runs: int
    median_abs_pct: float
    max_abs_pct: float
    mean_pct: float
    """Signed mean: positive = over-predicted on average."""

    @classmethod
    def of(cls, pairs: Sequence[tuple[float, float]]) -> "ErrorStats | None":
        errors = [100.0 * (p - m) / m for p, m in pairs if m]
        if not errors:
            return None
        return cls(runs=len(errors), median_abs_pct=statistics.median(abs(e) for e in errors),
                   max_abs_pct=max(abs(e) for e in errors), mean_pct=statistics.fmean(errors))

    def to_dict(self) -> dict[str, Any]:
        return {"runs": self.runs, "median_abs_pct": self.median_abs_pct, "max_abs_pct": self.max_abs_pct,
                "mean_pct": self.mean_pct}


@dataclass(frozen=True, kw_only=True)
class ConstantFit:
    """One constant: its default, its fitted value (None: not fitted) and the error it leaves."""

    key: str
    """``mfu.bf16``, ``bandwidth_efficiency`` or ``cuda_context_bytes``."""
    default: float
    value: float | None
    runs: int
    """Runs that inform it."""
    quantity: str
    """What its error is measured on: ``step time`` or ``process total``."""
    before: ErrorStats | None = None
    """The error on its runs with the defaults..."""
    after: ErrorStats | None = None
    """...and with the fitted constants."""
    at_bound: bool = False
    """The fit hit a physical bound (the model likely misses a term on these runs)."""
    note: str = ""
    """Why it was not fitted."""

    @property
    def name(self) -> str:
        if self.key.startswith("mfu."):
            return f"mfu {self.key[4:]}"
        return {"bandwidth_efficiency": "memory bandwidth efficiency", "cuda_context_bytes": "CUDA context"}[self.key]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "name": self.name, "default": self.default, "value": self.value, "runs": self.runs,
                "quantity": self.quantity, "before": self.before.to_dict() if self.before else None,
                "after": self.after.to_dict() if self.after else None, "at_bound": self.at_bound, "note": self.note}


@dataclass(frozen=True, kw_only=True)
class CalibrationFit:
    """The fitted constants and the errors before and after, on the runs fitted."""

    constants: tuple[ConstantFit, ...]
    step_before: ErrorStats | None = None
    step_after: ErrorStats | None = None
    total_before: ErrorStats | None = None
    """Process total (CUDA)."""
    total_after: ErrorStats | None = None
    allocated: ErrorStats | None = None
    """Peak allocated: no constant changes it; reported as the memory model's check."""
    reserved: ErrorStats | None = None
    """Peak reserved (CUDA): the replayed allocator, not fitted; reported."""

    @property
    def fitted(self) -> tuple[ConstantFit, ...]:
        return tuple(c for c in self.constants if c.value is not None)

    def values(self) -> CalibrationValues:
        return _values(self.constants, fitted=True)

    def defaults(self) -> CalibrationValues:
        """The defaults of the constants it fitted."""
        return _values(self.fitted, fitted=False)

    def to_dict(self) -> dict[str, Any]:
        def d(stats: ErrorStats | None) -> dict[str, Any] | None:
            return stats.to_dict() if stats else None

        return {"constants": [c.to_dict() for c in self.constants], "step_before": d(self.step_before),
                "step_after": d(self.step_after), "total_before": d(self.total_before), "total_after": d(self.total_after),
                "allocated": d(self.allocated), "reserved": d(self.reserved)}


def _values(constants: Sequence[ConstantFit], *, fitted: bool) -> CalibrationValues:
    mfu: dict[str, float] = {}
    bandwidth, context = None, None
    for c in constants:
        value = c.value if fitted else c.default
        if value is None:
            continue
        if c.key.startswith("mfu."):
            mfu[c.key[4:]] = value
        elif c.key == _BANDWIDTH:
            bandwidth = value
        else:
            context = int(round(value))
    return CalibrationValues(mfu=mfu, bandwidth_efficiency=bandwidth, cuda_context_bytes=context)


# ---- step time ------------------------------------------------------------------------------
def predict_step(run: StepRun, *, mfu: Mapping[str, float], bandwidth_efficiency: float) -> float:
    """The model's step for ``run`` with these constants."""
    return run.matmul_s / mfu[run.dtype] + run.memory_s / bandwidth_efficiency + run.fixed_s


def _informs(run: StepRun, key: str, defaults: CalibrationValues) -> bool:
    step = predict_step(run, mfu=defaults.mfu, bandwidth_efficiency=defaults.bandwidth_efficiency or 1.0)
    if key == _BANDWIDTH:
        part = run.memory_s / (defaults.bandwidth_efficiency or 1.0)
    else:
        part = run.matmul_s / defaults.mfu[run.dtype] if run.dtype == key[4:] else 0.0
    return step > 0 and part / step >= MIN_SHARE


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when (nearly) singular."""
    n = len(rhs)
    a = [row[:] + [rhs[i]] for i, row in enumerate(matrix)]
    scale = max((abs(v) for row in matrix for v in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n + 1):
                a[r][c] -= f * a[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x


def bounded_least_squares(rows: Sequence[Sequence[float]], targets: Sequence[float], *, bounds: Sequence[tuple[float, float]],
                          prior: Sequence[float], pull: float = PULL) -> list[float]:
    """argmin_u sum_i (rows_i . u - targets_i)^2 + pull * sum_k (u_k - prior_k)^2 with lo_k <= u_k <= hi_k.

    Exact for the few unknowns of a calibration: every face of the box is tried (3^k solves) and
    the feasible minimiser of least cost kept. The pull makes every face's system definite."""
    k = len(prior)
    best: tuple[float, list[float]] | None = None
    for states in itertools.product((None, 0, 1), repeat=k):
        u = [bounds[j][s] if s is not None else 0.0 for j, s in enumerate(states)]
        free = [j for j, s in enumerate(states) if s is None]
        if free:
            # normal equations of the free unknowns, the fixed ones moved to the right-hand side
            fixed = [j for j in range(k) if states[j] is not None]
            residual_targets = [t - sum(row[j] * u[j] for j in fixed) for row, t in zip(rows, targets)]
            matrix = [[sum(row[a] * row[b] for row in rows) + (pull if a == b else 0.0) for b in free] for a in free]
            rhs = [sum(row[a] * t for row, t in zip(rows, residual_targets)) + pull * prior[a] for a in free]
            solved = _solve(matrix, rhs)
            if solved is None:
                continue
            for j, value in zip(free, solved):
                u[j] = value
            if any(not bounds[j][0] - 1e-9 <= u[j] <= bounds[j][1] + 1e-9 for j in free):
                continue
        cost = sum((sum(r * v for r, v in zip(row, u)) - t) ** 2 for row, t in zip(rows, targets))
        cost += pull * sum((v - p) ** 2 for v, p in zip(u, prior))
        if best is None or cost < best[0] - 1e-15:
            best = (cost, u)
    assert best is not None, "the all-bounds face is always feasible"
    return [min(max(v, lo), hi) for v, (lo, hi) in zip(best[1], bounds)]


def _fit_step(runs: Sequence[StepRun], keys: Sequence[str], defaults: CalibrationValues) -> dict[str, float]:
    """Least squares of the relative step errors over ``keys`` (MFU dtypes, bandwidth); the
    unknowns are the reciprocals 1/mfu and 1/e, bounded by ``BOUNDS``."""
    assert defaults.bandwidth_efficiency is not None
    rows, targets = [], []
    for run in runs:
        row = []
        for key in keys:
            part = run.memory_s if key == _BANDWIDTH else (run.matmul_s if run.dtype == key[4:] else 0.0)
            row.append(part / run.measured_s)
        fixed = run.fixed_s
        if _BANDWIDTH not in keys:
            fixed += run.memory_s / defaults.bandwidth_efficiency
        if f"mfu.{run.dtype}" not in keys:
            fixed += run.matmul_s / defaults.mfu[run.dtype]
        rows.append(row)
        targets.append(1.0 - fixed / run.measured_s)
    bounds, prior = [], []
    for key in keys:
        lo, hi = BOUNDS[_BANDWIDTH if key == _BANDWIDTH else "mfu"]
        bounds.append((1.0 / hi, 1.0 / lo))  # the unknown is the reciprocal
        prior.append(1.0 / (defaults.bandwidth_efficiency if key == _BANDWIDTH else defaults.mfu[key[4:]]))
    # the pull is relative: scale each unknown by its default
    scaled_rows = [[r * p for r, p in zip(row, prior)] for row in rows]
    scaled_bounds = [(lo / p, hi / p) for (lo, hi), p in zip(bounds, prior)]
    u = bounded_least_squares(scaled_rows, targets, bounds=scaled_bounds, prior=[1.0] * len(keys))
    return {key: 1.0 / (v * p) for key, v, p in zip(keys, u, prior)}


def _step_constants(runs: Sequence[StepRun], defaults: CalibrationValues, min_runs: int) -> tuple[ConstantFit, ...]:
    dtypes = sorted({r.dtype for r in runs}, key=MFU_KEYS.index)
    keys = [f"mfu.{d}" for d in dtypes] + ([_BANDWIDTH] if runs else [])
    informing = {key: [r for r in runs if _informs(r, key, defaults)] for key in keys}
    fittable = [key for key in keys if len(informing[key]) >= min_runs]
    fitted = _fit_step(runs, fittable, defaults) if fittable else {}
    mfu_after = {**defaults.mfu, **{k[4:]: v for k, v in fitted.items() if k.startswith("mfu.")}}
    bw_after = fitted.get(_BANDWIDTH, defaults.bandwidth_efficiency)
    assert defaults.bandwidth_efficiency is not None and bw_after is not None

    def errors(subset: Sequence[StepRun], mfu: Mapping[str, float], bw: float) -> ErrorStats | None:
        return ErrorStats.of([(predict_step(r, mfu=mfu, bandwidth_efficiency=bw), r.measured_s) for r in subset])

    out = []
    for key in keys:
        default = defaults.bandwidth_efficiency if key == _BANDWIDTH else defaults.mfu[key[4:]]
        value = fitted.get(key)
        subset = informing[key]
        lo, hi = BOUNDS[_BANDWIDTH if key == _BANDWIDTH else "mfu"]
        out.append(ConstantFit(
            key=key, default=default, value=value, runs=len(subset), quantity="step time",
            before=errors(subset, defaults.mfu, defaults.bandwidth_efficiency),
            after=errors(subset, mfu_after, bw_after) if value is not None else None,
            at_bound=value is not None and (abs(value - lo) < 1e-9 or abs(value - hi) < 1e-9),
            note="" if value is not None else
            f"needs {min_runs} runs where it is >= {MIN_SHARE:.0%} of the step, has {len(subset)}",
        ))
    return tuple(out)


# ---- memory ---------------------------------------------------------------------------------
def _context_constant(runs: Sequence[MemoryRun], defaults: CalibrationValues, min_runs: int) -> ConstantFit | None:
    if defaults.cuda_context_bytes is None:
        return None  # no CUDA context on this device (the CPU)
    samples = [(r, r.outside_measured) for r in runs if r.outside_measured is not None]
    default = defaults.cuda_context_bytes
    lo, hi = BOUNDS[_CONTEXT]

    def totals(context: int) -> ErrorStats | None:
        return ErrorStats.of([(r.predicted_reserved + r.predicted_outside + context, r.measured_total)  # type: ignore[operator]
                              for r, _ in samples])

    if len(samples) < min_runs:
        return ConstantFit(key=_CONTEXT, default=default, value=None, runs=len(samples), quantity="process total",
                           before=totals(default),
                           note=f"needs {min_runs} runs that measured the process total, has {len(samples)}")
    median = statistics.median(s for _, s in samples)
    value = int(min(max(median, lo), hi))
    return ConstantFit(key=_CONTEXT, default=default, value=value, runs=len(samples), quantity="process total",
                       before=totals(default), after=totals(value), at_bound=value in (lo, hi))


def fit_calibration(*, steps: Sequence[StepRun], memory: Sequence[MemoryRun], defaults: CalibrationValues,
                    min_runs: int = MIN_RUNS) -> CalibrationFit:
    """Fit what ``steps`` and ``memory`` determine; ``defaults`` holds the model's constants for
    this device (every MFU key, the bandwidth efficiency, the CUDA context or None without one).
    Constants with fewer than ``min_runs`` informing runs keep their defaults (``value`` None)."""
    if defaults.bandwidth_efficiency is None or set(defaults.mfu) != set(MFU_KEYS):
        raise ValueError("defaults must give every MFU key and the bandwidth efficiency")
    if isinstance(min_runs, bool) or not isinstance(min_runs, int) or min_runs < 1:
        raise ValueError(f"min_runs must be a whole number >= 1, got {min_runs!r}")
    constants = list(_step_constants(steps, defaults, min_runs))
    context = _context_constant(memory, defaults, min_runs)
    if context is not None:
        constants.append(context)
    fit_values = _values(constants, fitted=True)
    mfu_after = {**defaults.mfu, **fit_values.mfu}
    bw_after = fit_values.bandwidth_efficiency or defaults.bandwidth_efficiency
    with_context = [r for r in memory if r.outside_measured is not None]
    context_after = fit_values.cuda_context_bytes if fit_values.cuda_context_bytes is not None else defaults.cuda_context_bytes

    def totals(ctx: int | None) -> ErrorStats | None:
        if ctx is None:
            return None
        return ErrorStats.of([(r.predicted_reserved + r.predicted_outside + ctx, r.measured_total)  # type: ignore[operator]
                              for r in with_context])

    return CalibrationFit(
        constants=tuple(constants),
        step_before=ErrorStats.of([(predict_step(r, mfu=defaults.mfu, bandwidth_efficiency=defaults.bandwidth_efficiency),
                                    r.measured_s) for r in steps]),
        step_after=ErrorStats.of([(predict_step(r, mfu=mfu_after, bandwidth_efficiency=bw_after), r.measured_s)
                                  for r in steps]),
        total_before=totals(defaults.cuda_context_bytes),
        total_after=totals(context_after),
        allocated=ErrorStats.of([(r.predicted_allocated, r.measured_allocated) for r in memory]),
        reserved=ErrorStats.of([(r.predicted_reserved, r.measured_reserved) for r in memory
                                if r.predicted_reserved is not None and r.measured_reserved is not None]),
    )


__all__ = ["BOUNDS", "MIN_RUNS", "MIN_SHARE", "CalibrationFit", "ConstantFit", "ErrorStats", "MemoryRun", "StepRun",
           "bounded_least_squares", "fit_calibration", "predict_step"]
