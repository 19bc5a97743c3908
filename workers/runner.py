"""``measure``: one measurement in a fresh process, so that a leak, an OOM or a crash of one run
cannot contaminate the next one or the caller.

The child is ``python -m workers.child`` in its own session (process group), so a timeout kills
it and anything it started (DeepSpeed's compile jobs) with SIGKILL. A child that dies from a
signal (segfault, kill -9, abort) is outcome ``error`` naming the signal; nothing is retried.

The child dies with its parent: a parent killed with ``kill -9`` runs no cleanup, so the child
watches for it itself (``workers.child``: ``PR_SET_PDEATHSIG`` on Linux plus a thread polling
its parent pid) and then removes the job directory and kills its process group. The job
directory is named after the parent pid (``workers-job-<pid>-*``) so that one the child could not
remove either (both killed at once) is swept by the next run once its owner pid is gone.

Memory limit: ``memory_limit_bytes`` is enforced on the bytes the probe tracks (CPU: live tensor
storage bytes; CUDA: ``torch.cuda.set_per_process_memory_fraction``), not with
``RLIMIT_AS``: the address space of a torch process is dominated by libraries and allocator
reservations that vary from run to run, while the tracked bytes are deterministic and are what
the memory model predicts. Going over the limit is outcome ``oom`` with the error text.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from typing import Any, Iterator, Mapping

from planner.config import TrainConfig
from planner.results import Measurement, RunOutcome

#: characters of the child's log kept in the error text of a failed run
_LOG_TAIL_CHARS = 2000


def measure(
    *,
    model_config: Mapping[str, Any],
    config: TrainConfig,
    device: str = "cpu",
    steps: int = 3,
    timeout_s: float = 900,
    memory_limit_bytes: int | None = None,
    checkpoint_dir: str | None = None,
    seed: int = 0,
) -> Measurement:
    """Train ``config`` for ``steps`` optimizer steps in a fresh process and measure its peak."""
    return measure_with_details(
        model_config=model_config, config=config, device=device, steps=steps, timeout_s=timeout_s,
        memory_limit_bytes=memory_limit_bytes, checkpoint_dir=checkpoint_dir, seed=seed,
    )[0]


def measure_with_details(
    *,
    model_config: Mapping[str, Any],
    config: TrainConfig,
    device: str = "cpu",
    steps: int = 3,
    timeout_s: float = 900,
    memory_limit_bytes: int | None = None,
    checkpoint_dir: str | None = None,
    seed: int = 0,
    rendezvous: Mapping[str, str] | None = None,
) -> tuple[Measurement, dict[str, Any]]:
    """``measure`` plus the run's details (peak breakdown by category, phase, parameter counts).
    ``rendezvous``: this process is one rank of several (``DISTRIBUTED_ENV``'s variables, as a
    launcher sets them: ``planner.verify.ranks`` gives each rank's); else a rank of its own."""
    from workers.train import _check_args

    _check_args(model_config=model_config, device=device, steps=steps, memory_limit_bytes=memory_limit_bytes)
    if not timeout_s > 0:  # NaN too: it reached proc.communicate(timeout=nan) after the child started
        from planner.errors import InvalidConfigError

        raise InvalidConfigError(f"timeout must be > 0 seconds, got {timeout_s}")
    job = {
        "model_config": dict(model_config),
        "config": config.to_dict(),
        "device": device,
        "steps": steps,
        "memory_limit_bytes": memory_limit_bytes,
        "checkpoint_dir": checkpoint_dir,
        "seed": seed,
    }
    return run_job(job, timeout_s=timeout_s, device=device, deepspeed=config.sharding.spec.library == "deepspeed",
                   rendezvous=rendezvous)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


#: Set in a verification run's environment (``planner.verify.runs``) to "<plan id>:<candidate id>"
#: and kept in its measurement process's, so that an operator, or a test, can find the process of
#: one run.
RUN_ENV_MARKER = "PLANNER_VERIFY_RUN"


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The measurement process's environment: this one without the planner's settings (the
    database URL or its file, the API's tokens: a training run needs none, and it runs library
    code that a credential has no business near), except the run's marker
    (``RUN_ENV_MARKER``, by which an operator finds a run's process)."""
    return {k: v for k, v in environ.items() if not k.startswith("PLANNER_") or k == RUN_ENV_MARKER}


#: torch.distributed's rendezvous variables (torchrun / the deepspeed launcher set them)
DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def distributed_env(rendezvous: Mapping[str, str]) -> dict[str, str]:
    """``rendezvous`` checked: exactly ``DISTRIBUTED_ENV``'s variables, as strings."""
    assert set(rendezvous) == set(DISTRIBUTED_ENV), f"a rank's rendezvous names {sorted(rendezvous)}"
    return {name: str(rendezvous[name]) for name in DISTRIBUTED_ENV}


@contextlib.contextmanager
def distributed_env_kept() -> Iterator[None]:
    """Put ``DISTRIBUTED_ENV``'s variables back as they were after the block: an in-process run
    joins a process group of one rank (``planner.sharding.spec.join_process_group``), which
    setdefaults ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
    ``os.environ``; left there, a later measurement would read a port long gone."""
    saved = {name: os.environ.get(name) for name in DISTRIBUTED_ENV}
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_in_process(**kwargs: Any) -> tuple[Measurement, dict[str, Any]]:
    """``workers.train.run_in_process`` (the same keywords) with the distributed environment as it
    was before (``distributed_env_kept``)."""
    from workers.train import run_in_process as train_here

    with distributed_env_kept():
        return train_here(**kwargs)


def run_job(job: dict[str, Any], *, timeout_s: float, device: str = "cpu", deepspeed: bool = False,
            rendezvous: Mapping[str, str] | None = None) -> tuple[Measurement, dict[str, Any]]:
    """Run one child-process job (see ``workers.child``); never raises for what the child does.
    ``rendezvous``: the child is that rank of a process group (``distributed_env``)."""
    from workers.train import library_versions

    started = _now()
    env = child_env(os.environ)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    # Without a rendezvous the child is one rank of its own: a launcher's (or an in-process
    # run's) would make it join another process group or bind a port that is already taken.
    for name in DISTRIBUTED_ENV:
        env.pop(name, None)
    if rendezvous is not None:
        env.update(distributed_env(rendezvous))
    if device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    sweep_orphaned_job_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{JOB_DIR_PREFIX}{os.getpid()}-") as tmp:
        # the child checks its parent is this pid (closing the race of a parent that dies before
        # the child arms PR_SET_PDEATHSIG) and removes this directory when the parent is gone
        env.update({PARENT_PID_ENV: str(os.getpid()), JOB_DIR_ENV: tmp})
        job = dict(job, result_path=os.path.join(tmp, "result.json"))
        log_path = os.path.join(tmp, "child.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "workers.child"],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )
            timed_out = False
            try:
                proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        if not timed_out and proc.returncode == 0 and os.path.exists(job["result_path"]):
            with open(job["result_path"]) as f:
                result = json.load(f)
            return Measurement.from_dict(result["measurement"]), result["details"]
        with open(log_path, "rb") as f:
            tail = f.read().decode("utf-8", "replace")[-_LOG_TAIL_CHARS:].strip()
    if timed_out:
        error = f"timed out after {timeout_s:g} s: the measurement process was killed"
    elif proc.returncode < 0:
        error = f"measurement process killed by {_signal_name(proc.returncode)}"
    else:
        error = f"measurement process exited with code {proc.returncode}"
    if tail:
        error += f"; last output: {tail}"
    failed = Measurement(
        outcome=RunOutcome.ERROR, device=device, library_versions=library_versions(deepspeed=deepspeed),
        node=socket.gethostname(), started_at=started, finished_at=_now(), error=error,
    )
    return failed, {"returncode": proc.returncode, "timed_out": timed_out}


#: job directories are ``<tmp>/workers-job-<parent pid>-<random>``
JOB_DIR_PREFIX = "workers-job-"
#: environment of the child: the pid it must outlive no longer than, and its job directory
PARENT_PID_ENV = "WORKERS_PARENT_PID"
JOB_DIR_ENV = "WORKERS_JOB_DIR"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def sweep_orphaned_job_dirs(root: str | None = None) -> list[str]:
    """Remove the job directories whose owner pid is dead; returns the ones removed.

    Normally the child removes its directory when its parent dies; this covers a child that was
    killed together with its parent (``kill -9`` of the whole group, an OOM killer)."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(JOB_DIR_PREFIX):
            continue
        owner, sep, _ = name[len(JOB_DIR_PREFIX):].partition("-")
        if not sep or not owner.isdigit() or _pid_alive(int(owner)):
            continue  # a live owner's run, or a directory of the old naming we cannot attribute
        path = os.path.join(root, name)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


__all__ = ["DISTRIBUTED_ENV", "RUN_ENV_MARKER", "child_env", "distributed_env", "distributed_env_kept", "measure",
           "measure_with_details", "run_in_process", "run_job", "sweep_orphaned_job_dirs"]
