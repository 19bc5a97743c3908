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


def describe_model(spec) -> str:
    """``id (N params)`` with what else the user should know: the active parameters per token of an
    MoE, the catalog model whose architecture a release variant (``-Instruct``/``-it``/``-Chat``)
    resolved to, the multimodal wrapper whose language model this is."""
    notes = [f"{format_params(spec.params_total)} params"]
    if spec.is_moe:
        notes.append(f"{format_params(spec.params_active)} active per token")
    if spec.alias_of:
        notes.append(f"architecture of {spec.alias_of}")
    if spec.wrapper_type:
        notes.append(f"language model of the {spec.wrapper_type} wrapper, trained text-only")
    return f"{spec.id} ({'; '.join(notes)})"


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
    table.add_column("active per token", justify="right")
    table.add_column("max seq len", justify="right")
    table.add_column("plannable")
    for spec in specs:
        architecture = f"{spec.model_type} ({spec.wrapper_type} text)" if spec.wrapper_type else spec.model_type
        active = f"{format_params(spec.params_active)} ({spec.experts_per_token}/{spec.num_experts} experts)" \
            if spec.is_moe else "all"
        plannable = "no: " + "; ".join(spec.unmodelled) if spec.unmodelled else "yes"
        table.add_row(spec.id, architecture, format_params(spec.params_total), active, str(spec.max_seq_len), plannable)
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
