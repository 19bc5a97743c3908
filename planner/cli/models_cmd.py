"""``planner models``: list the offline model catalog."""

from __future__ import annotations

from typing import Optional

import typer


def format_params(n: int) -> str:
    """Three significant figures: ``6738415616`` -> ``6.74B``, ``13015864320`` -> ``13.0B``,
    ``124439808`` -> ``124M``."""
    # 999.5M and up would print as "1000M": switch to billions there
    value, unit = (n / 1e9, "B") if n >= 999_500_000 else (n / 1e6, "M")
    decimals = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:.{decimals}f}{unit}"


def models(
    search: Optional[str] = typer.Option(
        None, "--search", "-s", help="Only ids or architectures containing TEXT."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of model summaries."),
) -> None:
    """List the models the planner knows offline (any other model: pass a path to its config.json)."""
    from planner.catalog import list_catalog
    from planner.cli._common import console, print_json

    specs = list_catalog(search=search)
    if as_json:
        print_json([spec.summary() for spec in specs])
        return
    out = console()
    if not specs:
        out.print(f"no catalog model matches {search!r}; pass a path to a config.json to plan any model")
        return
    from rich.table import Table

    table = Table(title=f"{len(specs)} catalog models")
    table.add_column("id")
    table.add_column("architecture")
    table.add_column("parameters", justify="right")
    table.add_column("max seq len", justify="right")
    for spec in specs:
        params = format_params(spec.params_total)
        if spec.is_moe:
            params = f"{params} ({format_params(spec.params_active)} active)"
        table.add_row(spec.id, spec.model_type, params, str(spec.max_seq_len))
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
