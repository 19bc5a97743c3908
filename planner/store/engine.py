"""Where the store lives and how it connects: URLs, engines, SQLite's locking, readable errors.

SQLite (the default) is opened in WAL mode so readers never block the one writer, with a busy
timeout, and every write transaction starts with ``BEGIN IMMEDIATE``: taking the write lock up
front means a waiting writer queues on the busy handler instead of failing half-way with
``SQLITE_BUSY`` when it upgrades a read lock (https://www.sqlite.org/lang_transaction.html,
"BEGIN IMMEDIATE"; https://www.sqlite.org/wal.html, "Sometimes Queries Return SQLITE_BUSY").
Whatever still comes back as ``database is locked`` is retried with bounded backoff.

SQLAlchemy is imported by the functions that make or read engines, not by this module: the
SQLite path of the one-shot commands (``planner.store.lite``) uses the locations, settings and
retries here without it.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from planner.errors import StoreError

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy import Engine

T = TypeVar("T")

#: Environment variable naming the database (any SQLAlchemy URL).
DATABASE_URL_ENV = "PLANNER_DATABASE_URL"
#: Environment variable overriding the data directory (tests set it).
HOME_ENV = "PLANNER_HOME"
#: Execution option that makes the SQLite ``begin`` hook take the write lock at once.
WRITE_OPTION = "planner_write"

#: How long one SQLite statement waits on another process's lock before SQLITE_BUSY.
SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Retries of a whole write transaction that still failed with ``database is locked``.
LOCKED_RETRIES = 8
#: Backoff of those retries: first sleep and cap, seconds (doubling, with jitter).
LOCKED_BACKOFF_S = (0.05, 2.0)


def data_dir() -> Path:
    """``$PLANNER_HOME`` when set, else the XDG data directory (``~/.local/share/oom-planner``)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("oom-planner", appauthor=False))


def default_database_url() -> str:
    """``$PLANNER_DATABASE_URL`` if set, else the SQLite file ``<data dir>/planner.db``.

    The data directory is created on first use.
    """
    url = os.environ.get(DATABASE_URL_ENV, "").strip()
    if url:
        return url
    directory = data_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreError(
            f"cannot create the data directory {directory}: {exc.strerror}; "
            f"set {HOME_ENV} or {DATABASE_URL_ENV}"
        ) from None
    return f"sqlite:///{directory / 'planner.db'}"


def safe_url(url: str) -> str:
    """The URL with any password masked, for messages."""
    if "@" not in url:
        return url  # no credentials in it (the SQLite default): nothing to mask
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return text[0].strip() if text else type(orig).__name__


def open_failure(url: str, exc: BaseException) -> StoreError:
    """One line for a database that cannot be reached or opened."""
    return StoreError(
        f"cannot open database {safe_url(url)}: {_first_line(exc)}; check --db or {DATABASE_URL_ENV}"
    )


def db_failure(url: str, exc: BaseException) -> StoreError:
    """One line for a database error in the middle of work (connection lost, lock timeout...)."""
    return StoreError(f"database {safe_url(url)} failed: {_first_line(exc)}")


def configure_sqlite(dbapi_connection: Any, connection_record: Any = None) -> None:
    """The settings of every SQLite connection (SQLAlchemy's "connect" event, and ``planner.store.lite``)."""
    # Let SQLAlchemy's "begin" event emit BEGIN itself; pysqlite's own implicit BEGIN would
    # defer the lock and commit DDL early (SQLAlchemy docs, "Serializable isolation /
    # Savepoints / Transactional DDL" for pysqlite).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        # NORMAL is durable across application crashes in WAL mode and avoids an fsync per
        # commit (https://www.sqlite.org/pragma.html#pragma_synchronous).
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _on_sqlite_begin(conn: Any) -> None:
    write = conn.get_execution_options().get(WRITE_OPTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def make_engine(url: str) -> Engine:
    """An engine for ``url``; bad URLs and missing drivers are one-line ``StoreError``s.

    Nothing connects yet: the first connection is made (and its failure reported) by the caller.
    """
    from sqlalchemy import create_engine, event
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
            event.listen(engine, "connect", configure_sqlite)
            event.listen(engine, "begin", _on_sqlite_begin)
            return engine
        return create_engine(parsed, pool_pre_ping=True)
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise StoreError(
            f"cannot open database {safe_url(url)}: not a database URL this planner can use ({exc}); "
            "write e.g. sqlite:///path/planner.db or postgresql+psycopg://user@host/db"
        ) from None
    except ImportError as exc:
        raise StoreError(
            f"cannot open database {safe_url(url)}: its driver is not installed ({exc}); "
            "install the driver the URL names (pip install 'oom-planner[postgres]' for postgresql+psycopg)"
        ) from None


def is_sqlite_locked(exc: BaseException) -> bool:
    """SQLite's ``database is locked`` / ``database table is locked`` / busy errors, as SQLAlchemy
    wraps them (``OperationalError.orig``) or as sqlite3 raises them."""
    import sqlite3

    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc)
    else:
        # an SQLAlchemy error can only exist once SQLAlchemy is imported: no import needed to ask
        sa_exc = sys.modules.get("sqlalchemy.exc")
        if sa_exc is None or not isinstance(exc, sa_exc.OperationalError):
            return False
        text = str(getattr(exc, "orig", exc))
    return "locked" in text.lower() or "busy" in text.lower()


def retry_locked(work: Callable[[], T], *, sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``work()``, retrying it whole while SQLite reports the database locked."""
    first, cap = LOCKED_BACKOFF_S
    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - only SQLite's lock errors are retried, the rest re-raised
            if attempt == LOCKED_RETRIES or not is_sqlite_locked(exc):
                raise
            delay = min(cap, first * 2**attempt)
            sleep(delay * (0.5 + random.random()))  # jitter: waiters do not retry in lockstep
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = [
    "DATABASE_URL_ENV",
    "configure_sqlite",
    "data_dir",
    "db_failure",
    "default_database_url",
    "is_sqlite_locked",
    "make_engine",
    "open_failure",
    "retry_locked",
    "safe_url",
]
