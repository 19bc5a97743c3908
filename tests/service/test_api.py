"""The HTTP API against real SQLite and PostgreSQL stores, in-process (FastAPI's TestClient).

What it answers is checked against the CLI on the same request (the API has no logic of its own);
the errors against the rules of issue 13: one line, the field, 4xx (503 when a dependency is down),
never a traceback; and the security rules: the token on every POST, no path read from disk.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.api import FakeSubmission, fake_verify  # noqa: E402
from support.store import db_url, pg_url, sqlite_url  # noqa: E402,F401 - fixtures

from planner.errors import PlannerError  # noqa: E402
from planner.service import create_app  # noqa: E402
from planner.service.settings import MAX_BODY_BYTES, ServiceSettings  # noqa: E402

LLAMA = {"model": "meta-llama/Llama-2-7b-hf", "gpu": "a10g", "target_batch": 32}
GPT2 = {"model": "gpt2", "gpu": "a10g", "target_batch": 8}
TOKEN = "s3cret-token-for-tests-0123456789abcdef"  # 32+ characters (settings.MIN_TOKEN_CHARS)


def make_client(url: str, **settings) -> TestClient:
    return TestClient(create_app(ServiceSettings(database_url=url, **settings)))


@pytest.fixture
def api(db_url):
    with make_client(db_url) as client:
        client.db_url = db_url
        yield client


@pytest.fixture
def lite(sqlite_url):
    with make_client(sqlite_url) as client:
        client.db_url = sqlite_url
        yield client


def catalog_config(model_id: str) -> dict:
    from planner.catalog import resolve_model

    return dict(resolve_model(model_id).config)


# ---- the same answers as the CLI --------------------------------------------------------------
def test_plan_is_suggest_json_and_is_stored(api, cli):
    answer = api.post("/v1/plans", json=LLAMA)
    assert answer.status_code == 201, answer.text
    data = answer.json()
    plan_id = data["plan_id"]
    assert answer.headers["location"] == f"/v1/plans/{plan_id}"

    printed = cli("suggest", "-m", LLAMA["model"], "-g", "a10g", "-b", "32", "--json", "--no-save", "--db", api.db_url)
    assert printed.code == 0, printed
    expected = json.loads(printed.out)
    assert set(data) == set(expected)
    for key in ("request", "plans", "rejected", "searched", "usable_bytes", "safety_margin_bytes"):
        assert data[key] == expected[key], key
    assert data["plans"] and data["plans"][0]["rank"] == 1

    listed = api.get("/v1/plans").json()["plans"]
    assert [p["id"] for p in listed] == [plan_id]
    assert listed[0]["top_plan"] and listed[0]["status"] == "planned"
    history = cli("history", "--json", "--db", api.db_url)
    assert [row["id"] for row in json.loads(history.out)] == [plan_id]

    shown = api.get(f"/v1/plans/{plan_id[:8]}").json()
    assert shown["id"] == plan_id and shown["status"] == "planned" and shown["ray_job_id"] is None
    assert [c["config"] for c in shown["candidates"]] == [p["config"] for p in data["plans"]]
    first = shown["candidates"][0]
    assert first["memory"]["breakdown"] and first["measurements"] == []
    assert shown == json.loads(cli("show", plan_id, "--json", "--db", api.db_url).out)


def test_estimate_is_estimate_json(lite, cli):
    body = {"model": "gpt2", "gpu": "a10g", "method": "lora", "micro_batch": 4, "seq_len": 512, "grad_ckpt": True}
    answer = lite.post("/v1/estimate", json=body)
    assert answer.status_code == 200, answer.text
    printed = cli("estimate", "-m", "gpt2", "-g", "a10g", "--method", "lora", "--micro-batch", "4", "--seq-len", "512",
                  "--grad-ckpt", "--json")
    assert answer.json() == json.loads(printed.out)
    assert lite.get("/v1/plans").json()["plans"] == []  # an estimate stores nothing


def test_catalogs_are_the_cli_lists(lite, cli):
    assert lite.get("/v1/gpus").json() == json.loads(cli("gpus", "--json").out)
    models = lite.get("/v1/models").json()
    assert models == json.loads(cli("models", "--json").out)
    assert [m["id"] for m in lite.get("/v1/models", params={"search": "llama"}).json()] == [
        m["id"] for m in json.loads(cli("models", "--search", "llama", "--json").out)
    ]


def test_history_filters_and_pages(lite):
    ids = [lite.post("/v1/plans", json=GPT2 | {"target_batch": b}).json()["plan_id"] for b in (4, 8, 16)]
    lite.post("/v1/plans", json=LLAMA | {"gpu": "l4"})
    page = lite.get("/v1/plans", params={"model": "GPT2", "limit": 2}).json()
    assert [p["id"] for p in page["plans"]] == ids[::-1][:2] and page["next_offset"] == 2
    rest = lite.get("/v1/plans", params={"model": "gpt2", "limit": 2, "offset": 2}).json()
    assert [p["id"] for p in rest["plans"]] == [ids[0]] and rest["next_offset"] is None
    assert [p["gpu"] for p in lite.get("/v1/plans", params={"gpu": "L4"}).json()["plans"]] == ["l4"]
    assert lite.get("/v1/plans", params={"status": "verified"}).json()["plans"] == []
    assert len(lite.get("/v1/plans", params={"since": "1h"}).json()["plans"]) == 4
    assert lite.get("/v1/plans", params={"since": "2999-01-01"}).json()["plans"] == []


def test_inline_config_is_planned_under_its_name(lite):
    config = catalog_config("gpt2")
    answer = lite.post("/v1/plans", json=GPT2 | {"model": "my-org/tiny-gpt", "config": config})
    assert answer.status_code == 201, answer.text
    assert answer.json()["request"]["model_id"] == "my-org/tiny-gpt"
    catalog = lite.post("/v1/plans", json=GPT2).json()
    # same numbers, same fingerprint: the inline config is the catalog's gpt2
    assert answer.json()["request"]["model_fingerprint"] == catalog["request"]["model_fingerprint"]
    assert answer.json()["plans"] == catalog["plans"]


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "status", "field", "words"), [
    ({"gpu": "a10g", "target_batch": 8}, 422, "model", "Field required"),
    (GPT2 | {"target_batch": "eight"}, 422, "target_batch", "valid integer"),
    (GPT2 | {"target_batch": 0}, 422, "target_batch", ">= 1"),
    (GPT2 | {"seq_len": 99999}, 422, "seq_len", "seq_len 99999 is longer than gpt2 allows (1024)"),
    (GPT2 | {"gpu": "h900"}, 422, "gpu", "unknown GPU"),
    (GPT2 | {"method": "dora"}, 422, "method", "method must be one of auto|full|lora|qlora, got 'dora'"),
    (GPT2 | {"gpu_mem": "24"}, 422, "gpu_mem", "unit is required"),
    (GPT2 | {"gpu_mem": -5}, 422, "gpu_mem", "gpu_mem must be larger than zero, got -5"),
    (GPT2 | {"gpu_mem": "0GiB"}, 422, "gpu_mem", "larger than zero"),
    (GPT2 | {"cpu_mem": 10**40}, 422, "cpu_mem", "more than 1 PiB"),
    (GPT2 | {"colour": "red"}, 422, "colour", "Extra inputs"),
    (GPT2 | {"model": "gtp2"}, 422, "model", "not a catalog id"),
    (GPT2 | {"config": {"model_type": "gpt2"}}, 422, "config", "config: missing"),
    (GPT2 | {"config": {"model_type": "bart"}}, 422, "config", "config: model_type bart"),
    (GPT2 | {"config": {"model_type": "mamba"}}, 422, "config", "config: unknown model_type 'mamba'"),
])
def test_bad_plan_requests_name_the_field(lite, body, status, field, words):
    answer = lite.post("/v1/plans", json=body)
    assert answer.status_code == status, answer.text
    data = answer.json()
    assert data["field"] == field and words in data["error"], data
    assert "\n" not in data["error"] and "Traceback" not in answer.text
    assert "--" not in data["error"].replace("--no-offload", "")  # fields, not CLI options
    assert lite.get("/v1/plans").json()["plans"] == []  # nothing half-written


@pytest.mark.parametrize(("raw", "words"), [(b"notjson", "the body is not valid JSON (Expecting value at character 0)"),
                                            (b'{"model": "gpt2",', "the body is not valid JSON"),
                                            (b"", "the body is empty")])
def test_a_body_that_is_not_json_says_so(lite, raw, words):
    answer = lite.post("/v1/plans", content=raw, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    data = answer.json()
    assert data["field"] == "body" and data["error"].startswith(f"body: {words}"), data
    assert "send one JSON object" in data["error"] and "\n" not in data["error"]
    assert lite.get("/v1/plans").json()["plans"] == []


def test_nothing_fits_is_422_with_the_closest_tries(lite, cli):
    answer = lite.post("/v1/plans", json=LLAMA | {"gpu": "t4", "gpu_mem": "2GiB", "allow_offload": False})
    assert answer.status_code == 422
    data = answer.json()
    assert data["plans"] == [] and data["plan_id"] is None and data["error"].startswith("nothing fits")
    assert data["rejected"] and all(r["family"] and r["reason"] for r in data["rejected"])
    printed = cli("suggest", "-m", LLAMA["model"], "-g", "t4", "--gpu-mem", "2GiB", "--no-offload", "-b", "32", "--json",
                  "--db", lite.db_url)
    assert printed.code == 3 and json.loads(printed.out)["rejected"] == data["rejected"]


def test_unknown_and_malformed_plan_ids(lite):
    missing = lite.get("/v1/plans/0123456789abcdef")
    assert missing.status_code == 404 and "no plan with id" in missing.json()["error"]
    malformed = lite.get("/v1/plans/not-an-id")
    assert malformed.status_code == 422 and malformed.json()["field"] == "plan_id"
    assert lite.get("/v1/nothing").status_code == 404
    assert lite.get("/v1/plans", params={"status": "done"}).json()["field"] == "status"
    bad_since = lite.get("/v1/plans", params={"since": "yesterday"})
    assert bad_since.status_code == 422 and bad_since.json()["field"] == "since"
    assert lite.get("/v1/plans", params={"limit": 0}).json()["field"] == "limit"


def test_a_crash_is_a_clean_500(sqlite_url, monkeypatch):
    from planner import planning

    def broken(*args, **kwargs):  # the search the plan use case (planner.usecases) runs
        raise RuntimeError("a bug with internals in its message")

    monkeypatch.setattr(planning, "make_plan", broken)
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url)), raise_server_exceptions=False) as client:
        answer = client.post("/v1/plans", json=GPT2)
    assert answer.status_code == 500
    assert answer.json() == {"error": "internal error: the server logged it; please report it"}


def test_database_down_is_503_with_the_reason():
    url = "postgresql+psycopg://planner@127.0.0.1:1/nowhere?connect_timeout=2"
    with make_client(url) as client:  # the app starts anyway
        health = client.get("/healthz")
        assert health.status_code == 503 and "127.0.0.1:1" in health.json()["database"]
        answer = client.post("/v1/plans", json=GPT2)
        assert answer.status_code == 503 and answer.json()["error"].startswith("cannot open database")
        assert client.get("/v1/gpus").status_code == 200  # what needs no database still answers


def test_healthz_counts_plans(api):
    assert api.get("/healthz").json() == {"status": "ok", "database": "ok", "plans": 0}
    api.post("/v1/plans", json=GPT2)
    assert api.get("/healthz").json()["plans"] == 1


# ---- security -----------------------------------------------------------------------------------
def test_token_is_required_on_every_post(sqlite_url):
    with make_client(sqlite_url, token=TOKEN) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"}):
            for path, body in (("/v1/plans", GPT2), ("/v1/estimate", {"model": "gpt2", "gpu": "a10g"})):
                answer = client.post(path, json=body, headers=headers)
                assert answer.status_code == 401, (headers, answer.text)
                assert answer.headers["www-authenticate"] == "Bearer" and "Bearer" in answer.json()["error"]
        # 401 comes before the body is read: garbage without the token is not a 422
        assert client.post("/v1/plans", content=b"{not json").status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/v1/plans", json=GPT2, headers=auth).status_code == 201
        assert client.post("/v1/estimate", json={"model": "gpt2", "gpu": "a10g"}, headers=auth).status_code == 200
        assert len(client.get("/v1/plans").json()["plans"]) == 1  # reads stay open


def test_token_is_compared_in_constant_time(monkeypatch):
    import hmac

    from planner.service import app as service_app

    seen = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: seen.append((a, b)) or a == b)
    assert service_app.authorized(f"Bearer {TOKEN}", TOKEN) and seen == [(TOKEN.encode(), TOKEN.encode())]
    assert not service_app.authorized("Bearer x", TOKEN)


def test_empty_token_setting_is_refused(monkeypatch):
    from planner.errors import PlannerError

    monkeypatch.setenv("PLANNER_API_TOKEN", " ")
    with pytest.raises(PlannerError, match="PLANNER_API_TOKEN is set but empty"):
        ServiceSettings.from_env()


def test_server_paths_and_caches_are_never_read(lite, tmp_path, monkeypatch):
    import planner.catalog as catalog

    config = tmp_path / "config.json"
    config.write_text(json.dumps(catalog_config("gpt2")))
    cache = tmp_path / "hub" / "models--acme--secret" / "snapshots" / "abc"
    cache.mkdir(parents=True)
    (cache / "config.json").write_text(json.dumps(catalog_config("gpt2")))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    opened = []
    monkeypatch.setattr(catalog, "load_config_file", lambda path: opened.append(path) or {})
    # a folder named like a catalog id in the server's working directory (issue 22, item 8)
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(catalog_config("gpt2") | {"n_layer": 2}))
    monkeypatch.chdir(tmp_path)
    for model in (str(config), str(tmp_path), "acme/secret", "~/.ssh/id_rsa", "../../etc/passwd", "gpt2/config.json",
                  "./gpt2", "config.json"):
        for path, body in (("/v1/plans", GPT2 | {"model": model}), ("/v1/plans", GPT2 | {"model": model, "verify": True}),
                           ("/v1/estimate", {"model": model, "gpu": "a10g"})):
            answer = lite.post(path, json=body)
            assert answer.status_code == 422 and answer.json()["field"] == "model", answer.text
            assert "not a catalog id" in answer.json()["error"] and "\n" not in answer.json()["error"]
    planned = lite.post("/v1/plans", json=GPT2)  # the catalog's gpt2 (12 layers), not ./gpt2
    assert planned.status_code == 201 and planned.json()["request"]["model_id"] == "gpt2"
    assert opened == []


def test_inline_config_and_body_are_size_limited(lite):
    config = catalog_config("gpt2") | {"padding": "x" * 140_000}
    answer = lite.post("/v1/plans", json=GPT2 | {"model": "big", "config": config})
    assert answer.status_code == 422 and answer.json()["field"] == "config" and "at most" in answer.json()["error"]
    huge = lite.post("/v1/plans", content=b"{" + b" " * MAX_BODY_BYTES + b"}", headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "request body over" in huge.json()["error"]
    declared = lite.post("/v1/plans", content=b"{}", headers={"Content-Length": str(10**9)})
    assert declared.status_code == 413


def test_remote_code_is_never_trusted(lite, monkeypatch):
    """An inline config asking for remote code is read as numbers only: no transformers import,
    nothing executed."""
    config = catalog_config("gpt2") | {"auto_map": {"AutoModel": "evil.Model"}, "trust_remote_code": True}
    monkeypatch.delitem(sys.modules, "transformers", raising=False)
    answer = lite.post("/v1/plans", json=GPT2 | {"model": "acme/evil", "config": config})
    assert answer.status_code == 201
    assert "transformers" not in sys.modules


# ---- verification as a Ray job ----------------------------------------------------------------
def test_verify_without_a_cluster_configured_is_503(lite):
    answer = lite.post("/v1/plans", json=GPT2 | {"verify": True})
    assert answer.status_code == 503 and "PLANNER_RAY_ADDRESS" in answer.json()["error"]


def test_verify_submits_a_ray_job_and_answers_202(sqlite_url, monkeypatch):
    calls = fake_verify(monkeypatch, lambda **kw: FakeSubmission(plan_id="ab" * 16, job_id="raysubmit_123"))
    with make_client(sqlite_url, ray_address="http://ray-head:8265") as client:
        answer = client.post("/v1/plans", json=GPT2 | {"verify": True, "verify_top": 2, "steps": 4})
    assert answer.status_code == 202, answer.text
    assert answer.json() == {"plan_id": "ab" * 16, "job_id": "raysubmit_123", "plan_url": f"/v1/plans/{'ab' * 16}"}
    (call,) = calls
    assert call["address"] == "http://ray-head:8265" and call["database_url"] == sqlite_url
    assert (call["verify_top"], call["steps"]) == (2, 4)
    assert call["model"] == "gpt2" and call["result"].request.target_batch == 8


def test_verify_with_the_cluster_down_is_503_with_the_reason(sqlite_url, monkeypatch):
    from planner.errors import ClusterUnavailableError

    def down(**kwargs):
        raise ClusterUnavailableError("cannot reach the Ray dashboard at http://ray-head:8265: connection refused")

    fake_verify(monkeypatch, down)
    with make_client(sqlite_url, ray_address="http://ray-head:8265") as client:
        answer = client.post("/v1/plans", json=GPT2 | {"verify": True})
    assert answer.status_code == 503
    assert answer.json() == {"error": "cannot reach the Ray dashboard at http://ray-head:8265: connection refused"}


@pytest.mark.slow
def test_verify_against_an_unreachable_dashboard_is_503_and_stores_nothing(sqlite_url):
    """The real ``planner.verify.jobs.submit_plan``, against a port where nothing listens."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    with make_client(sqlite_url, ray_address="http://127.0.0.1:1") as client:
        answer = client.post("/v1/plans", json=GPT2 | {"verify": True})
        assert answer.status_code == 503, answer.text
        assert "cannot reach the Ray job API at http://127.0.0.1:1" in answer.json()["error"]
        assert client.get("/v1/plans").json()["plans"] == []


