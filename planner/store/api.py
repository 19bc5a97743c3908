"""The plan store: save plans and measurements, find them again. Returns entities, never rows.

Every public method runs in one ``session_scope()``: it commits as a whole or rolls back as a
whole, so a plan and its candidates are stored together or not at all. Write transactions are
retried while SQLite reports the database locked (see ``planner.store.engine``).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from datetime import date, datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence, TypeVar

from sqlalchemy import Engine, and_, case, func, or_, select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, selectinload

from planner.errors import PlannerError, StoreError
from planner.limits import MAX_HISTORY
from planner.results import Candidate, Measurement, PlanRequest, PlanResult
from planner.store.codec import (
    candidate_values,
    canonical_json,
    check_page,
    constraints_hash,
    expired_values,
    id_prefix,
    measurement_values,
    new_id,
    request_values,
    resolved_id,
    status_values,
    summary_entity,
    utcnow,
)
from planner.store.dbmodels import Base, CalibrationRow, CandidateRow, MeasurementRow, PlanRequestRow
from planner.store.engine import (
    WRITE_OPTION,
    db_failure,
    default_database_url,
    make_engine,
    open_failure,
    retry_locked,
    safe_url,
)
from planner.store.entities import (
    HistoryCursor,
    MeasuredRun,
    PlanStatus,
    PlanSummary,
    StoredPlan,
    parse_status,
)

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration import Calibration, CalibrationValues
    from planner.store.schema import SchemaState

T = TypeVar("T")

_RELATIVE = re.compile(r"^\s*(\d+)\s*([mhdw])\s*$", re.IGNORECASE)
_UNIT = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_since(text: str, /, *, now: datetime | None = None) -> datetime:
    """``7d``, ``12h``, ``30m``, ``2w`` before ``now``, or an ISO date/time (UTC when naive)."""
    now = now or utcnow()
    match = _RELATIVE.match(str(text))
    if match:
        try:
            return now - timedelta(**{_UNIT[match.group(2).lower()]: int(match.group(1))})
        except OverflowError:
            raise PlannerError(f"--since {text!r} reaches before the year 1: write e.g. 7d, 52w or 2026-01-01") from None
    raw = str(text).strip()
    try:
        when = datetime.fromisoformat(raw)
    except ValueError:
        try:
            when = datetime.combine(date.fromisoformat(raw), datetime.min.time())
        except ValueError:
            raise PlannerError(
                f"--since {text!r} is not a time: write e.g. 7d, 12h, 30m or 2026-11-01"
            ) from None
    when = when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    try:
        return when.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01T00:00+01:00 is in the year 0 in UTC
        raise PlannerError(f"--since {text!r} falls outside the years 1-9999 in UTC: write e.g. 7d or 2026-11-01") from None


# ---- entity -> row -------------------------------------------------------------------------
def _request_row(*, plan_id: str, request: PlanRequest, status: PlanStatus, result: PlanResult | None,
                 ray_job_id: str | None) -> PlanRequestRow:
    return PlanRequestRow(**request_values(plan_id=plan_id, request=request, status=status, result=result,
                                           ray_job_id=ray_job_id))


def _candidate_row(*, plan_id: str, position: int, candidate: Candidate) -> CandidateRow:
    return CandidateRow(**candidate_values(plan_id=plan_id, position=position, candidate=candidate))


def _measurement_row(*, candidate_id: str, measurement: Measurement, ranks: Sequence[Measurement] = ()) -> MeasurementRow:
    return MeasurementRow(**measurement_values(candidate_id=candidate_id, measurement=measurement, ranks=ranks))


class Store:
    """A plan store on one database. Make it with ``open_store``; ``close()`` when done."""

    def __init__(self, *, engine: Engine, url: str) -> None:
        self.url = url
        self._engine = engine
        self._write_engine = engine.execution_options(**{WRITE_OPTION: True})

    # ---- transactions ----------------------------------------------------------------------
    @contextmanager
    def _raw_scope(self, *, write: bool) -> Iterator[Session]:
        session = Session(bind=self._write_engine if write else self._engine, expire_on_commit=False)
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @contextmanager
    def session_scope(self, *, write: bool = False) -> Iterator[Session]:
        """One transaction: commits when the block ends, rolls back everything if it raises.

        ``write=True`` takes SQLite's write lock at BEGIN (other backends ignore it). Database
        failures come out as one-line ``StoreError``s.
        """
        try:
            with self._raw_scope(write=write) as session:
                yield session
        except DBAPIError as exc:
            raise db_failure(self.url, exc) from None

    def _run(self, work: Callable[[Session], T], *, write: bool) -> T:
        def once() -> T:
            with self._raw_scope(write=write) as session:
                return work(session)

        try:
            return retry_locked(once) if write else once()
        except DBAPIError as exc:
            raise db_failure(self.url, exc) from None

    # ---- ids -------------------------------------------------------------------------------
    @staticmethod
    def _resolve(session: Session, row_type: type[Base], prefix: str, *, what: str) -> str:
        key = id_prefix(prefix, what=what)
        column = row_type.id  # type: ignore[attr-defined]
        return resolved_id(session.scalars(select(column).where(column.startswith(key)).limit(2)).all(), prefix,
                           what=what)

    # ---- writing ---------------------------------------------------------------------------
    def save_plan(self, *, result: PlanResult, status: PlanStatus = PlanStatus.PLANNED, ray_job_id: str | None = None) -> str:
        """Store the request, every candidate of ``result.plans`` and the rejections in one
        transaction; returns the new plan id."""
        status = PlanStatus(status)
        plan_id = new_id()

        def work(session: Session) -> str:
            session.add(_request_row(plan_id=plan_id, request=result.request, status=status, result=result, ray_job_id=ray_job_id))
            # The request row is written before the candidates are built: a candidate that cannot
            # be stored rolls the request back with it (tests/store/test_store.py checks that).
            session.flush()
            for position, candidate in enumerate(result.plans):
                session.add(_candidate_row(plan_id=plan_id, position=position, candidate=candidate))
            session.flush()
            return plan_id

        return self._run(work, write=True)

    def record_measurement(self, *, candidate_id: str, measurement: Measurement, ranks: Sequence[Measurement] = ()) -> str:
        """Store a real run against a stored candidate (id or unique prefix), with each rank's
        measurement when several ranks ran it; returns its id."""

        def work(session: Session) -> str:
            full_id = self._resolve(session, CandidateRow, candidate_id, what="candidate")
            row = _measurement_row(candidate_id=full_id, measurement=measurement, ranks=ranks)
            session.add(row)
            return row.id

        return self._run(work, write=True)

    def record_single_measurement(
        self, *, request: PlanRequest, candidate: Candidate, measurement: Measurement
    ) -> tuple[str, str]:
        """For ``planner measure``: a ``measured`` plan holding one candidate and its run, in one
        transaction. Returns (plan id, candidate id)."""
        plan_id = new_id()

        def work(session: Session) -> tuple[str, str]:
            session.add(_request_row(plan_id=plan_id, request=request, status=PlanStatus.MEASURED, result=None, ray_job_id=None))
            session.flush()
            row = _candidate_row(plan_id=plan_id, position=0, candidate=candidate)
            session.add(row)
            session.flush()
            session.add(_measurement_row(candidate_id=row.id, measurement=measurement))
            return plan_id, row.id

        return self._run(work, write=True)

    def set_status(
        self, *, plan_id: str, status: PlanStatus | str, reason: str | None = None, ray_job_id: str | None = None,
        lease_s: float | None = None,
    ) -> None:
        """Move a plan to ``status`` with why (``reason``), and note the Ray job verifying it when
        given. ``verifying`` takes a lease of ``lease_s`` (default ``DEFAULT_LEASE_S``): the driver
        renews it (``renew_lease``) while it runs, or readers mark the plan failed (its driver died).
        Other statuses hold no lease."""
        status = parse_status(status) if isinstance(status, str) else status

        def work(session: Session) -> None:
            row = session.get(PlanRequestRow, self._resolve(session, PlanRequestRow, plan_id, what="plan"))
            assert row is not None
            values = status_values(plan_id=row.id, current=PlanStatus(row.status), status=status, reason=reason,
                                   ray_job_id=ray_job_id, lease_s=lease_s, now=utcnow())
            for column, value in values.items():
                setattr(row, column, value)

        self._run(work, write=True)

    def renew_lease(self, *, plan_id: str, lease_s: float) -> None:
        """The verifying driver is alive: push the plan's lease ``lease_s`` seconds from now."""

        def work(session: Session) -> None:
            row = session.get(PlanRequestRow, self._resolve(session, PlanRequestRow, plan_id, what="plan"))
            assert row is not None
            if row.status == str(PlanStatus.VERIFYING):
                row.lease_until = utcnow() + timedelta(seconds=lease_s)

        self._run(work, write=True)

    def expire_stale_verifications(self) -> int:
        """Mark ``failed`` every ``verifying`` plan whose lease ran out (its driver died or was
        killed); returns how many. Readers call it, so no plan stays ``verifying`` forever."""
        r = PlanRequestRow
        now = utcnow()
        stale = (r.status == str(PlanStatus.VERIFYING)) & (r.lease_until < now)
        # one cheap SELECT on the status index in the common case: nothing is stale
        if self._run(lambda s: s.scalars(select(r.id).where(stale).limit(1)).first(), write=False) is None:
            return 0

        def work(session: Session) -> int:
            rows = session.scalars(select(r).where(stale)).all()
            for row in rows:
                for column, value in expired_values(lease_until=row.lease_until, now=now).items():
                    setattr(row, column, value)
            return len(rows)

        return self._run(work, write=True)

    # ---- reading ---------------------------------------------------------------------------
    @staticmethod
    def _load_plan(session: Session, plan_id: str) -> StoredPlan:
        query = (
            select(PlanRequestRow)
            .where(PlanRequestRow.id == plan_id)
            .options(selectinload(PlanRequestRow.candidates).selectinload(CandidateRow.measurements))
        )
        return session.scalars(query).one().to_entity()

    def get_plan(self, *, plan_id: str) -> StoredPlan:
        """The plan with this id or unique id prefix, with its candidates and measurements."""
        self.expire_stale_verifications()
        return self._run(
            lambda s: self._load_plan(s, self._resolve(s, PlanRequestRow, plan_id, what="plan")), write=False
        )

    def find_same_request(self, *, request: PlanRequest) -> StoredPlan | None:
        """The stored plan of the same request (equal ``PlanRequest.identity()``): the newest
        verified one if any, else the newest. ``planner measure`` records are not plans and are never returned."""
        r = PlanRequestRow
        query = (
            select(r.id)
            .where(
                *(getattr(r, column) == value for column, value in request.identity().items()),
                r.status != str(PlanStatus.MEASURED),
            )
            .order_by(case((r.status == str(PlanStatus.VERIFIED), 0), else_=1), r.created_at.desc(), r.id.desc())
            .limit(1)
        )

        self.expire_stale_verifications()

        def work(session: Session) -> StoredPlan | None:
            plan_id = session.scalars(query).first()
            return None if plan_id is None else self._load_plan(session, plan_id)

        return self._run(work, write=False)

    def find_verified(self, *, request: PlanRequest) -> StoredPlan | None:
        """The newest verified plan of an identical request, or None: what ``planner suggest``
        and ``POST /v1/plans`` answer from instead of planning again."""
        found = self.find_same_request(request=request)
        return found if found is not None and found.verified else None

    def history(
        self,
        *,
        model: str | None = None,
        gpu: str | None = None,
        status: PlanStatus | str | None = None,
        since: datetime | None = None,
        limit: int = 20,
        offset: int = 0,
        after: HistoryCursor | None = None,
    ) -> list[PlanSummary]:
        """Past plans, newest first (by creation time, then id). ``model`` matches any part of the
        model id and ``gpu`` the whole GPU name, both ignoring case; ``after`` starts after that
        plan (a keyset cursor: ``HistoryCursor.of(the last row of a page)``) and ``offset`` skips
        that many more.

        One statement whatever the page: the page is cut in SQL (``LIMIT``/``OFFSET`` on the
        creation-time index, after the keyset condition) and each row's rank-1 label, candidate
        and run counts are subqueries over that page only. Nothing is loaded to be skipped and no
        id list is sent back, so a page deep in 100,000 plans stays under the drivers' bind
        parameter limits (65,535 on SQLite and PostgreSQL) and costs about what the first does."""
        check_page(limit=limit, offset=offset, model=model, gpu=gpu)
        r, c, m = PlanRequestRow, CandidateRow, MeasurementRow
        page = select(r.id, r.created_at, r.status, r.model_id, r.gpu, r.gpu_count, r.target_batch, r.seq_len)
        if model:
            page = page.where(r.model_id.icontains(model, autoescape=True))
        if gpu:
            page = page.where(func.lower(r.gpu) == gpu.lower())
        if status is not None:
            page = page.where(r.status == str(parse_status(status) if isinstance(status, str) else status))
        if since is not None:
            page = page.where(r.created_at >= since)
        if after is not None:
            page = page.where(or_(r.created_at < after.created_at,
                                  and_(r.created_at == after.created_at, r.id < after.id)))
        p = page.order_by(r.created_at.desc(), r.id.desc()).limit(limit).offset(offset).subquery("page")
        top = select(c.label).where(c.plan_id == p.c.id, c.rank == 1).limit(1).scalar_subquery()
        candidates = select(func.count()).select_from(c).where(c.plan_id == p.c.id).scalar_subquery()
        runs = (select(func.count()).select_from(m).join(c, m.candidate_id == c.id)
                .where(c.plan_id == p.c.id).scalar_subquery())
        query = select(p, top.label("top"), candidates.label("n_candidates"), runs.label("n_runs")).order_by(
            p.c.created_at.desc(), p.c.id.desc())
        self.expire_stale_verifications()

        def work(session: Session) -> list[PlanSummary]:
            return [summary_entity(row) for row in session.execute(query)]

        return self._run(work, write=False)

    # ---- calibration -----------------------------------------------------------------------
    def measured_runs(self, *, gpu: str) -> list[MeasuredRun]:
        """Every stored run that ended ``ok`` on ``gpu`` (the stored request's GPU, any case),
        oldest first, with the configuration it ran."""
        c, m, r = CandidateRow, MeasurementRow, PlanRequestRow
        query = (
            select(m, c, r).join(c, m.candidate_id == c.id).join(r, c.plan_id == r.id)
            .where(func.lower(r.gpu) == gpu.lower(), m.outcome == "ok")
            .order_by(m.recorded_at, m.id)
        )

        def work(session: Session) -> list[MeasuredRun]:
            return [
                MeasuredRun(plan_id=req.id, request=req.request_entity(), candidate=cand.candidate_entity(),
                            measurement=meas.to_entity())
                for meas, cand, req in session.execute(query).all()
            ]

        return self._run(work, write=False)

    def measured_gpus(self) -> dict[str, int]:
        """GPU name -> number of ``ok`` runs stored for it."""
        c, m, r = CandidateRow, MeasurementRow, PlanRequestRow
        query = (
            select(r.gpu, func.count()).select_from(m).join(c, m.candidate_id == c.id).join(r, c.plan_id == r.id)
            .where(m.outcome == "ok").group_by(r.gpu).order_by(r.gpu)
        )
        return self._run(lambda session: {gpu: n for gpu, n in session.execute(query).all()}, write=False)

    def save_calibration(
        self, *, gpu: str, values: "CalibrationValues", defaults: "CalibrationValues", report: Mapping[str, Any],
        measurement_ids: list[str], planner_version: str = "",
    ) -> "Calibration":
        """Store a calibration of ``gpu`` as its active one (the previous one stays, inactive)."""
        row = CalibrationRow(
            gpu=gpu, created_at=utcnow(), active=True, dropped_at=None, measurements=len(measurement_ids),
            constants=canonical_json(values.to_dict(), what="the calibration"),
            defaults=canonical_json(defaults.to_dict(), what="the calibration's defaults"),
            report=canonical_json(dict(report), what="the calibration's report"),
            measurement_ids=list(measurement_ids), planner_version=planner_version[:32],
        )

        def work(session: Session) -> "Calibration":
            self._drop_active(session, gpu)
            session.add(row)
            session.flush()
            return row.to_entity()

        return self._run(work, write=True)

    @staticmethod
    def _drop_active(session: Session, gpu: str) -> list[CalibrationRow]:
        rows = session.scalars(select(CalibrationRow).where(CalibrationRow.gpu == gpu, CalibrationRow.active.is_(True))).all()
        now = utcnow()
        for old in rows:
            old.active, old.dropped_at = False, now
        session.flush()
        return list(rows)

    def active_calibration(self, *, gpu: str) -> "Calibration | None":
        """The calibration plans on ``gpu`` use, or None (the model's defaults)."""
        k = CalibrationRow
        query = select(k).where(k.gpu == gpu, k.active.is_(True)).order_by(k.id.desc()).limit(1)

        def work(session: Session) -> "Calibration | None":
            row = session.scalars(query).first()
            return None if row is None else row.to_entity()

        return self._run(work, write=False)

    def reset_calibration(self, *, gpu: str) -> "Calibration | None":
        """Drop ``gpu``'s active calibration (plans go back to the defaults); returns the dropped
        one as it was, or None when there was none."""

        def work(session: Session) -> "Calibration | None":
            dropped = self._drop_active(session, gpu)
            return max((row.to_entity() for row in dropped), key=lambda c: c.id, default=None)

        return self._run(work, write=True)

    def calibrations(self, *, gpu: str | None = None) -> list["Calibration"]:
        """Every calibration (of ``gpu``), newest first, active or not."""
        k = CalibrationRow
        query = select(k).order_by(k.id.desc())
        if gpu:
            query = query.where(k.gpu == gpu)
        return self._run(lambda session: [row.to_entity() for row in session.scalars(query).all()], write=False)

    def count_plans(self) -> int:
        """Number of stored plan requests (of every status)."""
        return self._run(lambda s: s.scalar(select(func.count()).select_from(PlanRequestRow)) or 0, write=False)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store(url={safe_url(self.url)!r})"


