"""``"verify": true`` end to end: POST /v1/plans submits the verification as a Ray job to a real
head (``ray start --head`` on 127.0.0.1, tests/verify/test_verify.py's ``ray_head``), answers 202 at
once, and GET /v1/plans/{id} shows the status move and the measurement arrive."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")
pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'oom-planner[ray]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.ray import ray_head  # noqa: E402,F401 - fixture
from support.store import sqlite_url  # noqa: E402,F401 - fixture

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402

#: the smallest decoder in the catalog, LoRA on short sequences: one real run takes seconds on a CPU
REQUEST = {"model": "gpt2", "gpu": "cpu", "target_batch": 2, "seq_len": 32, "method": "lora", "top_k": 2,
           "verify": True, "verify_top": 1, "steps": 2}
DEADLINE_S = 600


@pytest.mark.slow
def test_verify_over_http_runs_as_a_ray_job_and_the_plan_shows_it(sqlite_url, ray_head, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import json

    # a folder named like the catalog id in the server's working directory is never read nor sent
    # (issue 22, item 8): the job verifies the catalog's gpt2, the model that was planned
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    monkeypatch.chdir(tmp_path)
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
    from planner.verify.jobs import job_client  # with the cluster's token where Ray's token auth is on

    job = job_client(ray_head).get_job_info(job_id)
    assert "--model gpt2 " in job.entrypoint and "working_dir" not in (job.runtime_env or {})
    # the database went by reference: this SQLite URL (no credential) on the driver's command line
    assert f"--db {sqlite_url}" in job.entrypoint and job.runtime_env["env_vars"] == {"HF_HUB_OFFLINE": "1"}
    runs = [m for c in plan["candidates"] for m in c["measurements"]]
    assert len(runs) == 1 and runs[0]["outcome"] == "ok" and runs[0]["peak_allocated_bytes"] > 0
    assert seen[0] in ("planned", "verifying")
