"""Per-request budgets: CPU time and memory, enforced while a route runs.

``planner.limits`` refuses, before any work, a plan whose sizes multiply past what one request may
cost. What it cannot see (the re-ranking after the allocator replay refuses plans, a path nobody
has profiled yet) is bounded here: a watchdog thread reads the CPU time of each thread answering a
request (its own clock: ``pthread_getcpuclockid``, so waiting on the database or on other
requests costs nothing) and the process's resident memory, and stops a request past its budget by
raising an exception in its thread (``PyThreadState_SetAsyncExc``: delivered at the thread's next
Python instruction; the search is Python). The route answers 422 (CPU) or 413 (memory) naming the
budget, the worker lives on and so do the other requests on it. At shutdown every request still
running is stopped the same way, so a worker exits within its graceful-shutdown timeout: the watchdog
stops them at the deadline the exit signal sets (``stop_after``), not when the server gets to its
shutdown, which it reaches only once the event loop runs, and a loop thread among busy request threads
waits its turn for the GIL for seconds (eight planning requests held a SIGTERM'd server 2.7-5.7 s).

Routes are wrapped by ``BudgetedRoute`` (the router's route class); the app's ``Budgets`` reaches
their thread through a context variable the middleware sets (anyio copies the context into the
thread that runs a sync route).
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import inspect
import logging
import os
import threading
import time
from typing import Any, Callable

from fastapi.routing import APIRoute

from planner.service.errors import ServiceError

log = logging.getLogger("planner.service")

#: how often the watchdog looks (a budget is overrun by this much at most, plus the time to the
#: thread's next Python instruction)
TICK_S = 0.05

#: CPU seconds a stopped request may go on using before it is stopped again. An exception raised
#: in a thread is delivered wherever that thread is, and where it is a garbage-collection callback
#: (a ``WeakKeyDictionary``'s ``remove``, a ``__del__``) Python prints "Exception ignored in" and
#: carries on (CPython ``PyErr_WriteUnraisable``): the request would run to its end and answer 201.
#: Seen 2 runs in 3 of the whole test suite, where earlier tests leave collectable memo entries.
#: Unwinding after a delivered stop costs microseconds, so a request still burning CPU this long
#: after one has not seen it. Two ticks: a request that ran 0.5 s against a 0.3 s budget finished
#: before a 0.25 s refire once its first stop was swallowed (a clean-clone CI run answered 201).
REFIRE_CPU_S = 2 * TICK_S


class Stopped(BaseException):
    """Raised in a request's thread by the watchdog. A BaseException, so that no ``except
    Exception`` on the way swallows it; ``BudgetedRoute`` turns it into the answer."""

    status = 503
    reason = "stopped"


class CpuBudgetExceeded(Stopped):
    status = 422


class MemoryBudgetExceeded(Stopped):
    status = 413


class ShuttingDown(Stopped):
    status = 503


def _raise_in(thread_id: int, kind: type[BaseException] | None) -> None:
    """Raise ``kind`` in the thread ``thread_id`` at its next instruction (None: forget one
    raised and not delivered yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(kind) if kind else None)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:  # resident pages, second field
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Running:
    __slots__ = ("thread_id", "clock", "cpu0", "rss0", "fired", "fired_at", "what")

    def __init__(self, what: str) -> None:
        self.thread_id = threading.get_ident()
        self.clock = time.pthread_getcpuclockid(self.thread_id)
        self.cpu0 = time.clock_gettime(self.clock)
        self.rss0 = _rss_bytes()
        self.fired: type[Stopped] | None = None
        self.fired_at = 0.0  # the request's CPU seconds when it was last stopped
        self.what = what

    def cpu(self) -> float:
        return time.clock_gettime(self.clock) - self.cpu0


