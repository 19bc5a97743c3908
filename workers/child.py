"""Entry point of a measurement process: ``python -m workers.child``.

Reads one job as JSON on stdin, runs it with ``workers.train.run_in_process`` and writes
``{"measurement": ..., "details": ...}`` as JSON to the job's ``result_path``. The result goes to
a file rather than stdout because transformers, peft and DeepSpeed print on stdout; the parent
keeps stdout/stderr in a log whose tail explains a crash.

``fault`` (tests only) makes the process die the way a broken run would: ``sigkill``
(``kill -9`` of itself), ``abort`` (``os.abort()``: SIGABRT, as a failing C++ assertion) or
``hang`` (sleeps past any timeout).

The child never outlives its parent (``die_with_parent``): a parent killed with ``kill -9`` runs
no cleanup, and an orphaned training run would keep a core (or a GPU's memory) busy outside any
timeout. On Linux the kernel sends SIGTERM when the parent dies (``PR_SET_PDEATHSIG``,
prctl(2)); a thread polling ``os.getppid()`` covers other systems and a main thread stuck in C
code. Either way the child removes its job directory and SIGKILLs its own process group (itself
and what it started, e.g. DeepSpeed's compile jobs).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time

#: prctl(2) option: the signal the kernel sends this process when its parent thread dies
#: (linux/prctl.h: ``#define PR_SET_PDEATHSIG 1``)
PR_SET_PDEATHSIG = 1
#: seconds between two checks of the parent pid by the watchdog thread
WATCHDOG_INTERVAL_S = 0.25


def _orphaned(job_dir: str | None) -> None:
    """The parent is gone: remove the job directory and kill this process group, now."""
    from workers.runner import JOB_DIR_PREFIX

    # only a job directory run_job made: a stray environment variable must not remove anything else
    if job_dir and os.path.basename(job_dir.rstrip(os.sep)).startswith(JOB_DIR_PREFIX):
        shutil.rmtree(job_dir, ignore_errors=True)
    if os.getpgrp() == os.getpid():  # our own session (run_job starts it so): the whole group
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_pdeathsig(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):  # no prctl in this libc: the watchdog thread still runs
        pass


def die_with_parent(parent_pid: int, job_dir: str | None) -> None:
    """Make this process end (removing ``job_dir``) as soon as ``parent_pid`` is no longer its parent."""

    def on_sigterm(signum, frame):  # noqa: ARG001
        if os.getppid() != parent_pid:
            _orphaned(job_dir)
        # a SIGTERM from someone else while the parent lives: die of it, so the parent reports it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_INTERVAL_S)
        _orphaned(job_dir)

    # the handler first, so that the death signal never finds the default action (no cleanup)
    signal.signal(signal.SIGTERM, on_sigterm)
    _arm_pdeathsig(signal.SIGTERM)
    # the parent may have died before prctl was armed: then we were reparented already
    if os.getppid() != parent_pid:
        _orphaned(job_dir)
    threading.Thread(target=watchdog, name="die-with-parent", daemon=True).start()


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
    from workers.runner import JOB_DIR_ENV, PARENT_PID_ENV

    if os.environ.get(PARENT_PID_ENV, "").isdigit():  # started by run_job (not by hand)
        die_with_parent(int(os.environ[PARENT_PID_ENV]), os.environ.get(JOB_DIR_ENV))
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
