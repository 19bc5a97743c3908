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
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from planner.errors import DatabaseMissingError, StoreError

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy import Engine

T = TypeVar("T")

#: Environment variable naming the database (any SQLAlchemy URL).
DATABASE_URL_ENV = "PLANNER_DATABASE_URL"
#: Environment variable naming a file that holds the database URL (the ``_FILE`` convention of
#: Docker and Kubernetes secrets, as the postgres image's POSTGRES_PASSWORD_FILE). A verification
#: job is handed this path, never the URL (``planner.verify.jobs``), so the password stays in a
#: file on the machines that mount it.
DATABASE_URL_FILE_ENV = "PLANNER_DATABASE_URL_FILE"
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
    """``$PLANNER_DATABASE_URL`` if set, else the URL in the file ``$PLANNER_DATABASE_URL_FILE``
    names, else the SQLite file ``<data dir>/planner.db``. Both variables set is refused: which
    one wins would be a guess.

    The data directory is created on first use.
    """
    url = os.environ.get(DATABASE_URL_ENV, "").strip()
    path = os.environ.get(DATABASE_URL_FILE_ENV, "").strip()
    if url and path:
        raise StoreError(f"both {DATABASE_URL_ENV} and {DATABASE_URL_FILE_ENV} are set: unset one of them")
    if path:
        return read_url_file(path)
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