class Budgets:
    """The CPU and memory budgets of one app's requests, and the watchdog that holds them."""

    def __init__(self, *, cpu_s: float, memory_bytes: int) -> None:
        self.cpu_s, self.memory_bytes = cpu_s, memory_bytes
        self._lock = threading.Lock()
        self._running: dict[int, _Running] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._deadline: float | None = None  # time.monotonic() at which to stop everything (stop_after)

    # ---- in the request's thread ---------------------------------------------------------------
    def run(self, work: Callable[[], Any], *, what: str) -> Any:
        """``work()`` under the budgets; a budget overrun is a ``ServiceError`` with its status."""
        entry = _Running(what)
        with self._lock:
            if self._stopping:
                raise ServiceError(503, "the server is shutting down: send the request again")
            self._running[entry.thread_id] = entry
            self._start()
        try:
            try:
                return work()
            finally:
                self._leave(entry)
        except Stopped as stopped:
            raise ServiceError(stopped.status, self._message(type(stopped), entry)) from None

    def _leave(self, entry: _Running) -> None:
        """Deregister; forget an exception raised and not delivered yet. Should it arrive while we
        are at it, deregister all the same and let it out (once: once deregistered, the watchdog does not
        fire again)."""
        arrived: Stopped | None = None
        while True:
            try:
                with self._lock:
                    self._running.pop(entry.thread_id, None)
                    if entry.fired is not None:
                        _raise_in(entry.thread_id, None)
                break
            except Stopped as stopped:
                arrived = stopped
        if arrived is not None:
            raise arrived

    def _message(self, kind: type[Stopped], entry: _Running) -> str:
        if kind is CpuBudgetExceeded:
            return (f"the request used more than {self.cpu_s:g} s of CPU, this server's budget per request "
                    f"(PLANNER_API_CPU_SECONDS), and was stopped: ask for less (a smaller model or search, fewer "
                    f"plans: top_k), or ask the operator to raise the budget")
        if kind is MemoryBudgetExceeded:
            return (f"the server's memory grew by more than {self.memory_bytes / 2**20:,.0f} MiB while the request "
                    f"ran, this server's budget per request (PLANNER_API_MEMORY), and it was stopped: ask for less "
                    f"(a smaller model or search)")
        return "the server is shutting down: send the request again"

    # ---- the watchdog ----------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="planner-budget-watchdog", daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            with self._lock:
                if self._deadline is not None and time.monotonic() >= self._deadline and not self._stopping:
                    self._stop_live()
                if not self._running:
                    if self._stopping:
                        return
                    continue
                self._look(list(self._running.values()))

    def _look(self, running: list[_Running]) -> None:
        """Under the lock: fire at the requests past their budget, and again at those that went on
        after a stop (``REFIRE_CPU_S``)."""
        for entry in running:
            try:
                if entry.fired is not None and entry.cpu() > entry.fired_at + REFIRE_CPU_S:
                    log.warning("%s went on after its stop (the exception arrived where Python ignores it)",
                                entry.what)
                    self._fire(entry, entry.fired)
            except OSError:
                continue
        live = [e for e in running if e.fired is None]
        for entry in live:
            try:
                if entry.cpu() > self.cpu_s:
                    self._fire(entry, CpuBudgetExceeded)
            except OSError:  # the thread is gone; _leave removes it
                continue
        rss = _rss_bytes()
        grown = [e for e in live if e.fired is None and rss - e.rss0 > self.memory_bytes]
        if grown:  # the memory is the process's: stop the request that has run longest on the CPU
            self._fire(max(grown, key=lambda e: e.cpu()), MemoryBudgetExceeded)
            for entry in live:  # the growth is the stopped one's: the others count from here
                entry.rss0 = rss

    def _fire(self, entry: _Running, kind: type[Stopped]) -> None:
        entry.fired = kind
        try:
            entry.fired_at = entry.cpu()
        except OSError:  # the thread is gone; _leave removes it
            return
        log.warning("stopping %s: %s", entry.what, kind.__name__)
        _raise_in(entry.thread_id, kind)

    def stop_all(self) -> int:
        """Shutdown: stop every request still running (503); returns how many."""
        with self._lock:
            return self._stop_live()

    def stop_after(self, seconds: float) -> None:
        """The server was told to exit: stop whatever still runs ``seconds`` from now (its graceful
        timeout), from the watchdog's thread. Safe in a signal handler: it takes no lock (the handler
        may interrupt this thread while it holds one)."""
        if self._deadline is None:
            self._deadline = time.monotonic() + seconds
        threading.Thread(target=self._start_locked, name="planner-budget-arm", daemon=True).start()

    def _start_locked(self) -> None:
        with self._lock:
            self._start()

    def _stop_live(self) -> int:
        """Under the lock: fire ``ShuttingDown`` at every live request, refuse new ones."""
        self._stopping = True
        live = [e for e in self._running.values() if e.fired is None]
        for entry in live:
            self._fire(entry, ShuttingDown)
        return len(live)


#: the app's budgets, set per request by the middleware (``planner.service.app.Guard``)
CURRENT: contextvars.ContextVar[Budgets | None] = contextvars.ContextVar("planner_budgets", default=None)


def within_budget(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``endpoint`` (a sync route) run under the budgets of the app answering."""
    what = f"{endpoint.__name__}"

    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        budgets = CURRENT.get()
        if budgets is None:  # not served through the app's middleware
            return endpoint(*args, **kwargs)
        return budgets.run(lambda: endpoint(*args, **kwargs), what=what)

    return run


class BudgetedRoute(APIRoute):
    """FastAPI's route, with its sync endpoint run under the budgets (``within_budget``)."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = within_budget(endpoint)
        super().__init__(path, endpoint, **kwargs)


__all__ = ["BudgetedRoute", "Budgets", "CURRENT", "CpuBudgetExceeded", "MemoryBudgetExceeded", "ShuttingDown",
           "Stopped", "within_budget"]