def test_verify_refuses_what_a_job_cannot_carry(sqlite_url, monkeypatch):
    calls = fake_verify(monkeypatch, lambda **kw: pytest.fail("nothing may be submitted"))
    with make_client(sqlite_url, ray_address="http://ray-head:8265") as client:
        inline = client.post("/v1/plans", json=GPT2 | {"verify": True, "model": "x", "config": catalog_config("gpt2")})
        assert inline.status_code == 422 and inline.json()["field"] == "verify"
        bad = client.post("/v1/plans", json=GPT2 | {"verify": True, "seq_len": 10**6})
        assert bad.status_code == 422 and bad.json()["field"] == "seq_len"
    assert calls == []


def test_a_verified_plan_is_answered_from_the_store(db_url, cli, monkeypatch):
    """As ``planner suggest``: the same request with a verified plan stored gets that plan back
    (200, from_store) without a new plan or job; "fresh" plans again."""
    from planner.store import PlanStatus, open_store

    fake_verify(monkeypatch, lambda **kw: pytest.fail("a verified request needs no job"))
    with make_client(db_url, ray_address="http://ray-head:8265") as client:
        first = client.post("/v1/plans", json=GPT2).json()["plan_id"]
        with open_store(url=db_url) as store:
            store.set_status(plan_id=first, status=PlanStatus.VERIFIED, reason="verified by hand for the test")
        for body in (GPT2, GPT2 | {"verify": True}):
            again = client.post("/v1/plans", json=body)
            assert again.status_code == 200, again.text
            data = again.json()
            assert data["plan_id"] == first and data["from_store"] is True
            assert data["verification"]["status"] == "verified"
        printed = cli("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--json", "--db", db_url)
        assert printed.code == 0 and json.loads(printed.out) == data
        fresh = client.post("/v1/plans", json=GPT2 | {"fresh": True})
        assert fresh.status_code == 201 and fresh.json()["plan_id"] != first
        assert len(client.get("/v1/plans").json()["plans"]) == 2


