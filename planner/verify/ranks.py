"""One verification run of a candidate of N GPUs, by N ranks: N Ray actors in one placement group,
joined in one ``torch.distributed`` process group, each measuring its own peak in a fresh process.

How a run goes:

* **placed**: one placement group of N bundles, ``STRICT_PACK`` (every bundle on one node, as a
  torchrun of N processes on one machine): on GPUs each bundle is one GPU of the requested type
  and a CPU, on the CPU each is one CPU. One ``RankWorker`` actor per bundle
  (``PlacementGroupSchedulingStrategy(placement_group_bundle_index=k)``); the group is made all at
  once or waits, so no rank starts before all can.
* **joined**: each actor says where it is (``RankWorker.place``: the node's address, the GPU Ray
  gave it, and, rank 0, a free port); every rank's ``run`` is handed all N places as object refs,
  which Ray resolves before the call, so the driver never blocks on a group that is still
  pending. Rank k's measurement process gets torchrun's rendezvous (``RANK``=k, ``WORLD_SIZE``=N,
  ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` of rank 0) and the sharding scheme's
  ``worker_init`` joins it (``planner.sharding.spec.join_process_group``: gloo on the CPU, NCCL on
  GPUs). On GPUs, as Ray Train's workers do, every rank sees the group's GPUs
  (``CUDA_VISIBLE_DEVICES``: their union) and trains on its own, ``cuda:LOCAL_RANK``: NCCL and
  DeepSpeed index the devices by the local rank; that is the whole difference from the CPU path.
* **measured**: ``workers.measure_with_details`` in a fresh process per rank, as a one-rank run
  measures (the probe, the memory limit, the timeout); the run's result is the worst rank's peak
  (each peak the highest of the ranks') and the slowest rank's step; every rank's measurement is
  stored beside it (``PlanStore.record_measurement(ranks=...)``).
* **stopped**: the first rank that ends without fitting (an OOM, an error, a measurement process or
  an actor killed) fails the run: the others would wait on a collective forever, so every actor is
  killed (``ray.kill``: its measurement process dies with it, ``workers.child.die_with_parent``)
  and the placement group removed, and the run is stored with that rank named and its cause; the
  ranks it stopped say so (``planner.store.entities.STOPPED_PREFIX``). A run that ends well is
  released the same way.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from planner.results import Measurement, RunOutcome
from planner.store.entities import STOPPED_PREFIX
from planner.verify.accelerators import ray_accelerator
from planner.verify.runs import DRIVER_ONLY_ENV, RunSpec, crashed

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec


def rank_bundles(*, gpu: "GPUSpec", gpus: int) -> list[dict[str, float]]:
    """The placement group's bundles: per rank one CPU, and on GPUs one GPU of the requested type
    (0.001 of its ``accelerator_type:`` resource, as ``@ray.remote(accelerator_type=...)`` asks)."""
    accelerator = ray_accelerator(gpu)
    if accelerator is None:
        return [{"CPU": 1.0} for _ in range(gpus)]
    return [{"CPU": 1.0, "GPU": 1.0, accelerator.resource: 0.001} for _ in range(gpus)]


def rendezvous(places: list[dict[str, Any]], *, rank: int) -> tuple[dict[str, str], str, str | None]:
    """Rank ``rank``'s (rendezvous variables, device, ``CUDA_VISIBLE_DEVICES`` or None) from every
    rank's ``RankWorker.place``: rank 0's address and port; on GPUs the union of the group's GPUs,
    visible to every rank, and this rank's index in it as its local rank and device."""
    world = len(places)
    own = places[rank]["gpu_ids"]
    if own:
        union = sorted({g for p in places if p["node_id"] == places[rank]["node_id"] for g in p["gpu_ids"]},
                       key=lambda g: (len(g), g))
        local = union.index(own[0])
        visible, device = ",".join(union), f"cuda:{local}"
    else:
        local, visible, device = rank, None, "cpu"
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(world),
           "MASTER_ADDR": places[0]["address"], "MASTER_PORT": str(places[0]["port"])}
    return env, device, visible


class RankWorker:
    """A Ray actor: one rank of one run (its own worker process, killed when the run ends)."""

    def place(self, *, first: bool) -> dict[str, Any]:
        """Where this rank runs: node id and address, the GPUs Ray gave it, and (rank 0) a free
        port on its node for the group's rendezvous."""
        import ray

        from planner.sharding.spec import free_port

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "address": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in context.get_accelerator_ids().get("GPU", [])],
                "port": free_port() if first else None}

    def run(self, job: dict[str, Any], rank: int, board: Any, *places: dict[str, Any]) -> dict[str, Any]:
        """Measure this rank in a fresh process joined to the others; its measurement as JSON data."""
        import ray

        import workers
        from planner.config import TrainConfig
        from workers.runner import RUN_ENV_MARKER

        for name in DRIVER_ONLY_ENV:  # the job's database reference is the driver's alone
            os.environ.pop(name, None)
        env, device, visible = rendezvous(list(places), rank=rank)
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible  # inherited by the measurement process
        node_id = ray.get_runtime_context().get_node_id()
        if rank == 0:
            board.started.remote(job["key"], node_id, time.time())
        os.environ[RUN_ENV_MARKER] = job["key"]
        measurement, _details = workers.measure_with_details(
            model_config=job["model_config"], config=TrainConfig.from_dict(job["config"]), device=device,
            steps=job["steps"], timeout_s=job["timeout_s"], memory_limit_bytes=job["memory_limit_bytes"],
            rendezvous=env)
        return {"measurement": measurement.to_dict(), "node": f"{socket.gethostname()} (ray node {node_id[:8]})"}


