"""``planner gpus``: list the GPU catalog with the figures the models use."""

from __future__ import annotations

import typer


def gpus(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of GPU specs, with the source of each number."),
) -> None:
    """List the GPUs the planner knows (memory as the driver reports it, dense tensor-core TFLOP/s)."""
    from planner.cli._common import console, print_json
    from planner.gpus import list_gpus
    from planner.units import GiB

    specs = list_gpus()
    if as_json:
        print_json([spec.to_dict() for spec in specs])
        return
    from rich.table import Table

    table = Table(title=f"{len(specs)} devices: dense TFLOP/s, bandwidths in GB/s per direction")
    for header in ("name", "memory GiB", "bf16", "fp8 TF/s", "bf16 TF/s", "fp16 TF/s", "fp32 TF/s", "memory GB/s", "host link", "interconnect"):
        table.add_column(header, no_wrap=True, justify="left" if header in ("name", "interconnect") else "right")
    for spec in specs:
        table.add_row(
            spec.name,
            f"{spec.memory_bytes / GiB:.1f}",
            "yes" if spec.bf16 else "no",
            f"{spec.fp8_tflops:g}" if spec.fp8 else "-",
            f"{spec.bf16_tflops:g}" if spec.bf16 else "-",
            f"{spec.fp16_tflops:g}",
            f"{spec.fp32_tflops:g}",
            f"{spec.mem_bandwidth_gbs:g}",
            f"{spec.host_link_gbs:g}",
            f"{spec.interconnect} {spec.interconnect_gbs:g}",
        )
    out = console()
    out.print(table)
    out.print("cpu: this machine's RAM and measured 2-core GEMM rates; see `planner gpus --json` for sources")


def register(app: typer.Typer) -> None:
    app.command("gpus")(gpus)
