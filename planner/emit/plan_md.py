"""``PLAN.md``: the plan in words, its predicted memory, the assumptions and what was measured."""

from __future__ import annotations

from typing import Sequence

from planner.config import Method, Precision, TrainConfig
from planner.emit import settings
from planner.modelspec import ModelSpec
from planner.optim import OPTIMIZERS
from planner.results import Candidate, Measurement, PlanRequest
from planner.units import format_bytes

_PRECISION_WORDS = {
    Precision.FP32: "fp32 weights, gradients and compute",
    Precision.FP16_MIXED: "fp32 weights, fp16 autocast compute with a loss scaler (Trainer fp16=True)",
    Precision.BF16_MIXED: "fp32 weights, bf16 autocast compute (Trainer bf16=True)",
    Precision.FP16: "the model loaded in fp16: weights, gradients and optimizer states in fp16",
    Precision.BF16: "the model loaded in bf16: weights, gradients and optimizer states in bf16",
    Precision.FP8: "fp32 weights, bf16 autocast compute, the linear layers' GEMMs in fp8 by torchao's float8 "
                   "linears (accelerate mixed_precision fp8, backend AO: accelerate_config.yaml; Trainer bf16/fp16 off)",
}


def _method_words(config: TrainConfig) -> str:
    if config.method is Method.FULL:
        return "full fine-tuning (every parameter trains)"
    targets = "every linear layer but the output head" if config.lora_all_linear else ", ".join(config.lora_targets or ())
    base = "a 4-bit NF4 base model (QLoRA)" if config.method is Method.QLORA else "a frozen base model"
    return f"LoRA rank {config.lora_r} on {targets}, over {base}"


def _precision_words(config: TrainConfig) -> str:
    cast = config.sharding.spec.cast_words("bf16" if config.precision.needs_bf16 else "fp16")
    if cast is not None and config.precision.is_mixed:
        return cast[0]  # the scheme's own words for its 16-bit cast (DeepSpeed's mode, FSDP2's policy)
    return _PRECISION_WORDS[config.precision]


def _in_words(config: TrainConfig, request: PlanRequest, spec: ModelSpec) -> list[str]:
    c = config
    lines = [
        f"- model: {spec.id} ({spec.params_total:,} parameters)",
        f"- devices: {c.gpus} x {request.gpu} ({format_bytes(request.gpu_memory_bytes)} each)",
        f"- batch: {c.micro_batch} sequences per device x {c.grad_accum} accumulation steps x {c.gpus} devices "
        f"= {c.global_batch} sequences of {c.seq_len} tokens per optimizer step",
        f"- method: {_method_words(c)}",
        f"- precision: {_precision_words(c)}",
        f"- optimizer: {OPTIMIZERS[c.optimizer].words}",
        f"- activation checkpointing: {'on, per decoder layer, non-reentrant' if c.grad_ckpt else 'off'}",
        f"- attention: {c.attention.hf_name}",
        f"- {c.sharding.spec.plan_line(c.sharding.offload)}",
    ]
    return lines


def _memory_table(candidate: Candidate, *, usable: int) -> list[str]:
    m = candidate.memory
    rows = ["| component | bytes | |", "|---|---:|---:|"]
    for name, size in sorted(m.breakdown.items(), key=lambda kv: -kv[1]):
        rows.append(f"| {name} | {size:,} | {format_bytes(size)} |")
    rows += [
        f"| **peak allocated** (at {m.peak_phase or 'peak'}) | {m.peak_allocated_bytes:,} | {format_bytes(m.peak_allocated_bytes)} |",
        f"| peak reserved | {m.peak_reserved_bytes:,} | {format_bytes(m.peak_reserved_bytes)} |",
        f"| process total | {m.process_total_bytes:,} | {format_bytes(m.process_total_bytes)} |",
    ]
    if usable:
        rows.append(f"| usable on the device | {usable:,} | {format_bytes(usable)} |")
    if m.cpu_bytes:
        rows.append(f"| host RAM (offload) | {m.cpu_bytes:,} | {format_bytes(m.cpu_bytes)} |")
    if m.paged_bytes:
        for name, size in (("paged optimizer states (unified memory)", m.paged_bytes),
                           ("of them on the host at the step", m.paged_host_bytes)):
            rows.append(f"| {name} | {size:,} | {format_bytes(size)} |")
    return rows


def _measured(candidate: Candidate, measurements: Sequence[Measurement], status: str) -> list[str]:
    if not measurements:
        return [f"Not measured yet (plan status: {status}): verify the plan, or run this configuration with "
                "`planner measure`, to see its real peak next to the prediction."]
    predicted = candidate.memory.peak_allocated_bytes
    rows = [f"Plan status: {status}.", "", "| outcome | device | peak allocated | vs predicted | step | tokens/s |",
            "|---|---|---:|---:|---:|---:|"]
    for m in measurements:
        peak = m.peak_allocated_bytes
        error = f"{(predicted - peak) / peak:+.1%}" if peak else "-"
        rows.append(
            f"| {m.outcome} | {m.device} | {format_bytes(peak) if peak else '-'} | {error} | "
            f"{f'{m.step_s:.3g} s' if m.step_s else '-'} | {f'{m.tokens_per_s:,.0f}' if m.tokens_per_s else '-'} |"
        )
        if m.error:
            rows.append(f"| error: {m.error.splitlines()[0][:120] if m.error.strip() else ''} | | | | | |")
    return rows


def render_plan_md(
    *, candidate: Candidate, spec: ModelSpec, request: PlanRequest, plan_id: str, rank: int, usable_bytes: int,
    measurements: Sequence[Measurement], status: str, files: Sequence[str],
) -> str:
    """The text of ``PLAN.md``."""
    c = candidate.config
    t = candidate.throughput
    parts = [
        f"# Plan {plan_id}, #{rank}: {c.label()}",
        "",
        "## The plan",
        *_in_words(c, request, spec),
        "",
        f"Predicted speed: {t.step_s:.3g} s per optimizer step, {t.tokens_per_s:,.0f} tokens/s.",
        "",
        "## Predicted memory per device",
        *_memory_table(candidate, usable=usable_bytes),
        "",
        "## What the prediction assumes",
        *(f"- {a}" for a in (*settings.run_assumptions(c), *candidate.memory.assumptions, *t.assumptions)),
        "",
        "## Measured",
        *_measured(candidate, measurements, status),
        "",
        "## Files",
        *(f"- `{name}`" for name in files),
        "",
        "Run: `accelerate launch --config_file accelerate_config.yaml train.py --dataset DATA`",
        "",
    ]
    return "\n".join(parts)


__all__ = ["render_plan_md"]
