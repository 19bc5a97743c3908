"""One verification run as a Ray task: the measurement worker (``workers.measure``) in a fresh
process on a node of the requested type, with a board the driver reads to show what started.

``max_retries=0``: a crashed run is a result, never silently retried. ``max_calls=1``: the Ray
worker process exits after its run, on top of the measurement's own process, so nothing a run
allocated (device memory, pinned host buffers) outlives it. A candidate of several GPUs runs as
one rank per GPU instead (``planner.verify.ranks``); the driver follows either kind of run alike
(``OneRun``, ``RankedRun``: their refs, ``take`` a ready one, ``release``, ``outcome``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from planner.results import Measurement, RunOutcome
from planner.store.engine import DATABASE_URL_ENV, DATABASE_URL_FILE_ENV
from planner.verify.accelerators import run_resources
from workers.runner import RUN_ENV_MARKER

if TYPE_CHECKING:  # pragma: no cover
    from planner.config import TrainConfig
    from planner.gpus import GPUSpec

#: What a run's worker process drops from the environment the job gave it: the database
#: reference (``planner.verify.jobs.job_database``) is for the job's driver, which alone writes
#: the store; a run hands its measurement back as its task's result
DRIVER_ONLY_ENV = (DATABASE_URL_ENV, DATABASE_URL_FILE_ENV)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What one verification run trains and how long it may take."""

    key: str
    """``<plan id>:<candidate id>``."""
    model_config: dict[str, Any]
    """The model's config.json (random weights are built from it on the worker)."""
    config: "TrainConfig"
    device: str
    """``cpu`` or ``cuda``: what the measurement process trains on."""
    steps: int = 3
    """Optimizer steps; the last is measured."""
    timeout_s: float = 900.0
    """The measurement process is killed after this long (outcome ``error``)."""
    memory_limit_bytes: int | None = None
    """Hold the run to this many bytes (``--gpu-mem`` on the CPU, a smaller GPU's memory on a larger one)."""

    def to_job(self) -> dict[str, Any]:
        return {"key": self.key, "model_config": self.model_config, "config": self.config.to_dict(), "device": self.device,
                "steps": self.steps, "timeout_s": self.timeout_s, "memory_limit_bytes": self.memory_limit_bytes}


def run_on_worker(job: dict[str, Any], board: Any) -> dict[str, Any]:
    """The task body, on a Ray worker: say it started, measure in a fresh process, return the
    measurement as JSON data with the node it ran on."""
    import socket

    import ray

    import workers
    from planner.config import TrainConfig

    for name in DRIVER_ONLY_ENV:  # the job's database reference is the driver's alone
        os.environ.pop(name, None)
    node_id = ray.get_runtime_context().get_node_id()
    board.started.remote(job["key"], node_id, time.time())
    os.environ[RUN_ENV_MARKER] = job["key"]  # inherited by the measurement process
    measurement = workers.measure(
        model_config=job["model_config"], config=TrainConfig.from_dict(job["config"]), device=job["device"],
        steps=job["steps"], timeout_s=job["timeout_s"], memory_limit_bytes=job["memory_limit_bytes"],
    )
    return {"measurement": measurement.to_dict(), "node_id": node_id, "hostname": socket.gethostname()}


class Board:
    """A Ray actor (no CPU) the runs report their start to; the driver polls it for the display."""

    def __init__(self) -> None:
        self._started: dict[str, tuple[str, float]] = {}

    def started(self, key: str, node_id: str, when: float) -> None:
        self._started[key] = (node_id, when)

    def snapshot(self) -> dict[str, tuple[str, float]]:
        return dict(self._started)


def new_board() -> Any:
    import ray

    return ray.remote(num_cpus=0)(Board).remote()


def crashed(exc: BaseException, *, device: str) -> Measurement:
    """The measurement of a run (or a rank) whose Ray worker died or raised: outcome ``error``,
    with why."""
    from ray.exceptions import RayTaskError

    from workers.runner import _now

    if isinstance(exc, RayTaskError):
        what = f"the run raised {str(exc).strip().splitlines()[-1]}"
    else:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
        what = f"the Ray worker process running it died ({type(exc).__name__}: {first})"
    return Measurement(outcome=RunOutcome.ERROR, device=device, started_at=_now(), finished_at=_now(), error=what)


@dataclass(eq=False)
class OneRun:
    """A run of one rank as the driver follows it (``planner.verify.ranks.RankedRun`` is the one
    of several ranks, with the same methods)."""

    run: RunSpec
    refs: list[Any]
    """The task's result: one ref."""
    measurement: Measurement | None = None

    def take(self, ref: Any) -> bool:
        """The task ended: keep its measurement (an ``error`` one if its worker died); True."""
        import ray
        from ray.exceptions import RayError

        try:
            out = ray.get(ref)
            self.measurement = replace(Measurement.from_dict(out["measurement"]),
                                       node=f"{out['hostname']} (ray node {out['node_id'][:8]})")
        except RayError as exc:
            self.measurement = crashed(exc, device=self.run.device)
        return True

    def release(self) -> None:
        """Nothing holds on: the task's worker exits after it (``max_calls=1``)."""

    def outcome(self) -> tuple[Measurement, tuple[Measurement, ...]]:
        assert self.measurement is not None, "outcome() of a run that has not ended"
        return self.measurement, ()


def submit_run(run: RunSpec, *, gpu: "GPUSpec", gpus: int, board: Any) -> OneRun:
    """Start a run of one rank, on one GPU (or the CPU), as a task (``OneRun``); a run of several
    GPUs is ``planner.verify.ranks.submit_ranks``'s."""
    import ray

    assert gpus == 1, "a run of several GPUs is one rank per GPU (planner.verify.ranks)"
    task = ray.remote(max_calls=1)(run_on_worker)  # max_calls is refused by .options()
    options: dict[str, Any] = {"max_retries": 0, "retry_exceptions": False, **run_resources(gpu=gpu, gpus=gpus)}
    return OneRun(run=run, refs=[task.options(**options).remote(run.to_job(), board)])


__all__ = ["DRIVER_ONLY_ENV", "RUN_ENV_MARKER", "Board", "OneRun", "RunSpec", "crashed", "new_board", "run_on_worker", "submit_run"]
