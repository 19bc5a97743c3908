"""Alembic migrations yield exactly the models' metadata, and go down and up again."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect
from support.store import db_url, pg_url, sqlite_url  # noqa: F401 - fixtures

from planner.store import upgrade_database
from planner.store.dbmodels import VERSION_TABLE, Base
from planner.store.schema import HEAD_REVISION, alembic_command, alembic_config, head_revision, migrations_dir

MODEL_TABLES = {"plan_requests", "plan_candidates", "plan_measurements", "calibrations"}


def _drift(engine) -> list:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": True})
        return compare_metadata(context, Base.metadata)


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names())


def test_upgrade_yields_the_models_then_down_and_up_again(db_url):
    engine = create_engine(db_url)
    try:
        assert _tables(engine) == set()
        assert upgrade_database(url=db_url) == (None, "0004")
        assert _tables(engine) == MODEL_TABLES | {VERSION_TABLE}
        assert _drift(engine) == []
        # the indexes the history and reuse queries rely on exist
        indexes = {ix["name"] for ix in inspect(engine).get_indexes("plan_requests")}
        assert {"ix_plan_requests_same_request", "ix_plan_requests_created_at"} <= indexes

        with engine.begin() as conn:
            alembic_command("downgrade", alembic_config(url=db_url, connection=conn), "base")
        assert _tables(engine) == {VERSION_TABLE}
        with engine.connect() as conn:
            assert MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_heads() == ()

        assert upgrade_database(url=db_url) == (None, "0004")
        assert _drift(engine) == []
    finally:
        engine.dispose()


def test_drift_check_sees_a_difference(sqlite_url):
    """The no-drift assertion above can fail: a missing index is reported."""
    from sqlalchemy import text

    upgrade_database(url=sqlite_url)
    engine = create_engine(sqlite_url)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_plan_requests_same_request"))
    diff = _drift(engine)
    engine.dispose()
    assert [d[0] for d in diff] == ["add_index"] and diff[0][1].name == "ix_plan_requests_same_request"


def test_one_linear_history_and_the_ini_matches():
    script = ScriptDirectory.from_config(alembic_config(url="sqlite://"))
    assert script.get_heads() == ["0004"] == [head_revision()]
    # the constant the fast "already at head" check compares with must follow new migrations
    assert HEAD_REVISION == head_revision()
    assert script.get_revision("0004").down_revision == "0003"
    assert script.get_revision("0003").down_revision == "0002"
    assert script.get_revision("0002").down_revision == "0001"
    assert script.get_revision("0001").down_revision is None
    ini = (migrations_dir().parent / "alembic.ini").read_text()
    assert "script_location = migrations" in ini


@pytest.mark.parametrize("url", ["sqlite:///x.db", "postgresql+psycopg://u@h/db"])
def test_offline_sql_renders(url, capsys):
    alembic_command("upgrade", alembic_config(url=url), "head", sql=True)
    sql = capsys.readouterr().out
    assert "CREATE TABLE plan_requests" in sql and "CREATE INDEX ix_plan_requests_same_request" in sql
    assert f"CREATE TABLE {VERSION_TABLE}" in sql


def test_a_plan_stored_at_0001_survives_the_upgrade_to_0002(db_url):
    """A store written by the previous release keeps its plans: the new columns are empty, the
    plan reads back, and a long model id (refused by PostgreSQL's varchar(255) before) fits."""
    from sqlalchemy import text

    from planner.store import open_store

    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            alembic_command("upgrade", alembic_config(url=db_url, connection=conn), "0001")
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO plan_requests (id, created_at, model_id, model_fingerprint, gpu, gpu_count, "
                "gpu_memory_bytes, target_batch, seq_len, constraints, constraints_hash, planner_version, status, "
                "rejected, searched, usable_bytes, safety_margin_bytes) VALUES ('ab0cd', "
                "'2026-11-20 10:00:00', 'gpt2', 'f', 'a10g', 1, 1, 8, 1024, '{}', 'h', '0.1.0', 'planned', '[]', "
                "3, 1, 1)"))
        assert upgrade_database(url=db_url) == ("0001", "0004")
        assert _drift(engine) == []
        with open_store(url=db_url) as store:
            plan = store.get_plan(plan_id="ab0cd")
        assert plan.request.model_id == "gpt2" and plan.status_reason is None and plan.status_changed_at is None
        with engine.begin() as conn:
            conn.execute(text("UPDATE plan_requests SET model_id = :m"), {"m": "/x" * 500})
    finally:
        engine.dispose()


