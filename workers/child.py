"""Entry point of a measurement process: ``python -m workers.child``.

Reads one job as JSON on stdin, runs it with ``workers.train.run_in_process`` and writes
``{"measurement": ..., "details": ...}`` as JSON to the job's ``result_path``. The result goes to
a file rather than stdout because transformers, peft and DeepSpeed print on stdout; the parent
keeps stdout/stderr in a log whose tail explains a crash.

``fault`` (tests only) makes the process die the way a broken run would: ``sigkill``
(``kill -9`` of itself), ``abort`` (``os.abort()``: SIGABRT, as a failing C++ assertion) or
``hang`` (sleeps past any timeout).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _fault(kind: str) -> None:
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "abort":
        os.abort()
    elif kind == "hang":
        time.sleep(3600)
    else:
        raise SystemExit(f"unknown fault {kind!r}")


def main() -> int:
    job = json.loads(sys.stdin.read())
    if job.get("fault"):
        _fault(job["fault"])
    from planner.config import TrainConfig
    from workers.train import run_in_process

    measurement, details = run_in_process(
        model_config=job["model_config"],
        config=TrainConfig.from_dict(job["config"]),
        device=job["device"],
        steps=job["steps"],
        memory_limit_bytes=job.get("memory_limit_bytes"),
        checkpoint_dir=job.get("checkpoint_dir"),
        seed=job.get("seed", 0),
    )
    tmp = job["result_path"] + ".part"
    with open(tmp, "w") as f:
        json.dump({"measurement": measurement.to_dict(), "details": details}, f, default=str)
    os.replace(tmp, job["result_path"])  # the parent never reads a half-written result
    return 0


if __name__ == "__main__":
    sys.exit(main())
