"""Verification jobs carry no secret (issue 22, item 1).

Ray stores a job's entrypoint, runtime environment and metadata and returns them from the
dashboard's job API; every worker process of the job inherits the runtime environment's
variables. The job is therefore told its database by reference (a file on the head, or a URL
without a password on the entrypoint) and gets an allow-list of variables: these tests check the
pieces, then capture a real submission to a real head (``ray start --head``) with tokens and a
PostgreSQL password set, and find neither anywhere Ray keeps or shows the job, while the job still
verifies its plan through the file.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest
from support.ray import TINY, ray_head, tiny_config  # noqa: F401 - fixtures
from support.store import pg_url, sqlite_url  # noqa: F401 - fixtures

from planner.errors import StoreError

PASSWORD = "pw-" + secrets.token_hex(8)
TOKEN = "write-" + secrets.token_hex(16)  # 37 characters: past settings.MIN_TOKEN_CHARS
READ_TOKEN = "read-" + secrets.token_hex(16)


def _with_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


# ---- the pieces ----------------------------------------------------------------------------------
def test_the_job_env_is_an_allow_list_whatever_this_process_holds(monkeypatch):
    from planner.verify.jobs import FORWARDED_ENV, submission_env

    monkeypatch.setenv("PLANNER_API_TOKEN", TOKEN)
    monkeypatch.setenv("PLANNER_API_READ_TOKEN", READ_TOKEN)
    monkeypatch.setenv("PLANNER_DATABASE_URL", f"postgresql+psycopg://u:{PASSWORD}@db/x")
    monkeypatch.setenv("PLANNER_DB_STATEMENT_TIMEOUT", "7")
    monkeypatch.setenv("PLANNER_SOMETHING_NEW", "x")
    env = submission_env()
    assert env == {"PLANNER_DB_STATEMENT_TIMEOUT": "7", "HF_HUB_OFFLINE": "1"}
    assert set(FORWARDED_ENV) == {"PLANNER_DB_CONNECT_TIMEOUT", "PLANNER_DB_STATEMENT_TIMEOUT", "PLANNER_DB_POOL_TIMEOUT"}


# ids without the random secret, so that every pytest-xdist worker collects the same tests
@pytest.mark.parametrize("url", [f"postgresql+psycopg://planner:{PASSWORD}@db:5432/planner",
                                 f"postgresql+psycopg:///planner?host=db&password={PASSWORD}",
                                 f"postgresql+psycopg://planner@db/planner?sslpassword={PASSWORD}"],
                         ids=["userinfo", "password-query", "sslpassword-query"])
def test_a_url_with_a_password_is_given_by_its_file_or_refused(url):
    from planner.verify.jobs import job_database

    assert job_database(url, url_file="/run/secrets/db") == (
        [], {"PLANNER_DATABASE_URL_FILE": "/run/secrets/db", "PLANNER_DATABASE_URL": ""})
    with pytest.raises(StoreError) as refused:
        job_database(url, url_file=None)
    line = str(refused.value)
    assert PASSWORD not in line and "\n" not in line and "PLANNER_DATABASE_URL_FILE" in line


@pytest.mark.parametrize("url", ["sqlite:////data/planner.db", "postgresql+psycopg://planner@db:5432/planner",
                                 "postgresql+psycopg:///planner?host=/var/run/postgresql"])
def test_a_url_without_a_credential_goes_on_the_entrypoint(url):
    from planner.verify.jobs import job_database

    assert job_database(url, url_file=None) == (["--db", url], {})


def test_the_database_url_file(tmp_path, monkeypatch):
    from planner.store.engine import default_database_url

    secret = tmp_path / "database-url"
    secret.write_text(f"postgresql+psycopg://planner:{PASSWORD}@db/planner\n")
    monkeypatch.setenv("PLANNER_DATABASE_URL_FILE", str(secret))
    assert default_database_url() == f"postgresql+psycopg://planner:{PASSWORD}@db/planner"
    monkeypatch.setenv("PLANNER_DATABASE_URL", "sqlite:////x.db")
    with pytest.raises(StoreError, match="both PLANNER_DATABASE_URL and PLANNER_DATABASE_URL_FILE are set"):
        default_database_url()
    monkeypatch.setenv("PLANNER_DATABASE_URL", "")  # blanked, as a job's env does over the head's own
    assert default_database_url().endswith("@db/planner")
    for content, message in (("", "holds no database URL"), ("just-a-password", "holds no database URL")):
        secret.write_text(content)
        with pytest.raises(StoreError, match=message) as bad:
            default_database_url()
        assert "just-a-password" not in str(bad.value)
    monkeypatch.setenv("PLANNER_DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(StoreError, match="cannot read PLANNER_DATABASE_URL_FILE .*missing: No such file"):
        default_database_url()


def test_a_run_process_gets_no_planner_setting_but_its_marker():
    from workers.runner import child_env

    env = child_env({"PATH": "/bin", "PLANNER_DATABASE_URL": "x", "PLANNER_DATABASE_URL_FILE": "/f",
                     "PLANNER_API_TOKEN": TOKEN, "PLANNER_VERIFY_RUN": "p:c", "HF_HUB_OFFLINE": "1"})
    assert env == {"PATH": "/bin", "PLANNER_VERIFY_RUN": "p:c", "HF_HUB_OFFLINE": "1"}


def test_submit_refuses_a_password_url_without_its_file_and_stores_nothing(cli, tiny_config, sqlite_url, monkeypatch):
    monkeypatch.setenv("PLANNER_DATABASE_URL", f"postgresql+psycopg://planner:{PASSWORD}@127.0.0.1:1/none")
    r = cli("submit", "--address", "http://127.0.0.1:1", "-m", tiny_config, "-g", "cpu", "-b", "4")
    assert r.code == 2 and "PLANNER_DATABASE_URL_FILE" in r.err and PASSWORD not in r.err + r.out
    assert len(r.err.strip().splitlines()) == 1


def test_the_service_refuses_to_verify_with_a_password_url_and_no_file(pg_url):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from planner.service import create_app
    from planner.service.settings import ServiceSettings

    settings = ServiceSettings(database_url=_with_password(pg_url), ray_address="http://127.0.0.1:1")
    with TestClient(create_app(settings)) as client:
        answer = client.post("/v1/plans", json={"model": "gpt2", "gpu": "cpu", "target_batch": 2, "seq_len": 32,
                                                "method": "lora", "verify": True})
        assert answer.status_code == 503, answer.text
        assert "PLANNER_DATABASE_URL_FILE" in answer.text and PASSWORD not in answer.text, answer.text
        assert client.get("/v1/plans").json()["plans"] == []  # refused before anything was stored


def test_a_catalog_id_is_sent_as_is_even_when_a_folder_of_that_name_is_here(tmp_path, monkeypatch):
    """issue 22 item 8: ``gpt2`` is the catalog's gpt2, never ./gpt2/config.json of the cwd."""
    from planner.errors import UnknownModelError
    from planner.verify.jobs import _model_argument

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(TINY))
    monkeypatch.chdir(tmp_path)
    assert _model_argument("gpt2", local_files=True) == ("gpt2", None)
    assert _model_argument("gpt2", local_files=False) == ("gpt2", None)
    with pytest.raises(UnknownModelError, match="is not a catalog id"):
        _model_argument("gpt2/config.json", local_files=False)


