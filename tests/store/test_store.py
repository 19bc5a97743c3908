"""The plan store's API on a real SQLite file and on the real PostgreSQL server."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import OperationalError
from support.store import (  # noqa: F401 - fixtures
    candidate,
    db_url,
    measurement,
    memory,
    pg_url,
    plan_result,
    request,
    sqlite_url,
)

from planner.errors import PlannerError, SchemaOutOfDateError, StoreError
from planner.results import PlanResult
from planner.store import PlanStatus, default_database_url, open_store, parse_since, upgrade_database
from planner.store.dbmodels import CandidateRow, PlanRequestRow
from planner.store.engine import LOCKED_RETRIES, retry_locked


@pytest.fixture
def store(db_url):
    with open_store(url=db_url) as s:
        yield s


def test_plan_round_trips_through_the_store(store):
    result = plan_result()
    plan_id = store.save_plan(result=result)

    assert len(plan_id) == 32 and int(plan_id, 16) >= 0
    plan = store.get_plan(plan_id=plan_id[:6])
    assert plan.id == plan_id
    assert plan.to_result() == result  # request, 3 candidates, rejections, searched, bytes
    assert [c.position for c in plan.candidates] == [0, 1, 2]
    assert plan.status is PlanStatus.PLANNED and not plan.verified
    assert plan.created_at.tzinfo is not None and plan.created_at.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - plan.created_at) < timedelta(minutes=1)
    # breakdown as given: 8,030,261,248 x 2 bytes of bf16 weights
    assert plan.candidates[0].candidate.memory.breakdown["weights"] == 16_060_522_496


def test_measurements_are_stored_against_their_candidate(store):
    plan_id = store.save_plan(result=plan_result())
    first, second = store.get_plan(plan_id=plan_id).candidates[:2]
    ok = measurement(peak=17_000_000_000)
    oom = measurement(outcome="oom", step_s=None)
    store.record_measurement(candidate_id=first.id, measurement=ok)
    run_id = store.record_measurement(candidate_id=second.id[:10], measurement=oom)

    plan = store.get_plan(plan_id=plan_id)
    assert [m.measurement for m in plan.candidates[0].measurements] == [ok]  # timestamps round-trip too
    assert plan.candidates[1].latest.id == run_id
    assert plan.candidates[1].latest.measurement.error == "CUDA out of memory"
    assert plan.candidates[2].measurements == ()
    assert len(plan.measurements) == 2


def test_measurement_with_a_bad_timestamp_is_refused(store):
    plan_id = store.save_plan(result=plan_result(candidates=1))
    first = store.get_plan(plan_id=plan_id).candidates[0]
    with pytest.raises(StoreError, match="started_at 'yesterday' is not an ISO 8601 time"):
        store.record_measurement(candidate_id=first.id, measurement=replace(measurement(), started_at="yesterday"))
    assert store.get_plan(plan_id=plan_id).measurements == ()


def test_set_status_and_ray_job(store):
    plan_id = store.save_plan(result=plan_result())
    store.set_status(plan_id=plan_id, status=PlanStatus.VERIFYING, ray_job_id="raysubmit_abc")
    store.set_status(plan_id=plan_id[:8], status="verified")
    plan = store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.VERIFIED and plan.verified and plan.ray_job_id == "raysubmit_abc"
    with pytest.raises(PlannerError, match="--status must be one of planned"):
        store.set_status(plan_id=plan_id, status="done")


def test_status_reason_and_when_it_changed(store):
    plan_id = store.save_plan(result=plan_result())
    before = store.get_plan(plan_id=plan_id)
    assert before.status_changed_at is None and before.status_reason is None
    store.set_status(plan_id=plan_id, status="failed", reason="every candidate ran out of memory")
    plan = store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.FAILED and plan.status_reason == "every candidate ran out of memory"
    assert plan.status_changed_at is not None and plan.status_changed_at.tzinfo is not None
    assert plan.lease_until is None
    assert plan.to_dict()["status_reason"] == "every candidate ran out of memory"


def test_a_verifying_plan_whose_lease_ran_out_is_read_as_failed(store):
    """A driver that died mid-verification leaves no plan verifying forever: the next reader
    (show, history, the reuse lookup) marks it failed, with why."""
    alive, dead = store.save_plan(result=plan_result()), store.save_plan(result=plan_result())
    store.set_status(plan_id=alive, status="verifying", lease_s=600)
    store.set_status(plan_id=dead, status="verifying", lease_s=-1)  # its lease ran out a second ago
    assert store.expire_stale_verifications() == 1
    assert store.expire_stale_verifications() == 0
    failed = store.get_plan(plan_id=dead)
    assert failed.status is PlanStatus.FAILED and "no sign of life since" in failed.status_reason
    assert failed.lease_until is None
    assert store.get_plan(plan_id=alive).status is PlanStatus.VERIFYING

    store.set_status(plan_id=alive, status="verifying", lease_s=-1)
    assert [p.status for p in store.history(limit=5) if p.id == alive] == [PlanStatus.FAILED]


def test_renewing_the_lease_keeps_a_plan_verifying(store):
    plan_id = store.save_plan(result=plan_result())
    store.set_status(plan_id=plan_id, status="verifying", lease_s=-1)
    store.renew_lease(plan_id=plan_id, lease_s=600)
    plan = store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.VERIFYING and plan.lease_until > plan.status_changed_at
    store.set_status(plan_id=plan_id, status="verified", reason="2 of 2 candidates fit")
    store.renew_lease(plan_id=plan_id, lease_s=600)  # a late renewal does not reopen a finished plan
    assert store.get_plan(plan_id=plan_id).lease_until is None


def test_single_measurement_is_a_measured_plan(store):
    req = request(constraints={"config": "lora mb2"})
    one = candidate(rank=1, micro_batch=2, grad_accum=8)
    plan_id, candidate_id = store.record_single_measurement(request=req, candidate=one, measurement=measurement())
    plan = store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.MEASURED and plan.request == req
    assert [c.id for c in plan.candidates] == [candidate_id]
    assert plan.candidates[0].candidate == one
    assert plan.candidates[0].latest.measurement == measurement()
    # a measure record is not a plan to reuse
    assert store.find_same_request(request=req) is None


def test_history_is_newest_first_and_filters(store):
    llama = store.save_plan(result=plan_result(req=request(gpu="L4")))
    mistral = store.save_plan(result=plan_result(req=request(model_id="mistralai/Mistral-7B-v0.1", gpu="L40S")))
    nothing = store.save_plan(result=replace(plan_result(req=request(gpu="T4")), plans=()))
    store.set_status(plan_id=llama, status="verified")

    rows = store.history()
    assert [r.id for r in rows] == [nothing, mistral, llama]
    assert rows[2].verified and rows[2].top_plan == "lora r16 all-linear, bf16-mixed, adamw, mb4x4, ckpt"
    assert rows[0].top_plan is None and rows[0].candidates == 0
    assert rows[1].candidates == 3 and rows[1].measurements == 0
    assert [r.id for r in store.history(model="LLAMA-3")] == [nothing, llama]  # part of the id, any case
    assert [r.id for r in store.history(gpu="l4")] == [llama]  # whole name: not L40S
    assert [r.id for r in store.history(status="verified")] == [llama]
    assert [r.id for r in store.history(limit=2)] == [nothing, mistral]
    assert store.history(since=datetime.now(timezone.utc) + timedelta(hours=1)) == []
    assert len(store.history(since=parse_since("1h"))) == 3
    with pytest.raises(PlannerError, match="^--limit must be a whole number from 1 to 100,000, got 0$"):
        store.history(limit=0)


def test_same_request_is_found_and_verified_plans_win(store):
    req = request()
    assert store.find_same_request(request=req) is None
    older = store.save_plan(result=plan_result(req=req))
    newer = store.save_plan(result=plan_result(req=req))
    store.save_plan(result=plan_result(req=request(constraints={"method": "qlora", "top_k": 3})))
    store.save_plan(result=plan_result(req=request(seq_len=2048)))

    assert store.find_same_request(request=req).id == newer
    # constraints compare as canonical JSON: key order does not matter
    assert store.find_same_request(request=replace(req, constraints={"top_k": 3, "method": "lora"})).id == newer
    store.set_status(plan_id=older, status="verified")
    found = store.find_same_request(request=req)
    assert found.id == older and found.verified
    assert store.find_same_request(request=replace(req, gpu_count=2)) is None


def test_ids_unknown_ambiguous_and_malformed(store):
    ids = [store.save_plan(result=plan_result(candidates=1)) for _ in range(17)]
    # 17 ids over 16 hex digits: at least two share their first character
    first = [i[0] for i in ids]
    shared = next(c for c in first if first.count(c) > 1)
    from planner.errors import AmbiguousIdError, RecordNotFoundError

    with pytest.raises(AmbiguousIdError, match=f"plan id '{shared}' is ambiguous"):
        store.get_plan(plan_id=shared)
    with pytest.raises(RecordNotFoundError, match="no plan with id"):
        store.get_plan(plan_id=uuid.uuid4().hex)
    with pytest.raises(RecordNotFoundError, match="is not an id"):
        store.get_plan(plan_id="5%")
    with pytest.raises(RecordNotFoundError, match="no candidate with id"):
        store.record_measurement(candidate_id=uuid.uuid4().hex, measurement=measurement())


def _count(url: str, row_type) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(row_type))
    finally:
        engine.dispose()


def test_a_failing_candidate_leaves_nothing_behind(store, db_url):
    good = plan_result()
    # the third candidate's breakdown holds an object JSON cannot encode
    broken = replace(good.plans[2], memory=replace(good.plans[2].memory, breakdown={"weights": object()}))
    result = PlanResult(request=good.request, plans=(*good.plans[:2], broken))

    with pytest.raises(StoreError, match=r"cannot store candidate 3 .*memory estimate"):
        store.save_plan(result=result)
    assert _count(db_url, PlanRequestRow) == 0
    assert _count(db_url, CandidateRow) == 0
    store.save_plan(result=good)
    assert _count(db_url, PlanRequestRow) == 1 and _count(db_url, CandidateRow) == 3


def test_nan_predictions_are_refused(store):
    good = plan_result()
    nan = replace(good.plans[0], throughput=replace(good.plans[0].throughput, tokens_per_s=float("nan")))
    with pytest.raises(StoreError, match="throughput estimate: it is not plain JSON"):
        store.save_plan(result=replace(good, plans=(nan,)))
    assert store.count_plans() == 0


def test_schema_behind_is_refused_until_upgraded(db_url):

    from planner.store.schema import alembic_command, alembic_config

    open_store(url=db_url).close()  # creates the schema: brand-new databases are set up on first use
    engine = create_engine(db_url)
    with engine.begin() as conn:
        alembic_command("downgrade", alembic_config(url=db_url, connection=conn), "base")
    with pytest.raises(SchemaOutOfDateError) as info:
        open_store(url=db_url)
    assert str(info.value) == "database schema at base is behind this planner (0004): run 'planner db upgrade'"
    assert upgrade_database(url=db_url) == (None, "0004")
    assert upgrade_database(url=db_url) == ("0004", "0004")
    with open_store(url=db_url) as s:
        assert s.count_plans() == 0

    with engine.begin() as conn:  # as if a newer planner had migrated it
        conn.execute(text("UPDATE planner_alembic_version SET version_num = 'ffff'"))
    with pytest.raises(StoreError, match="at schema revision ffff, newer than this planner"):
        open_store(url=db_url)
    engine.dispose()


def test_unversioned_planner_tables_are_not_touched(sqlite_url):
    open_store(url=sqlite_url).close()
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE planner_alembic_version"))
    engine.dispose()
    with pytest.raises(StoreError, match="has planner tables but no revision stamp"):
        open_store(url=sqlite_url)


@pytest.mark.parametrize(
    "url, reason",
    [
        ("postgresql+psycopg://postgres@127.0.0.1:1/none", "cannot open database postgresql"),
        ("nonsense", "not a database URL"),
        ("nosuchdialect://x/y", "not a database URL"),
        ("sqlite:////nonexistent-dir/x/planner.db", "unable to open database file"),
    ],
)
def test_unreachable_or_bad_databases_are_one_line(url, reason):
    with pytest.raises(StoreError, match=reason) as info:
        open_store(url=url)
    assert "\n" not in str(info.value)
    assert "check --db" in str(info.value) or "write e.g." in str(info.value)


def test_password_is_masked_in_errors():
    with pytest.raises(StoreError) as info:
        open_store(url="postgresql+psycopg://postgres:s3cret@127.0.0.1:1/none")
    assert "s3cret" not in str(info.value) and "***" in str(info.value)


def test_default_database_is_sqlite_in_the_data_dir(planner_home, monkeypatch):
    assert not planner_home.exists()
    assert default_database_url() == f"sqlite:///{planner_home / 'planner.db'}"
    assert planner_home.is_dir()  # created on first use
    with open_store() as s:
        s.save_plan(result=plan_result())
        with s.session_scope() as session:
            assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    assert (planner_home / "planner.db").is_file()
    monkeypatch.setenv("PLANNER_DATABASE_URL", "postgresql+psycopg://u@h/db")
    assert default_database_url() == "postgresql+psycopg://u@h/db"


def test_session_scope_rolls_back_as_a_whole(store):
    plan_id = store.save_plan(result=plan_result())
    with pytest.raises(RuntimeError):
        with store.session_scope(write=True) as session:
            session.get(PlanRequestRow, plan_id).status = "failed"
            session.flush()
            raise RuntimeError("boom")
    assert store.get_plan(plan_id=plan_id).status is PlanStatus.PLANNED


def test_writer_waits_for_another_process_lock(sqlite_url):
    """A plan saved while another connection holds SQLite's write lock is stored once it is free."""
    import sqlite3

    with open_store(url=sqlite_url) as s:
        holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None, check_same_thread=False)
        holder.execute("BEGIN IMMEDIATE")
        releaser = threading.Timer(0.5, lambda: holder.execute("COMMIT"))
        releaser.start()
        started = time.monotonic()
        plan_id = s.save_plan(result=plan_result())
        waited = time.monotonic() - started
        releaser.join()
        holder.close()
        assert waited >= 0.4  # it queued behind the lock rather than failing
        assert s.get_plan(plan_id=plan_id).id == plan_id


