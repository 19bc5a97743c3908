"""What ``planner suggest`` prints of a plan: the table, the other policy's first plan, the
trade-offs, what the top plan's memory is made of and what each of its knobs costs."""

from __future__ import annotations


def host_line(*, host: int, host_source: str, no_offload: bool, gpus: int) -> str:
    """How much host RAM the node has for offload, where the figure comes from, what is kept back."""
    from planner.host import host_reserve
    from planner.units import format_bytes

    if no_offload:
        return "host RAM for offload not considered"
    if not host_source:
        return "host RAM of the node not known (offload plans need --cpu-mem)"
    return (f"host RAM of the node {format_bytes(host)} ({host_source}), {format_bytes(host_reserve(host, gpus))} of it "
            f"kept for the OS and {gpus} training process{'es' if gpus > 1 else ''}")


def print_suggestion(out, result, *, spec, device, seq_defaulted: bool, host: int, no_offload: bool, host_source: str = "--cpu-mem") -> None:
    from rich.table import Table

    from planner.units import format_bytes

    req = result.request
    from planner.cli.models_cmd import describe_model

    out.print(f"{describe_model(spec)} on {req.gpu_count} x {device.display_name}, "
              f"target batch {req.target_batch}, seq len {req.seq_len}" + (" (default: min(2048, model max))" if seq_defaulted else ""))
    out.print(f"device {format_bytes(device.memory_bytes)}, safety margin {format_bytes(result.safety_margin_bytes)}, "
              f"usable {format_bytes(result.usable_bytes)}; "
              f"{host_line(host=host, host_source=host_source, no_offload=no_offload, gpus=req.gpu_count)}; "
              f"{result.searched:,} configurations searched")
    if device.calibration:
        out.print(f"uses {device.calibration}", markup=False, soft_wrap=True)
    table = Table(title=f"top {len(result.plans)} plans, ranked by {result.prefer or 'fidelity'}"
                  + (" (the most faithful method first)" if (result.prefer or "fidelity") == "fidelity" else " (the fastest first)"))
    for col, justify in (("#", "right"), ("method", "left"), ("precision", "left"), ("optimizer", "left"), ("micro x accum", "right"),
                         ("ckpt", "left"), ("zero/offload", "left"), ("memory", "right"), ("90% interval", "right"),
                         ("OOM risk", "right"), ("tokens/s", "right"), ("step", "right")):
        table.add_column(col, justify=justify)
    for plan in result.plans:
        c = plan.config
        method = str(c.method) + (f" r{c.lora_r} {'all-linear' if c.lora_all_linear else 'attn'}" if c.method.uses_adapters else "")
        zo = c.sharding.short() or "-"
        table.add_row(str(plan.rank), method, str(c.precision), str(c.optimizer), f"{c.micro_batch} x {c.grad_accum}",
                      "on" if c.grad_ckpt else "off", zo, format_bytes(plan.memory.process_total_bytes),
                      _interval(plan), _risk(plan.memory.oom_probability), f"{plan.throughput.tokens_per_s:,.0f}",
                      f"{plan.throughput.step_s:.3g}s")
    out.print(table)
    out.print(f"OOM risk: the chance the process passes the device's {format_bytes(device.memory_bytes)}, from the memory "
              "model's error on published runs (README, \"How sure\"); over 5% is near the edge", markup=False)
    _print_policy_and_notes(out, result)
    top = result.plans[0]
    biggest = sorted(top.memory.breakdown.items(), key=lambda kv: -kv[1])[:5]
    ranks = req.gpu_count
    out.print("plan 1 memory: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in biggest)
              + (f"; host RAM {format_bytes(top.memory.cpu_bytes)}" + (
                  f" per GPU, {format_bytes(top.memory.cpu_bytes * ranks)} on the node" if ranks > 1 else "")
                 if top.memory.cpu_bytes else ""))
    for line in _knob_costs(top, spec=spec, device=device):
        out.print(f"  {line}", markup=False)
    if result.rejected:
        out.print("why the more faithful options do not fit:")
        for r in result.rejected[:6]:
            out.print(f"  {r.family}: {r.reason}", markup=False)


def _interval(plan) -> str:
    from planner.units import format_bytes

    if plan.memory.peak_interval_bytes is None:
        return "-"
    low, high = plan.memory.peak_interval_bytes
    return f"{format_bytes(low)}-{format_bytes(high)}"