def test_a_run_stored_at_0003_reads_with_no_ranks_and_0004_goes_down_and_up(db_url):
    """Runs stored before per-rank results read back with no ranks; a multi-rank run stores each
    rank's; down to 0003 drops the column (the runs stay), up again restores it empty."""
    from sqlalchemy import text

    from support.store import candidate, request

    from planner.results import Measurement
    from planner.store import PlanStatus, open_store
    from planner.store.codec import candidate_values, request_values

    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            alembic_command("upgrade", alembic_config(url=db_url, connection=conn), "0003")
        # the plan and its candidate as the store writes them (their tables are the same at 0003);
        # the run as 0003's plan_measurements holds it, without ranks
        plan = request_values(plan_id="ab0cd", request=request(), status=PlanStatus.MEASURED, result=None, ray_job_id=None)
        one = candidate_values(plan_id="ab0cd", position=0, candidate=candidate(rank=1, micro_batch=1, grad_accum=8))
        with engine.begin() as conn:
            conn.execute(Base.metadata.tables["plan_requests"].insert(), [plan])
            conn.execute(Base.metadata.tables["plan_candidates"].insert(), [one | {"id": "cd0ef"}])
            conn.execute(text(
                "INSERT INTO plan_measurements (id, candidate_id, recorded_at, outcome, device, library_versions, node) "
                "VALUES ('ef01', 'cd0ef', '2026-11-20 10:01:00', 'ok', 'cpu', '{}', 'n')"))
        assert upgrade_database(url=db_url) == ("0003", "0004")
        assert _drift(engine) == []
        ok = Measurement(outcome="ok", device="cpu", peak_allocated_bytes=7)
        with open_store(url=db_url) as store:
            [old] = store.get_plan(plan_id="ab0cd").candidates[0].measurements
            assert old.ranks == () and old.worst_rank is None and old.to_dict()["ranks"] == []
            store.record_measurement(candidate_id="cd0ef", measurement=ok, ranks=(ok, ok))
            assert [len(m.ranks) for m in store.get_plan(plan_id="ab0cd").candidates[0].measurements] == [0, 2]
        with engine.begin() as conn:
            alembic_command("downgrade", alembic_config(url=db_url, connection=conn), "0003")
        assert "ranks" not in {c["name"] for c in inspect(engine).get_columns("plan_measurements")}
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM plan_measurements")).scalar() == 2
        assert upgrade_database(url=db_url) == ("0003", "0004")
        assert _drift(engine) == []
        with open_store(url=db_url) as store:
            assert [m.ranks for m in store.get_plan(plan_id="ab0cd").candidates[0].measurements] == [(), ()]
    finally:
        engine.dispose()


def test_threads_of_one_process_create_new_databases_at_once(tmp_path):
    """Alembic's command proxies are module globals: the service's store opener and another
    store opened in the same process used to migrate against each other's connection (CI saw
    ``KeyError: 'script'`` and 'relation "plan_requests" does not exist' on a SQLite URL)."""
    import threading

    from planner.store.schema import ensure_schema

    urls = [f"sqlite:///{tmp_path / f'store{i}.db'}" for i in range(8)]
    start, errors = threading.Barrier(len(urls)), []

    def create(url: str) -> None:
        engine = create_engine(url)
        try:
            start.wait()
            ensure_schema(engine, url=url, create=True)
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(f"{url}: {type(exc).__name__}: {exc}")
        finally:
            engine.dispose()

    threads = [threading.Thread(target=create, args=(url,)) for url in urls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    for url in urls:
        engine = create_engine(url)
        assert set(Base.metadata.tables) <= _tables(engine)
        engine.dispose()
