"""The plan store's SQLite file through the standard library: the one-shot commands' store.

Why: ``planner suggest`` and ``planner estimate`` ask the store three things (the device's active
calibration, the stored plan of the same request, and to keep the new plan), and importing
SQLAlchemy to ask them cost more than everything else the command does: 1.27 G of the 3.49 G
instructions of a cold ``planner suggest`` (callgrind, SQLAlchemy 2.1: ``import sqlalchemy`` 0.80 G,
``sqlalchemy.orm`` 0.25 G, the declarative models 0.22 G). On the embedded default (an SQLite
file whose schema is at this planner's head) ``open_plan_store`` hands out this store, which
answers all of ``planner.store.interface.PlanStore`` through ``sqlite3``; anything else (a
database to create or upgrade, PostgreSQL, a URL with options, the service's shared store, the
calibration's writes) goes to the SQLAlchemy store of ``planner.store.api``.

Same transactions, settings and values as the SQLAlchemy store: the connection gets
``engine.configure_sqlite``'s pragmas, a write takes the lock at ``BEGIN IMMEDIATE`` and is retried
by ``engine.retry_locked``, errors are ``engine.db_failure``'s one line, rows are built and read by
``planner.store.codec``, and the columns are encoded as SQLAlchemy's SQLite dialect encodes them
(JSON as ``json.dumps`` text, timestamps as naive UTC text ``YYYY-MM-DD HH:MM:SS.ffffff``,
booleans as 0/1). tests/store/test_store_lite.py writes through both stores and compares the stored
rows, and checks the column lists below against ``planner.store.dbmodels``.
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, TypeVar
from urllib.parse import quote

from planner.results import Candidate, Measurement, PlanRequest, PlanResult
from planner.store import codec
from planner.store.engine import (
    SQLITE_BUSY_TIMEOUT_MS,
    configure_sqlite,
    db_failure,
    open_failure,
    retry_locked,
)
from planner.store.entities import HistoryCursor, PlanStatus, PlanSummary, StoredPlan, parse_status
from planner.store.revision import HEAD_REVISION, VERSION_TABLE

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration.values import Calibration

T = TypeVar("T")

#: Each table's columns in the models' order, and which of them are JSON, timestamps or booleans
#: (``planner.store.dbmodels``; tests/store/test_store_lite.py checks every list against it).
REQUESTS = ("plan_requests", (
    "id", "created_at", "model_id", "model_fingerprint", "gpu", "gpu_count", "gpu_memory_bytes", "target_batch",
    "seq_len", "constraints", "constraints_hash", "planner_version", "status", "status_reason", "status_changed_at",
    "lease_until", "ray_job_id", "rejected", "searched", "usable_bytes", "safety_margin_bytes",
))
CANDIDATES = ("plan_candidates", (
    "id", "plan_id", "position", "rank", "label", "config", "memory", "throughput", "fits",
    "predicted_peak_allocated_bytes", "predicted_process_total_bytes", "predicted_step_s", "predicted_tokens_per_s",
))
MEASUREMENTS = ("plan_measurements", (
    "id", "candidate_id", "recorded_at", "outcome", "device", "peak_allocated_bytes", "peak_reserved_bytes",
    "process_total_bytes", "step_s", "tokens_per_s", "library_versions", "node", "started_at", "finished_at", "error",
    "ranks",
))
CALIBRATIONS = ("calibrations", (
    "id", "gpu", "created_at", "active", "dropped_at", "measurements", "constants", "defaults", "report",
    "measurement_ids", "planner_version",
))
JSON_COLUMNS = frozenset({"constraints", "rejected", "config", "memory", "throughput", "library_versions",
                          "constants", "defaults", "report", "measurement_ids", "ranks"})
TIME_COLUMNS = frozenset({"created_at", "status_changed_at", "lease_until", "recorded_at", "started_at",
                          "finished_at", "dropped_at"})
BOOL_COLUMNS = frozenset({"fits", "active"})

_SQLITE_PREFIX = "sqlite:///"


def sqlite_path(url: str) -> str | None:
    """The file of a plain ``sqlite:///<path>`` URL (what ``default_database_url`` makes); None
    for any other URL, or one whose path SQLAlchemy would read differently (options after ``?``,
    percent-escapes, an in-memory database)."""
    if not url.startswith(_SQLITE_PREFIX):
        return None
    path = url[len(_SQLITE_PREFIX):]
    if not path or path == ":memory:" or any(ch in path for ch in "?%#"):
        return None
    return path


def _encode(column: str, value: Any) -> Any:
    if value is None:
        return None
    if column in JSON_COLUMNS:
        return json.dumps(value)  # SQLAlchemy's JSON type: the dialect's json_serializer, json.dumps
    if column in TIME_COLUMNS:  # UTCDateTime: naive UTC, then sqlite.DATETIME's storage format
        v = value.astimezone(timezone.utc)
        return f"{v:%Y-%m-%d %H:%M:%S}.{v.microsecond:06d}"
    if column in BOOL_COLUMNS:
        return int(value)
    return value


def _decode(column: str, value: Any) -> Any:
    if value is None:
        return None
    if column in JSON_COLUMNS:
        return json.loads(value)
    if column in TIME_COLUMNS:
        return datetime.fromisoformat(value).replace(tzinfo=timezone.utc)
    if column in BOOL_COLUMNS:
        return bool(value)
    return value


def _row(columns: tuple[str, ...], values: tuple) -> SimpleNamespace:
    return SimpleNamespace(**{c: _decode(c, v) for c, v in zip(columns, values)})


def _select(table: tuple[str, tuple[str, ...]], where: str, *, prefix: str = "") -> str:
    name, columns = table
    listed = ", ".join(f"{prefix}{c}" for c in columns)
    return f"SELECT {listed} FROM {name} {where}"


class LiteStore:
    """``PlanStore`` on an SQLite file at head (``open_plan_store`` makes it)."""

    def __init__(self, *, path: str, url: str) -> None:
        self.url, self._path = url, path

    @classmethod
    def open(cls, url: str) -> "LiteStore | None":
        """The lite store of ``url``, or None when the SQLAlchemy store must answer (not a plain
        SQLite file, no file yet, a schema not at this planner's head)."""
        path = sqlite_path(url)
        if path is None or not os.path.isfile(path):
            return None
        store = cls(path=path, url=url)
        try:
            stamped = store._run(lambda c: [r[0] for r in c.execute(f"SELECT version_num FROM {VERSION_TABLE}")],
                                 write=False)
        except sqlite3.OperationalError:
            return None  # no revision table: a new or foreign database, for open_store to judge
        except sqlite3.DatabaseError as exc:  # not a database at all
            raise open_failure(url, exc) from None
        return store if stamped == [HEAD_REVISION] else None

    # ---- transactions ----------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        # mode=rw: an SQLite file that vanished is an error here, never a new empty file
        conn = sqlite3.connect(f"file:{quote(self._path)}?mode=rw", uri=True, isolation_level=None,
                               timeout=SQLITE_BUSY_TIMEOUT_MS / 1000)
        configure_sqlite(conn)
        return conn

    @contextmanager
    def _transaction(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            yield conn
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

    def _run(self, work: Callable[[sqlite3.Connection], T], *, write: bool) -> T:
        def once() -> T:
            with self._transaction(write=write) as conn:
                return work(conn)

        return retry_locked(once) if write else once()

    def _guarded(self, work: Callable[[sqlite3.Connection], T], *, write: bool) -> T:
        """``_run`` with the database's failures as ``db_failure``'s one line."""
        try:
            return self._run(work, write=write)
        except sqlite3.Error as exc:
            raise db_failure(self.url, exc) from None

    # ---- ids -------------------------------------------------------------------------------
    @staticmethod
    def _resolve(conn: sqlite3.Connection, table: str, prefix: str, *, what: str) -> str:
        """As ``Store._resolve`` (SQLAlchemy's ``startswith`` is ``LIKE ? || '%'``; the key is hex)."""
        key = codec.id_prefix(prefix, what=what)
        found = [r[0] for r in conn.execute(f"SELECT id FROM {table} WHERE id LIKE ? || '%' LIMIT 2", (key,))]
        return codec.resolved_id(found, prefix, what=what)

    # ---- writing ---------------------------------------------------------------------------
    def save_plan(self, *, result: PlanResult, status: PlanStatus = PlanStatus.PLANNED, ray_job_id: str | None = None) -> str:
        """As ``Store.save_plan``: the request and every candidate in one transaction; the rows
        are built before it begins, so one that cannot be stored leaves nothing behind."""
        plan_id = codec.new_id()
        request = codec.request_values(plan_id=plan_id, request=result.request, status=PlanStatus(status),
                                       result=result, ray_job_id=ray_job_id)
        candidates = [codec.candidate_values(plan_id=plan_id, position=n, candidate=c) for n, c in enumerate(result.plans)]

        def work(conn: sqlite3.Connection) -> str:
            _insert(conn, REQUESTS[0], request)
            for values in candidates:
                _insert(conn, CANDIDATES[0], values)
            return plan_id

        return self._guarded(work, write=True)

    def record_measurement(self, *, candidate_id: str, measurement: Measurement, ranks: Sequence[Measurement] = ()) -> str:
        """As ``Store.record_measurement``."""

        def work(conn: sqlite3.Connection) -> str:
            full_id = self._resolve(conn, CANDIDATES[0], candidate_id, what="candidate")
            values = codec.measurement_values(candidate_id=full_id, measurement=measurement, ranks=ranks)
            _insert(conn, MEASUREMENTS[0], values)
            return values["id"]

        return self._guarded(work, write=True)

    def record_single_measurement(self, *, request: PlanRequest, candidate: Candidate,
                                  measurement: Measurement) -> tuple[str, str]:
        """As ``Store.record_single_measurement``."""
        plan_id = codec.new_id()
        plan = codec.request_values(plan_id=plan_id, request=request, status=PlanStatus.MEASURED, result=None,
                                    ray_job_id=None)
        one = codec.candidate_values(plan_id=plan_id, position=0, candidate=candidate)
        run = codec.measurement_values(candidate_id=one["id"], measurement=measurement)

        def work(conn: sqlite3.Connection) -> tuple[str, str]:
            _insert(conn, REQUESTS[0], plan)
            _insert(conn, CANDIDATES[0], one)
            _insert(conn, MEASUREMENTS[0], run)
            return plan_id, one["id"]

        return self._guarded(work, write=True)

    def set_status(self, *, plan_id: str, status: PlanStatus | str, reason: str | None = None,
                   ray_job_id: str | None = None, lease_s: float | None = None) -> None:
        """As ``Store.set_status`` (the same move check and lease, ``codec.status_values``)."""
        status = parse_status(status) if isinstance(status, str) else status

        def work(conn: sqlite3.Connection) -> None:
            full_id = self._resolve(conn, REQUESTS[0], plan_id, what="plan")
            current = conn.execute("SELECT status FROM plan_requests WHERE id = ?", (full_id,)).fetchone()[0]
            values = codec.status_values(plan_id=full_id, current=PlanStatus(current), status=status, reason=reason,
                                         ray_job_id=ray_job_id, lease_s=lease_s, now=codec.utcnow())
            _update(conn, REQUESTS[0], full_id, values)

        self._guarded(work, write=True)

    def renew_lease(self, *, plan_id: str, lease_s: float) -> None:
        """As ``Store.renew_lease``: only a plan still ``verifying``."""

        def work(conn: sqlite3.Connection) -> None:
            full_id = self._resolve(conn, REQUESTS[0], plan_id, what="plan")
            until = _encode("lease_until", codec.utcnow() + timedelta(seconds=lease_s))
            conn.execute("UPDATE plan_requests SET lease_until = ? WHERE id = ? AND status = ?",
                         (until, full_id, str(PlanStatus.VERIFYING)))

        self._guarded(work, write=True)

    def expire_stale_verifications(self) -> int:
        """As ``Store.expire_stale_verifications``: one cheap look first, the write only when a
        plan's lease ran out (its verifying driver died)."""
        now = codec.utcnow()
        stale = "FROM plan_requests WHERE status = ? AND lease_until < ?"
        args = (str(PlanStatus.VERIFYING), _encode("lease_until", now))
        if self._guarded(lambda c: c.execute(f"SELECT id {stale} LIMIT 1", args).fetchone(), write=False) is None:
            return 0

        def work(conn: sqlite3.Connection) -> int:
            rows = conn.execute(f"SELECT id, lease_until {stale}", args).fetchall()
            for plan_id, lease_until in rows:
                _update(conn, REQUESTS[0], plan_id,
                        codec.expired_values(lease_until=_decode("lease_until", lease_until), now=now))
            return len(rows)

        return self._guarded(work, write=True)

    # ---- reading ---------------------------------------------------------------------------
    def get_plan(self, *, plan_id: str) -> StoredPlan:
        """As ``Store.get_plan``."""
        self.expire_stale_verifications()
        return self._guarded(lambda c: _load_plan(c, self._resolve(c, REQUESTS[0], plan_id, what="plan")), write=False)

    def find_same_request(self, *, request: PlanRequest) -> StoredPlan | None:
        """As ``Store.find_same_request``: the newest verified plan of the same request
        (``PlanRequest.identity()``), else the newest; never a ``planner measure`` record."""
        identity = request.identity()
        query = (
            "SELECT id FROM plan_requests WHERE " + " AND ".join(f"{column} = ?" for column in identity)
            + " AND status != ? ORDER BY CASE WHEN status = ? THEN 0 ELSE 1 END, created_at DESC, id DESC LIMIT 1"
        )
        args = (*identity.values(), str(PlanStatus.MEASURED), str(PlanStatus.VERIFIED))
        self.expire_stale_verifications()

        def work(conn: sqlite3.Connection) -> StoredPlan | None:
            found = conn.execute(query, args).fetchone()
            return None if found is None else _load_plan(conn, found[0])

        return self._guarded(work, write=False)

    def find_verified(self, *, request: PlanRequest) -> StoredPlan | None:
        """As ``Store.find_verified``."""
        found = self.find_same_request(request=request)
        return found if found is not None and found.verified else None

    def history(self, *, model: str | None = None, gpu: str | None = None, status: PlanStatus | str | None = None,
                since: datetime | None = None, limit: int = 20, offset: int = 0,
                after: HistoryCursor | None = None) -> list[PlanSummary]:
        """As ``Store.history``, in the statement SQLAlchemy makes of it on SQLite: the page cut
        in a subquery, and each row's rank-1 label, candidate and run counts over that page only."""
        codec.check_page(limit=limit, offset=offset, model=model, gpu=gpu)
        where, args = [], []
        if model:  # SQLAlchemy's icontains(autoescape=True): lower() LIKE, '/' escaping % _ and /
            escaped = model.replace("/", "//").replace("%", "/%").replace("_", "/_")
            where.append("lower(model_id) LIKE '%' || lower(?) || '%' ESCAPE '/'")
            args.append(escaped)
        if gpu:
            where.append("lower(gpu) = ?")
            args.append(gpu.lower())
        if status is not None:
            where.append("status = ?")
            args.append(str(parse_status(status) if isinstance(status, str) else status))
        if since is not None:
            where.append("created_at >= ?")
            args.append(_encode("created_at", since))
        if after is not None:
            where.append("(created_at < ? OR (created_at = ? AND id < ?))")
            at = _encode("created_at", after.created_at)
            args += [at, at, after.id]
        query = (
            "SELECT p.id, p.created_at, p.status, p.model_id, p.gpu, p.gpu_count, p.target_batch, p.seq_len, "
            "(SELECT c.label FROM plan_candidates c WHERE c.plan_id = p.id AND c.rank = 1 LIMIT 1) AS top, "
            "(SELECT count(*) FROM plan_candidates c WHERE c.plan_id = p.id) AS n_candidates, "
            "(SELECT count(*) FROM plan_measurements m JOIN plan_candidates c ON m.candidate_id = c.id "
            "WHERE c.plan_id = p.id) AS n_runs "
            "FROM (SELECT id, created_at, status, model_id, gpu, gpu_count, target_batch, seq_len FROM plan_requests"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?) AS p ORDER BY p.created_at DESC, p.id DESC"
        )
        names = ("id", "created_at", "status", "model_id", "gpu", "gpu_count", "target_batch", "seq_len", "top",
                 "n_candidates", "n_runs")
        self.expire_stale_verifications()
        rows = self._guarded(lambda c: c.execute(query, (*args, limit, offset)).fetchall(), write=False)
        return [codec.summary_entity(_row(names, row)) for row in rows]

    def count_plans(self) -> int:
        """As ``Store.count_plans``."""
        return self._guarded(lambda c: c.execute("SELECT count(*) FROM plan_requests").fetchone()[0], write=False)

    def active_calibration(self, *, gpu: str) -> "Calibration | None":
        """As ``Store.active_calibration``."""
        query = _select(CALIBRATIONS, "WHERE gpu = ? AND active = 1 ORDER BY id DESC LIMIT 1")
        found = self._guarded(lambda c: c.execute(query, (gpu,)).fetchone(), write=False)
        return None if found is None else codec.calibration_entity(_row(CALIBRATIONS[1], found))

    def close(self) -> None:
        """Nothing to release: each transaction opens and closes its own connection."""

    def __enter__(self) -> "LiteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LiteStore(url={self.url!r})"


def _insert(conn: sqlite3.Connection, table: str, values: dict[str, Any]) -> None:
    columns = list(values)
    marks = ", ".join("?" * len(columns))
    conn.execute(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})",
                 [_encode(c, values[c]) for c in columns])


