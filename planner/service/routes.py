"""The API's routes: parse, call the library (``planner.service.calls``, the store), answer JSON.

Routes are plain ``def``s: FastAPI runs them in its threadpool, so a search (CPU-bound, tens of
milliseconds) never blocks the event loop, and the store is shared between those threads.
Imported only by ``planner.service.app`` (it imports FastAPI).
"""

from __future__ import annotations

from typing import Any, Optional

from fastapi import APIRouter, Path, Query, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer

from planner.service import calls
from planner.service.budget import BudgetedRoute
from planner.service.check_body import CheckBody
from planner.service.errors import ServiceError
from planner.service.schemas import CompareBody, ErrorBody, EstimateBody, PlanBody
from planner.service.state import StoreHolder
from planner.store import PlanStatus

#: documents the Bearer scheme in the OpenAPI; the check itself is ``planner.service.app.Guard``
#: (it runs before the body is read, so a request without the token never gets past 401)
bearer = HTTPBearer(auto_error=False, description="A token of PLANNER_API_TOKEN, required on every POST when the server "
                    "sets it; on reads too (or one of PLANNER_API_READ_TOKEN) when the server sets PLANNER_API_READ_TOKEN")

def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorBody, "description": description}


#: every sync route runs under the per-request CPU and memory budgets (``planner.service.budget``)
router = APIRouter(route_class=BudgetedRoute, responses={
    422: _error("A field that does not parse, a value the planner refuses (the field is named), or a request past "
                "the server's CPU budget."),
    500: _error("A bug: logged on the server, never answered with a traceback."),
})

_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _error("Missing or wrong bearer token (only when PLANNER_API_TOKEN is set)."),
    413: _error("Request body too large, or a request past the server's memory budget."),
}
_PLAN_ID = Path(pattern=r"^[0-9a-fA-F]{1,32}$", description="A plan id, or its first characters.")


def _holder(request: Request) -> StoreHolder:
    return request.app.state.holder


def _calibration(request: Request, gpu: str) -> Any:
    """The device's active calibration (``planner calibrate``); None when the store cannot say
    (a plan never fails for want of one)."""
    from planner.calibration.lookup import calibration_in
    from planner.errors import StoreError

    try:
        return calibration_in(_holder(request).get(), gpu)
    except StoreError:
        return None


@router.post("/v1/plans", status_code=201, tags=["plans"], dependencies=[Security(bearer)],
             responses={**_WRITE_ERRORS, 200: {"description": "The stored verified plan of this same request."},
                        202: {"description": "With verify: the plan id and the Ray job id."},
                        501: _error("With verify: Ray is not installed where the server runs."),
                        503: _error("The database or the Ray cluster cannot be reached.")})
