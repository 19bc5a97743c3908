"""SQLAlchemy 2.0 ORM classes of the plan store (mlflow's pattern: rows + ``to_entity()``).

Rows never leave the store: ``planner.store.api`` turns them into the frozen entities of
``planner.store.entities`` inside the session that loaded them. Everything JSON-ish is a JSON
column (``sqlalchemy.JSON`` maps to SQLite's JSON1 text and PostgreSQL's ``json``); the numbers
queries filter or compare on (model, GPU, predicted and measured peaks) are also plain columns.

The schema is created by Alembic (``migrations/versions``), never by ``metadata.create_all``;
``tests/store/test_migrations.py`` checks that the migrations produce exactly this metadata.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from planner.calibration.values import Calibration
from planner.limits import MODEL_ID_MAX_CHARS
from planner.results import Candidate, PlanRequest
from planner.store import codec
from planner.store.codec import MEASUREMENT_FIELDS, REQUEST_FIELDS, copy_fields
from planner.store.entities import StoredCandidate, StoredMeasurement, StoredPlan
from planner.store.revision import VERSION_TABLE

#: Deterministic constraint names, so migrations can name what they alter or drop
#: (https://alembic.sqlalchemy.org/en/latest/naming.html).
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend.

    PostgreSQL's ``timestamptz`` returns aware values in the session's time zone; SQLite has no
    time zone type and returns naive ones. Both are normalised to UTC; naive input is refused.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        assert value.tzinfo is not None, "the store only writes timezone-aware timestamps"
        value = value.astimezone(timezone.utc)
        # SQLite stores the text form; dropping the offset keeps it sortable as text.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class PlanRequestRow(Base):
    """One ``planner suggest`` request (or ``planner measure`` record) and the plan's status."""

    __tablename__ = "plan_requests"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    model_id: Mapped[str] = mapped_column(String(MODEL_ID_MAX_CHARS))
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    gpu: Mapped[str] = mapped_column(String(64))
    gpu_count: Mapped[int] = mapped_column(Integer)
    gpu_memory_bytes: Mapped[int] = mapped_column(BigInteger)
    target_batch: Mapped[int] = mapped_column(Integer)
    seq_len: Mapped[int] = mapped_column(Integer)
    constraints: Mapped[dict[str, Any]] = mapped_column(JSON)
    constraints_hash: Mapped[str] = mapped_column(String(64))
    """sha256 of the canonical JSON of ``constraints``: equal requests compare on an index."""
    planner_version: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))
    status_reason: Mapped[str | None] = mapped_column(Text)
    """Why the plan has its status (a failed verification's cause), shown by ``planner show``."""
    status_changed_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    lease_until: Mapped[datetime | None] = mapped_column(UTCDateTime())
    """A ``verifying`` plan's driver renews this; past it, the plan is read as failed."""
    ray_job_id: Mapped[str | None] = mapped_column(String(128))
    rejected: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    searched: Mapped[int] = mapped_column(Integer)
    usable_bytes: Mapped[int] = mapped_column(BigInteger)
    safety_margin_bytes: Mapped[int] = mapped_column(BigInteger)

    candidates: Mapped[list[CandidateRow]] = relationship(
        back_populates="plan", order_by="CandidateRow.position", cascade="all, delete-orphan"
    )

    __table_args__ = (
        # history: newest first, optionally filtered by model, GPU or status
        Index("ix_plan_requests_created_at", "created_at"),
        Index("ix_plan_requests_model_created", "model_id", "created_at"),
        Index("ix_plan_requests_gpu_created", "gpu", "created_at"),
        Index("ix_plan_requests_status_created", "status", "created_at"),
        # reuse: the newest plan of an identical request
        Index(
            "ix_plan_requests_same_request",
            "model_fingerprint", "gpu", "gpu_count", "target_batch", "seq_len", "constraints_hash",
            "created_at",
        ),
    )

    def request_entity(self) -> PlanRequest:
        return codec.request_entity(self)

    def to_entity(self) -> StoredPlan:
        return codec.plan_entity(self, tuple(c.to_entity() for c in self.candidates))


