"""``planner history``, ``planner show`` and ``planner db``: past plans and the store's schema.

Whatever the store holds is printed through ``planner.text.visible`` and never as Rich markup:
a model id stored by an older planner (or a measurement's error, several lines by nature) may hold
control characters, and must reach the terminal as text, not as escape sequences or markup.

Also the helpers ``planner suggest`` and ``planner measure`` use to report and store what they
produced (``report_saved``, ``save_measurement``). ``planner.store`` (SQLAlchemy) is
imported inside the functions, so ``planner --help`` does not load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

import typer

from planner.limits import MAX_HISTORY
from planner.text import visible

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console
    from rich.text import Text

    from planner.results import Candidate, Measurement, PlanRequest
    from planner.store import PlanSummary, StoredCandidate, StoredPlan

DB_HELP = "Database URL, e.g. postgresql+psycopg://user@host/db (default: $PLANNER_DATABASE_URL or the SQLite file in the data directory)."
SHORT_ID = 8


def _cell(value: Any) -> "Text":
    """A table cell of stored text: unprintable characters escaped, no markup."""
    from rich.text import Text

    return Text(visible(value))


def _say(console: "Console", line: str) -> None:
    """A line holding stored text: unprintable characters escaped, no markup."""
    console.print(visible(line), markup=False, emoji=False)


def _when(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC")


def _gpu(gpu: str, count: int) -> str:
    return gpu if count == 1 else f"{count}x {gpu}"


def _verified(status: Any) -> str:
    """history's "verified?" column: yes / no, or why not yet."""
    from planner.store import PlanStatus

    return {PlanStatus.VERIFIED: "yes", PlanStatus.PLANNED: "no"}.get(status, f"no ({status})")


def _error_pct(predicted: float | None, measured: float | None) -> str:
    """Signed prediction error relative to the measurement: +5.0% = predicted 5% too high."""
    if predicted is None or measured is None or measured == 0:
        return "-"
    return f"{(predicted - measured) / measured * 100:+.1f}%"


def comparison_table(candidates: "list[tuple[int, StoredCandidate]]", *, title: str) -> Any:
    """Predicted vs measured, one row per quantity of every measurement of the given candidates."""
    from rich.table import Table

    from planner.units import format_bytes

    table = Table(title=visible(title), title_justify="left")
    for name in ("#", "run", "outcome", "device", "quantity", "predicted", "measured", "error"):
        table.add_column(name, justify="right" if name in ("#", "predicted", "measured", "error") else "left")
    for number, stored in candidates:
        memory, speed = stored.candidate.memory, stored.candidate.throughput
        for run in stored.measurements:
            m = run.measurement
            rows = [
                ("peak allocated", memory.peak_allocated_bytes, m.peak_allocated_bytes, format_bytes),
                ("peak reserved", memory.peak_reserved_bytes, m.peak_reserved_bytes, format_bytes),
                ("process total", memory.process_total_bytes, m.process_total_bytes, format_bytes),
                ("step time", speed.step_s, m.step_s, lambda s: f"{s:.3g} s"),
                ("tokens/s", speed.tokens_per_s, m.tokens_per_s, lambda t: f"{t:,.0f}"),
            ]
            head = [str(number), _cell(run.id[:SHORT_ID]), _cell(m.outcome), _cell(m.device)]
            for quantity, predicted, measured, fmt in rows:
                table.add_row(
                    *head, quantity, fmt(predicted),
                    "not measured" if measured is None else fmt(measured),
                    _error_pct(predicted, measured),
                )
                head = ["", "", "", ""]
            if m.error:
                first = m.error.strip().splitlines()[0][:80] if m.error.strip() else ""
                table.add_row("", "", "", "", "error", "", _cell(first), "")
            for rank, r in enumerate(run.ranks):
                worst = " (worst)" if rank == run.worst_rank else ""
                table.add_row("", "", _cell(r.outcome), "", f"rank {rank} peak allocated{worst}",
                              format_bytes(memory.peak_allocated_bytes),
                              _cell(format_bytes(r.peak_allocated_bytes) if r.peak_allocated_bytes is not None
                                    else (r.error or "not measured").strip().splitlines()[0][:80]),
                              _error_pct(memory.peak_allocated_bytes, r.peak_allocated_bytes))
    return table


