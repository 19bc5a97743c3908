"""History pages cut in SQL (issue 22, item 4): ``GET /v1/plans?offset=&limit=`` and ``planner
history -n`` over their whole documented ranges with 100,000 plans, on SQLite and PostgreSQL.

Before, a page loaded offset + limit + 1 rows and sent their ids back as an IN-list: from offset
65,035 that list passed the drivers' 65,535 bind parameters and the request failed. The plans here
are inserted in bulk (a plan's own rows are what ``save_plan`` writes; a few real plans carry
candidates and a run so the per-row counts are checked too).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert
from support.store import fresh_pg_schema, measurement, plan_result

from planner.limits import MAX_HISTORY
from planner.store import HistoryCursor, open_store
from planner.store.dbmodels import PlanRequestRow

BULK = 100_000
#: the bulk plans' creation times: one a second from here (every 7th shares its second with the
#: one before, so the id breaks ties), all older than the real plans saved now
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def bulk_plan_rows(n: int) -> list[dict]:
    """``n`` plan rows as ``save_plan`` writes a plan's own (no candidates), newest last (bench/history_speed.py uses them too)."""
    rows = []
    for i in range(n):
        second = i - (1 if i % 7 == 6 else 0)
        rows.append({
            "id": f"{i:032x}", "created_at": T0 + timedelta(seconds=second), "model_id": f"bulk/model-{i % 10}",
            "model_fingerprint": "0" * 64, "gpu": "L4" if i % 2 else "A10G", "gpu_count": 1,
            "gpu_memory_bytes": 24 * 2**30, "target_batch": 8, "seq_len": 512, "constraints": {},
            "constraints_hash": "0" * 64, "planner_version": "test", "status": "planned", "status_reason": None,
            "status_changed_at": None, "lease_until": None, "ray_job_id": None, "rejected": [], "searched": 0,
            "usable_bytes": 0, "safety_margin_bytes": 0,
        })
    return rows


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def filled(request, tmp_path_factory):
    """(url, ids newest first): BULK bulk plans and 3 real ones (newest), the middle one measured.
    Built once per backend for the module (about 13 s on SQLite, 15-30 s on PostgreSQL on the
    2-core CI machine); the tests only read it."""
    if request.param == "sqlite":
        yield _fill(f"sqlite:///{tmp_path_factory.mktemp('paging') / 'store.db'}")
    else:
        with fresh_pg_schema() as url:
            yield _fill(url)


def _fill(db_url: str) -> tuple[str, list[str]]:
    with open_store(url=db_url) as store:
        rows = bulk_plan_rows(BULK)
        with store.session_scope(write=True) as session:
            for start in range(0, BULK, 10_000):
                session.execute(insert(PlanRequestRow), rows[start:start + 10_000])
        real = [store.save_plan(result=plan_result(candidates=3)) for _ in range(3)]
        first = store.get_plan(plan_id=real[1]).candidates[0]
        store.record_measurement(candidate_id=first.id, measurement=measurement())
    ordered = sorted(rows, key=lambda r: (r["created_at"], r["id"]), reverse=True)
    return db_url, real[::-1] + [r["id"] for r in ordered]


def test_every_documented_page_of_100000_plans_is_cut_in_sql(filled):
    url, ids = filled
    with open_store(url=url) as store:
        head = store.history(limit=5)
        assert [r.id for r in head] == ids[:5]
        assert [(r.candidates, r.measurements) for r in head[:3]] == [(3, 0), (3, 1), (3, 0)]
        assert head[0].top_plan is not None and head[3].top_plan is None and head[3].candidates == 0
        for offset in (65_034, 65_035, 65_536, 99_000, MAX_HISTORY - 2, MAX_HISTORY):
            page = store.history(limit=500, offset=offset)
            assert [r.id for r in page] == ids[offset:offset + 500], offset
        assert [r.id for r in store.history(limit=MAX_HISTORY)] == ids[:MAX_HISTORY]  # history -n 100000
        # keyset: each page starts after the last row of the one before, ties on time broken by id
        cursor, seen = None, []
        for _ in range(4):
            page = store.history(limit=7, after=cursor)
            seen += [r.id for r in page]
            cursor = HistoryCursor.decode(HistoryCursor.of(page[-1]).encode())
        assert seen == ids[:28]
        deep = store.history(limit=3, offset=70_000)
        assert [r.id for r in store.history(limit=3, after=HistoryCursor.of(deep[-1]))] == ids[70_003:70_006]
        # filters still apply in SQL
        l4 = store.history(gpu="l4", limit=500, offset=40_000)
        assert len(l4) == 500 and {r.gpu for r in l4} == {"L4"}
        assert [r.id for r in store.history(model="MODEL-3", limit=2, offset=9_000)] == [
            i for i in ids[3:] if int(i, 16) % 10 == 3][9_000:9_002]


def test_the_api_and_planner_history_page_over_100000_plans(filled, cli):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from planner.service import create_app
    from planner.service.settings import ServiceSettings

    url, ids = filled
    with TestClient(create_app(ServiceSettings(database_url=url))) as client:
        for offset in (0, 65_035, 99_000):
            page = client.get("/v1/plans", params={"offset": offset, "limit": 500})
            assert page.status_code == 200, page.text
            body = page.json()
            assert [p["id"] for p in body["plans"]] == ids[offset:offset + 500]
            assert body["next_offset"] == offset + 500
        after = body["next_cursor"]
        nxt = client.get("/v1/plans", params={"after": after, "limit": 500}).json()
        assert [p["id"] for p in nxt["plans"]] == ids[99_500:100_000]
        last = client.get("/v1/plans", params={"after": nxt["next_cursor"], "limit": 500}).json()
        assert [p["id"] for p in last["plans"]] == ids[100_000:] and last["next_cursor"] is None
        assert last["next_offset"] is None
        bad = client.get("/v1/plans", params={"after": "not-a-cursor"})
        assert bad.status_code == 422 and "not a history cursor" in bad.text
    r = cli("history", "-n", "100000", "--json", "--db", url)
    assert r.code == 0, r
    assert [row["id"] for row in json.loads(r.out)] == ids[:100_000]
