"""A database that is down, hung or busy does not take the service with it (issue 22, item 5).

Real failures, not mocks: a TCP port that accepts and never answers (``SilentPort``), a proxy in
front of the real PostgreSQL that freezes mid-run (``FreezableProxy``), a SQLite file another
process holds the write lock of, a pool with every connection taken. The server binds, /healthz
answers within its 2 s, every request is answered (503 with the reason, never a 500 nor a hang),
and the service recovers by itself when the database is back.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.api import FreezableProxy, SilentPort, running_server, url_through  # noqa: E402
from support.store import db_url, pg_url, require_postgres, sqlite_url  # noqa: E402,F401 - fixtures

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402
from planner.store.deadlines import Timeouts  # noqa: E402

GPT2 = {"model": "gpt2", "gpu": "a10g", "target_batch": 8}
#: short waits, so that the tests take seconds: the defaults are 5 / 10 / 10 s
FAST = Timeouts(connect_s=2, statement_s=2, ping_s=1, pool_s=1)
FAST_ENV = {"PLANNER_DB_CONNECT_TIMEOUT": "2", "PLANNER_DB_STATEMENT_TIMEOUT": "2", "PLANNER_DB_POOL_TIMEOUT": "1"}


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    result = fn(*args, **kwargs)
    return result, time.monotonic() - start


def wait_for(check, *, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.2)


# ---- a database that never answers ------------------------------------------------------------------
@pytest.mark.slow
def test_serve_binds_and_answers_while_the_database_hangs(tmp_path):
    """`planner serve` on a port that accepts and never answers: it binds at once, /healthz says
    unavailable within 2 s, a plan is a 503 naming the timeout, what needs no database answers."""
    import httpx

    with SilentPort() as hung, running_server(
            env={"PLANNER_DATABASE_URL": f"postgresql+psycopg://planner@127.0.0.1:{hung.port}/planner", **FAST_ENV},
            log=tmp_path / "serve.log", ready=(503,)) as url:
        health, took = timed(httpx.get, f"{url}/healthz", timeout=10)
        assert health.status_code == 503 and took < 3.5, (health.text, took)
        assert health.json() == {"status": "unavailable", "database": health.json()["database"]}
        answer, took = timed(httpx.post, f"{url}/v1/plans", json=GPT2, timeout=30)
        assert answer.status_code == 503 and took < 10, (answer.text, took)
        assert "timeout" in answer.json()["error"] and "planner@" not in answer.json()["error"]
        assert httpx.get(f"{url}/v1/gpus", timeout=10).status_code == 200
        assert httpx.head(f"{url}/", timeout=10).status_code == 200


@pytest.mark.postgres
@pytest.mark.slow
def test_a_database_that_hangs_mid_run_is_503_and_recovers(pg_url, tmp_path):
    """The real PostgreSQL behind a proxy that freezes mid-run: 45 concurrent GETs are all
    answered (200 or 503, none 500, none hung) and /healthz within 2 s; thawed, the same server
    plans again without a restart."""
    import httpx
    from sqlalchemy.engine import make_url

    server = make_url(pg_url)
    with FreezableProxy(server.host, server.port or 5432) as proxy, running_server(
            env={"PLANNER_DATABASE_URL": url_through(pg_url, proxy.port), **FAST_ENV},
            log=tmp_path / "serve.log") as url, httpx.Client(base_url=url, timeout=60) as client:
        plan_id = client.post("/v1/plans", json=GPT2).json()["plan_id"]
        proxy.freeze()
        paths = ["/v1/plans", f"/v1/plans/{plan_id}", "/healthz"] * 15
        with ThreadPoolExecutor(45) as pool:
            answers = list(pool.map(lambda p: timed(client.get, p), paths))
        statuses = [a.status_code for a, _ in answers]
        assert set(statuses) <= {200, 503} and statuses.count(503) >= 15, statuses
        assert max(t for _, t in answers) < 30, sorted(t for _, t in answers)[-5:]
        assert all(t < 4 for (a, t), p in zip(answers, paths) if p == "/healthz"), answers
        refused = [a.json()["error"] for a, _ in answers if a.status_code == 503 and "error" in a.json()]
        assert refused and all("no answer within" in e or "did not answer" in e or "timeout" in e for e in refused), refused
        proxy.thaw()
        wait_for(lambda: client.get("/healthz").status_code == 200, timeout_s=30, what="recovery")
        again = client.post("/v1/plans", json=GPT2 | {"target_batch": 4})
        assert again.status_code == 201, again.text
        assert {p["id"] for p in client.get("/v1/plans").json()["plans"]} >= {plan_id, again.json()["plan_id"]}


@pytest.mark.postgres
def test_a_database_hung_at_start_opens_when_it_answers(pg_url):
    """Frozen before the server starts (the store cannot open): 503s with the reason; thawed,
    the background opener gets through and the same app plans."""
    from sqlalchemy.engine import make_url

    server = make_url(pg_url)
    with FreezableProxy(server.host, server.port or 5432) as proxy:
        proxy.freeze()
        settings = ServiceSettings(database_url=url_through(pg_url, proxy.port), db_timeouts=FAST)
        with TestClient(create_app(settings)) as client:
            answer, took = timed(client.post, "/v1/plans", json=GPT2)
            assert answer.status_code == 503 and took < 8, (answer.text, took)
            assert "timeout expired" in answer.json()["error"]
            proxy.thaw()
            wait_for(lambda: client.post("/v1/plans", json=GPT2).status_code == 201, timeout_s=30, what="recovery")


# ---- a database that is slow or busy -------------------------------------------------------------------
@pytest.mark.postgres
def test_a_statement_past_the_timeout_is_503(pg_url):
    """A table another session holds an exclusive lock on: the server's statement_timeout
    cancels the read and the answer is a 503 with PostgreSQL's reason; the lock gone, it reads."""
    from sqlalchemy import create_engine, text

    with TestClient(create_app(ServiceSettings(database_url=pg_url, db_timeouts=FAST))) as client:
        assert client.post("/v1/plans", json=GPT2).status_code == 201
        locker = create_engine(pg_url)
        with locker.connect() as conn:
            conn.execute(text("LOCK TABLE plan_requests IN ACCESS EXCLUSIVE MODE"))
            answer, took = timed(client.get, "/v1/plans")
            assert answer.status_code == 503 and took < 8, (answer.text, took)
            assert "statement timeout" in answer.json()["error"]
            conn.rollback()
        locker.dispose()
        assert client.get("/v1/plans").status_code == 200


