"""A bounded cost for every request (issue 22, item 2).

One inline MoE config inside every per-key bound (2,048 layers x 32,768 experts, 16 GPUs, a
batch of 2^20) ran for minutes, held 8.5 GB and got its worker killed. ``planner.limits`` now
refuses it before any work (422, the bound named); the service's per-request CPU and memory
budgets stop what those bounds cannot see (422 / 413); a stopping server stops what still runs.
Every catalog model still plans.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from planner.limits import (
    MAX_BLOCK_REPLAYS,
    MAX_TENSOR_SIZINGS,
    adapter_sets,
    check_search_cost,
    parameter_tensors,
    plans_replayed,
)

#: the issue's request: every size at its documented bound (the SIZE_BOUNDS of planner.catalog)
MIXTRAL_AT_THE_BOUNDS = {"num_hidden_layers": 2048, "num_local_experts": 32768, "num_experts_per_tok": 32768}
HUGE = {"gpu": "h100", "gpus": 16, "target_batch": 1_048_576}


def catalog_config(model_id: str, **changes) -> dict:
    from planner.catalog import resolve_model

    return dict(resolve_model(model_id).config) | changes


def inline_spec(config: dict):
    from planner.catalog import spec_from_config

    return spec_from_config(config, model_id="inline-test", source="inline")


# ---- the bounds, before any work ---------------------------------------------------------------
def test_parameter_tensors_counts_what_param_tensor_sizes_lists():
    """The bound counts the tensors without listing them: the same count (up to the four
    model-level tensors it assumes at most) on every catalog architecture."""
    from planner.catalog import catalog_ids, resolve_model
    from planner.config import Method, TrainConfig
    from planner.memory.parameters import param_tensor_sizes

    for model_id in catalog_ids():
        spec = resolve_model(model_id)
        listed = len(param_tensor_sizes(spec, TrainConfig(method=Method.FULL)))
        assert listed <= parameter_tensors(spec) <= listed + 4, model_id


def test_the_sizes_multiply_by_hand():
    """Mixtral-8x7B as transformers v5 builds it: a block holds q, k, v, o, the router and 8
    experts x (gate_up_proj, down_proj), no biases, and 2 RMSNorms: 4 + 1 + 16 + 2 = 23 tensors,
    x 32 blocks, + 4 model-level = 740. The search tries 4 ranks x 2 target sets = 8 adapter
    sets; top_k 5 replays 5 + 3 plans. The issue's request: 2,048 x (4 + 1 + 32,768 x 2 + 2) + 4."""
    from planner.catalog import resolve_model
    from planner.config import Method

    spec = resolve_model("mistralai/Mixtral-8x7B-v0.1")
    assert parameter_tensors(spec) == 32 * (4 + 1 + 8 * 2 + 2) + 4 == 740
    huge = inline_spec(catalog_config("mistralai/Mixtral-8x7B-v0.1", **MIXTRAL_AT_THE_BOUNDS))
    assert parameter_tensors(huge) == 2048 * (4 + 1 + 32768 * 2 + 2) + 4 == 134_232_068
    assert adapter_sets(spec, methods=tuple(Method), lora_ranks=(8, 16, 32, 64)) == 8
    assert adapter_sets(spec, methods=(Method.FULL,), lora_ranks=(8, 16, 32, 64)) == 0
    assert plans_replayed(5) == 8 and plans_replayed(1) == 2 and plans_replayed(10**9) == 21


def test_the_issue_request_is_refused_at_once_naming_the_bound():
    from planner.errors import ModelConfigError
    from planner.planning import SuggestRequest, make_plan

    spec = inline_spec(catalog_config("mistralai/Mixtral-8x7B-v0.1", **MIXTRAL_AT_THE_BOUNDS))
    start = time.process_time()
    with pytest.raises(ModelConfigError) as info:
        make_plan(SuggestRequest(model="inline-test", **HUGE), spec=spec)
    assert time.process_time() - start < 1
    message = str(info.value)
    assert "134,232,068 parameter tensors (2,048 blocks with 32,768 experts)" in message
    assert f"over the bound of {MAX_TENSOR_SIZINGS:,}" in message and "\n" not in message


