"""Stored runs as the fit's runs: each run's prediction recomputed, split by constant.

The prediction a run was stored with may have used an older model or another calibration, so
each run is predicted again here from its configuration, with the catalog's device (no
calibration) and every constant at 1 (``utilization=1``, ``bandwidth_efficiency=1``): what is
left is the seconds each constant divides. Resolving a run's model reads its config (catalog,
path or HF cache); a run whose model no longer resolves, or whose config changed since it was
measured (another fingerprint), is left out with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from planner.calibration.fit import MemoryRun, StepRun
from planner.calibration.values import MFU_KEYS, CalibrationValues

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.store import MeasuredRun

#: A precision whose matmuls run at each MFU key's peak (``planner.gpus.matmul_dtype``).
_PRECISION_OF = {"fp32": "fp32", "fp16": "fp16-mixed", "bf16": "bf16-mixed"}


@dataclass(frozen=True, kw_only=True)
class LeftOut:
    """A stored run the fit cannot use, and why."""

    id: str
    reason: str


@dataclass(frozen=True, kw_only=True)
class FitRuns:
    steps: tuple[StepRun, ...]
    memory: tuple[MemoryRun, ...]
    left_out: tuple[LeftOut, ...]
    ids: tuple[str, ...]
    """The measurements used (step, memory or both)."""


def uncalibrated(gpu: "GPUSpec") -> "GPUSpec":
    """The device as the catalog has it: no calibrated constant."""
    from planner.gpus import get_gpu

    return get_gpu(gpu.name, memory_bytes=gpu.memory_bytes)


def default_values(gpu: "GPUSpec") -> CalibrationValues:
    """The model's constants for this device: every MFU key, the bandwidth efficiency, and the
    CUDA context where there is one (None on the CPU)."""
    from planner.throughput import bandwidth_efficiency, default_utilization

    base = uncalibrated(gpu)
    return CalibrationValues(
        mfu={key: default_utilization(gpu=base, precision=_PRECISION_OF[key]) for key in MFU_KEYS},
        bandwidth_efficiency=bandwidth_efficiency(base),
        cuda_context_bytes=int(base.cuda_context_bytes) if base.kernels.caching_allocator else None,
    )


def _step_run(run: "MeasuredRun", spec: "ModelSpec", gpu: "GPUSpec") -> StepRun | None:
    from planner.gpus import matmul_dtype
    from planner.throughput import calibration_terms

    measured = run.measurement.measurement.step_s
    if not measured:
        return None
    config = run.candidate.config
    matmul_s, memory_s, fixed_s = calibration_terms(model=spec, config=config, gpu=gpu)
    return StepRun(id=run.measurement.id, dtype=matmul_dtype(config.precision), matmul_s=matmul_s,
                   memory_s=memory_s, fixed_s=fixed_s, measured_s=measured)


def _memory_run(run: "MeasuredRun", spec: "ModelSpec", gpu: "GPUSpec") -> MemoryRun | None:
    from planner.memory import estimate_memory
    from planner.memory.overhead import nccl_buffer_bytes

    m = run.measurement.measurement
    if m.peak_allocated_bytes is None:
        return None
    predicted = estimate_memory(model=spec, config=run.candidate.config, gpu=gpu)
    allocator = gpu.kernels.caching_allocator
    # NCCL's buffers and the paged optimizer states resident on the device (all but what the
    # model leaves on the host): what device used - free - reserved holds besides the context
    resident = predicted.paged_bytes - predicted.paged_host_bytes
    outside = nccl_buffer_bytes(gpu, run.candidate.config.gpus) + resident if allocator else 0
    return MemoryRun(
        id=run.measurement.id, predicted_allocated=predicted.peak_allocated_bytes, measured_allocated=m.peak_allocated_bytes,
        predicted_reserved=predicted.peak_reserved_bytes if allocator else None, measured_reserved=m.peak_reserved_bytes,
        predicted_outside=outside, measured_total=m.process_total_bytes,
    )


def fit_runs(measured: Sequence["MeasuredRun"], *, resolve: Callable[[str], "ModelSpec"] | None = None) -> FitRuns:
    """The fit's runs of ``measured`` (stored ``ok`` runs of one device). ``resolve`` finds a
    model by its stored id (default: ``planner.catalog.resolve_model``)."""
    from planner.catalog import fingerprint, resolve_model
    from planner.errors import PlannerError
    from planner.gpus import get_gpu

    resolve = resolve or resolve_model
    specs: dict[str, "ModelSpec | str"] = {}
    steps, memory, left_out, ids = [], [], [], []
    for run in measured:
        request, key = run.request, run.measurement.id
        if request.model_id not in specs:
            try:
                specs[request.model_id] = resolve(request.model_id)
            except PlannerError as exc:
                specs[request.model_id] = f"its model no longer resolves ({exc})"
        spec = specs[request.model_id]
        if isinstance(spec, str):
            left_out.append(LeftOut(id=key, reason=spec))
            continue
        if fingerprint(spec) != request.model_fingerprint:
            left_out.append(LeftOut(id=key, reason=f"the config of {request.model_id} changed since the run"))
            continue
        try:
            gpu = get_gpu(request.gpu, memory_bytes=request.gpu_memory_bytes)
            step, mem = _step_run(run, spec, gpu), _memory_run(run, spec, gpu)
        except PlannerError as exc:
            left_out.append(LeftOut(id=key, reason=f"the model cannot predict it now ({exc})"))
            continue
        steps += [step] if step else []
        memory += [mem] if mem else []
        if step or mem:
            ids.append(key)
    return FitRuns(steps=tuple(steps), memory=tuple(memory), left_out=tuple(left_out), ids=tuple(ids))


__all__ = ["FitRuns", "LeftOut", "default_values", "fit_runs", "uncalibrated"]
