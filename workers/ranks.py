"""``measure_ranks``: one measurement of a sharded plan by all of its ranks, each a fresh process
(``python -m workers.child``) joined to the others in one ``torch.distributed`` group (gloo on the
CPU, NCCL on GPUs): what torchrun would start, on one machine.

Each rank gets the rendezvous in its environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` on a free local port), which the sharding scheme's
``worker_init`` joins (``planner.sharding.spec.join_process_group``), and measures its own peak as
``workers.train`` does. A rank that fails or outlives the timeout fails the run: every rank's
process group is killed, so none is left waiting on a collective, and each rank's outcome is
returned with the cause.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

from planner.config import TrainConfig
from planner.results import Measurement, RunOutcome
from planner.sharding.spec import free_port
from workers.runner import (
    _LOG_TAIL_CHARS,
    JOB_DIR_ENV,
    JOB_DIR_PREFIX,
    PARENT_PID_ENV,
    _kill_group,
    _now,
    _signal_name,
    child_env,
)

#: seconds between two looks at the ranks' processes
_POLL_S = 0.2


def measure_ranks(
    *,
    model_config: Mapping[str, Any],
    config: TrainConfig,
    device: str = "cpu",
    steps: int = 3,
    timeout_s: float = 900,
    seed: int = 0,
) -> list[tuple[Measurement, dict[str, Any]]]:
    """Train ``config`` on ``config.gpus`` ranks at once and return each rank's measurement and
    details, in rank order (on GPUs rank k trains on ``cuda:k``)."""
    from workers.train import _check_args, library_versions

    _check_args(model_config=model_config, device=device, steps=steps, memory_limit_bytes=None)
    world = config.gpus
    started = _now()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix=f"{JOB_DIR_PREFIX}{os.getpid()}-") as tmp:
        procs, logs = [], []
        try:
            for rank in range(world):
                env = child_env(os.environ)
                env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), **{PARENT_PID_ENV: str(os.getpid()), JOB_DIR_ENV: tmp})
                if device == "cpu":
                    env.setdefault("DS_ACCELERATOR", "cpu")
                job = {"model_config": dict(model_config), "config": config.to_dict(),
                       "device": device if device == "cpu" else f"cuda:{rank}", "steps": steps,
                       "memory_limit_bytes": None, "checkpoint_dir": None, "seed": seed,
                       "result_path": os.path.join(tmp, f"result-{rank}.json")}
                log = open(os.path.join(tmp, f"rank-{rank}.log"), "wb")
                logs.append(log)
                proc = subprocess.Popen([sys.executable, "-m", "workers.child"], stdin=subprocess.PIPE, stdout=log,
                                        stderr=subprocess.STDOUT, env=env, start_new_session=True)
                proc.stdin.write(json.dumps(job).encode())
                proc.stdin.close()
                procs.append(proc)
            timed_out = _wait_all(procs, timeout_s)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    _kill_group(proc)
            for log in logs:
                log.close()
        out = []
        for rank, proc in enumerate(procs):
            path = os.path.join(tmp, f"result-{rank}.json")
            if proc.returncode == 0 and os.path.exists(path):
                with open(path) as f:
                    result = json.load(f)
                out.append((Measurement.from_dict(result["measurement"]), result["details"] | {"rank": rank}))
                continue
            with open(os.path.join(tmp, f"rank-{rank}.log"), "rb") as f:
                tail = f.read().decode("utf-8", "replace")[-_LOG_TAIL_CHARS:].strip()
            if timed_out:
                error = f"rank {rank}: timed out after {timeout_s:g} s, every rank was killed"
            elif proc.returncode < 0:
                error = f"rank {rank}: killed by {_signal_name(proc.returncode)}"
            else:
                error = f"rank {rank}: exited with code {proc.returncode}"
            failed = Measurement(outcome=RunOutcome.ERROR, device=device,
                                 library_versions=library_versions(deepspeed=config.sharding.spec.library == "deepspeed"),
                                 node=socket.gethostname(), started_at=started, finished_at=_now(),
                                 error=error + (f"; last output: {tail}" if tail else ""))
            out.append((failed, {"rank": rank, "returncode": proc.returncode, "timed_out": timed_out}))
        return out


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> bool:
    """Wait for every rank; the first that fails (its peers would wait on it forever) or the
    deadline kills them all. Returns whether the deadline passed."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            break
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
            return True
        time.sleep(_POLL_S)
    for p in procs:
        if p.poll() is None:
            _kill_group(p)
    return False


__all__ = ["measure_ranks"]
