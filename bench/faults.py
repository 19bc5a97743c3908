"""The fault scenario of ``bench/api_speed.py``: a service under load while one of its workers is
killed, its database connections are terminated and its database hangs for 10 s.

Prints the requests answered, the 5xx answers (503 says the database's state; a 500 would be a
bug), the requests the killed worker took down with it, and the rows lost: plans answered 201
that the store does not hold.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

#: seconds from the start: a worker killed, the connections terminated, the database hung (from, to), the end
KILL_AT, TERMINATE_AT, HANG, END = 5.0, 12.0, (18.0, 28.0), 35.0
BODIES = [{"model": model, "gpu": gpu, "target_batch": batch}
          for model in ("gpt2", "Qwen/Qwen2.5-0.5B") for gpu in ("a10g", "l4", "t4") for batch in (2, 4, 8, 16)]


def _workers(pid: int) -> list[int]:
    """The server processes uvicorn spawned under ``pid`` (multiprocessing's spawn children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


class Load:
    """``clients`` threads sending plans and reads until stopped; every answer recorded."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.results: list[tuple[str, str, float, float]] = []  # (kind, status or error, started at, seconds)
        self.plan_ids: list[str] = []
        self.start = time.monotonic()

    def _client(self, number: int) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=60) as client:
            i = number
            while not self.stop.is_set():
                i += 1
                kind = ("plan", "list", "one", "health")[i % 4]
                begun = time.monotonic()
                try:
                    if kind == "plan":
                        answer = client.post("/v1/plans", json=BODIES[i % len(BODIES)] | {"fresh": True})
                    elif kind == "one" and self.plan_ids:
                        answer = client.get(f"/v1/plans/{self.plan_ids[i % len(self.plan_ids)]}")
                    elif kind == "health":
                        answer = client.get("/healthz")
                    else:
                        answer = client.get("/v1/plans", params={"limit": 20})
                    status = str(answer.status_code)
                    if kind == "plan" and answer.status_code == 201:
                        with self.lock:
                            self.plan_ids.append(answer.json()["plan_id"])
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with self.lock:
                    self.results.append((kind, status, begun - self.start, time.monotonic() - begun))

    @contextlib.contextmanager
    def running(self) -> Iterator["Load"]:
        threads = [threading.Thread(target=self._client, args=(n,), daemon=True) for n in range(self.clients)]
        for thread in threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(90)


def _until(start: float, at: float) -> None:
    time.sleep(max(0.0, at - (time.monotonic() - start)))


def _terminate_postgres(admin_url: str, ports: list[int]) -> int:
    """pg_terminate_backend of the backends behind the proxy's connections; returns how many."""
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(admin_url)
    with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, password=u.password,
                         dbname=u.database, autocommit=True) as conn:
        rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE client_port = ANY(%s) "
                            "AND pid <> pg_backend_pid()", (ports,)).fetchall()
    return sum(1 for (done,) in rows if done)


@contextlib.contextmanager
def _database(db: str) -> Iterator[tuple[str, Callable[[], str], Callable[[], contextlib.AbstractContextManager]]]:
    """(the URL the server uses, terminate its connections, hold the database hung) for ``db``."""
    if db.startswith("sqlite"):
        path = db.removeprefix("sqlite:///")

        @contextlib.contextmanager
        def hung() -> Iterator[None]:  # another process's write lock: SQLite's way to hang a writer
            holder = sqlite3.connect(path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                yield
            finally:
                holder.execute("ROLLBACK")
                holder.close()

        yield db, lambda: "n/a (SQLite: no connections)", hung
        return
    from sqlalchemy.engine import make_url
    from test_api_support import FreezableProxy, url_through

    server = make_url(db)
    with FreezableProxy(server.host or "127.0.0.1", server.port or 5432) as proxy:
        def terminate() -> str:
            ports = proxy.upstream_ports()
            return f"{_terminate_postgres(db, ports)} backends terminated"

        @contextlib.contextmanager
        def hung() -> Iterator[None]:
            proxy.freeze()
            try:
                yield
            finally:
                proxy.thaw()

        yield url_through(db, proxy.port), terminate, hung


def _rows_lost(db: str, plan_ids: list[str]) -> tuple[int, int]:
    """(plans answered 201 that the store does not hold, stored plans without candidates)."""
    from sqlalchemy import select

    from planner.store import open_store
    from planner.store.dbmodels import CandidateRow, PlanRequestRow

    with open_store(url=db) as store, store.session_scope() as session:
        held = set(session.scalars(select(PlanRequestRow.id)).all())
        with_candidates = set(session.scalars(select(CandidateRow.plan_id).distinct()).all())
    return len(set(plan_ids) - held), len((set(plan_ids) & held) - with_candidates)


def fault_scenario(db: str, *, clients: int, server: Callable[..., Any]) -> None:
    procs: list = []
    with _database(db) as (url_for_server, terminate, hung), \
            server(url_for_server, workers=2, procs=procs) as url, Load(url, clients).running() as load:
        start, events = load.start, []
        _until(start, KILL_AT)
        victims = _workers(procs[0].pid)
        if victims:
            os.kill(victims[0], signal.SIGKILL)
        events.append(f"worker {victims[0] if victims else '?'} killed at {KILL_AT:g} s")
        _until(start, TERMINATE_AT)
        events.append(f"connections terminated at {TERMINATE_AT:g} s: {terminate()}")
        _until(start, HANG[0])
        with hung():
            _until(start, HANG[1])
        events.append(f"database hung from {HANG[0]:g} to {HANG[1]:g} s")
        _until(start, END)
    results, plan_ids = load.results, load.plan_ids
    lost, empty = _rows_lost(db, plan_ids)
    statuses = collections.Counter(status for _, status, _, _ in results)
    answered = sum(n for s, n in statuses.items() if s.isdigit())
    fives = {s: n for s, n in statuses.items() if s.isdigit() and s.startswith("5")}
    dropped = {s: n for s, n in statuses.items() if not s.isdigit()}
    slowest = max((t for _, s, _, t in results if s.isdigit()), default=0.0)
    in_hang = [t for _, s, at, t in results if s.isdigit() and HANG[0] <= at + t and at < HANG[1]]
    print(f"fault scenario: planner serve --workers 2 on {'SQLite' if db.startswith('sqlite') else 'PostgreSQL'}, "
          f"{clients} clients for {END:g} s; " + "; ".join(events))
    print(f"  requests: {len(results)} sent, {answered} answered ({dict(sorted(statuses.items()))}), slowest answer "
          f"{slowest:.1f} s, slowest while the database hung {max(in_hang, default=0):.1f} s")
    print(f"  5xx: {sum(fives.values())} ({fives or 'none'}); not answered (the killed worker's connections): "
          f"{sum(dropped.values())} {dropped or ''}")
    print(f"  plans answered 201: {len(plan_ids)}; rows lost: {lost}; stored without candidates: {empty}")


__all__ = ["fault_scenario"]
