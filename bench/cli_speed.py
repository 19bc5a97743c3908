"""Speed of ``planner suggest``: cold CLI wall time and in-process search throughput.

    python bench/cli_speed.py

Prints (a) the median wall time of 5 cold runs of
``planner suggest --model meta-llama/Llama-2-7b-hf --gpu a10g --target-batch 32 --no-save`` as a
subprocess (a fresh interpreter each time: imports, catalog read, search, printing), and (b) the
best of 5 in-process ``planner.search.suggest`` calls on the same request (configurations searched
and milliseconds). Targets: cold CLI <= 1.0 s; >= 5000 candidates in <= 100 ms. Whether each
target is met is printed; the exit code is 0 either way (speed is reported, never asserted).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "meta-llama/Llama-2-7b-hf"
GPU = "a10g"
TARGET_BATCH = 32
RUNS = 5
CLI_TARGET_S = 1.0
SEARCH_TARGET_CANDIDATES = 5000
SEARCH_TARGET_MS = 100.0


def cold_cli_seconds() -> list[float]:
    args = ["suggest", "--model", MODEL, "--gpu", GPU, "--target-batch", str(TARGET_BATCH), "--no-save"]
    code = "import sys; from planner.cli import main; sys.exit(main(sys.argv[1:]))"
    times = []
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PLANNER_HOME": home, "HF_HUB_OFFLINE": "1"}
        env.pop("PLANNER_DATABASE_URL", None)
        for _ in range(RUNS):
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
            times.append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise SystemExit(f"planner suggest failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return times


def search_ms() -> tuple[int, list[float]]:
    """Milliseconds of RUNS calls. The first call fills planner.memory's per-model memo cache
    (static and per-micro-batch terms); the later ones reuse it, so both are reported."""
    from planner.catalog import resolve_model
    from planner.cli.plan import default_seq_len
    from planner.gpus import get_gpu, physical_ram_bytes
    from planner.search import SearchSpace, suggest

    model = resolve_model(MODEL)
    gpu = get_gpu(GPU)
    space = SearchSpace(cpu_mem_bytes=physical_ram_bytes())  # what the CLI uses by default
    times, searched = [], 0
    for _ in range(RUNS):
        start = time.perf_counter()
        result = suggest(model=model, gpu=gpu, target_batch=TARGET_BATCH, seq_len=default_seq_len(model), space=space)
        times.append((time.perf_counter() - start) * 1000)
        searched = result.searched
    return searched, times


def main() -> int:
    times = cold_cli_seconds()
    median = statistics.median(times)
    print(f"(a) cold CLI: planner suggest --model {MODEL} --gpu {GPU} --target-batch {TARGET_BATCH} --no-save")
    print(f"    median of {RUNS}: {median:.3f} s (runs: {', '.join(f'{t:.3f}' for t in times)})")
    print(f"    target <= {CLI_TARGET_S:.1f} s: {'MET' if median <= CLI_TARGET_S else 'NOT MET'}")

    searched, times_ms = search_ms()
    ms = min(times_ms)
    rate = searched / (ms / 1000)
    print(f"(b) in-process planner.search.suggest, same request: {searched:,} candidates, best of {RUNS}: {ms:.1f} ms "
          f"({rate:,.0f} candidates/s)")
    print(f"    first call (memo cache empty): {times_ms[0]:.1f} ms; all: {', '.join(f'{t:.1f}' for t in times_ms)}")
    met = searched >= SEARCH_TARGET_CANDIDATES and ms <= SEARCH_TARGET_MS
    print(f"    target >= {SEARCH_TARGET_CANDIDATES} candidates in <= {SEARCH_TARGET_MS:.0f} ms: {'MET' if met else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
