"""What is live at the measured peak of one CPU run, by the op and library line that made it.

    python bench/peak_trace.py ARCH [CHANGES] [--top N]

ARCH is an architecture of bench/accuracy.py (llama, gpt2, bert, ...) or a config.json path;
CHANGES a JSON object of TrainConfig fields over bench/accuracy.py's base configuration, e.g.
'{"method": "lora", "precision": "fp32"}'. Prints the groups of live storages at the dispatch
count's peak (bytes, count, category, made by), the blocks the step had allocated at the
allocator's peak by the ops they were allocated in (this names what kernels allocate below the
dispatcher, e.g. bitsandbytes' CPU 8-bit step), and the memory model's breakdown: the way each
term of planner.memory that the accuracy benchmark found missing was found. Runs in this process
with the CPU probe's trace on (many times slower than a normal run); ZeRO runs need a fresh
process per run (``workers.measure_with_details``), which gives the allocator's lists too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import _BASE, ARCHS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arch", help=f"one of {', '.join(ARCHS)} or a config.json path")
    parser.add_argument("changes", nargs="?", default="{}", help="TrainConfig fields as JSON")
    parser.add_argument("--top", type=int, default=40, help="groups to print")
    args = parser.parse_args(argv)
    from planner.catalog import spec_from_config
    from planner.config import TrainConfig
    from planner.gpus import get_gpu
    from planner.memory import estimate_memory
    from planner.units import format_bytes
    from workers import run_in_process

    model_config = ARCHS.get(args.arch) or json.loads(Path(args.arch).read_text())
    config = TrainConfig(**(_BASE | json.loads(args.changes)))
    measurement, details = run_in_process(model_config=model_config, config=config, trace=True)
    if measurement.error:
        print(f"{measurement.outcome}: {measurement.error}", file=sys.stderr)
        return 1
    predicted = estimate_memory(model=spec_from_config(model_config, model_id=args.arch, source="bench"), config=config,
                                gpu=get_gpu("cpu"))
    measured = measurement.peak_allocated_bytes
    print(f"{args.arch} {config.label()}: measured {format_bytes(measured)} at {details['peak_phase']} "
          f"(allocator; dispatch count {format_bytes(details['peak_dispatch_bytes'])} at "
          f"{details['peak_dispatch_phase']}), predicted {format_bytes(predicted.peak_allocated_bytes)} at "
          f"{predicted.peak_phase} ({100 * (predicted.peak_allocated_bytes - measured) / measured:+.2f} %)")
    print("\nlive at the dispatch count's peak (bytes, count, category, made by):")
    for nbytes, count, category, made_by in details["peak_storages"][: args.top]:
        print(f"  {format_bytes(nbytes):>10} x{count:<4} {category:16} {made_by}")
    print("\nallocated in the measured step and live at the allocator's peak (bytes, count, ops):")
    for nbytes, count, made_by in details.get("peak_allocations", [])[: args.top]:
        print(f"  {format_bytes(nbytes):>10} x{count:<4} {made_by}")
    left_out = details.get("untracked_at_step_start") or []
    if left_out or details.get("allocator_drift_bytes"):
        print(f"\nleft out at the step's start (no live storage of the dispatch count; c10's total drifted "
              f"{format_bytes(details.get('allocator_drift_bytes') or 0)} above the ledger):")
        for nbytes, count, made_by in left_out[: args.top]:
            print(f"  {format_bytes(nbytes):>10} x{count:<4} {made_by}")
    print("\nthe model's breakdown at its peak:")
    for name, nbytes in sorted(predicted.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"  {format_bytes(nbytes):>10} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