def _candidates_table(plan: "StoredPlan") -> Any:
    from rich.table import Table

    from planner.units import format_bytes

    table = Table(title="candidates", title_justify="left")
    for name, right in (("#", True), ("rank", True), ("configuration", False), ("fits", False),
                        ("peak allocated", True), ("process total", True), ("step", True),
                        ("tokens/s", True), ("measured", False), ("id", False)):
        table.add_column(name, justify="right" if right else "left")
    for number, stored in enumerate(plan.candidates, start=1):
        c = stored.candidate
        latest = stored.latest
        table.add_row(
            str(number), "-" if c.rank is None else str(c.rank), _cell(c.config.label()), "yes" if c.fits else "no",
            format_bytes(c.memory.peak_allocated_bytes), format_bytes(c.memory.process_total_bytes),
            f"{c.throughput.step_s:.3g} s", f"{c.throughput.tokens_per_s:,.0f}",
            "never" if latest is None else f"{latest.measurement.outcome} ({len(stored.measurements)} run"
            + ("s)" if len(stored.measurements) > 1 else ")"),
            _cell(stored.id[:SHORT_ID]),
        )
    return table


def _breakdowns(plan: "StoredPlan") -> list[str]:
    from planner.units import format_bytes

    lines = []
    for number, stored in enumerate(plan.candidates, start=1):
        memory, speed = stored.candidate.memory, stored.candidate.throughput
        parts = ", ".join(f"{name} {format_bytes(size)}" for name, size in memory.breakdown.items())
        lines.append(f"#{number} memory at {memory.peak_phase or 'peak'}: {parts}")
        if speed.breakdown_s:
            lines.append(f"#{number} step: " + ", ".join(f"{k} {v:.3g} s" for k, v in speed.breakdown_s.items()))
        for note in (*memory.assumptions, *speed.assumptions):
            lines.append(f"#{number} assumes: {note}")
    return lines


def _constraint(value: Any) -> str:
    """A stored search constraint as a user would write it: lists comma-separated, None as "any"."""
    from planner.units import format_bytes

    if value is None:
        return "any"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return ", ".join(f"{k}={_constraint(v)}" for k, v in value.items())
    if isinstance(value, int) and value >= 1024**2:
        return format_bytes(value)
    return str(value)


def print_plan(plan: "StoredPlan", *, console: "Console") -> None:
    from planner.units import format_bytes

    r = plan.request
    _say(console, f"plan {plan.id}  ({plan.status}, {_when(plan.created_at)})")
    _say(console,
         f"model {r.model_id} (config {r.model_fingerprint[:12]})  on {_gpu(r.gpu, r.gpu_count)} "
         f"({format_bytes(r.gpu_memory_bytes)})  target batch {r.target_batch} x {r.seq_len} tokens")
    if r.constraints:
        _say(console, "constraints: " + "; ".join(f"{k} {_constraint(v)}" for k, v in r.constraints.items()))
    if plan.searched:
        console.print(
            f"searched {plan.searched} configurations; usable {format_bytes(plan.usable_bytes)} "
            f"(safety margin {format_bytes(plan.safety_margin_bytes)})"
        )
    if plan.status_reason:
        when = f" ({_when(plan.status_changed_at)})" if plan.status_changed_at else ""
        _say(console, f"{plan.status}{when}: {plan.status_reason}")
    if plan.ray_job_id:
        _say(console, f"ray job: {plan.ray_job_id}")
    console.print(_candidates_table(plan))
    for line in _breakdowns(plan):
        _say(console, line)
    measured = [(n, c) for n, c in enumerate(plan.candidates, start=1) if c.measurements]
    if measured:
        console.print(comparison_table(measured, title="predicted vs measured (error = (predicted - measured) / measured)"))
    for rejection in plan.rejected:
        _say(console, f"rejected {rejection.family}: {rejection.reason}")


def _history_table(rows: "list[PlanSummary]") -> Any:
    from rich.table import Table

    table = Table()
    for name in ("id", "when (UTC)", "model", "GPU", "batch", "top plan", "verified?", "runs"):
        # only the plan label may wrap: ids, names and times stay copyable
        table.add_column(name, justify="right" if name == "batch" else "left", no_wrap=name != "top plan")
    for row in rows:
        table.add_row(
            _cell(row.id[:SHORT_ID]), row.created_at.strftime("%Y-%m-%d %H:%M"), _cell(row.model_id),
            _cell(_gpu(row.gpu, row.gpu_count)), f"{row.target_batch} x {row.seq_len}",
            _cell(row.top_plan or "nothing fits"), _cell(_verified(row.status)),
            str(row.measurements) if row.measurements else "-",
        )
    return table


# ---- helpers for planner suggest / planner measure -----------------------------------------
@dataclass(frozen=True)
class SavedPlan:
    """What storing a plan found and did (``planner.usecases.plan_request``), for ``report_saved`` to print."""

    plan_id: str | None
    existing: "StoredPlan | None"
    note: str | None = None