def test_retry_locked_retries_only_locks_and_gives_up():
    locked = OperationalError("INSERT", {}, Exception("database is locked"))
    calls, sleeps = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise locked
        return "done"

    assert retry_locked(flaky, sleep=sleeps.append) == "done"
    assert len(calls) == 3 and len(sleeps) == 2
    # doubling from 0.05 s with jitter x[0.5, 1.5): 0.025..0.075, then 0.05..0.15
    assert 0.025 <= sleeps[0] < 0.075 and 0.05 <= sleeps[1] < 0.15

    sleeps.clear()
    with pytest.raises(OperationalError):
        retry_locked(lambda: (_ for _ in ()).throw(locked), sleep=sleeps.append)
    assert len(sleeps) == LOCKED_RETRIES and max(sleeps) < 2.0 * 1.5

    other = OperationalError("SELECT", {}, Exception("no such table: x"))
    with pytest.raises(OperationalError):
        retry_locked(lambda: (_ for _ in ()).throw(other), sleep=sleeps.append)
    assert len(sleeps) == LOCKED_RETRIES  # not retried


def test_parse_since():
    now = datetime(2026, 11, 21, 12, 0, tzinfo=timezone.utc)
    assert parse_since("7d", now=now) == datetime(2026, 11, 14, 12, 0, tzinfo=timezone.utc)
    assert parse_since("12h", now=now) == datetime(2026, 11, 21, 0, 0, tzinfo=timezone.utc)
    assert parse_since("30m", now=now) == datetime(2026, 11, 21, 11, 30, tzinfo=timezone.utc)
    assert parse_since("2w", now=now) == datetime(2026, 11, 7, 12, 0, tzinfo=timezone.utc)
    assert parse_since("2026-11-01") == datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert parse_since("2026-11-01T08:00+02:00") == datetime(2026, 11, 1, 6, tzinfo=timezone.utc)
    with pytest.raises(PlannerError, match="--since 'last week' is not a time: write e.g. 7d"):
        parse_since("last week")


