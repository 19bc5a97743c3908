"""How long the service waits for its database: connect, statement and pool timeouts.

The command line waits as long as its user does (Ctrl-C); a server cannot: one database port
that accepts and never answers held every worker thread, so the server never bound its port,
/healthz stopped answering and requests hung or failed as 500s. The service therefore opens its
store under ``Timeouts`` (``using``), and ``planner.store.engine.make_engine`` builds that engine
with them:

* connect: libpq's ``connect_timeout`` (the whole connection set-up, in whole seconds, at least 2:
  https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-CONNECT-CONNECT-TIMEOUT);
  SQLite has no connection to wait for.
* statement: the server's own ``statement_timeout`` for a server that answers but is slow or
  waits on a lock (it cancels the statement and the connection stays usable), and, for a server
  that does not answer at all, a watchdog thread here that closes the socket of any connection
  whose statement ran past it (libpq then fails the statement at once with "server closed the
  connection"; psycopg has no client-side statement timeout of its own). A connection's
  pre-ping on checkout has its own, shorter, limit. On SQLite the statement timeout bounds the
  wait for another writer's lock (busy_timeout) and the retries of a locked write.
* pool: how long a request waits for a free connection (SQLAlchemy's ``pool_timeout``); the
  service answers its ``TimeoutError`` as 503 too.

The command line waits the same way for a database server (``command_line``: the same defaults
and variables), so ``planner history`` on a hung PostgreSQL fails in seconds with one line
instead of hanging; its SQLite keeps waiting up to 30 s for another writer's lock (many
concurrent commands queue there, ``planner.store.engine.SQLITE_BUSY_TIMEOUT_MS``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Mapping

log = logging.getLogger("planner.store")


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """Seconds the service waits for its database."""

    connect_s: float = 5.0
    """To open a connection (libpq rounds up to whole seconds, at least 2)."""
    statement_s: float = 10.0
    """For one statement (the server's statement_timeout; the watchdog closes the connection
    one second later), and for SQLite's write lock."""
    ping_s: float = 3.0
    """For the pre-ping of a pooled connection on checkout (a dead or hung database is found there
    first)."""
    pool_s: float = 10.0
    """For a free pooled connection."""
    pool_size: int = 10
    max_overflow: int = 30
    """Pooled connections kept and made on demand beyond them: together the size of the thread
    pool the service's routes run in (anyio's 40), so routes wait on the database, not on the pool."""

    def __post_init__(self) -> None:
        for name in ("connect_s", "statement_s", "ping_s", "pool_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ValueError(f"{name} must be a number of seconds in (0, 3600], got {value!r}")


#: The variables that set ``Timeouts``, by field (the service reads them; a verification job's
#: driver is handed them, ``planner.verify.jobs.FORWARDED_ENV``: they hold no secret)
TIMEOUT_ENVS = {"connect_s": "PLANNER_DB_CONNECT_TIMEOUT", "statement_s": "PLANNER_DB_STATEMENT_TIMEOUT",
                "pool_s": "PLANNER_DB_POOL_TIMEOUT"}


def from_env(environ: "Mapping[str, str] | None" = None) -> Timeouts:
    """``Timeouts`` with the fields the ``TIMEOUT_ENVS`` variables set (unset or blank: the
    default); ``ValueError`` naming the variable for a value that is not a number of seconds."""
    environ = os.environ if environ is None else environ
    fields: dict[str, float] = {}
    for name, variable in TIMEOUT_ENVS.items():
        value = environ.get(variable, "").strip()
        if not value:
            continue
        try:
            fields[name] = float(value)
        except ValueError:
            raise ValueError(f"{variable} {value[:40]!r} is not a number of seconds: write e.g. 10") from None
        if not 0 < fields[name] <= 3600:  # (nan too) named by its variable, not by the field Timeouts checks
            raise ValueError(f"{variable} must be a number of seconds above 0 and at most 3600, got "
                             f"{value[:40]!r}: write e.g. {getattr(Timeouts, name):g}, or unset it for the default")
    return Timeouts(**fields)


def command_line() -> Timeouts:
    """What a command (not the service) waits for a database server: ``from_env``, as one line."""
    from planner.errors import StoreError

    try:
        return from_env()
    except ValueError as exc:
        raise StoreError(str(exc)) from None


_CURRENT: ContextVar[Timeouts | None] = ContextVar("planner_db_timeouts", default=None)


@contextlib.contextmanager
def using(timeouts: Timeouts | None) -> Iterator[None]:
    """Engines made (``make_engine``) and locked writes retried (``retry_locked``) inside this
    block follow ``timeouts``."""
    token = _CURRENT.set(timeouts)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Timeouts | None:
    """The timeouts of this context (None: wait as long as it takes, the command line's way)."""
    return _CURRENT.get()


# ---- PostgreSQL: the watchdog that closes a connection that does not answer ----------------------
#: seconds past the server's statement_timeout before the watchdog closes the socket: a server
#: that answers cancels the statement itself first, and the connection stays usable
GRACE_S = 1.0
#: how often the watchdog looks (the overrun is found this late at most)
TICK_S = 0.1
#: how long a closed-for-overrun note waits for its thread's error to read it
_NOTE_TTL_S = 60.0


class _Watched:
    __slots__ = ("conn", "timeouts", "idle", "owner", "active_since")

    def __init__(self, conn: Any, timeouts: Timeouts) -> None:
        self.conn, self.timeouts = weakref.ref(conn), timeouts
        self.idle, self.owner, self.active_since = False, None, None


class _Watchdog:
    """One daemon thread per process; it watches the psycopg connections of engines made under
    ``using`` and closes the socket of one whose statement (or pre-ping) runs past its limit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}
        self._notes: dict[int, tuple[float, float]] = {}  # thread id -> (limit s, when)
        self._thread: threading.Thread | None = None

    def watch(self, conn: Any, timeouts: Timeouts) -> None:
        with self._lock:
            self._watched[id(conn)] = _Watched(conn, timeouts)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="planner-db-watchdog", daemon=True)
                self._thread.start()

    def checked_out(self, conn: Any) -> None:
        entry = self._watched.get(id(conn))
        if entry is not None:
            entry.idle, entry.owner = False, threading.get_ident()

    def checked_in(self, conn: Any) -> None:
        entry = self._watched.get(id(conn))
        if entry is not None:
            entry.idle, entry.owner = True, None

    def forget(self, conn: Any) -> None:
        with self._lock:
            self._watched.pop(id(conn), None)

    def overrun(self) -> float | None:
        """The limit this thread's statement ran past, if the watchdog closed its connection
        within the last minute (read once)."""
        note = self._notes.pop(threading.get_ident(), None)
        if note is None or time.monotonic() - note[1] > _NOTE_TTL_S:
            return None
        return note[0]

    def _run(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                entries = list(self._watched.items())
            now = time.monotonic()
            for key, entry in entries:
                try:
                    self._look(key, entry, now)
                except Exception:  # noqa: BLE001 - a connection closing under us; the next tick sees it gone
                    log.debug("database watchdog: cannot read a connection", exc_info=True)

    def _look(self, key: int, entry: _Watched, now: float) -> None:
        conn = entry.conn()
        if conn is None or conn.closed:
            self.forget_key(key)
            return
        from psycopg.pq import TransactionStatus

        if conn.pgconn.transaction_status != TransactionStatus.ACTIVE:
            entry.active_since = None
            return
        if entry.active_since is None:
            entry.active_since = now
            return
        t = entry.timeouts
        limit = t.ping_s if entry.idle else t.statement_s + GRACE_S
        if now - entry.active_since <= limit:
            return
        if _answered(conn.pgconn.socket):
            # the server has answered and the reply waits unread: the delay is this process's (its
            # threads starved of the CPU: 50 plans at once beside a test suite on 2 cores closed a
            # connection whose reply had come), not a hung database
            return
        owner = entry.owner
        if owner is not None:
            self._notes[owner] = (limit, now)
        log.warning("database connection closed: no answer within %g s", limit)
        entry.active_since = None
        _close_socket(conn.pgconn.socket)

    def forget_key(self, key: int) -> None:
        with self._lock:
            self._watched.pop(key, None)


def _answered(fd: int) -> bool:
    """Bytes from the server wait on the connection's socket (a poll that does not block)."""
    import select

    try:
        readable, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(readable)


def _close_socket(fd: int) -> None:
    """Shut the connection's socket down under libpq (both directions): the thread blocked on it
    wakes with "server closed the connection unexpectedly". The descriptor stays libpq's to close."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already shut


_WATCHDOG = _Watchdog()


def overrun() -> float | None:
    """See ``_Watchdog.overrun``."""
    return _WATCHDOG.overrun()


def postgres_connect_args(query: dict[str, Any], timeouts: Timeouts) -> dict[str, Any]:
    """libpq options for a PostgreSQL engine under ``timeouts``: what the URL sets itself wins."""
    args: dict[str, Any] = {}
    if "connect_timeout" not in query:
        args["connect_timeout"] = max(2, int(-(-timeouts.connect_s // 1)))
    options = str(query.get("options", ""))
    if "statement_timeout" not in options:
        args["options"] = f"{options} -c statement_timeout={int(timeouts.statement_s * 1000)}".strip()
    return args


def watch_engine(engine: Any, timeouts: Timeouts) -> None:
    """Watch every connection ``engine`` opens (PostgreSQL through psycopg)."""
    from sqlalchemy import event

    event.listen(engine, "connect", lambda conn, record: _WATCHDOG.watch(conn, timeouts))
    event.listen(engine, "checkout", lambda conn, record, proxy: _WATCHDOG.checked_out(conn))
    event.listen(engine, "checkin", lambda conn, record: conn is not None and _WATCHDOG.checked_in(conn))
    event.listen(engine, "close", lambda conn, record: _WATCHDOG.forget(conn))


def pool_args(timeouts: Timeouts) -> dict[str, Any]:
    return {"pool_timeout": timeouts.pool_s, "pool_size": timeouts.pool_size, "max_overflow": timeouts.max_overflow}


__all__ = ["TIMEOUT_ENVS", "Timeouts", "command_line", "current", "from_env", "overrun", "pool_args", "postgres_connect_args", "using", "watch_engine"]
