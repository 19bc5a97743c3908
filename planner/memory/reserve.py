"""The search's screen from allocated to reserved: a stated overhead, evaluated in microseconds.

``estimate_memory`` replays the caching allocator on the step's allocations
(``planner.memory.allocator``); the search cannot replay ten thousand candidates, so it screens
them with this overhead and replays the plans it shows (``planner.search``)."""

from __future__ import annotations

from planner.memory.overhead import CUBLAS_WORKSPACES, cublas_workspace_bytes, outside_allocator
from planner.modelspec import ModelSpec
from planner.units import MiB

#: CUDA caching allocator: blocks >1 MiB are rounded up to 2 MiB multiples
#: (c10/cuda/CUDACachingAllocator.cpp kRoundLarge), so each large live tensor wastes 1 MiB on
#: average; segments of the large pool are at least 20 MiB (kLargeBuffer).
CUDA_ROUND_LARGE = 2 * MiB
#: Fraction of the activation churn the caching allocator keeps reserved but unused at the
#: peak. PyTorch's memory docs show reserved exceeding allocated by a few percent in steady
#: training; 5% of the transient bytes is our stated assumption until GPU measurements
#: calibrate it (bench/accuracy.py on a GPU machine).
CUDA_FRAGMENTATION = 0.05


def reserved_and_total(model: ModelSpec, gpu, *, peak: int, static: int, paged: int, gpus: int = 1) -> tuple[int, int]:
    """CUDA caching allocator on top of the allocated peak, then the process total.

    Large-block rounding on the live large tensors, the cuBLAS workspaces' segments, plus the
    stated fragmentation of the activation churn; the CUDA context, NCCL's buffers on ``gpus``
    devices and ``paged``, the paged (unified-memory) optimizer states the step needs on the device,
    come on top (``planner.memory.overhead``): the stepped tensor's (``StaticTerms.paged_step``), as
    ``estimate_memory`` counts them; the others stay on the device where it has room and on the
    host past it, which the throughput model prices (``planner.memory.overhead.paged_on_host``)."""
    transient = max(peak - static, 0)
    reserved = peak + _large_rounding(model) + _workspaces(gpu) + int(CUDA_FRAGMENTATION * transient)
    return reserved, reserved + outside_allocator(gpu, gpus) + paged


def _large_rounding(model: ModelSpec) -> int:
    """Large-block rounding: 1 MiB on average per large live tensor, about eight per block
    (its weights' and activations') and four outside the blocks."""
    n_large = model.num_layers * 8 + 4
    return n_large * CUDA_ROUND_LARGE // 2


def _workspaces(gpu) -> int:
    """The cuBLAS workspaces as the allocator reserves them: a request of 1-10 MiB gets a 20 MiB
    segment (kLargeBuffer, kMinLargeAlloc), a larger one its size rounded to 2 MiB (kRoundLarge);
    the default 8.125 MiB pair rounds to 10 MiB each and shares one 20 MiB segment."""
    nbytes = cublas_workspace_bytes(gpu)
    if not nbytes:
        return 0
    rounded = -(-nbytes // CUDA_ROUND_LARGE) * CUDA_ROUND_LARGE
    if rounded < 10 * MiB:
        return -(-CUBLAS_WORKSPACES * rounded // (20 * MiB)) * 20 * MiB
    return CUBLAS_WORKSPACES * rounded


def peak_independent(model: ModelSpec, gpu, *, paged: int, gpus: int = 1) -> int:
    """What ``reserved_and_total``'s process total adds to any peak besides fragmentation: the
    large-block rounding, the cuBLAS workspaces, the CUDA context, NCCL's buffers and the paged
    states the step needs on the device (whole numbers, so adding them first changes no byte)."""
    return _large_rounding(model) + _workspaces(gpu) + outside_allocator(gpu, gpus) + paged


def process_total(peak: int, *, static: int, fixed: int) -> int:
    """``reserved_and_total(...)[1]`` from ``fixed = peak_independent(...)``: the search evaluates
    thousands of peaks per device and configuration (tests/search/test_search_screen.py checks the two
    agree)."""
    transient = peak - static
    # (max(transient, 0) written out: the screen calls this ~4,500 times a search)
    return peak + fixed + int(CUDA_FRAGMENTATION * transient) if transient > 0 else peak + fixed


def largest_peak(usable: int, *, static: int, fixed: int) -> int:
    """The largest peak whose ``process_total`` is at most ``usable`` (-1 when even no tensor
    would fit): ``process_total`` grows strictly with the peak, so a split fits exactly when its
    peak is at most this, and the search's screen compares peaks alone. Below ``static`` the
    total is the peak plus ``fixed``; above it the fragmentation's share is solved for, then the
    float's rounding in ``int()`` is settled by stepping one byte (at most a few steps)."""
    room = usable - fixed
    if room < 0:
        return -1
    if room <= static:
        return room
    peak = static + int((room - static) / (1 + CUDA_FRAGMENTATION))
    while process_total(peak + 1, static=static, fixed=fixed) <= usable:
        peak += 1
    while process_total(peak, static=static, fixed=fixed) > usable:
        peak -= 1
    return peak


def reserve_assumption() -> str:
    return (f"allocator: +1 MiB rounding per large tensor and {CUDA_FRAGMENTATION:.0%} of transient bytes reserved "
            "(uncalibrated on GPU)")


__all__ = ["CUDA_FRAGMENTATION", "CUDA_ROUND_LARGE", "largest_peak", "peak_independent", "process_total", "reserve_assumption",
           "reserved_and_total"]
