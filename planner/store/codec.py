"""The store's rows as plain values, and the entities made from them: no SQLAlchemy here.

Both ways of reaching the database share this module, so a column is named and converted in one
place: the ORM rows of ``planner.store.dbmodels`` are built from the ``*_values`` dicts and turn
into entities through the ``*_entity`` functions, and so do the plain tuples of
``planner.store.lite`` (the SQLite path of the one-shot commands, which must not pay SQLAlchemy's
import). A "row" here is anything whose attributes are the table's columns: an ORM object or a
``types.SimpleNamespace`` of a fetched tuple.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Sequence

from planner.errors import AmbiguousIdError, PlannerError, RecordNotFoundError, UnstorableDataError
from planner.limits import MAX_HISTORY, check_model_id
from planner.results import (
    Candidate,
    Measurement,
    MemoryEstimate,
    PlanRequest,
    PlanResult,
    Rejection,
    ThroughputEstimate,
    canonical_json,
    constraints_hash,
)
from planner.store.entities import PlanStatus, PlanSummary, StoredCandidate, StoredMeasurement, StoredPlan

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration.values import Calibration

#: Fields copied one to one between ``PlanRequest`` and its row.
REQUEST_FIELDS = (
    "model_id", "model_fingerprint", "gpu", "gpu_count", "gpu_memory_bytes", "target_batch", "seq_len",
    "planner_version",
)
#: Fields copied one to one between ``Measurement`` and its row.
MEASUREMENT_FIELDS = (
    "device", "peak_allocated_bytes", "peak_reserved_bytes", "process_total_bytes", "step_s", "tokens_per_s",
    "node", "error",
)
def copy_fields(source: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


def new_id() -> str:
    """A uuid4 as 32 hex digits; any unique prefix of it names the same thing."""
    return uuid.uuid4().hex


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _iso(value: datetime | None) -> str:
    return value.isoformat() if value is not None else ""


# ---- entity -> row values --------------------------------------------------------------------
def request_values(
    *, plan_id: str, request: PlanRequest, status: PlanStatus, result: PlanResult | None, ray_job_id: str | None
) -> dict[str, Any]:
    """The ``plan_requests`` row of a new plan (or ``planner measure`` record)."""
    check_model_id(request.model_id)
    return dict(
        id=plan_id,
        created_at=utcnow(),
        constraints=canonical_json(dict(request.constraints), what="the request's constraints"),
        constraints_hash=constraints_hash(request.constraints),
        status=str(status),
        ray_job_id=ray_job_id,
        rejected=canonical_json(
            [r.to_dict() for r in result.rejected] if result else [], what="the rejected families"
        ),
        searched=result.searched if result else 0,
        usable_bytes=result.usable_bytes if result else 0,
        safety_margin_bytes=result.safety_margin_bytes if result else 0,
        **copy_fields(request, REQUEST_FIELDS),
    )


def candidate_values(*, plan_id: str, position: int, candidate: Candidate) -> dict[str, Any]:
    """The ``plan_candidates`` row of one candidate of a plan."""
    what = f"candidate {position + 1} ({candidate.config.label()})"
    return dict(
        id=new_id(),
        plan_id=plan_id,
        position=position,
        rank=candidate.rank,
        label=candidate.config.label()[:255],
        config=canonical_json(candidate.config.to_dict(), what=f"{what}: its config"),
        memory=canonical_json(candidate.memory.to_dict(), what=f"{what}: its memory estimate"),
        throughput=canonical_json(candidate.throughput.to_dict(), what=f"{what}: its throughput estimate"),
        fits=candidate.fits,
        predicted_peak_allocated_bytes=candidate.memory.peak_allocated_bytes,
        predicted_process_total_bytes=candidate.memory.process_total_bytes,
        predicted_step_s=candidate.throughput.step_s,
        predicted_tokens_per_s=candidate.throughput.tokens_per_s,
    )


def _timestamp(text: str, *, what: str) -> datetime | None:
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UnstorableDataError(f"cannot store the measurement: {what} {text!r} is not an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def measurement_values(*, candidate_id: str, measurement: Measurement, ranks: Sequence[Measurement] = ()) -> dict[str, Any]:
    """The ``plan_measurements`` row of one real run (with each rank's, when several ran it)."""
    m = measurement
    return dict(
        id=new_id(),
        candidate_id=candidate_id,
        recorded_at=utcnow(),
        outcome=str(m.outcome),
        library_versions=canonical_json(dict(m.library_versions), what="the measurement's library versions"),
        started_at=_timestamp(m.started_at, what="started_at"),
        finished_at=_timestamp(m.finished_at, what="finished_at"),
        ranks=rank_values(ranks),
        **copy_fields(m, MEASUREMENT_FIELDS),
    )


#: What the ``ranks`` column keeps of each rank's measurement: the run's own row holds the device
#: and the library versions, the same for every rank of one run
RANK_FIELDS = ("outcome", "peak_allocated_bytes", "peak_reserved_bytes", "process_total_bytes", "step_s", "tokens_per_s",
               "node", "started_at", "finished_at", "error")


def rank_values(ranks: Sequence[Measurement]) -> list[dict[str, Any]] | None:
    """The ``ranks`` column: one object per rank, in rank order, each naming its rank; None for a
    one-process run."""
    if not ranks:
        return None
    return canonical_json([{"rank": n, **{k: v for k, v in r.to_dict().items() if k in RANK_FIELDS}}
                           for n, r in enumerate(ranks)], what="the ranks' measurements")


def rank_entities(values: list[dict[str, Any]] | None, *, device: str) -> tuple[Measurement, ...]:
    """The ranks of a stored run, in rank order (none for a one-process run or a row before 0004)."""
    ordered = sorted(values or (), key=lambda v: v["rank"])
    assert [v["rank"] for v in ordered] == list(range(len(ordered))), "a run's ranks are 0..N-1"
    return tuple(Measurement(device=device, **{k: v.get(k) for k in RANK_FIELDS if k in v}) for v in ordered)


#: How long a verifying driver may stay silent before its plan is read as failed. The driver
#: renews every few seconds while runs are under way, so this only bounds how long a dead
#: driver's plan looks alive.
DEFAULT_LEASE_S = 120.0


def status_values(*, plan_id: str, current: PlanStatus, status: PlanStatus, reason: str | None,
                  ray_job_id: str | None, lease_s: float | None, now: datetime) -> dict[str, Any]:
    """The columns ``set_status`` writes: the move checked (``PlanStatus.check_transition``),
    why, when, and the lease: ``verifying`` takes one of ``lease_s`` (default
    ``DEFAULT_LEASE_S``), other statuses hold none; the Ray job when one is named."""
    current.check_transition(status, plan_id=plan_id)
    if status is PlanStatus.VERIFYING:
        lease_s = DEFAULT_LEASE_S if lease_s is None else lease_s
    else:
        lease_s = None
    values: dict[str, Any] = dict(status=str(status), status_reason=reason, status_changed_at=now,
                                  lease_until=now + timedelta(seconds=lease_s) if lease_s is not None else None)
    if ray_job_id is not None:
        values["ray_job_id"] = ray_job_id
    return values


def expired_values(*, lease_until: datetime, now: datetime) -> dict[str, Any]:
    """The columns of a ``verifying`` plan whose lease ran out: failed, with why (its driver
    died; the only move out of ``verifying`` not made by its driver)."""
    return dict(status=str(PlanStatus.FAILED), status_reason=stale_reason(lease_until), status_changed_at=now,
                lease_until=None)


_HEX_ID = re.compile(r"[0-9a-f]{1,32}")


def id_prefix(prefix: str, *, what: str) -> str:
    """The id (or its first characters) as stored: lowercase hex; ``RecordNotFoundError`` else."""
    key = str(prefix).strip().lower()
    if not _HEX_ID.fullmatch(key):
        raise RecordNotFoundError(f"{what} id {prefix!r} is not an id: copy one (or its first characters) from 'planner history'")
    return key


def resolved_id(found: list[str], prefix: str, *, what: str) -> str:
    """The one id of (at most two) ids found starting with ``prefix``, or why there is none."""
    if not found:
        raise RecordNotFoundError(f"no {what} with id {prefix!r}: see 'planner history'")
    if len(found) > 1:
        raise AmbiguousIdError(f"{what} id {prefix!r} is ambiguous (it starts several ids): give more characters")
    return found[0]


def check_page(*, limit: object, offset: object, model: object = None, gpu: object = None) -> None:
    """``history``'s page: ``limit`` 1 and ``offset`` 0 up to ``MAX_HISTORY``; its filters text."""
    for name, value in (("--model", model), ("--gpu", gpu)):
        if value is not None and not isinstance(value, str):  # (a number reached str.replace: AttributeError)
            raise PlannerError(f"{name} filters history by text (part of the model id, a GPU name), got {value!r}")
    for name, value, low in (("--limit", limit, 1), ("offset", offset, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_HISTORY:
            # the option's long name (the API names its field "limit"); the CLI checks the value
            # first and names the option as it was typed (-n or --limit)
            raise PlannerError(f"{name} must be a whole number from {low} to {MAX_HISTORY:,}, got {value!r}")


def stale_reason(lease_until: datetime) -> str:
    """Why a ``verifying`` plan whose lease ran out is read as failed."""
    return (
        "verification stopped unfinished: its driver gave no sign of life since "
        f"{lease_until:%Y-%m-%d %H:%M:%S} UTC (killed, or its machine went away); plan again with --fresh"
    )


# ---- row -> entity ---------------------------------------------------------------------------
def request_entity(row: Any) -> PlanRequest:
    return PlanRequest(constraints=dict(row.constraints), **copy_fields(row, REQUEST_FIELDS))


def plan_entity(row: Any, candidates: tuple[StoredCandidate, ...]) -> StoredPlan:
    return StoredPlan(
        id=row.id,
        created_at=row.created_at,
        status=PlanStatus(row.status),
        request=request_entity(row),
        candidates=candidates,
        rejected=tuple(Rejection(family=r["family"], reason=r["reason"], config=r.get("config")) for r in row.rejected),
        searched=row.searched,
        usable_bytes=row.usable_bytes,
        safety_margin_bytes=row.safety_margin_bytes,
        ray_job_id=row.ray_job_id,
        status_reason=row.status_reason,
        status_changed_at=row.status_changed_at,
        lease_until=row.lease_until,
    )


def summary_entity(row: Any) -> PlanSummary:
    """One ``history`` row: the request's columns, ``top`` (the rank-1 label), ``n_candidates``
    and ``n_runs``."""
    return PlanSummary(
        id=row.id, created_at=row.created_at, status=PlanStatus(row.status), model_id=row.model_id, gpu=row.gpu,
        gpu_count=row.gpu_count, target_batch=row.target_batch, seq_len=row.seq_len, top_plan=row.top,
        candidates=row.n_candidates or 0, measurements=row.n_runs or 0,
    )


def candidate_entity(row: Any) -> Candidate:
    from planner.config import TrainConfig

    return Candidate(
        rank=row.rank,
        config=TrainConfig.from_dict(row.config),
        memory=MemoryEstimate.from_dict(row.memory),
        throughput=ThroughputEstimate.from_dict(row.throughput),
        fits=row.fits,
    )


def stored_candidate(row: Any, measurements: tuple[StoredMeasurement, ...]) -> StoredCandidate:
    return StoredCandidate(id=row.id, position=row.position, candidate=candidate_entity(row), measurements=measurements)


def measurement_entity(row: Any) -> StoredMeasurement:
    return StoredMeasurement(
        id=row.id,
        candidate_id=row.candidate_id,
        recorded_at=row.recorded_at,
        measurement=Measurement(
            outcome=row.outcome,
            library_versions=dict(row.library_versions),
            started_at=_iso(row.started_at),
            finished_at=_iso(row.finished_at),
            **copy_fields(row, MEASUREMENT_FIELDS),
        ),
        ranks=rank_entities(row.ranks, device=row.device),
    )


def calibration_entity(row: Any) -> "Calibration":
    from planner.calibration.values import Calibration, CalibrationValues

    return Calibration(
        id=row.id, gpu=row.gpu, created_at=row.created_at, active=row.active, dropped_at=row.dropped_at,
        measurements=row.measurements, values=CalibrationValues.from_dict(row.constants),
        defaults=CalibrationValues.from_dict(row.defaults), report=dict(row.report),
        measurement_ids=tuple(row.measurement_ids), planner_version=row.planner_version,
    )


__all__ = [
    "DEFAULT_LEASE_S", "check_page", "expired_values", "id_prefix", "resolved_id", "status_values",
    "MEASUREMENT_FIELDS", "RANK_FIELDS", "REQUEST_FIELDS", "rank_entities", "rank_values", "calibration_entity", "candidate_entity", "candidate_values", "canonical_json",
    "constraints_hash", "copy_fields", "measurement_entity", "measurement_values", "new_id", "plan_entity",
    "request_entity", "request_values", "stale_reason", "stored_candidate", "summary_entity", "utcnow",
]
