"""The verification driver: run the top candidates of a stored plan on Ray, fall back in rank
order when one does not fit, store every run, and move the plan planned -> verifying -> verified
(or failed, with why).

Up to ``top`` runs are submitted at once; Ray starts as many as the cluster has room for and
queues the rest. A run that ends ``oom`` or ``error`` makes room for the next candidate in rank
order, until ``top`` candidates have been verified fitting or the list is exhausted. The plan's
lease is renewed while runs are under way, so a driver that dies leaves a plan that readers mark
failed instead of one that stays ``verifying`` forever.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from planner.errors import InvalidConfigError, StatusTransitionError
from planner.results import Measurement, RunOutcome
from planner.store.entities import PlanStatus

if TYPE_CHECKING:  # pragma: no cover
    from planner.gpus import GPUSpec
    from planner.store import PlanStore, StoredCandidate, StoredPlan

#: seconds between looks at the runs (and chances to redraw the progress display)
POLL_S = 0.5
#: a verifying plan's lease: renewed every LEASE_S / 4 while the driver lives
LEASE_S = 120.0


class RunState(enum.StrEnum):
    """Where one candidate's verification run stands."""

    QUEUED = "queued"
    """Submitted; waiting for a node with room."""
    RUNNING = "running"
    FITS = "fits"
    """The run finished and the configuration fit."""
    OOM = "oom"
    ERROR = "error"
    SKIPPED = "skipped"
    """Not run: this verification cannot exercise it (said why)."""

    def is_terminal(self) -> bool:
        return self not in (RunState.QUEUED, RunState.RUNNING)


_STATE_OF_OUTCOME = {RunOutcome.OK: RunState.FITS, RunOutcome.OOM: RunState.OOM, RunOutcome.ERROR: RunState.ERROR}


@dataclass(frozen=True, kw_only=True)
class VerifyOptions:
    """How to verify a plan."""

    top: int = 3
    """Candidates to verify fitting (the next in rank order replaces one that does not fit)."""
    steps: int = 3
    """Optimizer steps per run (the last is measured)."""
    timeout_s: float = 900.0
    """Seconds before a run's process is killed (outcome ``error``)."""
    address: str | None = None
    """Ray cluster to join (``auto``, ``HOST:6379``, ``ray://HOST:10001``); None: ``RAY_ADDRESS``
    if set (a Ray job's driver), else Ray embedded on this machine."""
    num_cpus: int | None = None
    """CPUs of an embedded Ray (None: all of this machine's)."""

    def __post_init__(self) -> None:
        _check_whole("--verify-top", self.top, 1, 50)
        check_run_limits(steps=self.steps, timeout_s=self.timeout_s)


