"""What is live at the measured peak of one CPU run, by the op and library line that made it.

    python bench/peak_trace.py ARCH [CHANGES] [--top N]

ARCH is an architecture of bench/accuracy.py (llama, gpt2, bert, ...) or a config.json path;
CHANGES a JSON object of TrainConfig fields over bench/accuracy.py's base configuration, e.g.
'{"method": "lora", "precision": "fp32"}'. Prints the groups of live storages (bytes, count,
category, made by) beside the memory model's breakdown: the way each term of planner.memory
that the accuracy benchmark found missing was found. Runs in this process with the CPU probe's
trace on (many times slower than a normal run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from accuracy import ARCHS, _BASE  # noqa: E402


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
    print(f"{args.arch} {config.label()}: measured {format_bytes(measured)} at {details['peak_phase']}, predicted "
          f"{format_bytes(predicted.peak_allocated_bytes)} at {predicted.peak_phase} "
          f"({100 * (predicted.peak_allocated_bytes - measured) / measured:+.2f} %)")
    print("\nlive at the measured peak (bytes, count, category, made by):")
    for nbytes, count, category, made_by in details["peak_storages"][: args.top]:
        print(f"  {format_bytes(nbytes):>10} x{count:<4} {category:16} {made_by}")
    print("\nthe model's breakdown at its peak:")
    for name, nbytes in sorted(predicted.breakdown.items(), key=lambda kv: -kv[1]):
        print(f"  {format_bytes(nbytes):>10} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