def test_a_locked_sqlite_write_is_503_within_the_timeout(sqlite_url, tmp_path):
    """Another process holds SQLite's write lock: a write waits the statement timeout (not 30 s
    and 8 retries), answers 503 naming the lock; reads go on (WAL); released, writes go on."""
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url, db_timeouts=FAST))) as client:
        assert client.post("/v1/plans", json=GPT2).status_code == 201
        holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            answer, took = timed(client.post, "/v1/plans", json=GPT2 | {"target_batch": 4})
            assert answer.status_code == 503 and took < 12, (answer.text, took)
            assert "locked" in answer.json()["error"]
            assert client.get("/v1/plans").status_code == 200
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert client.post("/v1/plans", json=GPT2 | {"target_batch": 4}).status_code == 201


def test_a_missing_sqlite_directory_recovers_without_a_restart(tmp_path):
    """A store the server cannot open (its directory is missing): 503 with the reason; the
    directory made, the next requests find the store."""
    folder = tmp_path / "later"
    with TestClient(create_app(ServiceSettings(database_url=f"sqlite:///{folder / 'planner.db'}", db_timeouts=FAST))) as client:
        answer = client.post("/v1/plans", json=GPT2)
        assert answer.status_code == 503 and "cannot open database" in answer.json()["error"]
        assert client.get("/healthz").status_code == 503
        folder.mkdir()
        wait_for(lambda: client.post("/v1/plans", json=GPT2).status_code == 201, timeout_s=30, what="recovery")
        assert client.get("/healthz").json()["status"] == "ok"


