"""POST /v1/estimate and /v1/plans take ``transformers`` (planner/transformers_versions.py) as the CLI's
--transformers: the same knobs, the keys sent winning over the version's, a bad version a 4xx of one line."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.store import sqlite_url  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

MIXTRAL = {"model": "mistralai/Mixtral-8x7B-v0.1", "gpu": "a100-80gb", "method": "qlora", "grad_ckpt": True}
BY_HAND = {"loss_shift": True, "reentrant_ckpt": True, "experts_loop": True, "experts_list_index": True,
           "rope_caches": True}


@pytest.fixture
def client(sqlite_url):
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as c:
        yield c


def test_estimate_takes_the_version(client):
    versioned = client.post("/v1/estimate", json={**MIXTRAL, "transformers": "4.39.3"})
    by_hand = client.post("/v1/estimate", json={**MIXTRAL, **BY_HAND})
    assert versioned.status_code == by_hand.status_code == 200, versioned.text
    assert versioned.json() == by_hand.json()
    # a key sent wins over the version's
    kept = client.post("/v1/estimate", json={**MIXTRAL, "transformers": "4.39.3", "reentrant_ckpt": False})
    assert kept.status_code == 200 and not kept.json()["config"].get("reentrant_ckpt")
    assert kept.json()["config"].get("experts_list_index")


def test_a_bad_version_is_refused_in_one_line(client):
    answer = client.post("/v1/estimate", json={**MIXTRAL, "transformers": "4.x"})
    assert 400 <= answer.status_code < 500, answer.text
    assert "--transformers" in answer.text or "transformers" in answer.text


def test_plans_take_the_version(client):
    body = {"model": "mistralai/Mistral-7B-v0.1", "gpu": "a100-80gb", "target_batch": 8, "method": "lora"}
    answer = client.post("/v1/plans", json={**body, "transformers": "4.41.2"})
    assert answer.status_code == 201, answer.text
    plans = answer.json()["plans"]
    assert plans and all(p["config"].get("loss_shift") and p["config"].get("reentrant_ckpt")
                         and p["config"].get("rope_caches") for p in plans)
