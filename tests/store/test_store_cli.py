"""``planner history``, ``planner show``, ``planner db`` and the suggest/measure helpers."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine
from support.store import candidate, measurement, pg_url, plan_result, request  # noqa: F401

from planner.store import open_store


def one_error_line(result, code: int = 2) -> str:
    assert result.code == code, result
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result
    return lines[0]


@pytest.fixture
def filled():
    """Three plans in the default (PLANNER_HOME) database; the oldest verified with a run."""
    with open_store() as s:
        llama = s.save_plan(result=plan_result())
        first = s.get_plan(plan_id=llama).candidates[0]
        s.record_measurement(candidate_id=first.id, measurement=measurement(peak=17_000_000_000))
        s.set_status(plan_id=llama, status="verified")
        mistral = s.save_plan(result=plan_result(req=request(model_id="mistralai/Mistral-7B-v0.1", gpu="A100-80GB")))
        qwen = s.save_plan(result=plan_result(req=request(model_id="Qwen/Qwen2.5-0.5B")))
    return {"llama": llama, "mistral": mistral, "qwen": qwen}


def test_history_on_an_empty_database(cli):
    assert "revision base (head 0004): empty: the schema is created on first use" in cli("db", "current").out
    result = cli("history")
    assert result.code == 0 and "no plans stored yet" in result.out
    result = cli("history", "--json")
    assert result.code == 0 and json.loads(result.out) == []


def test_history_table_and_filters(cli, filled):
    result = cli("history")
    assert result.code == 0, result
    lines = [line for line in result.out.splitlines() if "│" in line and "x 1024" in line]
    assert [line.split("│")[1].strip() for line in lines] == [filled[k][:8] for k in ("qwen", "mistral", "llama")]
    assert "meta-llama/Meta-Llama-3-8B" in lines[2] and "yes" in lines[2] and "lora r16 all-linear" in lines[2]

    rows = json.loads(cli("history", "--json", "--gpu", "a100-80gb").out)
    assert [r["id"] for r in rows] == [filled["mistral"]]
    assert set(rows[0]) == {"id", "created_at", "status", "verified", "model_id", "gpu", "gpu_count",
                            "target_batch", "seq_len", "top_plan", "candidates", "measurements"}
    rows = json.loads(cli("history", "--json", "--status", "verified", "--since", "1d").out)
    assert [(r["id"], r["verified"], r["measurements"]) for r in rows] == [(filled["llama"], True, 1)]
    assert [r["id"] for r in json.loads(cli("history", "--json", "--model", "qwen", "-n", "5").out)] == [filled["qwen"]]
    assert len(json.loads(cli("history", "--json", "-n", "2").out)) == 2
    assert "no plans match" in cli("history", "--model", "gpt-j").out


def test_history_bad_options(cli, filled):
    assert "--status must be one of planned|verifying|verified|failed|measured" in one_error_line(
        cli("history", "--status", "done"))
    assert "--since 'soon' is not a time" in one_error_line(cli("history", "--since", "soon"))
    assert "-n must be a whole number from 1 to 100,000, got 0" in one_error_line(cli("history", "-n", "0"))
    # past SQLite's 64-bit LIMIT, and times that leave the years 1-9999 when made UTC
    assert "-n must be a whole number from 1 to 100,000, got 9223372036854775808" in one_error_line(
        cli("history", "-n", "9223372036854775808"))
    for since in ("0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-05:00"):
        assert f"--since '{since}' falls outside the years 1-9999 in UTC" in one_error_line(cli("history", "--since", since))


def test_show_by_prefix_with_predicted_vs_measured(cli, filled):
    result = cli("show", filled["llama"][:7])
    assert result.code == 0, result
    out = result.out
    assert f"plan {filled['llama']}" in out and "verified" in out
    assert "weights 15 GiB" in out  # 16,060,522,496 B / 2^30 = 14.96 GiB
    assert "predicted vs measured" in out
    # predicted peak 16,060,522,496 + 4 x 167,772,160 + 4 x 700 MiB (2,936,012,800) = 19,667,623,936 B
    # = 18.3 GiB;
    # measured 17,000,000,000 B = 15.8 GiB; error (19,667,623,936 - 17e9) / 17e9 = +15.69%
    row = next(line for line in out.splitlines() if "peak allocated" in line and "%" in line)
    assert "18.3 GiB" in row and "15.8 GiB" in row and "+15.7%" in row
    assert "rejected full, bf16-mixed, adamw" in out

    data = json.loads(cli("show", filled["llama"], "--json").out)
    assert data["id"] == filled["llama"] and data["status"] == "verified" and len(data["candidates"]) == 3
    first = data["candidates"][0]
    assert first["memory"]["peak_allocated_bytes"] == 19_667_623_936
    assert first["measurements"][0]["peak_allocated_bytes"] == 17_000_000_000


def test_show_unknown_ambiguous_and_malformed_ids(cli, filled):
    assert "no plan with id 'abcdef0123'" in one_error_line(cli("show", "abcdef0123"))
    with open_store() as s:
        ids = [s.save_plan(result=plan_result(candidates=1)) for _ in range(14)]  # 17 in all
    first = [i[0] for i in [*ids, *filled.values()]]
    shared = next(c for c in first if first.count(c) > 1)
    assert f"plan id '{shared}' is ambiguous" in one_error_line(cli("show", shared))
    assert "is not an id" in one_error_line(cli("show", "plan-1"))


def test_unreachable_database_is_one_line(cli):
    line = one_error_line(cli("history", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/none"))
    # the user part is masked, like a password (planner.store.engine.safe_url)
    assert line.startswith("error: cannot open database postgresql+psycopg://***@127.0.0.1:1/none: ")
    assert line.endswith("check --db or PLANNER_DATABASE_URL")
    one_error_line(cli("show", "abc", "--db", "mysql+nodriver://x/y"))


def test_schema_behind_then_db_upgrade(cli, tmp_path):

    from planner.store.schema import alembic_command, alembic_config

    url = f"sqlite:///{tmp_path / 'old.db'}"
    open_store(url=url).close()
    engine = create_engine(url)
    with engine.begin() as conn:
        alembic_command("downgrade", alembic_config(url=url, connection=conn), "base")
    engine.dispose()

    line = one_error_line(cli("history", "--db", url))
    assert line == "error: database schema at base is behind this planner (0004): run 'planner db upgrade'"
    assert "behind: run 'planner db upgrade'" in cli("db", "current", "--db", url).out
    result = cli("db", "upgrade", "--db", url)
    assert result.code == 0 and "upgraded from base to 0004" in result.out
    assert "already at 0004" in cli("db", "upgrade", "--db", url).out
    assert "revision 0004 (head 0004): up to date" in cli("db", "current", "--db", url).out
    assert cli("history", "--db", url).code == 0


SUGGEST = ("suggest", "-m", "gpt2", "-g", "a10g", "-b", "8", "--top-k", "2")


def test_suggest_reports_an_existing_plan_of_the_same_request(cli):
    """``plan_request`` (planner.usecases) finds the same request's stored plan before storing the
    new one, and suggest says so, with what was measured of it."""
    assert "a plan for this request exists" not in cli(*SUGGEST, "--no-save").out  # nothing stored, nothing known
    out = cli(*SUGGEST).out
    first = out.split("plan id: ")[1].split()[0]
    assert "a plan for this request exists" not in out

    with open_store() as s:
        top = s.get_plan(plan_id=first).candidates[0]
        s.record_measurement(candidate_id=top.id, measurement=measurement(peak=17_000_000_000))
        s.set_status(plan_id=first, status="verified")
    out = cli(*SUGGEST, "--fresh").out
    second = out.split("plan id: ")[1].split()[0]
    assert f"a plan for this request exists: {first[:8]}" in out and ", verified" in out
    assert f"measured for plan {first[:8]}" in out and "15.8 GiB" in out  # measured beside predicted
    assert second != first
    with open_store() as s:
        assert s.count_plans() == 2


def test_no_save_with_a_broken_database_still_answers(cli):
    bad = "postgresql+psycopg://postgres@127.0.0.1:1/none"
    answered = cli(*SUGGEST, "--no-save", "--db", bad)
    assert answered.code == 0 and "note: past plans not checked: cannot open database" in answered.out
    refused = cli(*SUGGEST, "--db", bad)
    assert refused.code == 2 and "cannot open database" in refused.err
    assert "lora" in refused.out or "full" in refused.out  # the table printed first, then the error


def test_measure_helper_then_history_and_show(cli):
    from planner.cli.store import save_measurement

    plan_id = save_measurement(
        request=request(constraints={"measure": True}), candidate=candidate(rank=1, micro_batch=2, grad_accum=8),
        measurement=measurement(), db=None,
    )
    rows = json.loads(cli("history", "--json", "--status", "measured").out)
    assert [(r["id"], r["measurements"]) for r in rows] == [(plan_id, 1)]
    assert "no (measured)" in cli("history").out
    assert "predicted vs measured" in cli("show", plan_id[:6]).out


@pytest.mark.postgres
def test_history_and_show_on_postgresql(cli, pg_url):
    with open_store(url=pg_url) as s:
        plan_id = s.save_plan(result=plan_result())
    rows = json.loads(cli("history", "--json", "--db", pg_url).out)
    assert [r["id"] for r in rows] == [plan_id]
    result = cli("show", plan_id[:8], "--db", pg_url)
    assert result.code == 0 and f"plan {plan_id}" in result.out
    assert "revision 0004 (head 0004)" in cli("db", "current", "--db", pg_url).out


def test_help_does_not_load_the_store():
    import subprocess
    import sys

    code = ("import sys; from planner.cli import main; main(['--help']); "
            "print(sorted(m for m in ('planner.store', 'sqlalchemy', 'alembic', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_suggest_stores_the_plan_before_printing_it(cli, monkeypatch):
    """A reader that stops early (planner suggest | head) breaks the pipe while the plan is
    printed: the plan must already be stored."""
    import planner.cli.suggest_view as view

    def reader_gone(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(view, "print_suggestion", reader_gone)
    r = cli("suggest", "--model", "gpt2", "--gpu", "a10g", "--target-batch", "8")
    assert r.code != 0
    from planner.store import open_store

    with open_store() as store:
        assert len(store.history(limit=10)) == 1


def test_suggest_with_an_unreachable_database_prints_the_plan_then_the_error(cli):
    r = cli("suggest", "--model", "gpt2", "--gpu", "a10g", "--target-batch", "8", "--db", "postgresql+psycopg://postgres@127.0.0.1:1/none")
    assert r.code != 0
    assert "top" in r.out and "plans" in r.out
    assert r.err.strip().startswith("error: cannot open database") and len(r.err.strip().splitlines()) == 1


def test_history_finds_a_gpu_by_the_alias_suggest_accepts(cli):
    assert cli("suggest", "--model", "gpt2", "--gpu", "h100", "--target-batch", "8").code == 0
    for name in ("h100", "H100-80GB", "nvidia-h100"):
        rows = json.loads(cli("history", "--json", "--gpu", name).out)
        assert [r["gpu"] for r in rows] == ["h100-80gb"], name
    assert json.loads(cli("history", "--json", "--gpu", "a10g").out) == []


def test_commands_wait_for_a_hung_database_server_as_the_service_does(cli, monkeypatch):
    """A PostgreSQL port that accepts and never answers: history, show and suggest's save fail in
    seconds with one line (the service's connect timeout, PLANNER_DB_CONNECT_TIMEOUT), not never."""
    import time

    from support.api import SilentPort

    monkeypatch.setenv("PLANNER_DB_CONNECT_TIMEOUT", "2")
    with SilentPort() as hung:
        url = f"postgresql+psycopg://planner@127.0.0.1:{hung.port}/planner"
        for args in (("history",), ("show", "abc"), ("db", "current")):
            start = time.monotonic()
            r = cli(*args, "--db", url)
            took = time.monotonic() - start
            assert r.code == 2 and took < 8, (args, r, took)
            assert "timeout expired" in r.err and len(r.err.strip().splitlines()) == 1, r
    monkeypatch.setenv("PLANNER_DB_STATEMENT_TIMEOUT", "soon")
    r = cli("history", "--db", "postgresql+psycopg://planner@127.0.0.1:1/planner")
    assert r.code == 2 and "PLANNER_DB_STATEMENT_TIMEOUT 'soon' is not a number of seconds" in r.err