def _check_whole(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidConfigError(f"{name} must be a whole number from {low} to {high}, got {value!r}")


#: Optimizer steps of one verification run: a few are enough to measure the peak (the last is
#: measured, after the optimizer states exist), and a run per candidate holds a GPU
VERIFY_MAX_STEPS = 100
#: ``planner measure`` may run long (a step-time measurement, a kill test): only a typo is refused
MEASURE_MAX_STEPS = 1_000_000


def check_run_limits(*, steps: object, timeout_s: float, timeout_option: str = "--run-timeout",
                     max_steps: int = VERIFY_MAX_STEPS) -> None:
    """One run's optimizer steps (2 to ``max_steps``: the last is measured, after the optimizer
    states exist) and the seconds before it is killed (0-86400; NaN refused), named as the command
    calls them: suggest and submit ``--run-timeout``, measure ``--timeout``."""
    _check_whole("--steps", steps, 2, max_steps)
    if not 0 < timeout_s <= 86400:
        raise InvalidConfigError(f"{timeout_option} must be between 0 and 86400 seconds, got {timeout_s!r}")


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """One candidate's run as the display and the final report show it."""

    position: int
    """0-based position of the candidate in the stored plan (its rank - 1 for fitting plans)."""
    label: str
    state: RunState
    node: str = ""
    started_s: float | None = None
    """Seconds after the verification began that the run started."""
    elapsed_s: float | None = None
    """Seconds the run has taken (so far, while running)."""
    measurement: Measurement | None = None
    note: str = ""
    """Why it was skipped, or the first line of its error."""


@dataclass(frozen=True, kw_only=True)
class VerificationReport:
    """What a verification did: every run, the plan's final status and why, the answer."""

    plan_id: str
    status: PlanStatus
    reason: str
    runs: tuple[RunReport, ...]
    answer: int | None
    """Position of the fastest candidate that fit when run (by measured tokens/s)."""
    where: str
    elapsed_s: float


ProgressFn = Callable[[tuple[RunReport, ...], float], None]


class _Runs:
    """The mutable state of one verification: what runs, what is queued, what ended."""

    def __init__(self, *, plan: "StoredPlan", gpu: "GPUSpec", model_config: Mapping[str, Any],
                 options: VerifyOptions, store: "PlanStore") -> None:
        from planner.verify.runs import new_board

        self.plan, self.gpu, self.model_config, self.options, self.store = plan, gpu, dict(model_config), options, store
        self.gpus = plan.request.gpu_count
        self.device = "cpu" if gpu.is_cpu else "cuda"
        self.began = time.monotonic()
        self.board = new_board()
        self.pending = deque(c for c in plan.candidates if c.candidate.fits)
        self.reports: dict[int, RunReport] = {}
        #: each ref still awaited -> its candidate and its run (a run of N ranks has N refs)
        self.running: dict[Any, tuple["StoredCandidate", Any]] = {}
        self.fitted = 0

    def _limit(self) -> int:
        """Runs are held to the memory the plan was made for: ``--gpu-mem`` or the catalog's on the
        CPU (the probe's limit, so a CPU verification can OOM like a GPU one); on a GPU, a plan for
        a smaller device than the node's (a 16 GB V100 plan on a 32 GB node) is held to its size
        (``torch.cuda.set_per_process_memory_fraction``, capped at the whole device)."""
        return self.plan.request.gpu_memory_bytes

    def submit_more(self) -> None:
        from planner.verify.ranks import submit_ranks
        from planner.verify.runs import RunSpec, submit_run

        while self.pending and self.fitted + len(self.running) < self.options.top:
            stored = self.pending.popleft()
            label = stored.candidate.config.label()
            spec = RunSpec(key=f"{self.plan.id}:{stored.id}", model_config=self.model_config,
                           config=stored.candidate.config, device=self.device, steps=self.options.steps,
                           timeout_s=self.options.timeout_s, memory_limit_bytes=self._limit())
            # one rank: a task; N GPUs: N ranks, whatever the sharding (DDP, ZeRO, FSDP2)
            submit = submit_ranks if self.gpus > 1 else submit_run
            run = submit(spec, gpu=self.gpu, gpus=self.gpus, board=self.board)
            self.running.update((ref, (stored, run)) for ref in run.refs)
            self.reports[stored.position] = RunReport(position=stored.position, label=label, state=RunState.QUEUED)

    def look(self) -> None:
        """Mark the runs that started (from the board) and their elapsed time."""
        import ray

        started = ray.get(self.board.snapshot.remote())
        for stored, _run in {id(r): (s, r) for s, r in self.running.values()}.values():
            seen = started.get(f"{self.plan.id}:{stored.id}")
            if seen is None:
                continue
            node_id, when = seen
            began_s = when - (time.time() - (time.monotonic() - self.began))
            self.reports[stored.position] = replace(
                self.reports[stored.position], state=RunState.RUNNING, node=node_id[:8], started_s=max(0.0, began_s),
                elapsed_s=time.monotonic() - self.began - max(0.0, began_s))

    def finish(self, ref: Any) -> None:
        """One ref is ready: when its run is over (every rank ended, or one failed it), free what
        the run holds and store its measurement (with each rank's)."""
        if ref not in self.running:
            return  # a rank of a run that another rank's failure ended already
        stored, run = self.running.pop(ref)
        if not run.take(ref):
            return  # other ranks still run
        for other in run.refs:
            self.running.pop(other, None)
        run.release()
        measurement, ranks = run.outcome()
        self.store.record_measurement(candidate_id=stored.id, measurement=measurement, ranks=ranks)
        state = _STATE_OF_OUTCOME[measurement.outcome]
        self.fitted += state is RunState.FITS
        before = self.reports[stored.position]
        started = before.started_s if before.started_s is not None else 0.0
        self.reports[stored.position] = replace(
            before, state=state, measurement=measurement, elapsed_s=time.monotonic() - self.began - started,
            node=before.node or measurement.node, note=(measurement.error or "").strip().splitlines()[0][:200]
            if measurement.error else "")

    def snapshot(self) -> tuple[RunReport, ...]:
        return tuple(self.reports[p] for p in sorted(self.reports))

    def release_all(self) -> None:
        """Stop every run still under way (the driver was interrupted): no rank, actor or
        placement group outlives the verification."""
        for _stored, run in {id(r): (s, r) for s, r in self.running.values()}.values():
            run.release()
        self.running.clear()


def _drive(runs: _Runs, *, on_progress: ProgressFn | None) -> None:
    import ray

    renewed = time.monotonic()
    runs.submit_more()
    if on_progress is not None:
        # the runs as submitted, before the first look: on a quick cluster they start within
        # the first POLL_S, and the user would never see them queued
        on_progress(runs.snapshot(), time.monotonic() - runs.began)
    while runs.running:
        ready, _ = ray.wait(list(runs.running), num_returns=1, timeout=POLL_S)
        runs.look()
        for ref in ready:
            runs.finish(ref)
        runs.submit_more()
        if time.monotonic() - renewed > LEASE_S / 4:
            runs.store.renew_lease(plan_id=runs.plan.id, lease_s=LEASE_S)
            renewed = time.monotonic()
        if on_progress is not None:
            on_progress(runs.snapshot(), time.monotonic() - runs.began)


def _verdict(reports: tuple[RunReport, ...], *, top: int) -> tuple[PlanStatus, str, int | None]:
    fitting = [r for r in reports if r.state is RunState.FITS]
    if not fitting:
        tried = "; ".join(f"#{r.position + 1} {r.state}" + (f" ({r.note[:120]})" if r.note else "") for r in reports)
        return PlanStatus.FAILED, f"no candidate fit when run: {tried or 'nothing could be run'}", None
    best = max(fitting, key=lambda r: r.measurement.tokens_per_s or 0.0)
    others = [r for r in reports if r.state is not RunState.FITS]
    reason = (f"{len(fitting)} of the top {top} verified fitting"
              + (f" ({len(others)} other run{'s' if len(others) > 1 else ''} did not: "
                 + ", ".join(f"#{r.position + 1} {r.state}" for r in others) + ")" if others else "")
              + f"; fastest measured: #{best.position + 1} {best.label}")
    return PlanStatus.VERIFIED, reason, best.position


def verify_plan(*, store: "PlanStore", plan_id: str, gpu: "GPUSpec", model_config: Mapping[str, Any],
                options: VerifyOptions = VerifyOptions(), on_progress: ProgressFn | None = None) -> VerificationReport:
    """Verify the stored plan ``plan_id`` (its candidates that fit, in rank order) with real runs.

    Raises ``ClusterUnavailableError`` before anything changes when Ray cannot be reached or has no
    node for the request. Every run is stored as it ends; the plan ends ``verified`` or ``failed``
    (also when the driver is interrupted)."""
    from planner.verify.cluster import check_capacity, ray_session

    plan = store.get_plan(plan_id=plan_id)
    with ray_session(address=options.address, num_cpus=options.num_cpus) as where:
        check_capacity(gpu=gpu, gpus=plan.request.gpu_count, where=where)
        store.set_status(plan_id=plan.id, status=PlanStatus.VERIFYING, lease_s=LEASE_S,
                         reason=f"verifying the top {options.top} on {where}", ray_job_id=current_job_id())
        runs = _Runs(plan=plan, gpu=gpu, model_config=model_config, options=options, store=store)
        try:
            _drive(runs, on_progress=on_progress)
        except BaseException as exc:  # interrupted or broken: the plan must not stay verifying
            runs.release_all()
            try:
                store.set_status(plan_id=plan.id, status=PlanStatus.FAILED,
                                 reason=f"verification stopped unfinished: {type(exc).__name__} {exc}".strip())
            except StatusTransitionError:
                pass  # a reader found its lease run out and marked it failed already: it stays so
            raise
    reports = runs.snapshot()
    status, reason, answer = _verdict(reports, top=options.top)
    store.set_status(plan_id=plan.id, status=status, reason=reason)
    return VerificationReport(plan_id=plan.id, status=status, reason=reason, runs=reports, answer=answer, where=where,
                              elapsed_s=time.monotonic() - runs.began)


def current_job_id() -> str | None:
    """The Ray job submission id when this process is a Ray job's driver (``ray job submit`` or
    ``planner submit``): the job supervisor hands it over in ``RAY_JOB_CONFIG_JSON_ENV_VAR``'s
    metadata (ray/dashboard/modules/job/job_supervisor.py, ``JOB_ID_METADATA_KEY``)."""
    import json
    import os

    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return None
    try:
        return json.loads(raw).get("metadata", {}).get("job_submission_id") or None
    except (ValueError, AttributeError):
        return None


__all__ = ["LEASE_S", "RunReport", "RunState", "VerificationReport", "VerifyOptions", "check_run_limits",
           "current_job_id", "verify_plan"]
