"""Requests a demanding user sends that the schema fuzzing does not reach: each a 4xx with one line
in the API's own terms (the field, not the CLI's option), never a 500."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.store import sqlite_url  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

COMPARE = {"model": "gpt2", "target_batch": 8, "gpu_types": ["a10g"], "gpus_max": 1}


@pytest.fixture
def api(sqlite_url):
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        yield client


@pytest.mark.parametrize("change, fragment, field", [
    ({"epochs": 1e300, "dataset_tokens": "1e16"}, "more than 1e16", "epochs"),  # was a 500 (OverflowError)
    ({"gpu_types": []}, "no GPU type to compare", None),                       # was 200 with no option
    ({"gpus_max": 0}, "gpus_max must be", "gpus_max"),                          # said --gpus-max
    ({"epochs": 2}, "add dataset_tokens", "epochs"),                            # said --dataset-tokens
])
def test_compare_refuses_in_its_own_terms(api, change, fragment, field):
    answer = api.post("/v1/compare", json=COMPARE | change)
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert fragment in body["error"] and "--" not in body["error"].split(" or --dataset")[0], body
    assert body.get("field") == field, body


def test_a_rank_past_the_plans_names_the_rank_field(api):
    plan = api.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8, "top_k": 2})
    assert plan.status_code == 201, plan.text
    answer = api.get(f"/v1/plans/{plan.json()['plan_id']}/timeline", params={"rank": 9})
    assert answer.status_code == 422 and answer.json()["field"] == "rank", answer.text
    assert "--rank" not in answer.json()["error"], answer.text


@pytest.mark.parametrize("prices, fragment", [
    ({"warp-drive": 1}, "prices: unknown GPU 'warp-drive'"),  # was field "gpu": the request's gpu_types were fine
    ({"a10g": 1.7e308}, "more than 1,000"),                   # was 200 with every option's dollars null
])
def test_a_bad_price_sent_is_a_422_about_the_prices(api, prices, fragment):
    answer = api.post("/v1/compare", json=COMPARE | {"prices": prices})
    assert answer.status_code == 422, answer.text
    assert fragment in answer.json()["error"], answer.text
    if fragment.startswith("prices"):
        assert answer.json()["field"] == "prices", answer.text


@pytest.mark.parametrize("content, headers, fragment", [
    ('{"model": "gpt2", "gpu": "a10g", "target_batch": 8}', {"Content-Type": "text/plain"}, "not a JSON object"),
    ("[]", {"Content-Type": "application/json"}, "not a JSON object"),
    ('{"model": "gpt2", "config": {"a": ' + "[" * 50_000 + "]" * 50_000 + "}}", {"Content-Type": "application/json"},
     "nested too deeply"),  # was FastAPI's "There was an error parsing the body": no fix
], ids=["text-plain", "a-list", "deep-nesting"])
def test_a_body_that_is_no_json_object_says_what_to_send(api, content, headers, fragment):
    answer = api.post("/v1/plans", content=content, headers=headers)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert fragment in error and "Content-Type: application/json" in error, error


def test_a_check_file_sent_twice_is_refused_not_read_as_the_last(api):
    files = [{"name": "args.json", "content": '{"per_device_train_batch_size": 2}'},
             {"name": "args.json", "content": "{}"}]  # was 200, checking the default batch of 8
    answer = api.post("/v1/check", json={"gpu": "a10g", "model": "gpt2", "files": files})
    assert answer.status_code == 422, answer.text
    assert answer.json()["field"] == "files" and "args.json sent more than once" in answer.json()["error"]


def test_serve_on_a_port_in_use_or_a_host_that_is_not_here_is_one_line_exit_2(cli):
    import socket

    from support.cli import assert_user_error

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # was uvicorn's log and exit 3, the code of "nothing fits"
        assert_user_error(cli("serve", "--port", port), "Address already in use", "give another --port")
    assert_user_error(cli("serve", "--host", "no-such-host.invalid", "--port", port), "not an address of this machine")


@pytest.mark.parametrize("gpu", ["any", "a10g,l4"])
def test_a_plan_for_several_gpu_types_points_to_compare(api, gpu):
    answer = api.post("/v1/plans", json={"model": "gpt2", "gpu": gpu, "target_batch": 8})
    assert answer.status_code == 422, answer.text  # was "unknown GPU 'any'": as if it were misspelt
    assert "POST /v1/compare" in answer.json()["error"] and answer.json()["field"] == "gpu", answer.text
