"""What a plan trades away, and how close to the edge of the device it runs: pure functions of a
configuration and its memory estimate, shared by the ranking (``planner.search``), the CLI and
the HTTP API.

The ranking's two policies (``Prefer``) and the fidelity order they read live here too, so that
every reader of a plan explains it with the same words.
"""

from __future__ import annotations

import enum
from typing import Protocol

from planner.config import Method, Precision, TrainConfig
from planner.optim import OPTIMIZERS
from planner.uncertainty import NEAR_EDGE_PROBABILITY, Spread, oom_probability, peak_interval, spread
from planner.units import format_bytes


class MemoryEstimate(Protocol):
    """The figures of a memory estimate these functions read (``planner.results.MemoryEstimate``
    has them; named here so that the result types, which explain a plan with these functions,
    are not imported back)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    process_total_bytes: int
    cpu_bytes: int


class Prefer(enum.StrEnum):
    """How ``planner suggest`` ranks the plans that fit."""

    FIDELITY = "fidelity"
    """The most faithful fine-tuning first (``fidelity_tier``), then the fastest."""
    SPEED = "speed"
    """The fastest first, whatever it trains; fidelity breaks ties within 2% of speed."""


#: fp8's trade-off: the fp32 master weights and optimizer states stay (fidelity tier 0), but every
#: converted GEMM rounds its operands to 3 (e4m3) or 2 (e5m2, gradients) mantissa bits with one scale per
#: tensor; FP8 matched bf16 in pre-training up to 175B (Micikevicius et al. 2022, "FP8 Formats for Deep
#: Learning"), fine-tuning recipes mostly use bf16, and accelerate keeps the first and last linears in
#: 16 bits for stability (accelerate utils/ao.py ``filter_first_and_last_linear_layers``).
FP8_NOTE = ("fp8 GEMMs (torchao tensorwise, fp32 master kept): matched bf16 in pre-training (Micikevicius et al. "
            "2022); rarer than bf16 in fine-tuning, check the loss curve")


def is_pure_16bit(config: TrainConfig) -> bool:
    """Weights kept in 16 bits without an fp32 master copy (no autocast, no DeepSpeed mixed)."""
    return config.precision in (Precision.BF16, Precision.FP16)


#: bound once: reading a member through its class goes through ``EnumType.__getattr__``'s slow attribute
#: path on CPython 3.11 (``planner.config``'s note); the search reads them thousands of times a search
_FULL, _LORA = Method.FULL, Method.LORA


def fidelity_tier(config: TrainConfig) -> int:
    """How far the trained model may be from full fine-tuning with fp32 master weights (0).

    1 LoRA (fp32 adapters whatever the precision: peft keeps them in fp32, planner.memory.dtypes
    ADAPTER_BYTES), 2 QLoRA (the frozen base quantised to NF4), 3 full fine-tuning in pure 16-bit:
    without fp32 master weights an update smaller than half a unit in the last place of the
    weight is rounded away (bf16 keeps 8 significant bits, fp16 11), so fine-tuning at small
    learning rates can stall (Micikevicius et al. 2018, "Mixed Precision Training", §3.1: the
    fp32 master copy exists for exactly these updates; Zamirai et al. 2020, "Revisiting BFloat16
    Training": pure bf16 needs stochastic rounding or Kahan summation to match fp32). Placing it
    after QLoRA is this planner's stated judgement: a model that does not learn is the worse risk.
    """
    if config.method is _FULL:
        return 3 if is_pure_16bit(config) else 0
    return 1 if config.method is _LORA else 2


def allocator_overhead(memory: MemoryEstimate) -> int:
    """Reserved but not allocated at the peak: what the caching allocator replay expects to keep."""
    return max(memory.peak_reserved_bytes - memory.peak_allocated_bytes, 0)


def oom_risk(config: TrainConfig, memory: MemoryEstimate, *, capacity: int,
             calibrated: Spread | None = None) -> float:
    """The probability that the plan's process total passes the device's ``capacity``, from the
    memory model's measured error for its method (``planner.uncertainty``)."""
    return oom_probability(memory.process_total_bytes, capacity,
                           spread(config.method, gpus=config.gpus, calibrated=calibrated))


def memory_interval(config: TrainConfig, memory: MemoryEstimate, *, calibrated: Spread | None = None) -> tuple[int, int]:
    """The 90% central interval of the plan's process total (``planner.uncertainty.peak_interval``)."""
    return peak_interval(memory.process_total_bytes, spread(config.method, gpus=config.gpus, calibrated=calibrated))


def near_edge(config: TrainConfig, memory: MemoryEstimate, *, capacity: int) -> bool:
    """The probability of running out of memory is over NEAR_EDGE_PROBABILITY (5%): the device's
    capacity lies inside the plan's 90% interval (``planner.uncertainty``)."""
    return oom_risk(config, memory, capacity=capacity) > NEAR_EDGE_PROBABILITY


def _room_hint(config: TrainConfig) -> str:
    """What makes room for a plan near the edge: a micro-batch of 1 cannot be lowered."""
    if config.micro_batch > 1:
        return "lower the micro-batch"
    if not config.grad_ckpt:
        return "turn on gradient checkpointing"
    return "a shorter --seq-len, or a lighter method or optimizer"


def trade_offs(config: TrainConfig, memory: MemoryEstimate, *, capacity: int) -> tuple[str, ...]:
    """Short notes, each with its source, on what the plan gives up against full fine-tuning
    with AdamW and fp32 master weights, and on its risk. Empty for that reference recipe."""
    notes: list[str] = []
    if near_edge(config, memory, capacity=capacity):
        high = memory_interval(config, memory)[1]
        notes.append(f"NEAR THE EDGE: {oom_risk(config, memory, capacity=capacity):.0%} chance of running out of memory "
                     f"(90% interval up to {format_bytes(high)} of {format_bytes(capacity)}); {_room_hint(config)}")
    if is_pure_16bit(config) and config.method is Method.FULL:
        notes.append("pure fp16, no fp32 master, no loss scaling: gradients underflow, updates < 2^-11 of a weight lost "
                     "(Micikevicius et al. 2018)" if config.precision is Precision.FP16 else
                     "pure bf16, no fp32 master: updates < 2^-8 of a weight rounded away, may stall (Zamirai et al. 2020)")
    elif Precision.FP16 in (config.precision,) or config.precision is Precision.FP16_MIXED:
        notes.append("fp16: needs dynamic loss scaling, overflowing steps skipped (torch.amp.GradScaler)")
    elif config.precision is Precision.FP8:
        notes.append(FP8_NOTE)
    if config.method is Method.LORA:
        notes.append(f"LoRA r{config.lora_r}: adapters only, below full FT on hard tasks (Biderman et al. 2024)")
    elif config.method is Method.QLORA:
        notes.append(f"QLoRA r{config.lora_r}: NF4 base, matched 16-bit LoRA (Dettmers et al. 2023), dequantised at each use")
    notes += _optimizer_note(config)
    # the sharding scheme's own (planner.sharding)
    notes += config.sharding.spec.notes(config, config.sharding.offload, host_bytes=memory.cpu_bytes)
    return tuple(notes)


def _optimizer_note(config: TrainConfig) -> list[str]:
    note = OPTIMIZERS[config.optimizer].note  # the optimizer's descriptor (planner.optim)
    return [note] if note else []


__all__ = ["FP8_NOTE", "Prefer", "allocator_overhead", "fidelity_tier", "is_pure_16bit", "memory_interval", "near_edge", "oom_risk",
           "trade_offs"]