def test_a_pool_with_every_connection_taken_is_503(db_url):
    """SQLAlchemy's pool timeout was a 500: it is a 503 saying the connections stayed busy."""
    tight = Timeouts(connect_s=2, statement_s=2, ping_s=1, pool_s=0.5, pool_size=1, max_overflow=0)
    app = create_app(ServiceSettings(database_url=db_url, db_timeouts=tight))
    with TestClient(app) as client:
        assert client.post("/v1/plans", json=GPT2).status_code == 201
        engine = app.state.holder.get()._engine
        with engine.connect():  # the pool's only connection
            answer, took = timed(client.get, "/v1/plans")
        assert answer.status_code == 503 and took < 5, answer.text
        assert "connections stayed busy for 0.5 s" in answer.json()["error"]
        assert client.get("/v1/plans").status_code == 200


def test_the_watchdog_closes_a_connection_that_never_answers():
    """Below the service: an engine made under the timeouts, on a port that accepts and never
    answers a statement, fails within the limits instead of waiting forever."""
    from planner.errors import StoreError
    from planner.store import open_store
    from planner.store.deadlines import using

    with SilentPort() as hung, using(FAST):
        start = time.monotonic()
        with pytest.raises(StoreError, match="timeout expired"):
            open_store(url=f"postgresql+psycopg://planner@127.0.0.1:{hung.port}/planner")
        assert time.monotonic() - start < 6


@pytest.mark.postgres
def test_the_watchdog_cuts_a_statement_the_server_never_answers(pg_url):
    """Established connections, then the database stops answering (the proxy freezes): the
    statement is cut after the statement timeout plus a second, the error says so, and the store
    works again once the database answers."""
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from planner.errors import StoreError
    from planner.store import open_store
    from planner.store.deadlines import using

    server = make_url(pg_url)
    with FreezableProxy(server.host, server.port or 5432) as proxy, using(FAST):
        store = open_store(url=url_through(pg_url, proxy.port))
        try:
            assert store.count_plans() == 0
            # a statement inside a transaction: cut after the statement timeout (2 s) plus 1 s
            start = time.monotonic()
            with pytest.raises(StoreError, match=r"failed: no answer within 3 s \(the connection was closed"):
                with store.session_scope() as session:
                    session.execute(text("SELECT 1"))
                    proxy.freeze()
                    session.execute(text("SELECT 1"))
            assert 2.5 < time.monotonic() - start < 6
            # a new transaction: the pre-ping is cut after 1 s, the new connection times out after 2 s
            start = time.monotonic()
            with pytest.raises(StoreError, match="connection timeout expired"):
                store.count_plans()
            assert time.monotonic() - start < 6
            proxy.thaw()
            assert wait_for(lambda: _counts(store), timeout_s=20, what="recovery")
        finally:
            store.close()


def _counts(store) -> bool:
    from planner.errors import StoreError

    try:
        return store.count_plans() == 0
    except StoreError:
        return False


def test_healthz_answers_within_two_seconds_when_the_probe_hangs(sqlite_url, monkeypatch):
    """/healthz runs its probe in a thread of its own and waits 2 s at most."""
    from planner.service import state

    release = threading.Event()

    def hung(self):
        release.wait(30)
        return state.Health(ok=True, plans=0)

    monkeypatch.setattr(state.HealthProbe, "_probe", hung)
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        answer, took = timed(client.get, "/healthz")
        release.set()
    assert answer.status_code == 503 and 1.5 < took < 4
    assert answer.json() == {"status": "unavailable", "database": "the database did not answer within 2 s"}
