"""``planner emit``: write ready-to-run training files for a stored plan."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from planner.cli.store import DB_HELP


def emit(
    plan_id: str = typer.Argument(..., help="Plan id or its first characters (from 'planner history')."),
    directory: Path = typer.Argument(..., help="Where to write the files (created; must be new or empty)."),
    rank: int = typer.Option(1, "--rank", "-r", help="Which of the plan's ranked configurations (1 = best)."),
    force: bool = typer.Option(False, "--force", help="Write into a directory that already holds files, overwriting ours."),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="Default dataset of train.py: a .txt/.jsonl file or a datasets name "
                                          "(--for a trainer: its dataset key; default: its docs' example dataset)."),
    target: str = typer.Option("hf", "--for", help="hf|trl|axolotl|llama-factory|torchtune: train.py and its files (hf), "
                               "or that trainer's config and launch line."),
    db: Optional[str] = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Write train.py, training_args.json, the DeepSpeed/LoRA/bitsandbytes configs, an accelerate
    config and PLAN.md (or, --for a trainer, its config): the plan's configuration exactly as its
    memory prediction assumed, and the line that runs it."""
    from planner.cli._common import console
    from planner.emit import emitted_files, write_files
    from planner.emit.trainers import TARGETS
    from planner.errors import InvalidConfigError
    from planner.store import open_store

    if target not in TARGETS:
        raise InvalidConfigError(f"--for must be one of {', '.join(TARGETS)}, got {target!r}")
    with open_store(url=db) as store:
        plan = store.get_plan(plan_id=plan_id)
    files, launch = emitted_files(plan=plan, rank=rank, dataset=dataset, target=target)
    written = write_files(files, directory=directory, force=force)
    out = console()
    out.print(f"plan {plan.id[:8]} #{rank} written to {directory}:", markup=False)
    for path in written:
        out.print(f"  {path.name}", markup=False)
    out.print(f"run: cd {directory} && {launch}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("emit")(emit)
