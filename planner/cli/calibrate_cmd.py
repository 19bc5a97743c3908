"""``planner calibrate``: fit the device constants on the stored runs, print before/after, store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import typer

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console

    from planner.calibration.calibrate import CalibrationOutcome
    from planner.calibration.fit import ConstantFit, ErrorStats

_DB_HELP = "Database URL (default: PLANNER_DATABASE_URL or the local SQLite file)."


def _value(fit: "ConstantFit", value: float | None) -> str:
    from planner.units import format_bytes

    if value is None:
        return "-"
    return format_bytes(int(value)) if fit.key == "cuda_context_bytes" else f"{value:.3g}"


def _stats(stats: "ErrorStats | None") -> str:
    if stats is None:
        return "-"
    return f"{stats.median_abs_pct:.1f}% / {stats.max_abs_pct:.1f}% (mean {stats.mean_pct:+.1f}%)"


def _change(label: str, before: "ErrorStats | None", after: "ErrorStats | None") -> str:
    return (f"{label} over {before.runs} runs: median |error| {before.median_abs_pct:.1f}% -> {after.median_abs_pct:.1f}%, "
            f"max {before.max_abs_pct:.1f}% -> {after.max_abs_pct:.1f}%") if before and after else ""


def _print_outcome(out: "Console", outcome: "CalibrationOutcome") -> None:
    from rich.table import Table

    fit, runs = outcome.fit, outcome.runs
    out.print(f"{outcome.gpu}: {len(runs.ids)} measurements ({len(runs.steps)} with a step time, "
              f"{len(runs.memory)} with a memory peak)")
    for left in runs.left_out:
        out.print(f"  left out {left.id[:8]}: {left.reason}")
    table = Table(title="constants (error = (predicted - measured) / measured on the runs each constant shapes: "
                        "median / max |error|)", title_justify="left")
    for name, right in (("constant", False), ("default", True), ("fitted", True), ("runs", True), ("on", False),
                        ("error before", True), ("error after", True)):
        table.add_column(name, justify="right" if right else "left")
    for c in fit.constants:
        fitted = _value(c, c.value) + (" (at its bound)" if c.at_bound else "")
        table.add_row(c.name, _value(c, c.default), fitted if c.value is not None else f"not fitted: {c.note}",
                      str(c.runs), c.quantity, _stats(c.before), _stats(c.after))
    out.print(table)
    for line in (_change("step time", fit.step_before, fit.step_after),
                 _change("process total", fit.total_before, fit.total_after)):
        if line:
            out.print(line)
    if fit.allocated:
        out.print(f"peak allocated over {fit.allocated.runs} runs: median |error| {fit.allocated.median_abs_pct:.1f}%, "
                  f"max {fit.allocated.max_abs_pct:.1f}% (the memory model itself; no constant changes it)")
    if fit.reserved:
        out.print(f"peak reserved over {fit.reserved.runs} runs: median |error| {fit.reserved.median_abs_pct:.1f}%, "
                  f"max {fit.reserved.max_abs_pct:.1f}% (the replayed caching allocator; not fitted)")
    elif fit.allocated and not any(c.key == "cuda_context_bytes" for c in fit.constants):
        out.print(f"memory: nothing to fit on {outcome.gpu} (no CUDA context, no caching allocator)")
    if outcome.stored is not None:
        out.print(f"stored {outcome.stored.describe()}", soft_wrap=True)
        out.print(f"plans on {outcome.gpu} now use it; 'planner calibrate --gpu {outcome.gpu} --reset' goes back to the defaults")


def _reset(gpu: str, *, db: Optional[str], as_json: bool) -> None:
    from planner.cli._common import console, print_json
    from planner.store import open_store

    with open_store(url=db) as store:
        dropped = store.reset_calibration(gpu=gpu)
    if as_json:
        print_json({"gpu": gpu, "dropped": dropped.to_dict() if dropped else None})
    elif dropped is None:
        console().print(f"{gpu} has no active calibration: plans already use the model's defaults")
    else:
        console().print(f"dropped calibration #{dropped.id} for {gpu}: plans on {gpu} use the model's defaults again")


def calibrate(
    gpu: Optional[str] = typer.Option(
        None, "--gpu", "-g", help="Device to calibrate (cpu here); default: every device with stored runs."),
    reset: bool = typer.Option(
        False, "--reset", help="Drop the device's active calibration: plans go back to the model's defaults."),
    db: Optional[str] = typer.Option(None, "--db", help=_DB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Fit the device constants the model cannot derive (MFU per precision, memory-bandwidth
    efficiency, the CUDA context) on the runs stored by 'planner measure' and verifications; print
    the error before and after and store the calibration, which later plans use and name."""
    from planner import __version__
    from planner.calibration.calibrate import calibrate as fit_and_store
    from planner.calibration.calibrate import how_to_measure
    from planner.calibration.fit import MIN_RUNS
    from planner.cli._common import catalog_gpu, console, print_json
    from planner.errors import InvalidConfigError, NotEnoughMeasurementsError
    from planner.gpus import get_gpu
    from planner.store import open_store

    device = get_gpu(catalog_gpu(gpu)) if gpu is not None else None
    if reset:
        if device is None:
            raise InvalidConfigError("--reset drops one device's calibration: name it with --gpu, e.g. --gpu cpu")
        _reset(device.name, db=db, as_json=as_json)
        return
    with open_store(url=db) as store:
        names = [device.name] if device else [name for name in store.measured_gpus() if _known(name)]
        if not names:
            raise NotEnoughMeasurementsError(
                f"no ok measurements in the store: calibrate needs at least {MIN_RUNS} of a device; {how_to_measure('cpu')}")
        outcomes, refusals = [], []
        for name in names:
            try:
                outcomes.append(fit_and_store(store, device or get_gpu(name), version=__version__))
            except NotEnoughMeasurementsError as exc:
                if device is not None:
                    raise
                refusals.append(str(exc))
    if not outcomes:
        raise NotEnoughMeasurementsError(refusals[0] if len(refusals) == 1 else "; ".join(refusals))
    if as_json:
        print_json({"calibrated": [o.to_dict() for o in outcomes], "refused": refusals})
        return
    out = console()
    for outcome in outcomes:
        _print_outcome(out, outcome)
    for refusal in refusals:
        out.print(f"not calibrated: {refusal}")


def _known(name: str) -> bool:
    from planner.calibration.lookup import catalog_name

    return catalog_name(name) == name


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate)
