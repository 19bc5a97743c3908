"""``planner suggest``: search the whole space against a target batch, rank, store and print."""

from __future__ import annotations

from typing import Optional

import typer

from planner.cli._common import console_to_stderr
from planner.cli.plan import _GPU, _GPU_MEM, _GPUS, _JSON, _MODEL, _SEQ


def suggest(
    model: str = _MODEL,
    gpu: str = _GPU,
    target_batch: int = typer.Option(..., "--target-batch", "-b", help="Global batch: micro x accumulation x GPUs."),
    seq_len: Optional[int] = _SEQ,
    gpus: int = _GPUS,
    gpu_mem: Optional[str] = _GPU_MEM,
    method: str = typer.Option("auto", "--method", help="auto|full|lora|qlora"),
    precision: str = typer.Option("auto", "--precision", help="auto|fp32|fp16-mixed|bf16-mixed|fp16|bf16"),
    no_offload: bool = typer.Option(False, "--no-offload", help="Do not consider DeepSpeed CPU offload."),
    cpu_mem: Optional[str] = typer.Option(None, "--cpu-mem", help="Host RAM offload may use (default: this machine's RAM)."),
    top_k: int = typer.Option(5, "--top-k", "-k", help="Plans to show."),
    db: Optional[str] = typer.Option(None, "--db", help="Database URL (default: PLANNER_DATABASE_URL or the local SQLite file)."),
    no_save: bool = typer.Option(False, "--no-save", help="Do not store this plan."),
    as_json: bool = _JSON,
) -> None:
    """Search every configuration that reaches --target-batch and rank what fits: the most faithful
    method first (full > LoRA > QLoRA, narrowed by --method), then the fastest."""
    from planner.cli._common import console, print_json
    from planner.errors import NothingFitsError
    from planner.planning import SuggestRequest, make_plan
    from planner.units import parse_bytes

    request = SuggestRequest(
        model=model, gpu=gpu, target_batch=target_batch, seq_len=seq_len, gpus=gpus,
        gpu_mem_bytes=parse_bytes(gpu_mem, option="--gpu-mem") if gpu_mem is not None else None,
        method=method, precision=precision, allow_offload=not no_offload,
        cpu_mem_bytes=parse_bytes(cpu_mem, option="--cpu-mem") if cpu_mem is not None else None, top_k=top_k,
    )
    try:
        planned = make_plan(request)
    except NothingFitsError as exc:
        if as_json and exc.result is not None:
            # scripts get the request and every family's closest try; the error line still goes
            # to stderr and the exit code stays 3
            print_json(exc.result.to_dict() | {"plan_id": None, "error": str(exc)})
        raise
    result, spec, device = planned.result, planned.spec, planned.device
    from planner.cli.store import report_saved, save_plan
    from planner.errors import StoreError

    # stored before anything is printed: a reader that stops early (| head) loses no plan; a
    # store that fails still lets the table print first, then the error
    try:
        saved, store_error = save_plan(result=result, db=db, save=not no_save), None
    except StoreError as exc:
        saved, store_error = None, exc
    out = console() if not as_json else console_to_stderr()
    if not as_json:
        _print_suggestion(out, result, spec=spec, device=device, seq_defaulted=planned.seq_defaulted, host=planned.host_bytes,
                          no_offload=no_offload)
    if store_error is not None:
        raise store_error
    plan_id = report_saved(saved, console=out)
    if as_json:
        data = result.to_dict()
        data["plan_id"] = plan_id
        print_json(data)


def _print_suggestion(out, result, *, spec, device, seq_defaulted: bool, host: int, no_offload: bool) -> None:
    from rich.table import Table

    from planner.units import format_bytes

    req = result.request
    from planner.cli.models_cmd import format_params

    out.print(f"{spec.id} ({format_params(spec.params_total)} params) on {req.gpu_count} x {device.display_name}, "
              f"target batch {req.target_batch}, seq len {req.seq_len}" + (" (default: min(2048, model max))" if seq_defaulted else ""))
    out.print(f"device {format_bytes(device.memory_bytes)}, safety margin {format_bytes(result.safety_margin_bytes)}, "
              f"usable {format_bytes(result.usable_bytes)}; host RAM for offload {'not considered' if no_offload else format_bytes(host)}; "
              f"{result.searched:,} configurations searched")
    table = Table(title=f"top {len(result.plans)} plans")
    for col, justify in (("#", "right"), ("method", "left"), ("precision", "left"), ("optimizer", "left"), ("micro x accum", "right"),
                         ("ckpt", "left"), ("zero/offload", "left"), ("memory", "right"), ("headroom", "right"), ("tokens/s", "right"),
                         ("step", "right")):
        table.add_column(col, justify=justify)
    for plan in result.plans:
        c = plan.config
        method = str(c.method) + (f" r{c.lora_r} {'all-linear' if c.lora_all_linear else 'attn'}" if c.method.uses_adapters else "")
        zo = "-" if not c.zero else f"zero{c.zero}" + (f"+{c.offload}" if str(c.offload) != "none" else "")
        table.add_row(str(plan.rank), method, str(c.precision), str(c.optimizer), f"{c.micro_batch} x {c.grad_accum}",
                      "on" if c.grad_ckpt else "off", zo, format_bytes(plan.memory.process_total_bytes),
                      format_bytes(result.usable_bytes - plan.memory.process_total_bytes), f"{plan.throughput.tokens_per_s:,.0f}",
                      f"{plan.throughput.step_s:.3g}s")
    out.print(table)
    top = result.plans[0]
    biggest = sorted(top.memory.breakdown.items(), key=lambda kv: -kv[1])[:5]
    out.print("plan 1 memory: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in biggest)
              + (f"; host RAM {format_bytes(top.memory.cpu_bytes)}" if top.memory.cpu_bytes else ""))
    for line in _knob_costs(top, spec=spec, device=device):
        out.print(f"  {line}", markup=False)
    if result.rejected:
        out.print("why the more faithful options do not fit:")
        for r in result.rejected[:6]:
            out.print(f"  {r.family}: {r.reason}", markup=False)


def _knob_costs(plan, *, spec, device) -> list[str]:
    """What each knob of the top plan costs: the same plan with the knob turned back."""
    from planner.config import Offload, Optimizer
    from planner.errors import PlannerError
    from planner.memory import estimate_memory
    from planner.throughput import estimate_throughput
    from planner.units import format_bytes

    c = plan.config
    variants = []
    if c.grad_ckpt:
        variants.append(("gradient checkpointing", c.replace(grad_ckpt=False)))
    if c.optimizer is not Optimizer.ADAMW:
        variants.append((f"{c.optimizer} instead of adamw", c.replace(optimizer=Optimizer.ADAMW)))
    if c.offload is not Offload.NONE:
        variants.append((f"offload {c.offload}", c.replace(offload=Offload.NONE)))
    if c.grad_accum > 1:
        variants.append((f"accumulation x{c.grad_accum}", c.replace(micro_batch=c.micro_batch * c.grad_accum, grad_accum=1)))
    lines = []
    for name, variant in variants:
        try:
            mem = estimate_memory(model=spec, config=variant, gpu=device)
            thr = estimate_throughput(model=spec, config=variant, gpu=device)
        except PlannerError:
            continue
        saved = mem.process_total_bytes - plan.memory.process_total_bytes
        slower = plan.throughput.step_s / thr.step_s - 1
        lines.append(f"{name}: saves {format_bytes(saved)}, costs {slower:+.0%} step time")
    return lines


def register(app: typer.Typer) -> None:
    app.command("suggest")(suggest)
