"""Plain entities the store hands back: frozen dataclasses, never ORM rows.

They wrap the shared result types of ``planner.results`` (``PlanRequest``, ``Candidate``,
``Measurement``...) with what only the store knows: ids, timestamps and the plan's status.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from planner.results import Candidate, Measurement, PlanRequest, PlanResult, Rejection


class PlanStatus(enum.StrEnum):
    """Life cycle of a stored plan request."""

    PLANNED = "planned"
    """``planner suggest`` answered; nothing was run yet."""
    VERIFYING = "verifying"
    """Short real runs of its candidates are under way (e.g. a Ray job)."""
    VERIFIED = "verified"
    """A real run confirmed the top plan fits."""
    FAILED = "failed"
    """Verification ran and the plan did not hold (OOM or error)."""
    MEASURED = "measured"
    """Not a search: one configuration measured by ``planner measure``."""

    def is_terminal(self) -> bool:
        """No further transition is expected (``planned`` may still be verified later)."""
        return self in (PlanStatus.VERIFIED, PlanStatus.FAILED, PlanStatus.MEASURED)

    def check_transition(self, to: "PlanStatus", *, plan_id: str) -> None:
        """Refuse a move that the life cycle has not: out of a terminal status (the model is Ray's
        ``JobStatus.is_terminal()``: a job that ended never runs again; a new verification is a
        new plan), into ``measured`` (only ``planner measure`` makes such a record, born so), or
        from ``verifying`` back to ``planned``.
        ``planned`` -> ``planned`` (a job id noted) and ``verifying`` -> ``verifying`` (the lease
        taken again) are moves. Both stores call it before they write a status."""
        from planner.errors import StatusTransitionError

        if self.is_terminal():
            raise StatusTransitionError(
                f"plan {plan_id[:8]} is {self.value} already and a {self.value} plan stays so (asked: {to.value}): "
                "plan the request again (suggest --fresh) to verify it anew")
        if to is PlanStatus.MEASURED:
            raise StatusTransitionError(
                f"plan {plan_id[:8]} cannot become measured: only 'planner measure' records a measured run")
        if self is PlanStatus.VERIFYING and to is PlanStatus.PLANNED:
            raise StatusTransitionError(
                f"plan {plan_id[:8]} is being verified: it ends verified or failed, never planned again")


def parse_status(text: str) -> PlanStatus:
    """``"verified"`` -> ``PlanStatus.VERIFIED``; anything else is a one-line ``PlannerError``."""
    from planner.errors import PlannerError

    try:
        return PlanStatus(str(text).strip().lower())
    except ValueError:
        choices = "|".join(s.value for s in PlanStatus)
        raise PlannerError(f"--status must be one of {choices}, got {text!r}") from None


def _identity(item: "StoredPlan | PlanSummary") -> dict[str, Any]:
    """The keys every JSON form of a plan starts with."""
    return {
        "id": item.id,
        "created_at": item.created_at.isoformat(),
        "status": str(item.status),
        "verified": item.verified,
    }


@dataclass(frozen=True, kw_only=True)
class StoredMeasurement:
    """One real run stored against a candidate."""

    id: str
    """uuid4 hex."""
    candidate_id: str
    recorded_at: datetime
    """When the store received it (timezone-aware UTC)."""
    measurement: Measurement
    """The run's: on several ranks, the worst rank's peaks and the slowest rank's step, or the
    cause of the rank that failed it."""
    ranks: tuple[Measurement, ...] = ()
    """Each rank's own measurement, in rank order, when several ranks ran it (none for a
    one-process run)."""

    @property
    def worst_rank(self) -> int | None:
        """The rank whose peak allocation is the run's (the highest), or that failed it; None for a
        one-process run."""
        if not self.ranks:
            return None
        failed = [n for n, r in enumerate(self.ranks) if str(r.outcome) != "ok" and not is_stopped(r)]
        if failed:
            return failed[0]
        return max(range(len(self.ranks)), key=lambda n: (self.ranks[n].peak_allocated_bytes or 0, -n))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "candidate_id": self.candidate_id,
            "recorded_at": self.recorded_at.isoformat(),
            **self.measurement.to_dict(),
            "worst_rank": self.worst_rank,
            "ranks": [{"rank": n, **r.to_dict()} for n, r in enumerate(self.ranks)],
        }


#: The error of a rank the others' failure stopped (``planner.verify.ranks``): the run failed
#: elsewhere, not in it
STOPPED_PREFIX = "stopped: "


def is_stopped(measurement: Measurement) -> bool:
    """Whether a rank's measurement says it was stopped because another rank failed."""
    return (measurement.error or "").startswith(STOPPED_PREFIX)