def test_every_catalog_model_plans_inside_the_bounds():
    """The bounds refuse no real model, with the widest search and the most plans shown."""
    from planner.catalog import catalog_ids, resolve_model
    from planner.config import Method

    for model_id in catalog_ids():
        check_search_cost(resolve_model(model_id), methods=tuple(Method), lora_ranks=(8, 16, 32, 64), top_k=10**6)


def test_too_many_blocks_for_the_plans_asked_names_top_k():
    from planner.errors import ModelConfigError
    from planner.planning import SuggestRequest, make_plan

    spec = inline_spec(catalog_config("gpt2", n_layer=2048, n_embd=256, n_head=4))
    with pytest.raises(ModelConfigError, match=r"2,048 blocks x 8 plans .* 16,384 block replays, over the bound of "
                                                r"4,096 per request; ask for fewer plans \(--top-k 1\)"):
        make_plan(SuggestRequest(model="inline-test", gpu="h100", target_batch=8), spec=spec)
    assert MAX_BLOCK_REPLAYS // 2048 == plans_replayed(1)
    planned = make_plan(SuggestRequest(model="inline-test", gpu="h100", target_batch=8, top_k=1), spec=spec)
    assert len(planned.result.plans) == 1


def test_estimate_is_bounded_too(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(catalog_config("mistralai/Mixtral-8x7B-v0.1", **MIXTRAL_AT_THE_BOUNDS)))
    result = cli("estimate", "-m", str(config), "-g", "h100", "--method", "lora")
    assert result.code == 2 and "tensor sizings" in result.err and "Traceback" not in result.err


def test_the_cli_refuses_it_in_one_line(cli, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(catalog_config("mistralai/Mixtral-8x7B-v0.1", **MIXTRAL_AT_THE_BOUNDS)))
    result = cli("suggest", "-m", str(config), "-g", "h100", "--gpus", "16", "-b", "1048576", "--no-save")
    assert result.code == 2 and "tensor sizings" in result.err and "Traceback" not in result.err


def test_warm_leaves_planning_nothing_to_import():
    """A server warms at startup (``planner.planning.warm``) so that a request's CPU budget is its
    own work: planning after it imports no planner module and reads the catalog from memory. Run
    in a fresh interpreter: this one has imported everything already."""
    script = (
        "import sys\n"
        "from planner.catalog import _catalog\n"
        "from planner.planning import SuggestRequest, make_plan, warm\n"
        "warm()\n"
        "before, reads = set(sys.modules), _catalog.cache_info().misses\n"
        "make_plan(SuggestRequest(model='gpt2', gpu='a10g', target_batch=8))\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('planner')), "
        "_catalog.cache_info().misses - reads)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] 0"


# ---- the service ----------------------------------------------------------------------------------
fastapi = pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.api import running_server  # noqa: E402
from support.store import db_url, pg_url, sqlite_url  # noqa: E402,F401 - fixtures

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings  # noqa: E402


def test_the_issue_request_is_a_422_in_a_second_and_stores_nothing(db_url):
    body = {"model": "acme/moe", "config": catalog_config("mistralai/Mixtral-8x7B-v0.1", **MIXTRAL_AT_THE_BOUNDS)} | HUGE
    with TestClient(create_app(ServiceSettings(database_url=db_url))) as client:
        start = time.monotonic()
        answer = client.post("/v1/plans", json=body)
        assert answer.status_code == 422 and time.monotonic() - start < 5, answer.text
        assert answer.json()["field"] == "config" and answer.json()["error"].startswith("config: the model has")
        assert "tensor sizings" in answer.json()["error"]
        estimate = client.post("/v1/estimate", json={k: body[k] for k in ("model", "config", "gpu")})
        assert estimate.status_code == 422 and "tensor sizings" in estimate.json()["error"]
        assert client.get("/v1/plans").json()["plans"] == []


def test_a_request_past_the_cpu_budget_is_a_422_and_the_server_goes_on(sqlite_url):
    """What the static bounds let through but takes long is stopped at the budget. Here a
    96-block Qwen3 MoE on 8 GPUs, 18 plans shown: about 1.3 s of CPU, four times the budget (the
    190-block dense model this test used took 3 s before the search got faster, then 0.5 s, too
    close to the budget: a swallowed stop let it finish with a 201)."""
    slow = {"model": "acme/deep", "config": catalog_config("Qwen/Qwen3-30B-A3B", num_hidden_layers=96), "gpu": "h100",
            "gpus": 8, "target_batch": 64, "top_k": 18}
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url, cpu_budget_s=0.3))) as client:
        answer = client.post("/v1/plans", json=slow)
        assert answer.status_code == 422, answer.text
        assert answer.json()["error"].startswith("the request used more than 0.3 s of CPU")
        assert "PLANNER_API_CPU_SECONDS" in answer.json()["error"]
        assert client.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8}).status_code == 201
        assert len(client.get("/v1/plans").json()["plans"]) == 1


