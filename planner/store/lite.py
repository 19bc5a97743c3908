"""The plan store's SQLite file through the standard library, for the one-shot planning commands.

Why: ``planner suggest`` and ``planner estimate`` ask the store three things (the device's active
calibration, the stored plan of the same request, and to keep the new plan), and importing
SQLAlchemy to ask them cost more than everything else the command does: 1.27 G of the 3.49 G
instructions of a cold ``planner suggest`` (callgrind, SQLAlchemy 2.1: ``import sqlalchemy`` 0.80 G,
``sqlalchemy.orm`` 0.25 G, the declarative models 0.22 G). On the embedded default (an SQLite
file whose schema is at this planner's head) those three go through ``sqlite3`` here; anything
else (a database to create or upgrade, PostgreSQL, a URL with options, a stale verification to
expire) goes to the SQLAlchemy store of ``planner.store.api``, which stays the store of every other
command, of the service and of the migrations.

Same transactions, settings and values as the SQLAlchemy store: the connection gets
``engine.configure_sqlite``'s pragmas, a write takes the lock at ``BEGIN IMMEDIATE`` and is retried
by ``engine.retry_locked``, errors are ``engine.db_failure``'s one line, rows are built and read by
``planner.store.codec``, and the columns are encoded as SQLAlchemy's SQLite dialect encodes them
(JSON as ``json.dumps`` text, timestamps as naive UTC text ``YYYY-MM-DD HH:MM:SS.ffffff``,
booleans as 0/1). tests/test_store_lite.py writes through both stores and compares the stored
rows, and checks the column lists below against ``planner.store.dbmodels``.
"""

from __future__ import annotations

import json
import os
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar
from urllib.parse import quote

from planner.results import PlanRequest, PlanResult
from planner.store import codec
from planner.store.engine import (
    SQLITE_BUSY_TIMEOUT_MS,
    configure_sqlite,
    db_failure,
    default_database_url,
    missing_database,
    open_failure,
    retry_locked,
)
from planner.store.entities import PlanStatus, StoredPlan
from planner.store.revision import HEAD_REVISION, VERSION_TABLE

if TYPE_CHECKING:  # pragma: no cover
    from planner.calibration.values import Calibration
    from planner.store.api import Store

T = TypeVar("T")

#: Each table's columns in the models' order, and which of them are JSON, timestamps or booleans
#: (``planner.store.dbmodels``; tests/test_store_lite.py checks every list against it).
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
))
CALIBRATIONS = ("calibrations", (
    "id", "gpu", "created_at", "active", "dropped_at", "measurements", "constants", "defaults", "report",
    "measurement_ids", "planner_version",
))
JSON_COLUMNS = frozenset({"constraints", "rejected", "config", "memory", "throughput", "library_versions",
                          "constants", "defaults", "report", "measurement_ids"})
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
    """The three questions of a planning command, on an SQLite file at head (``open_for_command``)."""

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

    # ---- the three questions ---------------------------------------------------------------
    def active_calibration(self, *, gpu: str) -> "Calibration | None":
        """As ``Store.active_calibration``."""
        query = _select(CALIBRATIONS, "WHERE gpu = ? AND active = 1 ORDER BY id DESC LIMIT 1")
        found = self._guarded(lambda c: c.execute(query, (gpu,)).fetchone(), write=False)
        return None if found is None else codec.calibration_entity(_row(CALIBRATIONS[1], found))

    def find_same_request(self, *, request: PlanRequest) -> StoredPlan | None:
        """As ``Store.find_same_request``: the newest verified plan of an identical request, else
        the newest; never a ``planner measure`` record."""
        query = (
            "SELECT id FROM plan_requests WHERE model_fingerprint = ? AND gpu = ? AND gpu_count = ? AND "
            "target_batch = ? AND seq_len = ? AND constraints_hash = ? AND status != ? "
            "ORDER BY CASE WHEN status = ? THEN 0 ELSE 1 END, created_at DESC, id DESC LIMIT 1"
        )
        args = (request.model_fingerprint, request.gpu, request.gpu_count, request.target_batch, request.seq_len,
                codec.constraints_hash(request.constraints), str(PlanStatus.MEASURED), str(PlanStatus.VERIFIED))
        self.expire_stale_verifications()

        def work(conn: sqlite3.Connection) -> StoredPlan | None:
            found = conn.execute(query, args).fetchone()
            return None if found is None else _load_plan(conn, found[0])

        return self._guarded(work, write=False)

    def find_verified(self, *, request: PlanRequest) -> StoredPlan | None:
        """As ``Store.find_verified``."""
        found = self.find_same_request(request=request)
        return found if found is not None and found.verified else None

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

    def expire_stale_verifications(self) -> int:
        """As ``Store.expire_stale_verifications``; the rare plan to expire (its verifying driver
        died) is written by the SQLAlchemy store."""
        now = _encode("lease_until", codec.utcnow())
        query = "SELECT id FROM plan_requests WHERE status = ? AND lease_until < ? LIMIT 1"
        if self._guarded(lambda c: c.execute(query, (str(PlanStatus.VERIFYING), now)).fetchone(), write=False) is None:
            return 0
        from planner.store.api import open_store

        with open_store(url=self.url) as store:
            return store.expire_stale_verifications()

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


def open_for_command(*, url: str | None = None, create: bool = True) -> "LiteStore | Store":
    """The store a one-shot planning command asks: the lite store on an SQLite file at head, else
    ``open_store(url=url, create=create)``. With ``create=False`` a missing SQLite file raises
    ``DatabaseMissingError`` (and is not created)."""
    url = url or default_database_url()
    lite = LiteStore.open(url)
    if lite is not None:
        return lite
    path = sqlite_path(url)
    if not create and path is not None and not os.path.exists(path):
        raise missing_database(url)
    from planner.store.api import open_store

    return open_store(url=url, create=create)


__all__ = ["LiteStore", "open_for_command", "sqlite_path"]