def read_url_file(path: str) -> str:
    """The database URL held in the file at ``path`` (its first line, trimmed); one line naming
    the file, never its content, when it cannot be read or holds no URL."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            text = f.read(64 * 1024)
    except OSError as exc:
        raise StoreError(f"cannot read {DATABASE_URL_FILE_ENV} {path}: {exc.strerror or exc}; "
                         "give the path of a readable file that holds the database URL") from None
    except UnicodeDecodeError:
        raise StoreError(f"{DATABASE_URL_FILE_ENV} {path} is not a text file: it must hold the database URL") from None
    lines = text.strip().splitlines()
    url = lines[0].strip() if lines else ""
    if "://" not in url:
        raise StoreError(f"{DATABASE_URL_FILE_ENV} {path} holds no database URL: write one line such as "
                         "postgresql+psycopg://user:password@host:5432/db")
    return url


def url_has_credentials(url: str) -> bool:
    """Whether ``url`` carries a credential: a password in its user part, or a query value whose
    key is named like one (``?password=``, ``sslpassword``, ``passfile``...)."""
    return bool(url_secrets(url).credentials)


#: what a masked part of a URL reads as
MASK = "***"
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*:(?://)?)(?P<user>[^/?#]*)@")


def safe_url(url: str) -> str:
    """The URL as messages and logs may show it: the user part (name and password) and every
    query value masked, the driver, host, port and database kept, e.g.
    ``postgresql+psycopg://***@db:5432/planner?host=***&password=***``. A password may sit in the
    user part or in the query (``?password=``, libpq's ``?host=&password=`` form), and the user
    name is the other half of a login; what is left says where the database is."""
    text = str(url)
    base, sep, query = text.partition("?")
    base = _USERINFO.sub(lambda m: f"{m.group('head')}{MASK}@", base)
    if "://" not in base and "@" in base:  # not a URL's shape ("user:pw@host"): all before the @
        base = f"{MASK}@" + base.rpartition("@")[2]
    if not sep:
        return base
    query, hash_, _fragment = query.partition("#")
    masked = "&".join(f"{piece.partition('=')[0]}={MASK}" for piece in query.split("&") if piece)
    return f"{base}?{masked}" + ("#" + MASK if hash_ else "")


#: query keys whose values are credentials wherever they appear (libpq: password, sslpassword,
#: passfile; anything named like a secret)
_SECRET_KEYS = ("pass", "secret", "token", "key")


class Secrets:
    """What a message must not show: credentials (passwords, tokens), masked wherever they
    appear, and identities (a user name, a query value such as ``host=``), masked where they stand
    as a word of their own: the user ``postgres`` in 'authentication failed for user "postgres"',
    not in ``postgresql+psycopg://``. Values under 3 characters or all digits are left: masking
    every "5" of a message would hide more than it protects."""

    def __init__(self, credentials: Iterable[str] = (), identities: Iterable[str] = ()) -> None:
        keep = lambda parts: {p for p in parts if p and len(p) >= 3 and not p.isdigit()}  # noqa: E731
        self.credentials = tuple(sorted(keep(credentials), key=len, reverse=True))
        self.identities = tuple(sorted(keep(identities) - set(self.credentials), key=len, reverse=True))
        words = "|".join(re.escape(i) for i in self.identities)
        self._words = re.compile(rf"(?<![\w.+-])(?:{words})(?![\w.+-])") if words else None

    def __add__(self, other: "Secrets") -> "Secrets":
        return Secrets(self.credentials + other.credentials, self.identities + other.identities)

    def __bool__(self) -> bool:
        return bool(self.credentials or self.identities)

    def scrub(self, text: str) -> str:
        for secret in self.credentials:
            text = text.replace(secret, MASK)
        return self._words.sub(MASK, text) if self._words is not None else text


def url_secrets(url: str | None) -> Secrets:
    """The parts of ``url`` that ``safe_url`` masks, as written and percent-decoded: its password
    and the query values of keys named like secrets are credentials; the user name and the other
    query values identities. A driver's message may quote them (libpq: 'password authentication
    failed for user "..."', an option echoed from the connection string)."""
    if not url:
        return Secrets()
    from urllib.parse import unquote_plus

    base, _, query = str(url).partition("?")
    credentials: set[str] = set()
    identities: set[str] = set()
    match = _USERINFO.match(base)
    userinfo = match.group("user") if match and "://" in base else base.rpartition("@")[0] if "@" in base else ""
    user, _, password = userinfo.partition(":")
    identities.add(user)
    credentials.add(password)
    for piece in query.partition("#")[0].split("&"):
        key, _, value = piece.partition("=")
        (credentials if any(word in key.lower() for word in _SECRET_KEYS) else identities).add(value)
    decoded = lambda parts: parts | {unquote_plus(p) for p in parts}  # noqa: E731
    return Secrets(decoded(credentials), decoded(identities))


def _first_line(exc: BaseException, url: str) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    line = text[0].strip() if text else type(orig).__name__
    return url_secrets(url).scrub(line)


def open_failure(url: str, exc: BaseException) -> StoreError:
    """One line for a database that cannot be reached or opened."""
    return StoreError(
        f"cannot open database {safe_url(url)}: {_reason(exc, url)}; check --db or {DATABASE_URL_ENV}"
    )


def db_failure(url: str, exc: BaseException) -> StoreError:
    """One line for a database error in the middle of work (connection lost, lock timeout...)."""
    return StoreError(f"database {safe_url(url)} failed: {_reason(exc, url)}")


def _reason(exc: BaseException, url: str) -> str:
    """The driver's first line, or the deadline this thread's statement ran past
    (``planner.store.deadlines``: the service's watchdog closed its connection)."""
    from planner.store.deadlines import overrun

    seconds = overrun()
    if seconds is not None:
        return (f"no answer within {seconds:g} s (the connection was closed; the next request "
                "reconnects): the database is down, hung or overloaded")
    return _first_line(exc, url)


def configure_sqlite(dbapi_connection: Any, connection_record: Any = None, *,
                     busy_timeout_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> None:
    """The settings of every SQLite connection (SQLAlchemy's "connect" event, and ``planner.store.lite``)."""
    # Let SQLAlchemy's "begin" event emit BEGIN itself; pysqlite's own implicit BEGIN would
    # defer the lock and commit DDL early (SQLAlchemy docs, "Serializable isolation /
    # Savepoints / Transactional DDL" for pysqlite).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
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
    """An engine for ``url``; bad URLs and missing drivers are one-line ``StoreError``s. Made
    under ``planner.store.deadlines.using`` (the service), it waits for its database only as long
    as those timeouts say; a database server outside it (the command line) gets the same
    timeouts from the environment (``deadlines.command_line``).

    Nothing connects yet: the first connection is made (and its failure reported) by the caller.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    from planner.store import deadlines

    timeouts = deadlines.current()
    try:
        parsed = make_url(url)
        if parsed.get_backend_name() == "sqlite":
            return _sqlite_engine(parsed, timeouts)
        # a command waits for a server as the service does (planner.store.deadlines.command_line)
        return _server_engine(parsed, timeouts if timeouts is not None else deadlines.command_line())
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise StoreError(
            f"cannot open database {safe_url(url)}: not a database URL this planner can use "
            f"({url_secrets(url).scrub(str(exc))}); write e.g. sqlite:///path/planner.db or postgresql+psycopg://user@host/db"
        ) from None
    except ImportError as exc:
        raise StoreError(
            f"cannot open database {safe_url(url)}: its driver is not installed ({exc}); "
            "install the driver the URL names (pip install 'oom-planner[postgres]' for postgresql+psycopg)"
        ) from None


def _sqlite_engine(parsed: Any, timeouts: Any) -> Engine:
    """SQLite: WAL, BEGIN IMMEDIATE for writes; under timeouts, a lock is waited for at most the
    statement timeout and the pool hands out a connection within the pool timeout."""
    import functools

    from sqlalchemy import create_engine, event

    from planner.store import deadlines

    busy_ms = SQLITE_BUSY_TIMEOUT_MS if timeouts is None else int(timeouts.statement_s * 1000)
    options: dict[str, Any] = {}
    if timeouts is not None and parsed.database not in (None, "", ":memory:"):
        options = deadlines.pool_args(timeouts)  # a file: SQLAlchemy's QueuePool
    engine = create_engine(parsed, connect_args={"timeout": busy_ms / 1000}, **options)
    event.listen(engine, "connect", functools.partial(configure_sqlite, busy_timeout_ms=busy_ms))
    event.listen(engine, "begin", _on_sqlite_begin)
    return engine


def _server_engine(parsed: Any, timeouts: Any) -> Engine:
    """A database server (PostgreSQL): connections pinged on checkout; under timeouts, libpq's
    connect and statement timeouts, a bounded pool wait and the watchdog of planner.store.deadlines."""
    from sqlalchemy import create_engine

    from planner.store import deadlines

    if timeouts is None:
        return create_engine(parsed, pool_pre_ping=True)
    connect_args = deadlines.postgres_connect_args(dict(parsed.query), timeouts) if parsed.get_backend_name() == "postgresql" else {}
    engine = create_engine(parsed, pool_pre_ping=True, connect_args=connect_args, **deadlines.pool_args(timeouts))
    if parsed.get_backend_name() == "postgresql" and parsed.get_driver_name() == "psycopg":
        deadlines.watch_engine(engine, timeouts)
    return engine


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
    """Run ``work()``, retrying it whole while SQLite reports the database locked; under the
    service's timeouts (``planner.store.deadlines``), no retry starts past the statement timeout."""
    from planner.store import deadlines

    timeouts = deadlines.current()
    give_up = None if timeouts is None else time.monotonic() + timeouts.statement_s
    first, cap = LOCKED_BACKOFF_S
    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return work()
        except Exception as exc:  # noqa: BLE001 - only SQLite's lock errors are retried, the rest re-raised
            if attempt == LOCKED_RETRIES or not is_sqlite_locked(exc):
                raise
            if give_up is not None and time.monotonic() >= give_up:
                raise
            delay = min(cap, first * 2**attempt)
            sleep(delay * (0.5 + random.random()))  # jitter: waiters do not retry in lockstep
    raise AssertionError("unreachable")  # pragma: no cover


def missing_database(url: str) -> DatabaseMissingError:
    """A store opened only to read finds no SQLite file (and must not create an empty one)."""
    return DatabaseMissingError(f"no database at {url} yet: it is created by the first plan stored")


__all__ = [
    "DATABASE_URL_ENV",
    "DATABASE_URL_FILE_ENV",
    "configure_sqlite",
    "data_dir",
    "db_failure",
    "default_database_url",
    "is_sqlite_locked",
    "make_engine",
    "missing_database",
    "open_failure",
    "read_url_file",
    "retry_locked",
    "safe_url",
    "Secrets",
    "url_has_credentials",
    "url_secrets",
]
