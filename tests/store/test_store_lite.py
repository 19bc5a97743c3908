"""The SQLite path of the one-shot commands (planner.store.lite) against the SQLAlchemy store.

Both write the same database: what one stores, the other reads back equal, and the stored rows
are the same value for value (types, JSON text, timestamp text) but for ids and times.
"""

from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
from dataclasses import replace

import pytest
from sqlalchemy import JSON, Boolean
from support.store import measurement, plan_result, request, sqlite_url  # noqa: F401 - fixture

from planner.calibration.values import CalibrationValues
from planner.errors import DatabaseMissingError, StoreError
from planner.results import PlanResult
from planner.store import PlanStatus, dbmodels, open_store
from planner.store.dbmodels import UTCDateTime
from planner.store.interface import open_plan_store
from planner.store.lite import (
    BOOL_COLUMNS,
    CALIBRATIONS,
    CANDIDATES,
    JSON_COLUMNS,
    MEASUREMENTS,
    REQUESTS,
    TIME_COLUMNS,
    LiteStore,
    sqlite_path,
)
from planner.store.revision import VERSION_TABLE


@pytest.fixture
def store(sqlite_url):
    with open_store(url=sqlite_url) as s:  # creates the schema at head
        yield s


@pytest.fixture
def lite(store):
    found = LiteStore.open(store.url)
    assert found is not None
    return found


def _raw(url: str, table: str) -> list[dict]:
    conn = sqlite3.connect(sqlite_path(url))
    conn.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in conn.execute(f"SELECT * FROM {table} ORDER BY rowid")]
    finally:
        conn.close()


def _typed(url: str, table: str) -> list[dict]:
    """Each stored value with SQLite's storage class: what a later reader sees."""
    conn = sqlite3.connect(sqlite_path(url))
    try:
        columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        listed = ", ".join(f"{c}, typeof({c})" for c in columns)
        return [{c: (row[2 * i], row[2 * i + 1]) for i, c in enumerate(columns)}
                for row in conn.execute(f"SELECT {listed} FROM {table} ORDER BY rowid")]
    finally:
        conn.close()


@pytest.mark.parametrize("table, row_type", [(REQUESTS, dbmodels.PlanRequestRow), (CANDIDATES, dbmodels.CandidateRow),
                                             (MEASUREMENTS, dbmodels.MeasurementRow), (CALIBRATIONS, dbmodels.CalibrationRow)])
def test_column_lists_and_kinds_are_the_models(table, row_type):
    name, columns = table
    model = row_type.__table__
    assert name == model.name
    assert columns == tuple(c.name for c in model.columns)
    for column in model.columns:
        kinds = {"json": isinstance(column.type, JSON), "time": isinstance(column.type, UTCDateTime),
                 "bool": isinstance(column.type, Boolean)}
        assert kinds == {"json": column.name in JSON_COLUMNS, "time": column.name in TIME_COLUMNS,
                         "bool": column.name in BOOL_COLUMNS}, column.name


def test_a_plan_saved_by_either_store_is_stored_alike(store, lite):
    result = plan_result()
    by_orm, by_lite = store.save_plan(result=result), lite.save_plan(result=result)
    varying = {"id", "plan_id", "created_at"}
    for table in ("plan_requests", "plan_candidates"):
        rows = _typed(store.url, table)
        orm = [r for r in rows if by_orm in (r["id"][0], r.get("plan_id", (None,))[0])]
        new = [r for r in rows if by_lite in (r["id"][0], r.get("plan_id", (None,))[0])]
        assert len(orm) == len(new) > 0
        for a, b in zip(orm, new):
            assert {k: v for k, v in a.items() if k not in varying} == {k: v for k, v in b.items() if k not in varying}
            assert a.keys() == b.keys() and all(a[k][1] == b[k][1] for k in a)  # storage classes too
    # the timestamp text of both: SQLAlchemy's SQLite DATETIME format, naive UTC
    for row in _raw(store.url, "plan_requests"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}", row["created_at"])
    # and each store reads the other's plan as its own
    assert store.get_plan(plan_id=by_lite).to_result() == result
    assert lite.find_same_request(request=result.request).to_result() == result


def test_the_same_request_is_found_alike_with_measurements_and_statuses(store, lite):
    result = plan_result()
    assert lite.find_same_request(request=result.request) is None
    planned = store.save_plan(result=result)
    verified = store.save_plan(result=result)
    other = store.save_plan(result=plan_result(req=request(target_batch=8)))
    first = store.get_plan(plan_id=verified).candidates[0]
    store.record_measurement(candidate_id=first.id, measurement=measurement())
    store.record_measurement(candidate_id=first.id, measurement=measurement(outcome="oom", step_s=None))
    store.set_status(plan_id=verified, status=PlanStatus.VERIFIED, reason="rank 1 ran")
    store.record_single_measurement(request=result.request, candidate=result.plans[0], measurement=measurement())

    found = lite.find_same_request(request=result.request)
    assert found == store.find_same_request(request=result.request)
    assert found.id == verified and found.verified and len(found.measurements) == 2
    assert [m.measurement.outcome for m in found.candidates[0].measurements] == ["ok", "oom"]
    assert lite.find_verified(request=result.request) == found
    assert lite.find_same_request(request=request(target_batch=8)).id == other
    assert planned != verified