@dataclass(eq=False)
class RankedRun:
    """One run's N ranks as the driver follows them: their actors, their results so far, the
    rank that failed the run."""

    run: RunSpec
    tokens_per_step: int
    """Tokens of one optimizer step over all ranks (``TrainConfig.global_batch`` x ``seq_len``)."""
    group: Any
    actors: list[Any]
    refs: list[Any]
    """Each rank's ``run`` result, in rank order."""
    results: dict[int, Measurement] = field(default_factory=dict)
    failed: int | None = None

    def take(self, ref: Any) -> bool:
        """One rank ended (``ref`` is ready): keep its measurement; True when the run is over (all
        ranks fit, or this one did not: then the others are stopped at once)."""
        import ray
        from ray.exceptions import RayError

        rank = self.refs.index(ref)
        try:
            out = ray.get(ref)
            measurement = replace(Measurement.from_dict(out["measurement"]), node=out["node"])
        except RayError as exc:
            measurement = crashed(exc, device=self.run.device)
        self.results[rank] = measurement
        if measurement.outcome is not RunOutcome.OK:
            self.failed = rank
            self.release()
            return True
        return len(self.results) == len(self.refs)

    def release(self) -> None:
        """Kill every rank's actor (and so its measurement process) and remove the group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)
            self.group = None

    def outcome(self) -> tuple[Measurement, tuple[Measurement, ...]]:
        """(the run's measurement, each rank's). Failed: the failed rank's, its error naming it; the
        ranks it stopped say so. Fit: the highest peaks of the ranks, the slowest step."""
        world = len(self.refs)
        if self.failed is not None:
            cause = self.results[self.failed]
            stopped = Measurement(outcome=RunOutcome.ERROR, device=self.run.device,
                                  error=f"{STOPPED_PREFIX}rank {self.failed} failed the run first")
            ranks = tuple(self.results.get(k, stopped) for k in range(world))
            return replace(cause, error=f"rank {self.failed} of {world}: {cause.error or cause.outcome}"), ranks
        ranks = tuple(self.results[k] for k in range(world))

        def highest(name: str) -> int | None:
            values = [getattr(r, name) for r in ranks if getattr(r, name) is not None]
            return max(values) if values else None

        worst = max(ranks, key=lambda r: r.peak_allocated_bytes or 0)
        step_s = highest("step_s")
        nodes = sorted({r.node for r in ranks})
        return replace(worst, peak_allocated_bytes=highest("peak_allocated_bytes"),
                       peak_reserved_bytes=highest("peak_reserved_bytes"),
                       process_total_bytes=highest("process_total_bytes"), step_s=step_s,
                       tokens_per_s=self.tokens_per_step / step_s if step_s else None,
                       node=nodes[0] if len(nodes) == 1 else ", ".join(nodes),
                       started_at=min(r.started_at for r in ranks), finished_at=max(r.finished_at for r in ranks)), ranks


def submit_ranks(run: RunSpec, *, gpu: "GPUSpec", gpus: int, board: Any) -> RankedRun:
    """Start one run of ``gpus`` ranks (``RankedRun``); the driver follows its ``refs``."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group(rank_bundles(gpu=gpu, gpus=gpus), strategy="STRICT_PACK")
    worker = ray.remote(RankWorker)
    gpu_share = 0 if ray_accelerator(gpu) is None else 1
    actors = [worker.options(num_cpus=1, num_gpus=gpu_share, max_restarts=0, max_task_retries=0,
                             scheduling_strategy=PlacementGroupSchedulingStrategy(
                                 placement_group=group, placement_group_bundle_index=k)).remote()
              for k in range(gpus)]
    places = [actor.place.remote(first=k == 0) for k, actor in enumerate(actors)]
    job = run.to_job()
    refs = [actor.run.remote(job, k, board, *places) for k, actor in enumerate(actors)]
    tokens = run.config.global_batch * run.config.seq_len
    return RankedRun(run=run, tokens_per_step=tokens, group=group, actors=actors, refs=refs)


__all__ = ["RankWorker", "RankedRun", "rank_bundles", "rendezvous", "submit_ranks"]
