"""What the service shows and to whom (issue 22, items 3, 6, 7 and 8).

- secrets: a password (or user name) in the database URL, in its user part or its query string,
  is in no answer and no log line; /healthz says only ok/unavailable without a token;
- text: a model id or a query parameter that is not printable text is a 422, and what the store
  already holds reaches a terminal escaped;
- reads: PLANNER_API_READ_TOKEN protects every read; each request is logged with its caller's
  token id, never the token;
- the documentation page is the package's own, under the CSP, and HEAD / answers.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("fastapi", reason="the service extra is not installed (pip install 'oom-planner[service]')")

from fastapi.testclient import TestClient  # noqa: E402
from support.api import running_server  # noqa: E402
from support.store import PG_SERVER_URL, db_url, pg_url, require_postgres, sqlite_url  # noqa: E402,F401

from planner.service import create_app  # noqa: E402
from planner.service.settings import ServiceSettings, token_id  # noqa: E402
from planner.store.engine import safe_url, url_secrets  # noqa: E402

GPT2 = {"model": "gpt2", "gpu": "a10g", "target_batch": 8}
# 32+ characters each (settings.MIN_TOKEN_CHARS)
WRITE, READ, OTHER_WRITE = ("write-token-0123456789abcdef0123", "read-token-0123456789abcdef01234",
                            "second-writer-token-0123456789abc")
PASSWORD, USER = "hunter2-Secret", "plannerbob"


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- secrets in the database URL -------------------------------------------------------------------
@pytest.mark.parametrize(("url", "shown"), [
    (f"postgresql+psycopg://{USER}:{PASSWORD}@db:5432/planner", "postgresql+psycopg://***@db:5432/planner"),
    (f"postgresql+psycopg:///planner?host=db&user={USER}&password={PASSWORD}",
     "postgresql+psycopg:///planner?host=***&user=***&password=***"),
    (f"postgresql+psycopg://{USER}@db/planner?sslmode=require&sslpassword={PASSWORD}",
     "postgresql+psycopg://***@db/planner?sslmode=***&sslpassword=***"),
    (f"{USER}:{PASSWORD}@db/planner", "***@db/planner"),
    ("sqlite:////srv/@team/planner.db", "sqlite:////srv/@team/planner.db"),
])
def test_safe_url_masks_the_user_part_and_the_query(url, shown):
    assert safe_url(url) == shown
    secrets = url_secrets(url)
    if PASSWORD in url:
        assert secrets.scrub(f'password authentication failed for user "{USER}" ({PASSWORD})') == (
            'password authentication failed for user "***" (***)')
        assert secrets.scrub("postgresql+psycopg://***@db") == "postgresql+psycopg://***@db"


def query_password_url(port: int) -> str:
    """The issue's form: host, user and password in the query string (libpq's keywords)."""
    from sqlalchemy.engine import make_url

    server = make_url(PG_SERVER_URL)
    return (f"postgresql+psycopg:///{server.database}?host=127.0.0.1&port={port}&user={server.username}"
            f"&password={PASSWORD}")


def test_a_password_in_the_query_is_in_no_answer_and_no_log(caplog):
    """Nothing listens: every 503 body and log line says why without the password or user."""
    url = query_password_url(1)
    caplog.set_level(logging.INFO)
    with TestClient(create_app(ServiceSettings(database_url=url, token=WRITE))) as client:
        answers = [client.get("/healthz", headers=bearer(WRITE)), client.get("/v1/plans"),
                   client.post("/v1/plans", json=GPT2, headers=bearer(WRITE)), client.get("/v1/plans/abc")]
        anonymous = client.get("/healthz")
    assert [a.status_code for a in answers] == [503] * 4
    assert anonymous.status_code == 503 and anonymous.json() == {"status": "unavailable"}
    assert "127.0.0.1" in answers[0].json()["database"] or "port 1" in answers[0].json()["database"]
    for answer in answers:
        assert PASSWORD not in answer.text and "host=***" in answer.text, answer.text
    logged = caplog.text
    assert logged and PASSWORD not in logged and WRITE not in logged


@pytest.mark.postgres
def test_a_password_in_the_query_of_a_working_database_is_in_no_log(tmp_path):
    """A real server on the real PostgreSQL (trust authentication ignores the password): it plans,
    and its log, at info level with a line per request, holds neither password nor token."""
    require_postgres()
    import httpx

    from planner.store.schema import alembic_command, alembic_config

    # the server's database is the server's own schema, which earlier runs may have left at an
    # older revision (the server then answers 503 "run planner db upgrade", as it should): upgrade
    # it first, as an operator does
    alembic_command("upgrade", alembic_config(url=PG_SERVER_URL), "head")
    log = tmp_path / "serve.log"
    with running_server(env={"PLANNER_DATABASE_URL": query_password_url(5432), "PLANNER_API_TOKEN": WRITE},
                        log=log, log_level="info") as url:
        assert httpx.post(f"{url}/v1/plans", json=GPT2, headers=bearer(WRITE), timeout=60).status_code == 201
        health = httpx.get(f"{url}/healthz", timeout=10)
        assert health.json() == {"status": "ok"}
        detailed = httpx.get(f"{url}/healthz", headers=bearer(WRITE), timeout=10).json()
        assert detailed["status"] == "ok" and detailed["plans"] >= 1
        httpx.get(f"{url}/v1/plans", headers={"Authorization": "Bearer not-the-token"}, timeout=10)
    text = log.read_text()
    assert "POST /v1/plans -> 201" in text and f"by {token_id(WRITE)}" in text, text[-2000:]
    assert "by invalid-token" in text and "by anonymous" in text
    assert PASSWORD not in text and WRITE not in text and "not-the-token" not in text


# ---- healthz ----------------------------------------------------------------------------------------
def test_healthz_says_only_ok_without_a_token(db_url):
    with TestClient(create_app(ServiceSettings(database_url=db_url, token=WRITE, read_token=READ))) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/healthz", headers={"Authorization": "Bearer wrong"}).json() == {"status": "ok"}
        for token in (WRITE, READ):
            assert client.get("/healthz", headers=bearer(token)).json() == {"status": "ok", "database": "ok", "plans": 0}
        assert client.head("/healthz").status_code == 200
    # no token configured (a laptop): nothing to hold back but the URL's secrets
    with TestClient(create_app(ServiceSettings(database_url=db_url))) as client:
        assert client.get("/healthz").json() == {"status": "ok", "database": "ok", "plans": 0}


# ---- reads and writes, and who made them ---------------------------------------------------------------
def test_a_read_token_protects_every_read(db_url):
    settings = ServiceSettings(database_url=db_url, token=f"{WRITE},{OTHER_WRITE}", read_token=READ)
    with TestClient(create_app(settings)) as client:
        plan_id = client.post("/v1/plans", json=GPT2, headers=bearer(OTHER_WRITE)).json()["plan_id"]
        reads = ["/v1/plans", f"/v1/plans/{plan_id}", "/v1/gpus", "/v1/models", "/openapi.json"]
        for path in reads:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": READ}):
                answer = client.get(path, headers=headers)
                assert answer.status_code == 401 and "PLANNER_API_READ_TOKEN" in answer.json()["error"], (path, headers)
                assert answer.headers["www-authenticate"] == "Bearer"
            for token in (READ, WRITE, OTHER_WRITE):
                assert client.get(path, headers=bearer(token)).status_code == 200, (path, token)
        refused = client.post("/v1/plans", json=GPT2, headers=bearer(READ))
        assert refused.status_code == 401 and "a read token cannot write" in refused.json()["error"]
        # the page, its files and the documentation page need no token (they hold no data)
        for path in ("/", "/static/app.js", "/static/docs.js", "/docs"):
            assert client.get(path).status_code == 200, path
        assert client.head("/").status_code == 200


def test_a_read_token_needs_a_write_token():
    from planner.errors import PlannerError

    with pytest.raises(PlannerError, match="PLANNER_API_READ_TOKEN is set without PLANNER_API_TOKEN"):
        ServiceSettings(read_token=READ)
    with pytest.raises(PlannerError, match="empty item between commas"):
        ServiceSettings(token=f"{WRITE},,x")


def test_each_request_is_logged_with_its_callers_token_id(sqlite_url, caplog):
    caplog.set_level(logging.INFO, logger="planner.service.access")
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url, token=f"{WRITE},{OTHER_WRITE}"))) as client:
        client.post("/v1/plans", json=GPT2, headers=bearer(WRITE))
        client.post("/v1/plans", json=GPT2, headers=bearer(OTHER_WRITE))
        client.post("/v1/plans", json=GPT2)
        client.get("/v1/plans", params={"model": "gpt2"})
    lines = [r.getMessage() for r in caplog.records if r.name == "planner.service.access"]
    assert lines[0].startswith("POST /v1/plans -> 201 in ") and lines[0].endswith(f"by {token_id(WRITE)}")
    assert lines[1].endswith(f"by {token_id(OTHER_WRITE)}") and token_id(WRITE) != token_id(OTHER_WRITE)
    assert lines[2].startswith("POST /v1/plans -> 401") and lines[2].endswith("by anonymous")
    assert lines[3].startswith("GET /v1/plans?model=gpt2 -> 200")
    assert not any(WRITE in line or OTHER_WRITE in line for line in lines)


# ---- printable text -------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["evil\u001b[2J\u001b]0;pwned\u0007", "two\nlines", "nul\u0000byte", "tab\there",
                                   "bidi\u202eevil", "del\u007f"])
def test_an_unprintable_model_id_is_a_422_and_nothing_is_stored(db_url, model):
    from planner.catalog import resolve_model

    config = dict(resolve_model("gpt2").config)
    with TestClient(create_app(ServiceSettings(database_url=db_url))) as client:
        for path, body in (("/v1/plans", GPT2 | {"model": model, "config": config}),
                           ("/v1/estimate", {"model": model, "config": config, "gpu": "a10g"})):
            answer = client.post(path, json=body)
            assert answer.status_code == 422, answer.text
            assert answer.json()["field"] == "model" and "unprintable character U+" in answer.json()["error"]
        assert client.get("/v1/plans").json()["plans"] == []


@pytest.mark.parametrize("query", [{"model": "a\u0000b"}, {"gpu": "x\u001b[31m"}, {"since": "7d\n"},
                                   {"model\u0000": "x"}])
def test_an_unprintable_query_parameter_is_a_422(db_url, query):
    with TestClient(create_app(ServiceSettings(database_url=db_url))) as client:
        answer = client.get("/v1/plans", params=query)
    assert answer.status_code == 422, answer.text
    assert "unprintable character" in answer.json()["error"] and answer.json()["field"]


def test_stored_control_characters_reach_the_terminal_escaped(sqlite_url, cli):
    """A model id an older planner stored with ESC sequences and a newline: history and show
    print it escaped, one line, no raw control character."""
    from sqlalchemy import create_engine, text

    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        plan_id = client.post("/v1/plans", json=GPT2).json()["plan_id"]
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE plan_requests SET model_id = :m, status_reason = :r WHERE id = :i"),
                     {"m": "evil\u001b[2J\u001b]0;pwned\u0007\nforged line", "r": "bad\u001b[31m", "i": plan_id})
    engine.dispose()
    for args in (("history",), ("show", plan_id[:8])):
        printed = cli(*args, "--db", sqlite_url)
        assert printed.code == 0, printed
        assert "\u001b" not in printed.out and "\u0007" not in printed.out
        assert "evil\\x1b[2J\\x1b]0;pwned\\x07\\nforged line" in printed.out
    assert "\\x1b[31m" in cli("show", plan_id[:8], "--db", sqlite_url).out
    as_json = json.loads(cli("history", "--json", "--db", sqlite_url).out)  # JSON escapes them itself
    assert as_json[0]["model_id"].startswith("evil\u001b")


# ---- the documentation page -------------------------------------------------------------------------
def test_docs_are_the_packages_own_page(sqlite_url):
    with TestClient(create_app(ServiceSettings(database_url=sqlite_url))) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and page.headers["content-security-policy"].startswith("default-src 'self'")
        assert '<script src="/static/docs.js"' in page.text
        for path in ("/docs", "/", "/static/docs.js", "/static/app.js", "/static/style.css"):
            body = client.get(path).text
            assert "http://" not in body and "https://" not in body and "cdn" not in body.lower(), path
        assert client.get("/redoc").status_code == 404
        assert client.head("/docs").status_code == 200