# ---- the web page --------------------------------------------------------------------------------
def test_page_and_openapi_are_served(lite):
    page = lite.get("/")
    assert page.status_code == 200 and 'id="plan-form"' in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert lite.get("/static/app.js").status_code == 200
    spec = lite.get("/openapi.json").json()
    assert {"/v1/plans", "/v1/plans/{plan_id}", "/v1/estimate", "/v1/gpus", "/v1/models", "/healthz"} <= set(spec["paths"])
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
    assert lite.get("/docs").status_code == 200


# ---- planner serve --------------------------------------------------------------------------------
def test_planner_help_loads_no_web_framework():
    import subprocess

    code = ("import sys; from planner.cli import main; main(['--help']); main(['serve', '--help']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_serve_without_the_service_extra_names_it(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn -> ImportError
    result = cli("serve")
    assert result.code == 2 and "pip install 'oom-planner[service]'" in result.err and "Traceback" not in result.err


def test_serve_refuses_an_empty_token(cli, monkeypatch):
    monkeypatch.setenv("PLANNER_API_TOKEN", "")
    result = cli("serve", "--port", "1")
    assert result.code == 2 and "PLANNER_API_TOKEN is set but empty" in result.err


@pytest.mark.parametrize(("name", "value", "words"), [
    ("PLANNER_API_TOKEN", "changeme", "PLANNER_API_TOKEN: its token is shorter than 32 characters"),
    # 31 characters: one short of 16 random bytes in hex (settings.MIN_TOKEN_CHARS)
    ("PLANNER_API_TOKEN", f"{TOKEN},{'f' * 31}", "PLANNER_API_TOKEN: token 2 of 2 is shorter than 32 characters"),
    ("PLANNER_API_READ_TOKEN", "admin123", "PLANNER_API_READ_TOKEN: its token is shorter than 32 characters"),
])
def test_serve_refuses_a_token_too_short_to_be_a_secret_without_echoing_it(cli, monkeypatch, name, value, words):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: pytest.fail("served with a short token"))
    monkeypatch.setenv("PLANNER_API_TOKEN", TOKEN)
    monkeypatch.setenv(name, value)
    result = cli("serve", "--port", "1")
    assert result.code == 2 and result.out == "", result
    assert result.err.startswith(f"error: {words}") and len(result.err.strip().splitlines()) == 1, result
    assert "openssl rand -hex 32" in result.err
    assert not any(secret in result.err for secret in value.split(",")), result  # neither token is echoed
    with pytest.raises(PlannerError, match=words):  # an app built from the environment (a worker) refuses it too
        ServiceSettings.from_env()
    assert ServiceSettings(token="a" * 32).write_tokens == ("a" * 32,)  # 32 characters: accepted


