"""The plan use case (planner.usecases) as the CLI, the service and a Ray job's driver call it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
from support.store import sqlite_url  # noqa: F401 - fixture

from planner.errors import StoreError
from planner.planning import SuggestRequest
from planner.store import PlanStatus, open_plan_store
from planner.usecases import plan_request, verify_stored_plan
from planner.verify.driver import VerifyOptions

GPT2 = SuggestRequest(model="gpt2", gpu="a10g", target_batch=8, top_k=2)


def _opener(url):
    return lambda: open_plan_store(url=url)


def test_without_a_store_it_only_plans(sqlite_url):  # noqa: F811 - the fixture
    outcome = plan_request(GPT2, store=None)
    assert outcome.planned.result.plans and outcome.plan_id is None and outcome.store_error is None
    assert not os.path.exists(sqlite_url.removeprefix("sqlite:///"))  # no database touched


def test_it_stores_notes_the_same_request_and_answers_from_a_verified_plan(sqlite_url):  # noqa: F811
    first = plan_request(GPT2, store=_opener(sqlite_url))
    assert first.plan_id is not None and first.existing is None and first.reused is None
    second = plan_request(GPT2, store=_opener(sqlite_url))
    assert second.existing.id == first.plan_id and second.plan_id != first.plan_id
    with open_plan_store(url=sqlite_url) as store:
        store.set_status(plan_id=first.plan_id, status=PlanStatus.VERIFIED, reason="by hand for the test")
    reused = plan_request(GPT2, store=_opener(sqlite_url))
    assert reused.reused.id == first.plan_id and reused.plan_id is None
    fresh = plan_request(GPT2, store=_opener(sqlite_url), reuse=False, save=False)
    assert fresh.reused is None and fresh.existing.id == first.plan_id and fresh.plan_id is None
    with open_plan_store(url=sqlite_url) as store:
        assert store.count_plans() == 2


def test_a_store_that_fails_after_the_plan_comes_back_with_the_plan():
    bad = "postgresql+psycopg://postgres@127.0.0.1:1/none"
    outcome = plan_request(GPT2, store=_opener(bad))
    assert outcome.planned.result.plans and isinstance(outcome.store_error, StoreError)
    assert "cannot open database" in str(outcome.store_error)


def test_a_shared_store_stays_open(sqlite_url):  # noqa: F811
    with open_plan_store(url=sqlite_url, shared=True) as store:
        outcome = plan_request(GPT2, store=lambda: contextlib.nullcontext(store))
        assert store.get_plan(plan_id=outcome.plan_id).status is PlanStatus.PLANNED


def test_a_stored_plan_is_verified_only_with_the_model_it_was_planned_for(sqlite_url):  # noqa: F811
    """A job's driver is given the model by name: a different config is refused before anything
    runs (the candidates verified are the stored ones, for the stored model)."""
    stored = plan_request(GPT2, store=_opener(sqlite_url))
    with open_plan_store(url=sqlite_url) as store:
        with pytest.raises(StoreError, match=f"plan {stored.plan_id[:8]} was made for another model config"):
            verify_stored_plan(store=store, plan_id=stored.plan_id, options=VerifyOptions(top=1), model="gpt2-medium")
        assert store.get_plan(plan_id=stored.plan_id).status is PlanStatus.PLANNED


def test_the_same_request_is_one_definition():
    planned = plan_request(GPT2, store=None).planned.result.request
    assert set(planned.identity()) == {"model_fingerprint", "gpu", "gpu_count", "target_batch", "seq_len",
                                       "constraints_hash"}
    assert replace(planned, model_id="renamed", planner_version="x").identity() == planned.identity()