def open_store(*, url: str | None = None, create: bool = True) -> Store:
    """Open the store at ``url`` (default: ``default_database_url()``).

    A brand-new database (none of the planner's tables, no revision stamp) gets the schema on
    first use when ``create``; a database whose schema is behind raises ``SchemaOutOfDateError``
    (run ``planner db upgrade``); an unreachable one raises a one-line ``StoreError``.
    """
    from planner.store.schema import ensure_schema

    url = url or default_database_url()
    if not create:
        _check_sqlite_file_exists(url)
    engine = make_engine(url)
    try:
        retry_locked(lambda: ensure_schema(engine, url=url, create=create))
    except StoreError:
        engine.dispose()
        raise
    except (DBAPIError, OSError) as exc:
        engine.dispose()
        raise open_failure(url, exc) from None
    return Store(engine=engine, url=url)


def _check_sqlite_file_exists(url: str) -> None:
    """Opening an SQLite file that does not exist creates it (an empty file, before any schema):
    a store opened only to read must not leave one behind."""
    from pathlib import Path

    from sqlalchemy.engine import make_url

    from planner.store.engine import missing_database

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - make_engine reports a bad URL in its own words
        return
    path = parsed.database
    if parsed.get_backend_name() == "sqlite" and path and path != ":memory:" and not Path(path).exists():
        raise missing_database(safe_url(url))


def _with_engine(url: str | None, work: Callable[[Engine, str], T]) -> T:
    url = url or default_database_url()
    engine = make_engine(url)
    try:
        return work(engine, url)
    except (DBAPIError, OSError) as exc:
        raise open_failure(url, exc) from None
    finally:
        engine.dispose()


def upgrade_database(*, url: str | None = None) -> tuple[str | None, str]:
    """Apply pending migrations (``planner db upgrade``); returns (revision before, head)."""
    from planner.store.schema import upgrade

    return _with_engine(url, lambda engine, u: retry_locked(lambda: upgrade(engine, url=u)))


def database_revision(*, url: str | None = None) -> "SchemaState":
    """Where the database's schema stands against this planner's head; changes nothing."""
    from planner.store.schema import schema_state

    def look(engine: Engine, _url: str) -> "SchemaState":
        with engine.connect() as conn:
            return schema_state(conn)

    return _with_engine(url, look)


__all__ = ["MAX_HISTORY", "Store", "database_revision", "upgrade_database", "canonical_json", "constraints_hash", "new_id", "open_store", "parse_since"]
