"""The app's one store: opened in the background, shared by every request, closed at shutdown.

``Store`` methods each run in their own transaction on a pooled engine, so one instance serves
concurrent requests (the threadpool FastAPI runs sync routes in); SQLite's single writer is
handled by the store itself (``BEGIN IMMEDIATE`` plus retries while locked, see
``planner.store.engine``).

The database may be down, or hung (a port that accepts and never answers), when the server
starts and at any time after: the server must still bind its port and answer. So the store is
opened by a background thread that retries until it succeeds (``open``), under the service's
database timeouts (``planner.store.deadlines``); a request that finds it not open yet waits for
the attempt under way a bounded time and is answered 503 with the last reason; once open, the
engine reconnects by itself (every connection is pinged on checkout). Nothing needs a restart.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.errors import StoreError
from planner.store.deadlines import Timeouts

if TYPE_CHECKING:  # pragma: no cover
    from planner.store import PlanStore

log = logging.getLogger("planner.service")

#: seconds between attempts to open the store: doubling from the first, up to the last
RETRY_S = (0.5, 10.0)


class StoreHolder:
    """Opens the store in the background (again and again until it works) and closes it on shutdown."""

    def __init__(self, *, url: str | None, timeouts: Timeouts | None = None) -> None:
        self._url = url
        self._timeouts = timeouts or Timeouts()
        self._store: "PlanStore | None" = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a request asks for an attempt now
        self._attempt_done = threading.Condition(self._lock)
        self._attempts = 0
        self._trying = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The database the store is (to be) opened on."""
        from planner.store.engine import default_database_url

        return self._url or default_database_url()

    @property
    def wait_s(self) -> float:
        """How long a request waits for an attempt under way: one connection's set-up plus one
        statement (the schema check)."""
        return self._timeouts.connect_s + self._timeouts.statement_s

    def open(self) -> None:
        """Start opening in the background; returns at once."""
        with self._lock:
            self._closed = False
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._open_until_done, name="planner-store-open", daemon=True)
                self._thread.start()

    def _open_until_done(self) -> None:
        from planner.store.deadlines import using
        from planner.store.interface import open_plan_store

        delay = RETRY_S[0]
        while True:
            with self._lock:
                if self._closed or self._store is not None:
                    return
                self._trying = True
            store, error = None, None
            try:
                with using(self._timeouts):
                    store = open_plan_store(url=self._url, shared=True)
            except StoreError as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - never let the opener die: say why and retry
                error = f"cannot open the database: {type(exc).__name__}"
                log.exception("opening the plan store failed")
            with self._lock:
                self._trying, self._attempts = False, self._attempts + 1
                if store is not None and self._closed:
                    store.close()
                    store = None
                self._store, changed = store, error != self._error
                self._error = error
                self._attempt_done.notify_all()
            if store is not None:
                log.info("plan store open")
                return
            if changed:
                log.warning("plan store not available (retrying every %g s at most): %s", RETRY_S[1], error)
            self._wake.wait(delay)
            self._wake.clear()
            delay = min(delay * 2, RETRY_S[1])

    def get(self, *, wait: bool = True) -> "PlanStore":
        """The open store; ``StoreError`` (answered as 503) with the last reason when the database
        cannot be opened. ``wait``: wait (at most ``wait_s``) for an attempt under way, and ask
        for one now when none is."""
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is not None:
                return self._store
            if self._closed:
                raise StoreError("the server is shutting down")
            if self._thread is None or not self._thread.is_alive():  # the opener gave way to a store since closed
                self._thread = threading.Thread(target=self._open_until_done, name="planner-store-open", daemon=True)
                self._thread.start()
            seen = self._attempts
            if wait:
                self._wake.set()
                deadline = time.monotonic() + self.wait_s
                # the attempt under way when we came, or the one our wake-up starts
                while self._store is None and self._attempts <= seen and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._attempt_done.wait(left):
                        break
            if self._store is not None:
                return self._store
            raise StoreError(self._error or "the database is being opened and has not answered yet; retry in a moment")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
            self._attempt_done.notify_all()
        self._wake.set()
        if store is not None:
            store.close()


@dataclass(frozen=True)
class Health:
    """What /healthz says."""

    ok: bool
    reason: str = ""
    plans: int | None = None


class HealthProbe:
    """/healthz's look at the database: one probe at a time, in a thread of its own (never the
    routes' pool, which a hung database may fill), awaited at most ``timeout_s``: a health check
    answers within that whatever the database does."""

    def __init__(self, holder: StoreHolder, *, timeout_s: float = 2.0) -> None:
        self._holder, self._timeout_s = holder, timeout_s
        self._running: "asyncio.Future[Health] | None" = None

    async def check(self) -> Health:
        loop = asyncio.get_running_loop()
        future = self._running
        if future is None or future.done() or future.get_loop() is not loop:
            future = self._running = loop.create_future()

            def probe() -> None:
                health = self._probe()
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(health))

            threading.Thread(target=probe, name="planner-health-probe", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._timeout_s)
        except asyncio.TimeoutError:
            return Health(ok=False, reason=f"the database did not answer within {self._timeout_s:g} s")

    def _probe(self) -> Health:
        try:
            return Health(ok=True, plans=self._holder.get().count_plans())
        except StoreError as exc:
            return Health(ok=False, reason=str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. the pool's TimeoutError: the database is not answering
            return Health(ok=False, reason=f"the database is not answering ({type(exc).__name__})")


__all__ = ["Health", "HealthProbe", "StoreHolder"]
