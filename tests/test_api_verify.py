"""``"verify": true`` end to end: POST /v1/plans submits the verification as a Ray job to a real
head (``ray start --head`` on 127.0.0.1, tests/test_verify.py's ``ray_head``), answers 202 at
once, and GET /v1/plans/{id} shows the status move and the measurement arrive."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")
pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'oom-planner[ray]')")

from fastapi.testclient import TestClient  # noqa: E402
from test_store_support import sqlite_url  # noqa: E402,F401 - fixture
from test_verify import ray_head  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

#: the smallest decoder in the catalog, LoRA on short sequences: one real run takes seconds on a CPU
REQUEST = {"model": "gpt2", "gpu": "cpu", "target_batch": 2, "seq_len": 32, "method": "lora", "top_k": 2,
           "verify": True, "verify_top": 1, "steps": 2}
DEADLINE_S = 600


@pytest.mark.slow
def test_verify_over_http_runs_as_a_ray_job_and_the_plan_shows_it(sqlite_url, ray_head):
    pytest.importorskip("torch")
    settings = ServiceSettings(database_url=sqlite_url, ray_address=ray_head)
    with TestClient(create_app(settings)) as client:
        answer = client.post("/v1/plans", json=REQUEST)
        assert answer.status_code == 202, answer.text
        sent = answer.json()
        plan_id, job_id = sent["plan_id"], sent["job_id"]
        assert sent["plan_url"] == f"/v1/plans/{plan_id}" and job_id

        seen, deadline = [], time.monotonic() + DEADLINE_S
        while True:
            plan = client.get(f"/v1/plans/{plan_id}").json()
            if not seen or seen[-1] != plan["status"]:
                seen.append(plan["status"])
            if plan["status"] in ("verified", "failed") or time.monotonic() > deadline:
                break
            time.sleep(2)
    assert plan["status"] == "verified", (seen, plan)
    assert plan["ray_job_id"] == job_id
    runs = [m for c in plan["candidates"] for m in c["measurements"]]
    assert len(runs) == 1 and runs[0]["outcome"] == "ok" and runs[0]["peak_allocated_bytes"] > 0
    assert seen[0] in ("planned", "verifying")
