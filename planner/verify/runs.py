"""One verification run as a Ray task: the measurement worker (``workers.measure``) in a fresh
process on a node of the requested type, with a board the driver reads to show what started.

``max_retries=0``: a crashed run is a result, never silently retried. ``max_calls=1``: the Ray
worker process exits after its run, on top of the measurement's own process, so nothing a run
allocated (device memory, pinned host buffers) outlives it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from planner.store.engine import DATABASE_URL_ENV, DATABASE_URL_FILE_ENV
from planner.verify.accelerators import ray_accelerator, run_resources
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


def submit_run(run: RunSpec, *, gpu: "GPUSpec", gpus: int, board: Any) -> tuple[Any, Any]:
    """Start one run; returns (object ref, placement group or None). Several GPUs are taken on
    one node through a placement group, which the caller removes when the run ends."""
    import ray

    task = ray.remote(max_calls=1)(run_on_worker)  # max_calls is refused by .options()
    options: dict[str, Any] = {"max_retries": 0, "retry_exceptions": False}
    group = None
    accelerator = ray_accelerator(gpu)
    if accelerator is not None and gpus > 1:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # one bundle holds all N GPUs: a bundle never spans nodes (STRICT_PACK says so anyway)
        group = placement_group([{"CPU": 1, "GPU": gpus, accelerator.resource: 0.001}], strategy="STRICT_PACK")
        options.update(num_cpus=1, num_gpus=gpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0))
    else:
        options.update(run_resources(gpu=gpu, gpus=gpus))
    return task.options(**options).remote(run.to_job(), board), group


__all__ = ["DRIVER_ONLY_ENV", "RUN_ENV_MARKER", "Board", "RunSpec", "new_board", "run_on_worker", "submit_run"]
