"""A stored plan's files (``GET /v1/plans/{id}/files``, ``planner emit``'s files zipped) and its
predicted step (``GET /v1/plans/{id}/timeline``, ``planner estimate --timeline``'s curves), as the
web page's plan view fetches them."""

from __future__ import annotations

import io
import zipfile

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.store import sqlite_url  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.calls import TIMELINE_POINTS  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402


@pytest.fixture
def api(sqlite_url):
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        yield client


@pytest.fixture
def plan_id(api):
    answer = api.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8})
    assert answer.status_code == 201, answer.text
    return answer.json()["plan_id"]


def test_the_files_are_what_planner_emit_writes(api, plan_id, tmp_path, cli):
    answer = api.get(f"/v1/plans/{plan_id}/files", params={"rank": 2})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/zip"
    assert answer.headers["content-disposition"] == f'attachment; filename="plan-{plan_id[:8]}-rank2.zip"'
    archive = zipfile.ZipFile(io.BytesIO(answer.content))
    url = api.app.state.holder.url
    r = cli("emit", plan_id, tmp_path / "out", "--rank", "2", "--db", url)
    assert r.code == 0, r
    written = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert {name: archive.read(name).decode() for name in archive.namelist()} == written
    assert {"train.py", "training_args.json", "PLAN.md"} <= set(written)


def test_the_timeline_is_the_candidates_step_with_its_peak_kept(api, plan_id):
    plan = api.get(f"/v1/plans/{plan_id}").json()
    data = api.get(f"/v1/plans/{plan_id}/timeline").json()
    top = plan["candidates"][0]
    assert data["label"] == top["label"] and data["peak_phase"] == top["memory"]["peak_phase"]
    assert len(data["x"]) == len(data["allocated"]) == len(data["reserved"]) <= TIMELINE_POINTS + 2
    assert all(len(v) == len(data["x"]) for v in data["stacks"].values())
    # the thinning keeps each stretch's largest point: the predicted peak is on the curve
    assert max(data["allocated"]) == data["peak_bytes"] == top["memory"]["peak_allocated_bytes"]
    assert data["x"] == sorted(data["x"]) and data["x"][0] == 0.0 and data["x"][-1] == 1.0
    assert data["capacity_bytes"] == plan["request"]["gpu_memory_bytes"] and data["usable_bytes"] == plan["usable_bytes"]


def test_a_plan_of_a_config_sent_inline_has_neither_and_says_where_to_get_them(api):
    from planner.catalog import resolve_model

    answer = api.post("/v1/plans", json={"model": "acme/x", "config": dict(resolve_model("gpt2").config), "gpu": "a10g",
                                         "target_batch": 8})
    inline = answer.json()["plan_id"]
    for route in ("files", "timeline"):
        refused = api.get(f"/v1/plans/{inline}/{route}")
        assert refused.status_code == 422 and "sent inline" in refused.json()["error"], refused.text


def test_a_rank_the_plan_has_not_and_an_unknown_plan_are_4xx(api, plan_id):
    assert api.get(f"/v1/plans/{plan_id}/files", params={"rank": 99}).status_code == 422
    assert api.get("/v1/plans/abcdef0123/timeline").status_code == 404
    assert api.get(f"/v1/plans/{plan_id}/timeline", params={"rank": 0}).status_code == 422
