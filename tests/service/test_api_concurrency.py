"""50 concurrent ``POST /v1/plans`` through a real server (uvicorn on 127.0.0.1) store 50 plans,
on SQLite (one writer at a time: the store's BEGIN IMMEDIATE and retries) and on PostgreSQL."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")
pytest.importorskip("uvicorn", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from support.api import running_server  # noqa: E402
from support.store import db_url, pg_url, sqlite_url  # noqa: E402,F401 - fixtures

from planner.store import open_store  # noqa: E402

CLIENTS = 50


@pytest.mark.slow
def test_fifty_concurrent_plans_are_all_stored(db_url, tmp_path):
    import httpx

    barrier = threading.Barrier(CLIENTS)
    # a spread of requests, so that the plans differ: 10 batch sizes x 5 GPUs
    bodies = [{"model": "gpt2", "gpu": gpu, "target_batch": batch}
              for gpu in ("a10g", "l4", "t4", "a100-40gb", "h100-80gb") for batch in range(1, 11)]
    with running_server(env={"PLANNER_DATABASE_URL": db_url}, log=tmp_path / "serve.log") as url, \
            httpx.Client(base_url=url, timeout=180, limits=httpx.Limits(max_connections=CLIENTS)) as client:

        def post(body: dict) -> httpx.Response:
            barrier.wait(timeout=60)  # all 50 in flight together
            return client.post("/v1/plans", json=body)

        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(post, bodies))
        assert [a.status_code for a in answers] == [201] * CLIENTS, [a.text for a in answers if a.status_code != 201][:3]
        ids = {a.json()["plan_id"] for a in answers}
        assert len(ids) == CLIENTS
        listed = client.get("/v1/plans", params={"limit": 100}).json()["plans"]
        assert {p["id"] for p in listed} == ids
    with open_store(url=db_url) as store:
        assert store.count_plans() == CLIENTS
        assert {s.id for s in store.history(limit=100)} == ids
        assert all(len(store.get_plan(plan_id=i).candidates) >= 1 for i in ids)