@dataclass(frozen=True, kw_only=True)
class StoredCandidate:
    """One candidate of a stored plan with the measurements taken of it (oldest first)."""

    id: str
    position: int
    """0-based order within the plan as the planner returned it (rank 1 first)."""
    candidate: Candidate
    measurements: tuple[StoredMeasurement, ...] = ()

    @property
    def latest(self) -> StoredMeasurement | None:
        """The most recent measurement, or None when it was never run."""
        return self.measurements[-1] if self.measurements else None

    def run_dict(self, run: StoredMeasurement) -> dict[str, Any]:
        """One of its runs as JSON, each rank's peak beside the prediction (the memory model
        predicts the peak of every rank alike: ``MemoryEstimate`` is per device)."""
        predicted = self.candidate.memory.peak_allocated_bytes
        data = run.to_dict()
        for rank in data["ranks"]:
            measured = rank["peak_allocated_bytes"]
            rank["predicted_peak_allocated_bytes"] = predicted
            rank["peak_error_pct"] = round(100.0 * (predicted - measured) / measured, 2) if measured else None
        return data

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "position": self.position,
            **self.candidate.to_dict(),
            "label": self.candidate.config.label(),
            "measurements": [self.run_dict(m) for m in self.measurements],
        }


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    """A stored run with the request and the configuration it ran (``planner calibrate`` fits on these)."""

    plan_id: str
    request: PlanRequest
    candidate: Candidate
    """The configuration run, with the prediction made when it was stored."""
    measurement: StoredMeasurement


@dataclass(frozen=True, kw_only=True)
class StoredPlan:
    """A stored ``planner suggest`` answer (or a ``planner measure`` record) with everything measured since."""

    id: str
    created_at: datetime
    """Timezone-aware UTC."""
    status: PlanStatus
    request: PlanRequest
    candidates: tuple[StoredCandidate, ...]
    rejected: tuple[Rejection, ...] = ()
    searched: int = 0
    usable_bytes: int = 0
    safety_margin_bytes: int = 0
    ray_job_id: str | None = None
    """Ray job that verifies it, when it was submitted as one."""
    status_reason: str | None = None
    """Why it has its status: a failed verification's cause, or what verified it."""
    status_changed_at: datetime | None = None
    """When the status last changed (timezone-aware UTC); None for plans stored before 0.2."""
    lease_until: datetime | None = None
    """While ``verifying``: the time by which its driver must renew the lease."""

    @property
    def verified(self) -> bool:
        return self.status is PlanStatus.VERIFIED

    @property
    def measurements(self) -> tuple[StoredMeasurement, ...]:
        return tuple(m for c in self.candidates for m in c.measurements)

    def to_result(self) -> PlanResult:
        """The ``PlanResult`` as the planner produced it (without the store's ids)."""
        return PlanResult(
            request=self.request,
            plans=tuple(c.candidate for c in self.candidates),
            rejected=self.rejected,
            searched=self.searched,
            usable_bytes=self.usable_bytes,
            safety_margin_bytes=self.safety_margin_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **_identity(self),
            "ray_job_id": self.ray_job_id,
            "status_reason": self.status_reason,
            "status_changed_at": self.status_changed_at.isoformat() if self.status_changed_at else None,
            "request": self.request.to_dict(),
            "searched": self.searched,
            "usable_bytes": self.usable_bytes,
            "safety_margin_bytes": self.safety_margin_bytes,
            "candidates": [c.to_dict() for c in self.candidates],
            "rejected": [r.to_dict() for r in self.rejected],
        }


@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """One row of ``planner history``."""

    id: str
    created_at: datetime
    status: PlanStatus
    model_id: str
    gpu: str
    gpu_count: int
    target_batch: int
    seq_len: int
    top_plan: str | None
    """Label of the rank-1 candidate; None when nothing fit."""
    candidates: int
    """Number of stored candidates."""
    measurements: int
    """Number of real runs stored against its candidates."""

    @property
    def verified(self) -> bool:
        return self.status is PlanStatus.VERIFIED

    def to_dict(self) -> dict[str, Any]:
        return {
            **_identity(self),
            "model_id": self.model_id,
            "gpu": self.gpu,
            "gpu_count": self.gpu_count,
            "target_batch": self.target_batch,
            "seq_len": self.seq_len,
            "top_plan": self.top_plan,
            "candidates": self.candidates,
            "measurements": self.measurements,
        }


@dataclass(frozen=True, kw_only=True)
class HistoryCursor:
    """Where a page of history ends: the last plan's creation time and id (history is ordered
    by both, newest first), so the next page starts after it whatever was stored since."""

    created_at: datetime
    id: str

    @classmethod
    def of(cls, row: PlanSummary) -> "HistoryCursor":
        return cls(created_at=row.created_at, id=row.id)

    def encode(self) -> str:
        """``<microseconds since the epoch, UTC>-<plan id>``: URL-safe and exact to the microsecond
        both stores keep."""
        delta = self.created_at.astimezone(timezone.utc) - _EPOCH
        micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
        return f"{micros}-{self.id}"

    @classmethod
    def decode(cls, text: str) -> "HistoryCursor":
        """The cursor ``encode`` wrote; ``InvalidConfigError`` naming the field for anything else."""
        from planner.errors import InvalidConfigError

        micros, sep, plan_id = text.partition("-")
        if not sep or not micros.isdigit() or len(micros) > 18 or not _PLAN_ID.fullmatch(plan_id):
            raise InvalidConfigError(f"--after {text[:80]!r} is not a history cursor: pass the next_cursor "
                                     "of the previous page as it was")
        return cls(created_at=_EPOCH + timedelta(microseconds=int(micros)), id=plan_id)


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
#: a stored plan's id: 32 lowercase hex digits (``planner.store.codec.new_id``)
_PLAN_ID = re.compile(r"[0-9a-f]{32}")


__all__ = [
    "STOPPED_PREFIX",
    "is_stopped",
    "HistoryCursor",
    "MeasuredRun",
    "PlanStatus",
    "PlanSummary",
    "StoredCandidate",
    "StoredMeasurement",
    "StoredPlan",
    "parse_status",
]
