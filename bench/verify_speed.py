"""Speed of verification: ``planner suggest --verify --verify-top 2`` on ``--gpu cpu``.

    python bench/verify_speed.py [--runs N]

Runs the whole command as a subprocess, as a user would (a fresh interpreter; Ray started
embedded and shut down; two short real training runs of a tiny llama given as a config.json, in
parallel on Ray workers; everything stored in SQLite in a temporary ``PLANNER_HOME``), N times
(default 1), each against a new database so that nothing is answered from the store. Prints the
wall seconds of each run, the median, and the median per verified candidate against the target
of <= 30 s per verified candidate on the 2-core machine. The exit code is 0 whether or not the
target is met (speed is reported, never asserted); a run that fails prints its error and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TINY = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2000, "max_position_embeddings": 256,
}
VERIFY_TOP = 2
TARGET_S_PER_CANDIDATE = 30.0


def one_run() -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="verify-speed-") as home:
        config = os.path.join(home, "config.json")
        with open(config, "w") as f:
            json.dump(TINY, f)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PLANNER_DATABASE_URL")}
        env.update(PLANNER_HOME=home, HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "planner", "suggest", "--model", config, "--gpu", "cpu", "--target-batch", "4",
               "--seq-len", "64", "--verify", "--verify-top", str(VERIFY_TOP), "--json"]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(1)
    return wall, json.loads(done.stdout)["verification"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    runs = parser.parse_args().runs
    walls, per_candidate = [], []
    for i in range(runs):
        wall, verification = one_run()
        fitted = sum(run["outcome"] == "ok" for run in verification["runs"])
        walls.append(wall)
        per_candidate.append(wall / max(fitted, 1))
        print(f"run {i + 1}: {wall:.1f} s wall for {fitted} verified candidates (Ray start included; "
              f"driver's own verification time {verification['elapsed_s']:.1f} s)")
    median = statistics.median(per_candidate)
    print(f"median wall: {statistics.median(walls):.1f} s over {runs} run(s); per verified candidate: {median:.1f} s "
          f"(target <= {TARGET_S_PER_CANDIDATE:.0f} s: {'met' if median <= TARGET_S_PER_CANDIDATE else 'NOT met'})")


if __name__ == "__main__":
    main()