# ---- a real submission ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_real_submission_holds_no_token_and_no_password_and_still_verifies(cli, tiny_config, pg_url, ray_head,
                                                                           tmp_path, monkeypatch):
    """``planner submit`` with the API's tokens in the environment and the database's password
    in a file: everything Ray is sent (entrypoint, runtime env, working_dir files) and everything
    it shows afterwards (the job API's JSON, the job's logs) is searched for them."""
    pytest.importorskip("torch")
    import urllib.request

    from ray.job_submission import JobSubmissionClient

    url = _with_password(pg_url)
    secret_file = tmp_path / "secrets" / "database-url"
    secret_file.parent.mkdir()
    secret_file.write_text(url + "\n")
    secret_file.chmod(0o600)
    # set now, after the head started: the head's own environment is the operator's, not the job's
    monkeypatch.setenv("PLANNER_API_TOKEN", TOKEN)
    monkeypatch.setenv("PLANNER_API_READ_TOKEN", READ_TOKEN)
    monkeypatch.setenv("PLANNER_DATABASE_URL_FILE", str(secret_file))

    sent: list[dict] = []
    real_submit = JobSubmissionClient.submit_job

    def capture(self, **kwargs):
        files = {}
        working_dir = (kwargs.get("runtime_env") or {}).get("working_dir")
        if working_dir:
            for path in Path(working_dir).rglob("*"):
                if path.is_file():
                    files[str(path.relative_to(working_dir))] = path.read_text()
        sent.append({"kwargs": kwargs, "files": files})
        return real_submit(self, **kwargs)

    monkeypatch.setattr(JobSubmissionClient, "submit_job", capture)
    r = cli("submit", "--address", ray_head, "-m", tiny_config, "-g", "cpu", "-b", "4", "--seq-len", "64",
            "--verify-top", "1", "--json")
    assert r.code == 0, r
    job_id, plan_id = json.loads(r.out)["job_id"], json.loads(r.out)["plan_id"]
    [submission] = sent
    kwargs = submission["kwargs"]
    assert kwargs["runtime_env"]["env_vars"] == {"PLANNER_DATABASE_URL_FILE": str(secret_file),
                                                 "PLANNER_DATABASE_URL": "", "HF_HUB_OFFLINE": "1"}
    assert "--db" not in kwargs["entrypoint"].split()
    assert list(submission["files"]) == ["config.json"] and json.loads(submission["files"]["config.json"]) == TINY

    status = cli("jobs", "status", job_id, "--wait", "--timeout", "600", "--address", ray_head, "--json")
    logs = cli("jobs", "logs", job_id, "--address", ray_head)
    assert status.code == 0, (status, logs.out[-3000:])
    # the job's driver opened the database through the file: the plan is verified there
    monkeypatch.delenv("PLANNER_API_TOKEN")
    plan = json.loads(cli("show", plan_id, "--json", "--db", url).out)
    assert plan["status"] == "verified" and plan["ray_job_id"] == job_id

    # as an operator reads it, with the cluster's own token where Ray's token auth is on
    from planner.verify.jobs import auth_headers, job_client

    def dashboard(path: str) -> urllib.request.Request:
        return urllib.request.Request(f"{ray_head}{path}", headers=auth_headers())

    with urllib.request.urlopen(dashboard(f"/api/jobs/{job_id}"), timeout=10) as answer:
        shown = answer.read().decode()
    with urllib.request.urlopen(dashboard("/api/jobs/"), timeout=10) as answer:
        listed = answer.read().decode()
    stored = job_client(ray_head).get_job_info(job_id)
    assert json.loads(shown)["runtime_env"]["env_vars"]["PLANNER_DATABASE_URL_FILE"] == str(secret_file)
    everything = {"submitted": json.dumps(kwargs, default=str), "working_dir": json.dumps(submission["files"]),
                  "job API": shown, "job list": listed, "job info": json.dumps(stored.dict(), default=str),
                  "logs": logs.out}
    for where, text in everything.items():
        for secret in (TOKEN, READ_TOKEN, PASSWORD):
            assert secret not in text, f"{secret[:6]}... found in the job's {where}"