def test_a_request_past_the_memory_budget_is_a_413(sqlite_url, monkeypatch):
    """The process grows past the budget while a request runs (stood in for by its RSS reading):
    that request is stopped with a 413 naming the budget."""
    from planner import planning
    from planner.service import budget

    started = threading.Event()
    real_rss = budget._rss_bytes

    def grown() -> int:
        return real_rss() + (2 * 1024**3 if started.is_set() else 0)

    def busy(*args, **kwargs):  # the search the plan use case (planner.usecases) runs
        started.set()
        while True:  # a search that never ends, in Python (the watchdog's exception arrives)
            sum(range(1000))

    monkeypatch.setattr(budget, "_rss_bytes", grown)
    monkeypatch.setattr(planning, "make_plan", busy)
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url, memory_budget_bytes=512 * 1024**2))) as client:
        answer = client.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8})
    assert answer.status_code == 413, answer.text
    assert "grew by more than 512 MiB" in answer.json()["error"] and "PLANNER_API_MEMORY" in answer.json()["error"]


def test_a_stop_that_arrives_where_python_ignores_it_is_sent_again(sqlite_url, monkeypatch):
    """The watchdog's exception lands wherever the thread is. In a garbage-collection callback
    (a WeakKeyDictionary's ``remove``) Python prints "Exception ignored" and goes on: the request
    ran to its end and answered 201 in 2 whole-suite runs of 3. Stood in for by a search that
    swallows the first stop as such a callback does; the second stop ends it."""
    from planner import planning
    from planner.service.budget import Stopped

    swallowed = []
    give_up = time.monotonic() + 20  # not stopped again: fail, not hang

    def spin():
        while time.monotonic() < give_up:
            sum(range(1000))

    def busy(*args, **kwargs):
        # The whole spin, its loop test included, runs inside the ``try``: a stop is delivered at a
        # loop's backward jump or a call, and one that landed on a ``while`` test outside the
        # ``try`` ended the request without a swallowed stop (seen under a loaded machine).
        while True:
            try:
                spin()
                break
            except Stopped as stop:
                if swallowed:
                    raise
                swallowed.append(stop)
        raise RuntimeError("the search was stopped once and never again")

    monkeypatch.setattr(planning, "make_plan", busy)
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url, cpu_budget_s=0.2))) as client:
        answer = client.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8})
    assert len(swallowed) == 1
    assert answer.status_code == 422 and "more than 0.2 s of CPU" in answer.json()["error"], answer.text


