"""``estimate_memory``: the peak of one configuration on one device, with its named breakdown."""

from __future__ import annotations

from planner.config import Method, TrainConfig
from planner.memory.activations import ACTIVATION_SAVED
from planner.memory.reserve import reserved_and_total, reserve_assumption
from planner.memory.states import static_terms
from planner.memory.step import batch_terms, phase_breakdowns
from planner.modelspec import ModelSpec
from planner.results import MemoryEstimate


def _assumptions(model: ModelSpec, config: TrainConfig, gpu, *, paged: int) -> list[str]:
    kernels = gpu.kernels
    out = []
    if not kernels.caching_allocator:
        out.append("cpu profile: live tensor bytes; no caching allocator, no CUDA context")
    else:
        if paged:
            out.append("paged 8-bit optimizer states counted in the process total, not in the allocator")
        out.append(reserve_assumption())
    if model.hidden_act not in ACTIVATION_SAVED:
        out.append(f"activation {model.hidden_act!r} is not in the model's table: assumed to save its input like a fused kernel")
    if config.method is Method.QLORA:
        out.append("NF4 with double quantisation, blocksize 64; non-4-bit params upcast to fp32 by prepare_model_for_kbit_training")
    return out


def estimate_memory(*, model: ModelSpec, config: TrainConfig, gpu) -> MemoryEstimate:
    """Predict peak memory per device for one configuration on one GPU (or the ``cpu`` profile)."""
    kernels = gpu.kernels
    static = static_terms(model, config, kernels)
    moments = phase_breakdowns(static, batch_terms(model, config, kernels), accumulating=config.grad_accum > 1)
    totals = {name: sum(parts.values()) for name, parts in moments.items()}
    peak_phase = max(totals, key=lambda k: totals[k])
    peak = totals[peak_phase]
    if kernels.caching_allocator:
        reserved, total = reserved_and_total(model, gpu, peak=peak, static=static.resident_bytes, paged=static.paged)
    else:
        reserved = total = peak
    return MemoryEstimate(
        peak_allocated_bytes=peak,
        peak_reserved_bytes=reserved,
        process_total_bytes=total,
        cpu_bytes=static.host,
        breakdown=moments[peak_phase],
        peak_phase=peak_phase,
        assumptions=tuple(_assumptions(model, config, gpu, paged=static.paged)),
    )


__all__ = ["estimate_memory"]
