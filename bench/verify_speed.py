"""Speed of verification: ``planner suggest --verify --verify-top 2`` on ``--gpu cpu``, with one
rank per candidate and with two.

    python bench/verify_speed.py [--runs N] [--gpus 1,2]

Runs the whole command as a subprocess, as a user would (a fresh interpreter; Ray started
embedded and shut down; two short real training runs of a tiny llama given as a config.json;
everything stored in SQLite in a temporary ``PLANNER_HOME``), N times (default 1) per GPU count,
each against a new database so that nothing is answered from the store. With ``--gpus 1`` the
two runs are one process each, in parallel on the 2 CPUs; with ``--gpus 2`` each run is two ranks
in one placement group of 2 CPUs joined over gloo (``planner.verify.ranks``), so the runs go one
after the other. Prints the wall seconds of each run, the median, and the median per verified
candidate against the target of <= 30 s per verified candidate (one rank) on the 2-core machine,
then the GPU counts side by side. The exit code is 0 whether or not the target is met (speed is
reported, never asserted); a run that fails prints its error and exits 1.
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


def one_run(*, gpus: int) -> tuple[float, dict]:
    with tempfile.TemporaryDirectory(prefix="verify-speed-") as home:
        config = os.path.join(home, "config.json")
        with open(config, "w") as f:
            json.dump(TINY, f)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PLANNER_DATABASE_URL")}
        env.update(PLANNER_HOME=home, HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "planner", "suggest", "--model", config, "--gpu", "cpu", "--target-batch", "4",
               "--seq-len", "64", "--gpus", str(gpus), "--verify", "--verify-top", str(VERIFY_TOP), "--json"]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(1)
    return wall, json.loads(done.stdout)["verification"]


def measure(*, gpus: int, runs: int) -> tuple[float, float]:
    """(median wall s, median wall s per verified candidate) of ``runs`` runs on ``gpus`` ranks."""
    walls, per_candidate = [], []
    for i in range(runs):
        wall, verification = one_run(gpus=gpus)
        fitted = sum(run["outcome"] == "ok" for run in verification["runs"])
        ranks = [len(run.get("ranks") or ()) or 1 for run in verification["runs"]]
        walls.append(wall)
        per_candidate.append(wall / max(fitted, 1))
        print(f"--gpus {gpus} run {i + 1}: {wall:.1f} s wall for {fitted} verified candidates of {ranks} ranks "
              f"(Ray start included; driver's own verification time {verification['elapsed_s']:.1f} s)")
    return statistics.median(walls), statistics.median(per_candidate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--gpus", default="1,2", help="GPU counts (ranks per candidate) to time, comma-separated")
    args = parser.parse_args()
    medians = {gpus: measure(gpus=gpus, runs=args.runs) for gpus in (int(g) for g in args.gpus.split(","))}
    for gpus, (wall, per) in medians.items():
        target = (f" (target <= {TARGET_S_PER_CANDIDATE:.0f} s: {'met' if per <= TARGET_S_PER_CANDIDATE else 'NOT met'})"
                  if gpus == 1 else "")
        print(f"--gpus {gpus}: median wall {wall:.1f} s over {args.runs} run(s); per verified candidate: {per:.1f} s"
              + target)
    if 1 in medians and len(medians) > 1:
        print("side by side (median wall s): " + ", ".join(f"{g} rank{'s' if g > 1 else ''} {w:.1f}"
                                                         for g, (w, _) in medians.items()))


if __name__ == "__main__":
    main()