def test_shutdown_stops_the_requests_still_running(sqlite_url, monkeypatch):
    from planner import planning

    started = threading.Event()

    def busy(*args, **kwargs):  # the search the plan use case (planner.usecases) runs
        started.set()
        while True:
            sum(range(1000))

    monkeypatch.setattr(planning, "make_plan", busy)
    app = create_app(ServiceSettings(database_url=sqlite_url, cpu_budget_s=600))
    answers = []
    with TestClient(app) as client:
        worker = threading.Thread(target=lambda: answers.append(client.post("/v1/plans", json={
            "model": "gpt2", "gpu": "a10g", "target_batch": 8})))
        worker.start()
        assert started.wait(30)
        start = time.monotonic()
        assert app.state.budgets.stop_all() == 1
        worker.join(10)
        assert not worker.is_alive() and time.monotonic() - start < 2
    assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]


@pytest.mark.slow
def test_sigterm_ends_a_server_within_its_graceful_timeout(sqlite_url, tmp_path):
    """A real `planner serve --graceful-timeout 1` with sixteen planning requests running (0.4 s of CPU
    each, 6 s and more of work on two cores): SIGTERM ends it within the second it may wait, not when
    the work is done (once 4.5 minutes; then 2.7-5.7 s, as the server reached its shutdown only when
    its event loop got the GIL among the busy request threads). Each request is stopped by the
    watchdog at the deadline the signal set, half a second before the server would cancel it, and
    answers 503 itself ("shutting down: send the request again"); before this they were cancelled and
    answered 500."""
    import httpx

    slow = {"model": "acme/deep", "config": catalog_config("Qwen/Qwen2.5-0.5B", num_hidden_layers=190), "gpu": "h100",
            "gpu_mem": "40GiB", "target_batch": 64, "top_k": 18}
    procs: list = []
    answers: list = []
    with running_server(env={"PLANNER_DATABASE_URL": sqlite_url, "PLANNER_API_CPU_SECONDS": "600"},
                        log=tmp_path / "serve.log", args=("--graceful-timeout", "1"), procs=procs) as url:
        httpx.post(f"{url}/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8}, timeout=60)  # warm

        def call() -> None:
            try:
                answers.append(httpx.post(f"{url}/v1/plans", json=slow, timeout=60).status_code)
            except httpx.HTTPError as exc:
                answers.append(type(exc).__name__)

        callers = [threading.Thread(target=call) for _ in range(16)]
        for caller in callers:
            caller.start()
        time.sleep(0.5)
        start = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        procs[0].wait(timeout=30)
        took = time.monotonic() - start
        for caller in callers:
            caller.join(30)
    assert took < 3, took
    # none cancelled mid-work by the server (500); a connection it had not read a request from yet is
    # closed (the client's ReadError: nothing was done, send it again)
    assert len(answers) == 16 and 503 in answers and 500 not in answers, answers
    assert set(answers) <= {201, 503, "ReadError", "RemoteProtocolError"}, answers


# ---- fuzzing near every bound --------------------------------------------------------------------
#: each key of an inline config at, just under and just past its bound, and the request's own
#: bounds; the model is small otherwise so that the products, not one size, decide
NEAR = {
    "num_hidden_layers": (1, 97, 195, 2047, 2048, 2049),
    "num_local_experts": (1, 8, 1092, 32767, 32768, 32769),
    "num_experts_per_tok": (1, 2, 32768, 32769),
    "hidden_size": (64, 256, 262144, 262145),
    "intermediate_size": (128, 1048576, 1048577),
    "vocab_size": (1000, 4194304, 4194305),
    "max_position_embeddings": (2048, 134217728, 134217729),
}
REQUEST = {"gpus": (1, 8, 16, 17), "target_batch": (1, 720720, 1048576, 1048577), "top_k": (1, 5, 18, 10**6),
           "seq_len": (None, 512, 2048), "method": ("auto", "full", "lora", "qlora")}
#: the most seconds one request may take here (the CPU budget set below, the machine's load on top)
FUZZ_CPU_BUDGET_S = 4.0
FUZZ_WALL_LIMIT_S = 20.0


def fuzz_bodies():
    from hypothesis import strategies as st

    base = {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "num_hidden_layers": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2}
    config = st.fixed_dictionaries({}, optional={k: st.sampled_from(v) for k, v in NEAR.items()}).map(
        lambda changes: base | changes)
    request = st.fixed_dictionaries({"target_batch": st.sampled_from(REQUEST["target_batch"])}, optional={
        k: st.sampled_from(v) for k, v in REQUEST.items() if k != "target_batch"})
    return st.tuples(config, request, st.sampled_from(["a10g", "h100", "t4"])).map(
        lambda t: {"model": "fuzz/moe", "config": t[0], "gpu": t[2]} | {k: v for k, v in t[1].items() if v is not None})


@pytest.mark.slow
def test_inline_configs_near_every_bound_are_answered_in_seconds(sqlite_url, tmp_path):
    """Through a real server: every request answered (2xx or 4xx, never 5xx) within the CPU
    budget plus the machine's load, and the server alive and planning at the end."""
    import httpx
    from hypothesis import HealthCheck, given, settings

    seen: list[tuple[int, float, dict]] = []
    with running_server(env={"PLANNER_DATABASE_URL": sqlite_url, "PLANNER_API_CPU_SECONDS": str(FUZZ_CPU_BUDGET_S)},
                        log=tmp_path / "serve.log") as url, httpx.Client(base_url=url, timeout=120) as client:

        @given(body=fuzz_bodies())
        @settings(max_examples=int(os.environ.get("PLANNER_FUZZ_EXAMPLES", "60")), deadline=None, database=None,
                  derandomize=True, suppress_health_check=list(HealthCheck))
        def run(body: dict) -> None:
            start = time.monotonic()
            answer = client.post("/v1/plans", json=body)
            took = time.monotonic() - start
            seen.append((answer.status_code, took, body))
            assert answer.status_code < 500, (body, answer.text)
            assert took < FUZZ_WALL_LIMIT_S, (took, body)

        run()
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/plans", json={"model": "gpt2", "gpu": "a10g", "target_batch": 8}).status_code == 201
    statuses = {status for status, _, _ in seen}
    assert 422 in statuses and statuses & {201}, statuses
    slowest = max(seen, key=lambda s: s[1])
    print(f"{len(seen)} requests; slowest {slowest[1]:.1f} s ({slowest[0]}); statuses {sorted(statuses)}")


def test_the_graceful_timeout_reaches_the_app_and_arms_the_stop(monkeypatch):
    """``planner serve`` passes --graceful-timeout as PLANNER_GRACEFUL_TIMEOUT; the budgets stop a running
    request at the deadline ``stop_after`` sets, from the watchdog (no server, no signal here)."""
    from planner.errors import PlannerError
    from planner.service.budget import Budgets
    from planner.service.errors import ServiceError
    from planner.service.settings import GRACEFUL_TIMEOUT_ENV, ServiceSettings

    monkeypatch.setenv(GRACEFUL_TIMEOUT_ENV, "2.5")
    assert ServiceSettings.from_env().graceful_timeout_s == 2.5
    monkeypatch.setenv(GRACEFUL_TIMEOUT_ENV, "soon")
    with pytest.raises(PlannerError, match="PLANNER_GRACEFUL_TIMEOUT 'soon' is not a number of seconds"):
        ServiceSettings.from_env()

    budgets = Budgets(cpu_s=600, memory_bytes=1 << 40)
    started, outcome = threading.Event(), []

    def busy() -> None:
        started.set()
        while True:  # Python work: the stop arrives at its next instruction
            sum(range(1000))

    def request() -> None:
        try:
            budgets.run(busy, what="busy")
        except ServiceError as exc:
            outcome.append((exc.status, time.monotonic()))

    worker = threading.Thread(target=request)
    worker.start()
    assert started.wait(10)
    armed = time.monotonic()
    budgets.stop_after(0.3)
    worker.join(10)
    assert not worker.is_alive() and outcome and outcome[0][0] == 503
    assert 0.3 <= outcome[0][1] - armed < 2