def create_plan(body: PlanBody, request: Request) -> Any:
    """Rank every configuration that reaches the target batch (``planner suggest --json``) and
    store it; nothing fitting is a 422 with each family's closest try. A request whose verified
    plan is stored is answered from the store (200, ``"from_store": true``) unless ``"fresh"``.
    With ``"verify": true`` the top candidates are verified by real runs as a Ray job: 202 with
    the plan and job ids, then ``GET /v1/plans/{id}`` shows the status and measurements as they
    arrive."""
    if body.verify:
        calls.check_verifiable(body)
    from contextlib import nullcontext

    from planner.usecases import plan_request

    holder, settings = _holder(request), request.app.state.settings
    calibration = _calibration(request, body.gpu)
    spec = calls.inline_spec(body)  # the model first, then the sizes: the order the fields are refused in
    wanted = calls.suggest_request(body)

    def store() -> Any:
        """The server's one store, opened in the background (503 while it cannot be): the use case
        asks for it once the request has planned, and it stays open."""
        return nullcontext(holder.get())

    job = None
    if body.verify and settings.ray_address is not None:
        from planner.verify.driver import VerifyOptions
        from planner.verify.jobs import JobRequest

        # the job is told its database by reference (the file's path, or a URL without a password),
        # never by a credential (planner.verify.jobs); only catalog ids travel, nothing of this disk
        job = JobRequest(address=settings.ray_address, database_url=holder.url,
                         database_url_file=settings.database_url_file, local_files=False,
                         options=VerifyOptions(top=body.verify_top, steps=body.steps))
    outcome = plan_request(wanted, store=store, spec=spec, calibration=calibration, reuse=not body.fresh,
                           save=not body.verify, job=job)
    if outcome.store_error is not None:
        raise outcome.store_error
    if outcome.reused is not None:
        return JSONResponse(calls.from_store(outcome.reused), status_code=200,
                            headers={"Location": f"/v1/plans/{outcome.reused.id}"})
    if body.verify:
        if outcome.submission is None:
            raise ServiceError(503, "verification is not configured on this server: set PLANNER_RAY_ADDRESS to the "
                                    "Ray dashboard (e.g. http://ray-head:8265) where 'planner serve' runs")
        location = f"/v1/plans/{outcome.plan_id}"
        return JSONResponse({"plan_id": outcome.plan_id, "job_id": outcome.submission.job_id, "plan_url": location},
                            status_code=202, headers={"Location": location})
    return JSONResponse(outcome.planned.result.to_dict() | {"plan_id": outcome.plan_id}, status_code=201,
                        headers={"Location": f"/v1/plans/{outcome.plan_id}"})


@router.get("/v1/plans", tags=["plans"], responses={503: _error("The database cannot be reached.")})
def list_plans(
    request: Request,
    model: Optional[str] = Query(None, max_length=200, description="Part of the model id (any case)."),
    gpu: Optional[str] = Query(None, max_length=64, description="GPU name (any case)."),
    status: Optional[PlanStatus] = Query(None, description="Only plans in this status."),
    since: Optional[str] = Query(None, max_length=64, description="Only plans since: 7d, 12h, 30m or 2026-11-01."),
    limit: int = Query(20, ge=1, le=500, description="Plans per page."),
    offset: int = Query(0, ge=0, le=99_000, description="Plans to skip (newest first; after `after` when given)."),
    after: Optional[str] = Query(None, max_length=64, description="Start after this plan: the `next_cursor` of the "
                                 "previous page. Pages walked by cursor stay put when plans are added meanwhile."),
) -> dict[str, Any]:
    """Past plans, newest first (``planner history --json``), a page at a time: ``next_offset``
    and ``next_cursor`` name the next page (null on the last)."""
    from planner.store import HistoryCursor, parse_since

    since_at = parse_since(since) if since else None
    cursor = HistoryCursor.decode(after) if after else None
    store = _holder(request).get()
    # one more row than the page says whether there is a next page; the page is cut in SQL
    rows = store.history(model=model, gpu=gpu, status=status, since=since_at, limit=limit + 1, offset=offset,
                         after=cursor)
    page, more = rows[:limit], len(rows) > limit
    return {"plans": [row.to_dict() for row in page], "limit": limit, "offset": offset,
            "next_offset": offset + limit if more else None,
            "next_cursor": HistoryCursor.of(page[-1]).encode() if more else None}


@router.get("/v1/plans/{plan_id}", tags=["plans"],
            responses={404: _error("No plan has this id."), 400: _error("The id prefix starts several ids."),
                       503: _error("The database cannot be reached.")})
def get_plan(request: Request, plan_id: str = _PLAN_ID) -> dict[str, Any]:
    """One plan (``planner show --json``): status, candidates with their memory and time
    breakdowns, and every measurement stored so far."""
    return _holder(request).get().get_plan(plan_id=plan_id).to_dict()


_RANK = Query(1, ge=1, le=100, description="Which of the plan's candidates (1: the top one).")
_PLAN_READ_ERRORS: dict[int | str, dict[str, Any]] = {
    404: _error("No plan has this id."), 400: _error("The id prefix starts several ids."),
    503: _error("The database cannot be reached.")}


