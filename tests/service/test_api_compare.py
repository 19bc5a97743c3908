"""``POST /v1/compare``: which GPU to rent over HTTP, the same answer as ``planner suggest --gpu
any --json``; prices only as sent (never a file of the server's); bad input a 4xx with one line."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.store import sqlite_url  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

BODY = {"model": "gpt2", "target_batch": 8, "gpu_types": ["a10g", "l4"], "gpus_max": 2, "tokens": "2B"}


@pytest.fixture
def api(sqlite_url):
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        yield client


def test_compare_answers_what_the_cli_prints(api, cli):
    answer = api.post("/v1/compare", json=BODY)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    r = cli("suggest", "-m", "gpt2", "-b", "8", "--gpu", "a10g,l4", "--gpus-max", "2", "--tokens", "2B", "--json")
    assert r.code == 0, r
    assert data == json.loads(r.out)
    assert data["tokens"] == 2 * 10**9 and data["prices"] == "shipped table"
    assert [o["dollars"] for o in data["by_cost"]] == sorted(o["dollars"] for o in data["by_cost"])
    assert {(o["gpu"], o["gpus"]) for o in data["options"]} == {("a10g", 1), ("a10g", 2), ("l4", 1), ("l4", 2)}


def test_prices_sent_replace_the_table(api):
    data = api.post("/v1/compare", json=BODY | {"prices": {"l4": 0.25}}).json()
    assert data["prices"] == "the prices sent"
    assert {o["gpu"] for o in data["by_cost"]} == {"l4"}
    assert all(o["price"]["usd_per_gpu_hour"] == 0.25 for o in data["by_cost"])


@pytest.mark.parametrize("change, field", [
    ({"prices": {"l4": -2}}, "positive number"),
    ({"prices": {"warp-drive": 1}}, "warp-drive"),
    ({"tokens": "lots"}, "tokens"),
    ({"gpu_types": ["cpu"]}, "cpu is this machine"),
    ({"model": "./local/config.json"}, "not a catalog id"),
    ({"gpus_max": 0}, "gpus_max"),  # the field, not the CLI option
])
def test_bad_input_is_a_422_with_one_line(api, change, field):
    answer = api.post("/v1/compare", json=BODY | change)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert field in error and "\n" not in error and "Traceback" not in answer.text
