"""One contract, every store: ``PlanStore`` (planner.store.interface) as the SQLAlchemy store
answers it on SQLite and on PostgreSQL, and as the lite store answers it on SQLite.

Each test takes ``plan_store`` and runs three times; the cross-checks at the end write through one
store and read through the other on the same SQLite file.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from support.store import (  # noqa: F401 - fixtures
    candidate,
    measurement,
    pg_url,
    plan_result,
    request,
    sqlite_url,
)

from planner.errors import AmbiguousIdError, RecordNotFoundError, StatusTransitionError
from planner.store import HistoryCursor, PlanStatus, PlanStore, open_plan_store, open_store
from planner.store.api import Store
from planner.store.lite import LiteStore

KINDS = ["sqlalchemy-sqlite", "lite-sqlite", pytest.param("sqlalchemy-postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=KINDS)
def plan_store(request):
    kind = request.param
    url = request.getfixturevalue("pg_url" if kind.endswith("postgresql") else "sqlite_url")
    if kind.startswith("lite"):
        open_store(url=url).close()  # the schema at head: the factory then hands out the lite store
        store = open_plan_store(url=url)
        assert isinstance(store, LiteStore)
    else:
        store = open_plan_store(url=url, shared=True)
        assert isinstance(store, Store)
    with store:
        yield store


def test_every_store_is_a_plan_store(plan_store):
    assert isinstance(plan_store, PlanStore)


def test_a_plan_round_trips_with_its_runs(plan_store):
    result = plan_result()
    plan_id = plan_store.save_plan(result=result)
    plan = plan_store.get_plan(plan_id=plan_id[:6])
    assert plan.id == plan_id and plan.to_result() == result and plan.status is PlanStatus.PLANNED
    first, second = plan.candidates[:2]
    ok, oom = measurement(), measurement(outcome="oom", step_s=None)
    plan_store.record_measurement(candidate_id=first.id, measurement=ok)
    run_id = plan_store.record_measurement(candidate_id=second.id[:10], measurement=oom)
    plan = plan_store.get_plan(plan_id=plan_id)
    assert [m.measurement for m in plan.candidates[0].measurements] == [ok]
    assert plan.candidates[1].latest.id == run_id and plan.candidates[2].measurements == ()
    assert plan_store.count_plans() == 1


def test_a_multi_rank_run_keeps_every_ranks_measurement(plan_store):
    """Two ranks: the run's row is the worst rank's, and each rank's reads back in rank order,
    named by its rank; a failed run names the rank that failed it (the other was stopped)."""
    plan = plan_store.get_plan(plan_id=plan_store.save_plan(result=plan_result()))
    first, second = plan.candidates[:2]
    low, high = replace(measurement(peak=5_000_000), node="a"), replace(measurement(peak=7_000_000), node="b")
    plan_store.record_measurement(candidate_id=first.id, measurement=high, ranks=(low, high))
    oom = replace(measurement(outcome="oom", step_s=None), error="rank 1: memory limit")
    stopped = replace(measurement(outcome="error", step_s=None), error="stopped: rank 1 failed the run")
    plan_store.record_measurement(candidate_id=second.id, measurement=oom, ranks=(stopped, oom))
    plan = plan_store.get_plan(plan_id=plan.id)
    ran, failed = plan.candidates[0].latest, plan.candidates[1].latest
    assert ran.measurement == high and [r.peak_allocated_bytes for r in ran.ranks] == [5_000_000, 7_000_000]
    assert [r.node for r in ran.ranks] == ["a", "b"] and ran.worst_rank == 1
    assert [str(r.outcome) for r in failed.ranks] == ["error", "oom"] and failed.worst_rank == 1
    as_json = failed.to_dict()
    assert as_json["worst_rank"] == 1 and [r["rank"] for r in as_json["ranks"]] == [0, 1]
    assert as_json["ranks"][1]["error"] == "rank 1: memory limit" and as_json["ranks"][1]["device"] == oom.device


def test_a_single_measurement_is_a_measured_plan_never_found_as_the_request(plan_store):
    req = request(constraints={"config": "lora mb2"})
    one = candidate(rank=1, micro_batch=2, grad_accum=8)
    plan_id, candidate_id = plan_store.record_single_measurement(request=req, candidate=one, measurement=measurement())
    plan = plan_store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.MEASURED and plan.request == req and plan.candidates[0].id == candidate_id
    assert plan.candidates[0].latest.measurement == measurement()
    assert plan_store.find_same_request(request=req) is None


def test_the_same_request_is_its_identity(plan_store):
    req = request()
    plan_id = plan_store.save_plan(result=plan_result(req=req))
    # what is not the request's identity: the model's name, the device memory planned, the version
    same = replace(req, model_id="a/renamed-copy", gpu_memory_bytes=1, planner_version="9.9")
    assert same.identity() == req.identity()
    assert plan_store.find_same_request(request=same).id == plan_id
    for change in (dict(model_fingerprint="0" * 64), dict(gpu="A10G"), dict(gpu_count=2), dict(target_batch=8),
                   dict(seq_len=2048), dict(constraints={"method": "lora", "top_k": 4})):
        other = replace(req, **change)
        assert other.identity() != req.identity()
        assert plan_store.find_same_request(request=other) is None, change
    # constraints compare as data, whatever their order
    reordered = replace(req, constraints=dict(reversed(list(req.constraints.items()))))
    assert plan_store.find_same_request(request=reordered).id == plan_id


def test_the_newest_verified_plan_is_found_first(plan_store):
    result = plan_result()
    verified = plan_store.save_plan(result=result)
    plan_store.set_status(plan_id=verified, status=PlanStatus.VERIFIED, reason="rank 1 ran")
    newer = plan_store.save_plan(result=result)
    assert plan_store.find_same_request(request=result.request).id == verified
    assert plan_store.find_verified(request=result.request).id == verified
    assert newer != verified


def test_status_moves_and_terminal_statuses_stay(plan_store):
    plan_id = plan_store.save_plan(result=plan_result())
    plan_store.set_status(plan_id=plan_id, status="planned", ray_job_id="raysubmit_1", reason="submitted")
    plan_store.set_status(plan_id=plan_id[:8], status=PlanStatus.VERIFYING, lease_s=600)
    plan_store.set_status(plan_id=plan_id, status="verifying", lease_s=600)  # the lease taken again
    with pytest.raises(StatusTransitionError, match="is being verified"):
        plan_store.set_status(plan_id=plan_id, status="planned")
    plan_store.set_status(plan_id=plan_id, status="verified", reason="2 of 2 fit")
    plan = plan_store.get_plan(plan_id=plan_id)
    assert plan.status is PlanStatus.VERIFIED and plan.ray_job_id == "raysubmit_1" and plan.lease_until is None
    for target in PlanStatus:
        with pytest.raises(StatusTransitionError, match=f"plan {plan_id[:8]} is verified already"):
            plan_store.set_status(plan_id=plan_id, status=target)
    assert plan_store.get_plan(plan_id=plan_id).status_reason == "2 of 2 fit"

    failed = plan_store.save_plan(result=plan_result())
    plan_store.set_status(plan_id=failed, status="failed", reason="oom")
    with pytest.raises(StatusTransitionError, match="is failed already"):
        plan_store.set_status(plan_id=failed, status="verifying")
    measured, _ = plan_store.record_single_measurement(request=request(), candidate=candidate(rank=1, micro_batch=1,
                                                       grad_accum=16), measurement=measurement())
    with pytest.raises(StatusTransitionError, match="is measured already"):
        plan_store.set_status(plan_id=measured, status="verified")
    planned = plan_store.save_plan(result=plan_result())
    with pytest.raises(StatusTransitionError, match="only 'planner measure' records a measured run"):
        plan_store.set_status(plan_id=planned, status="measured")


def test_a_dead_drivers_plan_is_read_as_failed_and_a_live_one_renews(plan_store):
    alive, dead = plan_store.save_plan(result=plan_result()), plan_store.save_plan(result=plan_result())
    plan_store.set_status(plan_id=alive, status="verifying", lease_s=-1)
    plan_store.renew_lease(plan_id=alive, lease_s=600)
    plan_store.set_status(plan_id=dead, status="verifying", lease_s=-1)
    assert plan_store.expire_stale_verifications() == 1 and plan_store.expire_stale_verifications() == 0
    failed = plan_store.get_plan(plan_id=dead)
    assert failed.status is PlanStatus.FAILED and "no sign of life since" in failed.status_reason
    assert failed.lease_until is None
    live = plan_store.get_plan(plan_id=alive)
    assert live.status is PlanStatus.VERIFYING and live.lease_until > live.status_changed_at + timedelta(seconds=500)
    plan_store.set_status(plan_id=alive, status="verified")
    plan_store.renew_lease(plan_id=alive, lease_s=600)  # a late renewal does not reopen a finished plan
    assert plan_store.get_plan(plan_id=alive).lease_until is None


def test_ids_unknown_ambiguous_and_malformed(plan_store):
    ids = [plan_store.save_plan(result=plan_result(candidates=1)) for _ in range(20)]
    with pytest.raises(RecordNotFoundError, match="no plan with id '0000"):
        plan_store.get_plan(plan_id="0" * 32)
    with pytest.raises(RecordNotFoundError, match="is not an id"):
        plan_store.get_plan(plan_id="x%")
    with pytest.raises(AmbiguousIdError, match="ambiguous"):
        plan_store.set_status(plan_id=_shared_prefix(ids), status="failed")
    with pytest.raises(RecordNotFoundError, match="no candidate with id"):
        plan_store.record_measurement(candidate_id="0" * 32, measurement=measurement())


def _shared_prefix(ids: list[str]) -> str:
    """A one-digit prefix that starts at least two of ``ids`` (20 random ids over 16 digits: always one)."""
    firsts = [i[0] for i in ids]
    return next(d for d in firsts if firsts.count(d) > 1)


def test_history_pages_filters_and_counts(plan_store):
    llama = plan_store.save_plan(result=plan_result())
    other = plan_store.save_plan(result=plan_result(req=request(model_id="org/Some_Model", gpu="A10G")))
    plan_store.set_status(plan_id=other, status="verified")
    first = plan_store.get_plan(plan_id=llama).candidates[0]
    plan_store.record_measurement(candidate_id=first.id, measurement=measurement())
    rows = plan_store.history(limit=10)
    assert [r.id for r in rows] == [other, llama]
    mine = rows[1]
    assert (mine.candidates, mine.measurements, mine.top_plan) == (3, 1, first.candidate.config.label())
    assert [r.id for r in plan_store.history(model="some_model")] == [other]
    # % and _ are letters here, not LIKE's wildcards: 'a_3' is not 'llama-3'
    assert plan_store.history(model="some%model") == [] and plan_store.history(model="a_3") == []
    assert [r.id for r in plan_store.history(model="A-3")] == [llama]
    assert [r.id for r in plan_store.history(gpu="a10g")] == [other]
    assert [r.id for r in plan_store.history(status="verified")] == [other]
    assert [r.id for r in plan_store.history(since=rows[1].created_at)] == [other, llama]
    assert [r.id for r in plan_store.history(limit=1, offset=1)] == [llama]
    assert [r.id for r in plan_store.history(after=HistoryCursor.of(rows[0]))] == [llama]
    with pytest.raises(Exception, match="--limit must be a whole number from 1"):
        plan_store.history(limit=0)


def test_the_active_calibration(plan_store):
    from planner.calibration.values import CalibrationValues

    assert plan_store.active_calibration(gpu="a10g") is None
    values = CalibrationValues.from_dict({"mfu": {"bf16": 0.41}})
    with open_store(url=plan_store.url) as writer:
        saved = writer.save_calibration(gpu="a10g", values=values, defaults=values, report={"n": 4},
                                        measurement_ids=["a"])
    assert plan_store.active_calibration(gpu="a10g") == saved


# ---- the two stores on one file ----------------------------------------------------------------
def test_either_store_reads_what_the_other_wrote_alike(sqlite_url):  # noqa: F811 - the fixture
    with open_store(url=sqlite_url) as orm:
        lite = open_plan_store(url=sqlite_url)
        assert isinstance(lite, LiteStore)
        a = orm.save_plan(result=plan_result())
        b = lite.save_plan(result=plan_result(req=request(model_id="x/y_z", gpu="A10G")))
        lite.set_status(plan_id=a, status="verifying", lease_s=600)
        orm.set_status(plan_id=b, status="failed", reason="oom")
        c = orm.get_plan(plan_id=b).candidates[1].id
        lite.record_measurement(candidate_id=c, measurement=measurement(outcome="oom", step_s=None))
        orm.record_measurement(candidate_id=c, measurement=measurement(), ranks=(measurement(), measurement(peak=9)))
        lite.record_measurement(candidate_id=c, measurement=measurement(), ranks=(measurement(peak=9), measurement()))
        orm.record_single_measurement(request=request(), candidate=candidate(rank=1, micro_batch=1, grad_accum=16),
                                      measurement=measurement())
        for plan_id in (a, b):
            assert lite.get_plan(plan_id=plan_id) == orm.get_plan(plan_id=plan_id)
        for filters in ({}, {"model": "y_z"}, {"gpu": "A10G"}, {"status": "failed"}, {"limit": 2, "offset": 1}):
            assert lite.history(**filters) == orm.history(**filters), filters
        assert lite.count_plans() == orm.count_plans() == 3
        with pytest.raises(StatusTransitionError):
            orm.set_status(plan_id=b, status="verifying")
        with pytest.raises(StatusTransitionError):
            lite.set_status(plan_id=b, status="verifying")


@pytest.mark.parametrize("filters", [{"model": 5}, {"gpu": ["a10g"]}])
def test_a_history_filter_that_is_not_text_is_one_line(plan_store, filters):
    # the lite store reached model.replace: AttributeError (op.history(model=5) was a traceback)
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="filters history by text"):
        plan_store.history(**filters)