@pytest.mark.parametrize(("args", "words"), [(("--port", "0"), "--port 0 is not a TCP port"),
                                             (("--workers", "0"), "--workers 0 is out of range"),
                                             (("--log-level", "loud"), "--log-level 'loud' is not a level")])
def test_serve_options_are_checked(cli, args, words):
    result = cli("serve", *args)
    assert result.code == 2 and words in result.err


def test_serve_warns_when_open_to_the_network_without_a_token(cli, monkeypatch):
    import uvicorn

    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: None)
    assert "PLANNER_API_TOKEN is not set" in cli("serve", "--host", "0.0.0.0").err
    assert "PLANNER_API_TOKEN" not in cli("serve").err  # 127.0.0.1: only this machine
    monkeypatch.setenv("PLANNER_API_TOKEN", TOKEN)
    assert "PLANNER_API_TOKEN" not in cli("serve", "--host", "0.0.0.0").err


def test_error_statuses_follow_what_failed(tmp_path):
    """The status follows the kind of store error the store itself raises, not its wording."""
    from planner.errors import ClusterUnavailableError, JobNotFoundError, MissingDependencyError, StoreError
    from planner.limits import check_model_id
    from planner.service.errors import status_for
    from planner.store import open_store
    from planner.store.api import canonical_json

    def raised(fn):
        with pytest.raises(StoreError) as info:
            fn()
        return info.value

    assert status_for(raised(lambda: check_model_id("m" * 5000))) == 422
    assert status_for(raised(lambda: canonical_json({"x": float("nan")}, what="the request's constraints"))) == 422
    with open_store(url=f"sqlite:///{tmp_path / 's.db'}") as store:
        assert status_for(raised(lambda: store.get_plan(plan_id="abc"))) == 404
        assert status_for(raised(lambda: store.get_plan(plan_id="not-hex!"))) == 404
    assert status_for(raised(lambda: open_store(url="postgresql+psycopg://postgres@127.0.0.1:1/none"))) == 503
    assert status_for(ClusterUnavailableError("cannot reach the Ray job API")) == 503
    assert status_for(JobNotFoundError("no Ray job 'x'")) == 404
    assert status_for(MissingDependencyError("pip install 'oom-planner[ray]'")) == 501


def test_the_last_page_is_reachable(lite):
    assert lite.get("/v1/plans", params={"offset": 99_000, "limit": 500}).json()["plans"] == []
    assert lite.get("/v1/plans", params={"offset": 99_001}).json()["field"] == "offset"