@router.get("/v1/plans/{plan_id}/files", tags=["plans"], response_class=Response,
            responses={**_PLAN_READ_ERRORS, 200: {"content": {"application/zip": {}},
                                                  "description": "The plan's files, zipped."}})
def plan_files(request: Request, plan_id: str = _PLAN_ID, rank: int = _RANK) -> Response:
    """The ready-to-run files of the plan's candidate ``rank`` (``planner emit PLAN_ID DIR
    --rank RANK``: train.py, training_args.json, PLAN.md, ...) as a zip archive."""
    plan = _holder(request).get().get_plan(plan_id=plan_id)
    name = f"plan-{plan.id[:8]}-rank{rank}.zip"
    return Response(calls.plan_files_zip(plan, rank=rank), media_type="application/zip",
                    headers={"Content-Disposition": f'attachment; filename="{name}"'})


@router.get("/v1/plans/{plan_id}/timeline", tags=["plans"], responses=_PLAN_READ_ERRORS)
def plan_timeline(request: Request, plan_id: str = _PLAN_ID, rank: int = _RANK) -> dict[str, Any]:
    """The predicted step of the plan's candidate ``rank`` as curves (``planner estimate
    --timeline``'s picture as numbers): live bytes by category and the caching allocator's reserve
    over the step, its moments and peak, the device's capacity and usable memory."""
    return calls.plan_timeline(_holder(request).get().get_plan(plan_id=plan_id), rank=rank)


@router.post("/v1/estimate", tags=["estimate"], dependencies=[Security(bearer)], responses=_WRITE_ERRORS)
def estimate(body: EstimateBody, request: Request) -> dict[str, Any]:
    """Memory and speed of one configuration (``planner estimate --json``), with the device's
    calibration; stores nothing."""
    return calls.estimate(body, calibration=_calibration(request, body.gpu))


@router.post("/v1/compare", tags=["estimate"], dependencies=[Security(bearer)], responses=_WRITE_ERRORS)
def compare(body: CompareBody, request: Request) -> dict[str, Any]:
    """Which GPU to rent (``planner suggest --gpu any --json``): the request planned on every GPU
    type (or ``gpu_types``) at 1, 2, 4 and 8 GPUs, each option's #1 plan timed for ``tokens`` and
    priced (the shipped table, dated per row, or ``prices``); ``by_cost`` cheapest first,
    ``by_time`` fastest first. Stores nothing. The whole catalog is about 90 searches: past the
    server's CPU budget, send fewer ``gpu_types``."""
    from planner.calibration.lookup import calibrations_in
    from planner.errors import StoreError
    from planner.gpus import gpu_names

    try:
        calibrations = calibrations_in(_holder(request).get(), gpu_names())
    except StoreError:
        calibrations = {}  # (a plan never fails for want of a calibration)
    return calls.compare(body, calibrations=calibrations)


@router.post("/v1/check", tags=["estimate"], dependencies=[Security(bearer)], responses=_WRITE_ERRORS)
def check(body: CheckBody, request: Request) -> dict[str, Any]:
    """An existing training config sent as its files (``planner check --json``): fits or not, the
    peak, where it peaks, the OOM risk and the closest change as a diff of the files' keys; stores
    nothing."""
    return calls.check(body, calibration=_calibration(request, body.gpu))


@router.get("/v1/gpus", tags=["catalog"])
def gpus() -> list[dict[str, Any]]:
    """Every GPU the planner knows (``planner gpus --json``), with the source of each number."""
    from planner.gpus import list_gpus

    return [spec.to_dict() for spec in list_gpus()]


@router.get("/v1/models", tags=["catalog"])
def models(
    search: Optional[str] = Query(None, max_length=200, description="Part of the id or architecture."),
) -> list[dict[str, Any]]:
    """The offline model catalog (``planner models --json``)."""
    from planner.catalog import list_catalog

    return [spec.summary() for spec in list_catalog(search=search)]


__all__ = ["router"]