def report_saved(saved: SavedPlan, *, console: "Console") -> str | None:
    """Say whether this request was planned before (and what its measurements showed) and
    print ``plan id: <id>``; returns the id (None when not saved)."""
    if saved.note:
        _say(console, saved.note)
    existing = saved.existing
    if existing is not None:
        state = "verified" if existing.verified else f"not verified ({existing.status})"
        _say(console,
             f"a plan for this request exists: {existing.id[:SHORT_ID]} from {_when(existing.created_at)}, "
             f"{state} (planner show {existing.id[:SHORT_ID]})")
        measured = [(n, c) for n, c in enumerate(existing.candidates, start=1) if c.measurements]
        if measured:
            console.print(comparison_table(measured, title=f"measured for plan {existing.id[:SHORT_ID]}"))
    if saved.plan_id is not None:
        console.print(f"plan id: {saved.plan_id}")
    return saved.plan_id


def save_measurement(*, request: "PlanRequest", candidate: "Candidate", measurement: "Measurement", db: str | None) -> str:
    """Store one ``planner measure`` run (request, candidate, measurement); returns its plan id."""
    from planner.store import open_plan_store

    with open_plan_store(url=db) as store:
        plan_id, _candidate_id = store.record_single_measurement(
            request=request, candidate=candidate, measurement=measurement
        )
    return plan_id


def _catalog_gpu(name: str | None) -> str | None:
    """The catalog name of a GPU written as suggest accepts it (``h100`` -> ``h100-80gb``, ``A10G``
    -> ``a10g``): plans are stored under catalog names. A name the catalog does not know is kept
    as typed (plans of older catalogs)."""
    from planner.errors import UnknownGPUError
    from planner.gpus import get_gpu

    if not name:
        return name
    try:
        return get_gpu(name).name
    except UnknownGPUError:
        return name


# ---- commands ------------------------------------------------------------------------------
def history(
    model: Optional[str] = typer.Option(None, "--model", help="Part of the model id (any case)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU name (any case)."),
    status: Optional[str] = typer.Option(None, "--status", help="planned|verifying|verified|failed|measured"),
    since: Optional[str] = typer.Option(None, "--since", help="Only plans since: 7d, 12h, 30m or 2026-11-01."),
    limit: int = typer.Option(20, "-n", "--limit", min=1, max=MAX_HISTORY, help="Show at most this many plans."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """List past plans, newest first."""
    from planner.cli._common import console, print_json
    from planner.store import open_plan_store, parse_since, parse_status

    since_at = parse_since(since) if since else None
    status_value = parse_status(status) if status else None
    with open_plan_store(url=db) as store:
        rows = store.history(model=model, gpu=_catalog_gpu(gpu), status=status_value, since=since_at, limit=limit)
    if as_json:
        print_json([row.to_dict() for row in rows])
    elif not rows:
        console().print("no plans stored yet" if not any((model, gpu, status, since)) else "no plans match")
    else:
        console().print(_history_table(rows))


def show(
    plan_id: str = typer.Argument(..., help="Plan id or its first characters (from 'planner history')."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Show one plan: its candidates, breakdowns and measurements (predicted vs measured)."""
    from planner.cli._common import console, print_json
    from planner.store import open_plan_store

    with open_plan_store(url=db) as store:
        plan = store.get_plan(plan_id=plan_id)
    if as_json:
        print_json(plan.to_dict())
    else:
        print_plan(plan, console=console())


def db_upgrade(db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Apply the store's pending schema migrations."""
    from planner.cli._common import console
    from planner.store import upgrade_database

    before, head = upgrade_database(url=db)
    if before == head:
        console().print(f"database schema already at {head}")
    else:
        console().print(f"database schema upgraded from {before or 'base'} to {head}")


def db_current(db: Optional[str] = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Print the database's schema revision and this planner's."""
    from planner.cli._common import console
    from planner.store import database_revision

    state = database_revision(url=db)
    if state.up_to_date:
        note = "up to date"
    elif state.brand_new:
        note = "empty: the schema is created on first use (or by 'planner db upgrade')"
    else:
        note = "behind: run 'planner db upgrade'"
    console().print(f"revision {state.current or 'base'} (head {state.head}): {note}")


def register(app: typer.Typer) -> None:
    app.command("history")(history)
    app.command("show")(show)
    db_app = typer.Typer(help="The plan store's database schema.", no_args_is_help=True)
    db_app.command("upgrade")(db_upgrade)
    db_app.command("current")(db_current)
    app.add_typer(db_app, name="db")