def _risk(p: float | None) -> str:
    """A probability as the table shows it: below 0.1% is "<0.1%", over 99.9% is ">99.9%"."""
    if p is None:
        return "-"
    if p < 0.001:
        return "<0.1%"
    return ">99.9%" if p > 0.999 else f"{p:.1%}"


def _print_policy_and_notes(out, result) -> None:
    """The other policy's first plan in one line, then each plan's trade-offs (and edge warning)."""
    from planner.tradeoffs import near_edge, trade_offs

    alt = result.alternative
    capacity = result.request.gpu_memory_bytes
    if alt is not None:
        other = "speed" if (result.prefer or "fidelity") == "fidelity" else "fidelity"
        out.print(f"--prefer {other} would rank first: {_short(alt.config)}, {alt.throughput.tokens_per_s:,.0f} tokens/s, "
                  f"headroom {_fmt(result.usable_bytes - alt.memory.process_total_bytes)}"
                  + (" (near the edge)" if near_edge(alt.config, alt.memory, capacity=capacity) else ""), markup=False)
    if result.advice:
        out.print("every plan is near the edge; what would give room: " + ", ".join(result.advice), markup=False,
                  soft_wrap=True)
    out.print("trade-offs:")
    for plan in result.plans:
        notes = trade_offs(plan.config, plan.memory, capacity=capacity)
        out.print(f"  {plan.rank}: " + ("; ".join(notes) if notes else "the reference recipe (full fine-tuning, AdamW, "
                                         "fp32 master weights): nothing traded"), markup=False)


def _short(c) -> str:
    method = str(c.method) + (f" r{c.lora_r} {'all-linear' if c.lora_all_linear else 'attn'}" if c.method.uses_adapters else "")
    zo = f", {c.sharding.short()}" if c.sharding.short() else ""
    return (f"{method}, {c.precision}, {c.optimizer}, {c.micro_batch} x {c.grad_accum}"
            f"{', ckpt' if c.grad_ckpt else ''}{zo}")


def _fmt(n: int) -> str:
    from planner.units import format_bytes

    return format_bytes(n)


def _knob_costs(plan, *, spec, device) -> list[str]:
    """What each knob of the top plan costs: the same plan with the knob turned back."""
    from planner.config import Sharding
    from planner.optim import SEARCHED
    from planner.errors import PlannerError
    from planner.memory import estimate_memory
    from planner.throughput import estimate_throughput

    c = plan.config
    variants = []
    if c.grad_ckpt:
        variants.append(("gradient checkpointing", c.replace(grad_ckpt=False)))
    usual = SEARCHED[0]  # the usual recipe's optimizer (AdamW), first in preference order
    if c.optimizer is not usual:
        variants.append((f"{c.optimizer} instead of {usual}", c.replace(optimizer=usual)))
    if c.sharding.offloaded:
        variants.append((f"offload {c.sharding.offload}", c.replace(sharding=Sharding(c.sharding.scheme))))
    if c.grad_accum > 1:
        variants.append((f"accumulation x{c.grad_accum}", c.replace(micro_batch=c.micro_batch * c.grad_accum, grad_accum=1)))
    lines = []
    for name, variant in variants:
        try:
            mem = estimate_memory(model=spec, config=variant, gpu=device)
            thr = estimate_throughput(model=spec, config=variant, gpu=device, paged_host=mem.paged_host_bytes)
        except PlannerError:
            continue
        saved = mem.process_total_bytes - plan.memory.process_total_bytes
        slower = plan.throughput.step_s / thr.step_s - 1
        lines.append(f"{name}: {_trade(saved, slower)}")
    return lines


def _trade(saved: int, slower: float) -> str:
    """What a plan's choice saves and costs against the usual one, in words that read right either way
    (a choice can save memory and be faster too: "costs -1% step time" said it backwards)."""
    from planner.units import format_bytes

    memory = f"saves {format_bytes(saved)}" if saved >= 0 else f"takes {format_bytes(-saved)} more"
    if abs(slower) < 0.005:
        return f"{memory}, the same step time"
    return f"{memory}, costs {slower:.0%} step time" if slower > 0 else f"{memory}, {-slower:.0%} faster"


__all__ = ["host_line", "print_suggestion"]