class CandidateRow(Base):
    """One evaluated configuration of a plan with its predictions."""

    __tablename__ = "plan_candidates"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    plan_id: Mapped[str] = mapped_column(ForeignKey("plan_requests.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer)
    label: Mapped[str] = mapped_column(String(255))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    memory: Mapped[dict[str, Any]] = mapped_column(JSON)
    """``MemoryEstimate.to_dict()``: peaks, breakdown, assumptions."""
    throughput: Mapped[dict[str, Any]] = mapped_column(JSON)
    fits: Mapped[bool] = mapped_column(Boolean)
    # Copies of the headline predictions, so calibration queries need no JSON functions.
    predicted_peak_allocated_bytes: Mapped[int] = mapped_column(BigInteger)
    predicted_process_total_bytes: Mapped[int] = mapped_column(BigInteger)
    predicted_step_s: Mapped[float] = mapped_column(Float)
    predicted_tokens_per_s: Mapped[float] = mapped_column(Float)

    plan: Mapped[PlanRequestRow] = relationship(back_populates="candidates")
    measurements: Mapped[list[MeasurementRow]] = relationship(
        back_populates="candidate",
        order_by="(MeasurementRow.recorded_at, MeasurementRow.id)",
        cascade="all, delete-orphan",
    )

    __table_args__ = (
        UniqueConstraint("plan_id", "position"),
        Index("ix_plan_candidates_plan_rank", "plan_id", "rank"),
    )

    def candidate_entity(self) -> Candidate:
        return codec.candidate_entity(self)

    def to_entity(self) -> StoredCandidate:
        return codec.stored_candidate(self, tuple(m.to_entity() for m in self.measurements))


class MeasurementRow(Base):
    """One short real training run of a candidate."""

    __tablename__ = "plan_measurements"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    candidate_id: Mapped[str] = mapped_column(ForeignKey("plan_candidates.id", ondelete="CASCADE"))
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime())
    outcome: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(255))
    peak_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    peak_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    process_total_bytes: Mapped[int | None] = mapped_column(BigInteger)
    step_s: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    library_versions: Mapped[dict[str, str]] = mapped_column(JSON)
    node: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    error: Mapped[str | None] = mapped_column(Text)
    ranks: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    """Each rank's own measurement, in rank order, when several ranks ran it
    (``codec.rank_values``); NULL for a one-process run and for runs stored before 0004."""

    candidate: Mapped[CandidateRow] = relationship(back_populates="measurements")

    __table_args__ = (
        Index("ix_plan_measurements_candidate_recorded", "candidate_id", "recorded_at"),
        # calibration: all OK runs on one device kind
        Index("ix_plan_measurements_outcome_device", "outcome", "device"),
    )

    def to_entity(self) -> StoredMeasurement:
        return codec.measurement_entity(self)


class CalibrationRow(Base):
    """One ``planner calibrate`` fit of one device: the constants, their defaults and the errors
    before and after. The newest active row of a GPU is what plans use; ``--reset`` and a newer
    calibration deactivate it, so every version stays readable."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    """The calibration's number (#3), increasing across devices."""
    gpu: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    active: Mapped[bool] = mapped_column(Boolean)
    dropped_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    measurements: Mapped[int] = mapped_column(Integer)
    constants: Mapped[dict[str, Any]] = mapped_column(JSON)
    """``CalibrationValues.to_dict()``: the fitted constants."""
    defaults: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The model's defaults of the same constants."""
    report: Mapped[dict[str, Any]] = mapped_column(JSON)
    """``CalibrationFit.to_dict()``: errors before and after, per constant."""
    measurement_ids: Mapped[list[str]] = mapped_column(JSON)
    planner_version: Mapped[str] = mapped_column(String(32))

    __table_args__ = (
        # the active calibration of a device: its newest active row
        Index("ix_calibrations_gpu_active", "gpu", "active", "id"),
    )

    def to_entity(self) -> Calibration:
        return codec.calibration_entity(self)


__all__ = [
    "CalibrationRow",
    "MEASUREMENT_FIELDS",
    "REQUEST_FIELDS",
    "copy_fields",
    "Base", "CandidateRow", "MeasurementRow", "PlanRequestRow", "UTCDateTime", "VERSION_TABLE"]