def _update(conn: sqlite3.Connection, table: str, row_id: str, values: dict[str, Any]) -> None:
    settings = ", ".join(f"{column} = ?" for column in values)
    conn.execute(f"UPDATE {table} SET {settings} WHERE id = ?", [*(_encode(c, v) for c, v in values.items()), row_id])


def _load_plan(conn: sqlite3.Connection, plan_id: str) -> StoredPlan:
    """The plan with its candidates (by position) and their measurements (by time, then id), as
    ``Store._load_plan`` loads them."""
    plan = _row(REQUESTS[1], conn.execute(_select(REQUESTS, "WHERE id = ?"), (plan_id,)).fetchone())
    rows = [_row(CANDIDATES[1], r) for r in
            conn.execute(_select(CANDIDATES, "WHERE plan_id = ? ORDER BY position"), (plan_id,))]
    runs: dict[str, list] = {row.id: [] for row in rows}
    measured = _select(MEASUREMENTS, "m JOIN plan_candidates c ON m.candidate_id = c.id "
                                     "WHERE c.plan_id = ? ORDER BY m.recorded_at, m.id", prefix="m.")
    for values in conn.execute(measured, (plan_id,)):
        run = _row(MEASUREMENTS[1], values)
        runs[run.candidate_id].append(codec.measurement_entity(run))
    candidates = tuple(codec.stored_candidate(row, tuple(runs[row.id])) for row in rows)
    return codec.plan_entity(plan, candidates)


__all__ = ["LiteStore", "sqlite_path"]