def test_plan_status_terminal_states():
    assert [s.value for s in PlanStatus if s.is_terminal()] == ["verified", "failed", "measured"]
    assert not PlanStatus.PLANNED.is_terminal() and not PlanStatus.VERIFYING.is_terminal()


def test_memory_helper_breakdown_sums_to_peak():
    m = memory(activations=1000)
    # 16,060,522,496 weights + 4 x 167,772,160 (LoRA fp32: weights, grads, 2 Adam states) + 1000
    assert m.peak_allocated_bytes == 16_060_522_496 + 4 * 167_772_160 + 1000 == sum(m.breakdown.values())


def test_a_model_id_longer_than_the_store_keeps_is_refused_before_anything_is_written(store):
    from planner.limits import MODEL_ID_MAX_CHARS

    long_id = "/m" * (MODEL_ID_MAX_CHARS // 2 + 1)
    with pytest.raises(StoreError, match="the model id is 1,026 characters and the store keeps at most 1,024"):
        store.save_plan(result=plan_result(req=request(model_id=long_id)))
    assert store.count_plans() == 0
    # the longest it keeps, on SQLite and PostgreSQL alike (varchar(255) refused 256 before 0002)
    plan_id = store.save_plan(result=plan_result(req=request(model_id="/m" * (MODEL_ID_MAX_CHARS // 2))))
    assert len(store.get_plan(plan_id=plan_id).request.model_id) == MODEL_ID_MAX_CHARS
