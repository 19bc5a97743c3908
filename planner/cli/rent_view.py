"""``planner suggest --gpu any``: the GPU types and counts ranked by cost and by time, printed."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from planner.rent import RentComparison, RentOption

#: rows of the cost table (``--json`` has every option)
SHOWN = 10


def print_comparison(out, comparison: "RentComparison") -> None:
    from rich.table import Table

    from planner.cli.suggest_view import _risk
    from planner.units import format_bytes

    cheapest = comparison.by_cost()
    tokens = comparison.workload
    table = Table(title=f"{comparison.model_id}: {tokens.tokens:,} tokens ({tokens.source}), cheapest first")
    for col, justify in (("#", "right"), ("GPU", "left"), ("GPUs", "right"), ("plan", "left"), ("memory", "right"),
                         ("OOM risk", "right"), ("tokens/s", "right"), ("hours", "right"), ("dollars", "right"),
                         ("tokens/$", "right"), ("price", "left")):
        table.add_column(col, justify=justify)
    for rank, option in enumerate(cheapest[:SHOWN], start=1):
        plan = option.plan
        table.add_row(str(rank), option.gpu, str(option.gpus), plan.config.label(),
                      format_bytes(plan.memory.process_total_bytes), _risk(plan.memory.oom_probability),
                      f"{plan.throughput.tokens_per_s:,.0f}", f"{option.hours:,.2f}", f"${option.dollars:,.2f}",
                      f"{option.tokens_per_dollar:,.0f}", option.price.describe())
    out.print(table)
    for line in _summary_lines(comparison):
        out.print(line, soft_wrap=True)


def _summary_lines(comparison: "RentComparison") -> list[str]:
    lines = []
    fastest = comparison.by_time()[:3]
    if fastest:
        lines.append("fastest: " + "; ".join(_short(o) for o in fastest))
    unpriced = sorted({o.gpu for o in comparison.options if o.plan is not None and o.price is None})
    if unpriced:
        lines.append(f"planned but not priced ({comparison.prices.origin} has no price for them; give --prices FILE): "
                     + ", ".join(unpriced))
    unfit = comparison.unfit()
    if unfit:
        lines.append("nothing fits at any count on: " + ", ".join(unfit))
    if not comparison.by_cost():
        lines.append("no priced option fits: give --prices FILE for the GPUs above, or change the request")
    lines.append(f"prices: {comparison.prices.origin} (on-demand, per GPU-hour, dated per row; a price holds for any "
                 "count: check that the provider rents that many on one node); time counts training steps only")
    return lines


def _short(option: "RentOption") -> str:
    cost = f", ${option.dollars:,.2f}" if option.dollars is not None else ", no price"
    return f"{option.gpus} x {option.gpu} {option.hours:,.2f} h{cost} ({option.plan.config.label()})"
