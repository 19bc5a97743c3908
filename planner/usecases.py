"""The plan use case: plan a request, store it, and verify it, whoever asks.

Three surfaces ask the same thing and call these functions alike:

* ``planner suggest`` (``planner/cli/suggest_cmd.py``): ``plan_request``, then, with
  ``--verify``, ``verify_stored_plan`` on Ray here;
* ``planner submit`` and ``POST /v1/plans`` (``planner/service/routes.py``): ``plan_request``
  with a ``JobRequest``: the plan is stored, then its verification is sent to a cluster as a Ray
  job;
* that job's driver (``planner jobs verify PLAN_ID``): ``verify_stored_plan`` of the stored plan,
  by its id. Nothing is planned again on the cluster: the candidates verified are the ones stored.

The store is handed in as a function that opens it (``StoreOpener``): it is opened only once the
request has been planned, so a request that does not plan touches no database (and creates no
SQLite file), and a store that fails after the plan was made comes back in
``PlanOutcome.store_error`` for the caller to show the plan first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

from planner.errors import StoreError

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration
    from planner.gpus import GPUSpec
    from planner.modelspec import ModelSpec
    from planner.planning import Planned, SuggestRequest
    from planner.store import PlanStore, StoredPlan
    from planner.verify.driver import ProgressFn, VerificationReport, VerifyOptions
    from planner.verify.jobs import JobRequest, Submission

#: Opens the store the use case writes: ``lambda: open_plan_store(url=db)`` for a command, or
#: ``lambda: contextlib.nullcontext(shared_store)`` for the service's store, which stays open.
StoreOpener = Callable[[], ContextManager["PlanStore"]]


@dataclass(frozen=True, kw_only=True)
class PlanOutcome:
    """What ``plan_request`` did."""

    planned: "Planned"
    """The search's answer, and what the request was resolved against."""
    plan_id: str | None = None
    """The stored plan's id; None when it was not stored (not asked, answered from the store, or
    the store failed)."""
    existing: "StoredPlan | None" = None
    """The same request's stored plan found before this one was stored (the newest verified,
    else the newest)."""
    reused: "StoredPlan | None" = None
    """The verified plan of the same request this request was answered from (nothing stored)."""
    store_error: StoreError | None = None
    """The store could not be opened, read or written once the plan was made."""
    submission: "Submission | None" = None
    """The Ray job that verifies the stored plan, when a ``JobRequest`` was given."""


def plan_request(request: "SuggestRequest", *, store: StoreOpener | None, spec: "ModelSpec | None" = None,
                 calibration: "Calibration | None" = None, reuse: bool = True, save: bool = True,
                 job: "JobRequest | None" = None) -> PlanOutcome:
    """Plan ``request`` (``planner.planning.make_plan``: bad input and ``NothingFitsError`` raise
    here), then, with a ``store``: find the same request's stored plan and answer from it when it
    is verified and ``reuse``; else store the new plan when ``save``. With ``job``, the stored
    plan's verification is submitted as a Ray job: a database the job could only be told by its
    password is refused before anything is planned, an unreachable cluster before anything is
    stored."""
    from planner.errors import InvalidConfigError
    from planner.planning import make_plan

    named = str(request.gpu).strip()
    if named.lower() == "any" or "," in named:  # (it read "unknown GPU 'any'" over HTTP and from planner submit)
        raise InvalidConfigError(f"--gpu {named} compares GPU types (planner suggest --gpu {named}, POST /v1/compare); "
                                 "a plan is for one type: give one name from 'planner gpus'")
    reference = None
    if job is not None:
        from planner.verify.jobs import job_reference

        reference = job_reference(job)
    planned = make_plan(request, spec=spec, calibration=calibration)
    if store is None:
        return PlanOutcome(planned=planned)
    try:
        with store() as opened:
            try:
                existing = opened.find_same_request(request=planned.result.request)
                if reuse and existing is not None and existing.verified:
                    return PlanOutcome(planned=planned, reused=existing)
                if job is None:
                    plan_id = opened.save_plan(result=planned.result) if save else None
                    return PlanOutcome(planned=planned, plan_id=plan_id, existing=existing)
            except StoreError as exc:
                return PlanOutcome(planned=planned, store_error=exc)
            from planner.verify.jobs import submit_plan

            submission = submit_plan(job, reference=reference, store=opened, result=planned.result,
                                     model=request.model)
            return PlanOutcome(planned=planned, plan_id=submission.plan_id, existing=existing, submission=submission)
    except StoreError as exc:
        if job is not None:
            raise  # the submission's own refusals, as they were said
        return PlanOutcome(planned=planned, store_error=exc)


@dataclass(frozen=True, kw_only=True)
class Verified:
    """What ``verify_stored_plan`` did."""

    report: "VerificationReport"
    plan: "StoredPlan"
    """The plan as stored once its runs ended: status, why, and every measurement."""
    device: "GPUSpec"
    """The device the runs were held to (the stored request's GPU and memory)."""


def verify_stored_plan(*, store: "PlanStore", plan_id: str, options: "VerifyOptions", spec: "ModelSpec | None" = None,
                       model: str | None = None, on_progress: "ProgressFn | None" = None) -> Verified:
    """Verify the stored plan ``plan_id`` (its candidates, as stored) with real runs on Ray.

    The runs train the model ``spec`` (or ``model`` resolved, default: the stored model id), which
    must be the one planned (its config's fingerprint); they are held to the stored request's GPU
    and memory. Every run is stored as it ends and the plan ends ``verified`` or ``failed``."""
    from planner.catalog import fingerprint, resolve_model
    from planner.gpus import get_gpu
    from planner.verify.driver import verify_plan

    plan = store.get_plan(plan_id=plan_id)
    request = plan.request
    spec = spec if spec is not None else resolve_model(model or request.model_id)
    if fingerprint(spec) != request.model_fingerprint:
        raise StoreError(f"plan {plan.id[:8]} was made for another model config than {spec.id!r} (config "
                         f"{request.model_fingerprint[:12]}, not {fingerprint(spec)[:12]}): give the model it was "
                         f"planned for ({request.model_id})")
    device = get_gpu(request.gpu, memory_bytes=request.gpu_memory_bytes)
    report = verify_plan(store=store, plan_id=plan.id, gpu=device, model_config=spec.config, options=options,
                         on_progress=on_progress)
    return Verified(report=report, plan=store.get_plan(plan_id=plan.id), device=device)


__all__ = ["PlanOutcome", "StoreOpener", "Verified", "plan_request", "verify_stored_plan"]