def test_a_stale_verification_is_expired_before_the_lookup(store, lite):
    result = plan_result()
    plan_id = store.save_plan(result=result)
    store.set_status(plan_id=plan_id, status="verifying", lease_s=-1)
    found = lite.find_same_request(request=result.request)
    assert found.status is PlanStatus.FAILED and "no sign of life since" in found.status_reason
    assert lite.expire_stale_verifications() == 0


def test_the_active_calibration_is_read_alike(store, lite):
    values = CalibrationValues.from_dict({"mfu": {"bf16": 0.41}})
    assert lite.active_calibration(gpu="a10g") is None
    store.save_calibration(gpu="a10g", values=values, defaults=values, report={"n": 4}, measurement_ids=["a", "b"])
    newest = store.save_calibration(gpu="a10g", values=values, defaults=values, report={"n": 5}, measurement_ids=["c"])
    assert lite.active_calibration(gpu="a10g") == newest == store.active_calibration(gpu="a10g")
    store.reset_calibration(gpu="a10g")
    assert lite.active_calibration(gpu="a10g") is None


def test_a_candidate_that_cannot_be_stored_leaves_nothing(store, lite):
    good = plan_result()
    nan = replace(good.plans[2], throughput=replace(good.plans[2].throughput, tokens_per_s=float("nan")))
    with pytest.raises(StoreError, match="candidate 3 .*throughput estimate: it is not plain JSON"):
        lite.save_plan(result=PlanResult(request=good.request, plans=(*good.plans[:2], nan)))
    assert _raw(store.url, "plan_requests") == [] and _raw(store.url, "plan_candidates") == []


def test_open_plan_store_takes_the_lite_path_only_at_head(sqlite_url, tmp_path):
    with pytest.raises(DatabaseMissingError, match="no database at .* yet"):
        open_plan_store(url=sqlite_url, create=False)
    assert not (tmp_path / "store.db").exists()  # a lookup leaves no empty file behind
    first = open_plan_store(url=sqlite_url)  # a new database: the SQLAlchemy store creates it
    assert not isinstance(first, LiteStore)
    first.close()
    assert isinstance(open_plan_store(url=sqlite_url, create=False), LiteStore)

    conn = sqlite3.connect(tmp_path / "store.db")
    with conn:
        conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '0002'")
    conn.close()
    assert LiteStore.open(sqlite_url) is None  # behind: open_store says what to do


@pytest.mark.parametrize("url, path", [
    ("sqlite:////abs/planner.db", "/abs/planner.db"),
    ("sqlite:///rel/planner.db", "rel/planner.db"),
    ("sqlite://", None), ("sqlite:///:memory:", None), ("sqlite:///a.db?mode=ro", None),
    ("sqlite:///a%20b.db", None), ("sqlite+pysqlite:///a.db", None), ("postgresql+psycopg://u@h/db", None),
])
def test_sqlite_path_takes_only_plain_sqlite_urls(url, path):
    assert sqlite_path(url) == path
    if path is not None:  # read as SQLAlchemy reads it
        from sqlalchemy.engine import make_url

        assert make_url(url).database == path


def test_a_file_that_is_not_a_database_is_one_line(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_text("not a database " * 100)
    with pytest.raises(StoreError, match=r"^cannot open database sqlite:///.*bad\.db: file is not a database"):
        open_plan_store(url=f"sqlite:///{bad}")


def test_a_repeated_suggest_does_not_import_sqlalchemy(tmp_path):
    """The point of the lite path: once the database exists, planning reads and writes it
    without SQLAlchemy (a fresh interpreter; the one running the tests has it imported)."""
    code = (
        "import sys, json; from planner.cli import main\n"
        "args = ['suggest', '--model', 'meta-llama/Llama-2-7b-hf', '--gpu', 'a10g', '--target-batch', '32', '--top-k', '1']\n"
        "assert main(args) == 0\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic'))),"
        " file=sys.stderr)\n"
    )
    env = {"PLANNER_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    first, second = (json.loads(r.stderr.strip().splitlines()[-1]) for r in runs)
    assert "sqlalchemy" in first  # the first run creates the database through Alembic
    assert second == []
    assert "a plan for this request exists" in runs[1].stdout
    with open_store(url=f"sqlite:///{tmp_path / 'planner.db'}") as s:
        assert s.count_plans() == 2
