"""Fuzzing the API from its own OpenAPI schema (schemathesis + hypothesis, in-process ASGI):
at least 500 generated requests, valid and invalid, across every operation; none may answer 5xx."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")

from support.api import FakeSubmission, fake_verify  # noqa: E402
from support.store import sqlite_url  # noqa: E402,F401 - fixture

#: generated cases per operation and generation mode (valid data, then data that breaks the schema)
EXAMPLES = 75
MIN_REQUESTS = 500
#: bodies per route of the deeper pass (each may run a whole search: ~0.2 s)
DEEP_EXAMPLES = 100


def fuzz_operation(operation, mode, seen: list[tuple[str, int]]) -> None:
    from hypothesis import HealthCheck, given, settings

    strategy = operation.as_strategy(generation_mode=mode)

    @given(case=strategy)
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call()
        seen.append((f"{case.method} {case.path}", response.status_code))
        assert response.status_code < 500, (case.method, case.formatted_path, case.body, case.query, response.text)
        assert "Traceback" not in response.text

    run()


@pytest.mark.slow
def test_no_generated_request_gets_a_5xx(sqlite_url, monkeypatch):
    """A Ray cluster that takes every job: the fuzzing is about the API, not about Ray."""
    import uuid

    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    from planner.service import create_app
    from planner.service.settings import ServiceSettings

    fake_verify(monkeypatch, lambda **kw: FakeSubmission(plan_id=uuid.uuid4().hex, job_id="raysubmit_fuzz"))
    app = create_app(ServiceSettings(database_url=sqlite_url, ray_address="http://127.0.0.1:8265"))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    seen: list[tuple[str, int]] = []
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                try:
                    fuzz_operation(operation, mode, seen)
                except Unsatisfiable:  # an operation without parameters has no invalid form
                    assert mode is GenerationMode.NEGATIVE and not operation.body and not operation.query


    finally:
        app.state.holder.close()
    operations = {name for name, _ in seen}
    assert len(seen) >= MIN_REQUESTS, f"only {len(seen)} requests generated"
    assert {"POST /v1/plans", "POST /v1/estimate", "GET /v1/plans", "GET /v1/plans/{plan_id}"} <= operations
    assert {status for _, status in seen} >= {200, 404, 422}


def names(kind: str) -> list[str]:
    from planner.catalog import catalog_ids
    from planner.gpus import list_gpus

    return catalog_ids() if kind == "models" else [g.name for g in list_gpus()]


def deep_bodies():
    """Bodies that get past the schema to the search: real model and GPU names, any numbers."""
    from hypothesis import strategies as st

    small = st.one_of(st.integers(-2, 70), st.sampled_from([128, 512, 1000, 2048, 4097, 2**20, 2**20 + 1, 2**63]))
    size = st.one_of(st.none(), st.integers(-1, 2**51), st.sampled_from(["80GiB", "16GB", "1KiB", "0GiB", "1e3GiB", "9PiB", "x"]))
    return st.fixed_dictionaries({"model": st.sampled_from(names("models")), "gpu": st.sampled_from(names("gpus")),
                                  "target_batch": small}, optional={
        "seq_len": small, "gpus": small, "gpu_mem": size, "cpu_mem": size, "top_k": small,
        "method": st.sampled_from(["auto", "full", "lora", "qlora", "dora"]),
        "precision": st.sampled_from(["auto", "fp32", "fp16-mixed", "bf16-mixed", "fp16", "bf16", "fp8"]),
        "allow_offload": st.booleans(), "prefer": st.sampled_from(["fidelity", "speed", "fast"]), **recipe_fields(),
    })


def recipe_fields() -> dict:
    """The recipe knobs of both bodies (PlanBody and EstimateBody), valid and not."""
    from hypothesis import strategies as st

    return {"lora_dropout": st.one_of(st.sampled_from([0, 0.0, 0.05, 0.1, 0.999, 1, -0.1]), st.floats(allow_nan=False, allow_infinity=False)),
            "loop": st.sampled_from(["trainer", "manual", "Manual", ""]), "fused_ce": st.booleans(),
            "packing": st.booleans(), "use_cache": st.booleans()}


def deep_estimates():
    from hypothesis import strategies as st

    small = st.one_of(st.integers(-1, 70), st.sampled_from([512, 2048, 2**20 + 1]))
    return deep_bodies().flatmap(lambda plan: st.fixed_dictionaries(
        {"model": st.just(plan["model"]), "gpu": st.just(plan["gpu"])}, optional={
            "seq_len": small, "micro_batch": small, "grad_accum": small, "gpus": small, "grad_ckpt": st.booleans(),
            "method": st.sampled_from(["full", "lora", "qlora"]), "lora_r": small, "zero": st.integers(-1, 4),
            "precision": st.sampled_from(["fp32", "fp16-mixed", "bf16-mixed", "fp16", "bf16"]),
            "optimizer": st.sampled_from(["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"]),
            "attention": st.sampled_from(["sdpa", "eager", "flash"]), "lora_targets": st.sampled_from(["all-linear", "q_proj", "nope"]),
            "offload": st.sampled_from(["none", "optimizer", "optimizer+params"]), **recipe_fields(),
        }))


@pytest.mark.slow
def test_requests_that_reach_the_search_get_no_5xx(sqlite_url):
    """The schema-driven fuzzing rarely names a real model; these bodies always do, so the
    search and the estimate themselves meet odd numbers and combinations."""
    from fastapi.testclient import TestClient
    from hypothesis import HealthCheck, given, settings

    from planner.service import create_app
    from planner.service.settings import ServiceSettings

    seen: list[tuple[str, int]] = []
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        for path, bodies in (("/v1/plans", deep_bodies()), ("/v1/estimate", deep_estimates())):

            @given(body=bodies)
            @settings(max_examples=DEEP_EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(body: dict) -> None:
                answer = client.post(path, json=body)
                seen.append((path, answer.status_code))
                assert answer.status_code < 500, (path, body, answer.text)
                assert answer.status_code in (200, 201) or answer.json()["error"], (path, body, answer.text)

            run()
    statuses = {status for _, status in seen}
    assert {200, 201, 422} <= statuses, seen
