"""How ``planner suggest --verify`` (and a verification job's driver) shows verification: a live table on a terminal, plain lines
otherwise, and at the end measured beside predicted for every candidate that ran."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from planner.text import visible

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from planner.modelspec import ModelSpec
    from planner.store import PlanStore, StoredPlan
    from planner.verify.driver import RunReport, VerifyOptions


def _state_text(report: "RunReport") -> str:
    if report.state == "queued":
        return "queued"
    took = f" {report.elapsed_s:.0f}s" if report.elapsed_s is not None else ""
    where = f" on {report.node}" if report.node else ""
    return f"{report.state}{took}{where}"


class LineProgress:
    """One plain line per change of a run's state (logs, pipes, CI)."""

    def __init__(self, console: "Console") -> None:
        self.console = console
        self.seen: dict[int, str] = {}

    def __call__(self, reports: "tuple[RunReport, ...]", elapsed_s: float) -> None:
        for r in reports:
            if self.seen.get(r.position) != r.state:
                self.seen[r.position] = r.state
                note = f": {visible(r.note)}" if r.note and r.state.is_terminal() else ""
                self.console.print(f"[{elapsed_s:6.1f}s] #{r.position + 1} {r.label}: {_state_text(r)}{note}", markup=False)

    def close(self) -> None:
        pass


class LiveProgress:
    """A table redrawn in place: queued / running / done per candidate with elapsed time."""

    def __init__(self, console: "Console") -> None:
        from rich.live import Live

        self.live = Live(console=console, refresh_per_second=4, transient=True)
        self.live.start()

    def __call__(self, reports: "tuple[RunReport, ...]", elapsed_s: float) -> None:
        from rich.table import Table

        table = Table(title=f"verifying ({elapsed_s:.0f}s)", title_justify="left")
        for name in ("#", "candidate", "state"):
            table.add_column(name)
        for r in reports:
            table.add_row(str(r.position + 1), r.label, _state_text(r))
        self.live.update(table)

    def close(self) -> None:
        self.live.stop()


def progress_display(console: "Console") -> Any:
    """Live on an interactive terminal, plain lines otherwise."""
    return LiveProgress(console) if console.is_terminal and sys.stdout.isatty() else LineProgress(console)


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or not measured:
        return ""
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def verification_table(plan: "StoredPlan", *, answer: int | None, reserved: bool) -> Any:
    """Measured beside predicted for every candidate that ran (its latest run)."""
    from rich.table import Table


    table = Table(title="verified: measured vs predicted (error = (predicted - measured) / measured)", title_justify="left")
    columns = ["#", "candidate", "outcome", "peak alloc pred", "measured", "err"]
    if reserved:
        columns += ["reserved pred", "measured", "err"]
    columns += ["tokens/s pred", "measured", "err"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("candidate", "outcome") else "right")
    for stored in plan.candidates:
        run = stored.latest
        if run is None:
            continue
        p, m = stored.candidate, run.measurement
        mark = " <- answer" if answer == stored.position else ""
        row = [str(stored.position + 1), p.config.label() + mark, *_memory_cells(p.memory, m, reserved=reserved),
               f"{p.throughput.tokens_per_s:,.0f}", f"{m.tokens_per_s:,.0f}" if m.tokens_per_s else "-",
               _err(p.throughput.tokens_per_s, m.tokens_per_s)]
        table.add_row(*row)
        for rank, r in enumerate(run.ranks):  # a run of several ranks: each rank's peak, the same prediction
            worst = " (worst)" if rank == run.worst_rank else ""
            table.add_row("", f"  rank {rank}{worst}", *_memory_cells(p.memory, r, reserved=reserved), "", "", "")
    return table


def _memory_cells(predicted, measured, *, reserved: bool) -> list[str]:
    """A run's (or one rank's) outcome and its peaks beside the predicted ones, with the errors."""
    from planner.units import format_bytes

    cells = [str(measured.outcome), format_bytes(predicted.peak_allocated_bytes),
             format_bytes(measured.peak_allocated_bytes) if measured.peak_allocated_bytes else "-",
             _err(predicted.peak_allocated_bytes, measured.peak_allocated_bytes)]
    if reserved:
        cells += [format_bytes(predicted.peak_reserved_bytes),
                  format_bytes(measured.peak_reserved_bytes) if measured.peak_reserved_bytes else "-",
                  _err(predicted.peak_reserved_bytes, measured.peak_reserved_bytes)]
    return cells


def print_verified(console: "Console", plan: "StoredPlan", *, answer: int | None, device_is_cpu: bool) -> None:
    """The verification's table, its verdict and the answer."""
    console.print(verification_table(plan, answer=answer, reserved=not device_is_cpu))
    for stored in plan.candidates:
        run = stored.latest
        if run is not None and run.measurement.error:
            console.print(f"  #{stored.position + 1} {run.measurement.outcome}: "
                          f"{visible(run.measurement.error.strip().splitlines()[0][:300])}", markup=False)
    when = plan.status_changed_at.strftime("%Y-%m-%d %H:%M UTC") if plan.status_changed_at else "?"
    console.print(f"plan {plan.status} {when}: {visible(plan.status_reason or '')}", markup=False)
    if answer is not None:
        best = plan.candidates[answer]
        m = best.latest.measurement
        console.print(f"answer: #{answer + 1} {best.candidate.config.label()} — fits when run "
                      f"({m.tokens_per_s:,.0f} tokens/s measured)", markup=False)
    if device_is_cpu:
        console.print("tokens/s on the cpu profile: the throughput model is for GPUs; on the CPU a small model's "
                      "step is mostly per-op overhead, which it does not model")


def verify_and_show(out: "Console", *, store: "PlanStore", plan_id: str, options: "VerifyOptions", as_json: bool,
                    spec: "ModelSpec | None" = None, model: str | None = None, header: str | None = None) -> "StoredPlan":
    """Verify the stored plan (``planner.usecases.verify_stored_plan``) with its progress shown,
    then the skipped runs, measured vs predicted and the answer (JSON: the plan with its
    verification). ``planner suggest --verify`` and a verification job's driver (``planner jobs
    verify``) both show it so. Returns the plan as stored after its runs. ``header``: a line shown
    once the runs have started, so that a refusal (an unknown plan id, another model, a malformed
    or unreachable Ray address) is the only thing printed."""
    from planner.answers import answer_position, verification_dict
    from planner.cli._common import print_json
    from planner.usecases import verify_stored_plan

    display = None

    def on_progress(reports, elapsed_s: float) -> None:
        nonlocal display
        if display is None:  # the first report: every check before the runs has passed
            if header is not None:
                out.print(header, markup=False)
            display = progress_display(out)
        display(reports, elapsed_s)

    try:
        verified = verify_stored_plan(store=store, plan_id=plan_id, options=options, spec=spec, model=model,
                                      on_progress=on_progress)
    finally:
        if display is not None:
            display.close()
    plan, report = verified.plan, verified.report
    if as_json:
        print_json(plan.to_result().to_dict() | {"plan_id": plan.id, "verification": verification_dict(plan, report)})
    else:
        for skipped in (r for r in report.runs if r.state == "skipped"):
            out.print(f"  #{skipped.position + 1} skipped: {skipped.note}", markup=False)
        print_verified(out, plan, answer=answer_position(plan), device_is_cpu=verified.device.is_cpu)
    return plan
