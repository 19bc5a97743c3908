"""Fuzz the CLI: N generated invocations (default 2,000) and the counts by exit code.

    python bench/fuzz.py [--examples 2000] [--seed 0] [--configs 0]

The grammar is tests/cli/test_fuzz_cli.py's (every command and option; ``measure`` only with a
``--gpus`` it refuses, behind a trap that fails any training run). Runs in-process against a
temporary planner home and database. Prints the count of each exit code, then every distinct
traceback (exception type and the innermost project frame) with the first argv that raised it.
``--configs N`` also sends N generated config.json documents through ``resolve_model``.
Exit status 1 when any invocation printed a traceback or broke the output contract.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "cli")]  # support.*, test_fuzz_cli


def _where(exc: BaseException) -> str:
    """``ExceptionType at planner/x.py:123`` (the innermost frame in the project)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if str(ROOT) in f.filename]
    place = f"{Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno}" if frames else "?"
    return f"{type(exc).__name__} at {place}"


def fuzz_cli(examples: int, seed: int, home: Path) -> tuple[collections.Counter, dict[str, tuple[list[str], str]]]:
    import test_fuzz_cli as grammar
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    counts: collections.Counter = collections.Counter()
    failures: dict[str, tuple[list[str], str]] = {}

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def run(data):
        argv, config = data.draw(grammar.argv_and_config(files))
        try:
            outcome = grammar.run_example(files, argv, config)
        except BaseException as exc:  # noqa: BLE001 - every escape is what we count
            if isinstance(exc, KeyboardInterrupt):
                raise
            counts["traceback"] += 1
            failures.setdefault(_where(exc), (argv, f"{type(exc).__name__}: {str(exc)[:200]}"))
            return
        counts[outcome.code] += 1
        for problem in grammar.problems(outcome):
            failures.setdefault(problem, (argv, outcome.err[-300:]))

    with grammar.closed_port() as port, grammar.measure_never_trains():
        files = grammar.FuzzFiles(home / "fuzz", closed_port=port)
        files.create()
        run()
    return counts, failures


def fuzz_configs(examples: int, seed: int, home: Path) -> collections.Counter:
    import test_fuzz_cli as grammar
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    from planner.catalog import resolve_model
    from planner.errors import PlannerError

    counts: collections.Counter = collections.Counter()
    path = home / "config.json"

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(document=grammar.config_documents())
    def run(document):
        grammar.write_document(path, document)
        try:
            resolve_model(str(path))
            counts["resolved"] += 1
        except PlannerError:
            counts["one-line error"] += 1
        except Exception as exc:  # noqa: BLE001
            counts[f"traceback: {_where(exc)}"] += 1

    run()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", type=int, default=0, help="also fuzz N config.json documents")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="planner-fuzz-") as tmp:
        home = Path(tmp)
        os.environ.update(PLANNER_HOME=str(home / "home"), HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(home / "empty-hub"))
        for name in ("RAY_ADDRESS", "PLANNER_DATABASE_URL"):  # test_fuzz_cli.FOREIGN_ENV
            os.environ.pop(name, None)
        t0 = time.perf_counter()
        counts, failures = fuzz_cli(args.examples, args.seed, home)
        elapsed = time.perf_counter() - t0
        total = sum(counts.values())
        print(f"{total} invocations in {elapsed:.0f} s ({1000 * elapsed / max(total, 1):.0f} ms each), seed {args.seed}")
        for code in sorted(counts, key=str):
            print(f"  exit {code}: {counts[code]}")
        if failures:
            print(f"{len(failures)} distinct problems:")
            for what, (argv, detail) in sorted(failures.items()):
                print(f"  {what}\n    argv: {argv!r}\n    {detail.strip()[:300]!r}")
        if args.configs:
            config_counts = fuzz_configs(args.configs, args.seed, home)
            print(f"{sum(config_counts.values())} config.json documents:")
            for what, n in sorted(config_counts.items()):
                print(f"  {what}: {n}")
            failures = failures or {k: ([], "") for k in config_counts if k.startswith("traceback")}
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
