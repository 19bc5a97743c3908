"""Alembic, driven from code: where the migrations are, which revision a database is at, upgrades.

The ``migrations`` package ships next to ``planner`` (see pyproject's package list), so the
Alembic ``Config`` is built here with ``script_location`` pointing at that package instead of
reading ``alembic.ini`` from the working directory; the open connection is handed to ``env.py``
through ``config.attributes["connection"]`` (Alembic cookbook, "Sharing a Connection across one
or more programmatic migration commands").
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, inspect, text

from planner.errors import SchemaOutOfDateError, StoreError
from planner.store.dbmodels import Base
from planner.store.engine import WRITE_OPTION, safe_url
from planner.store.revision import HEAD_REVISION, VERSION_TABLE

#: What ``planner db current`` prints for a database without any revision.
BASE = "base"
#: Key of PostgreSQL's advisory lock that serialises schema creation between processes.
_PG_MIGRATION_LOCK = "oom-planner-migrations"
#: Alembic's commands are not thread-safe: ``EnvironmentContext`` installs the module-level
#: proxies ``alembic.context`` and ``alembic.op`` on enter and deletes them on exit
#: (alembic/util/langhelpers.py ``ModuleClsProxy._install_proxy``/``_remove_proxy``), so two
#: threads migrating at once (the service's store opener beside another store in the same
#: process) run env.py against each other's connection and one dies on ``KeyError: 'script'``.
#: The database locks above serialise processes; this serialises the threads of one process.
_ALEMBIC_LOCK = threading.Lock()


def migrations_dir() -> Path:
    """The ``migrations`` package directory.

    It sits next to the ``planner`` package both in a checkout and in site-packages (a wheel
    installs both); an import lookup is the fallback for unusual layouts.
    """
    beside = Path(__file__).resolve().parents[2] / "migrations"
    if (beside / "env.py").is_file():
        return beside
    spec = importlib.util.find_spec("migrations")
    assert spec is not None and spec.origin, f"the migrations package is not installed (looked in {beside})"
    return Path(spec.origin).parent


def alembic_config(*, url: str, connection: Connection | None = None) -> Any:
    """An ``alembic.config.Config`` for ``url``; with ``connection``, env.py migrates on it."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation: a literal % in the URL (escaped password) must be doubled.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _script_directory() -> Any:
    from alembic.script import ScriptDirectory

    config = alembic_config(url="sqlite://")
    return ScriptDirectory.from_config(config)


def head_revision() -> str:
    """The newest revision this planner knows."""
    head = _script_directory().get_current_head()
    assert head is not None, "the migrations directory has no revisions"
    return head


def _is_known(revision: str) -> bool:
    try:
        return _script_directory().get_revision(revision) is not None
    except Exception:  # alembic raises its own ResolutionError / CommandError kinds
        return False


@dataclass(frozen=True, kw_only=True)
class SchemaState:
    """Where a database stands relative to this planner's migrations."""

    current: str | None
    """Revision stamped in the database, None when there is none."""
    head: str
    has_version_table: bool
    planner_tables: frozenset[str]
    """Tables of this planner's models present in the database."""

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head

    @property
    def brand_new(self) -> bool:
        """Nothing of ours in it: safe to create the schema without asking."""
        return not self.has_version_table and not self.planner_tables


def schema_state(conn: Connection) -> SchemaState:
    from alembic.runtime.migration import MigrationContext

    tables = set(inspect(conn).get_table_names())
    heads = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_heads()
    assert len(heads) <= 1, f"the planner's migrations never branch, found heads {heads}"
    return SchemaState(
        current=heads[0] if heads else None,
        head=head_revision(),
        has_version_table=VERSION_TABLE in tables,
        planner_tables=frozenset(tables & set(Base.metadata.tables)),
    )


def check_schema(state: SchemaState, *, url: str) -> None:
    """Raise the one-line error that tells the user what to do with a database not at head."""
    if state.up_to_date:
        return
    where = safe_url(url)
    if state.current is None and state.planner_tables and not state.has_version_table:
        raise StoreError(
            f"database {where} has planner tables but no revision stamp ({VERSION_TABLE}); "
            "point --db at a fresh database, or stamp it with alembic if its schema matches"
        )
    if state.current is not None and not _is_known(state.current):
        raise StoreError(
            f"database {where} is at schema revision {state.current}, newer than this planner "
            f"({state.head}): upgrade oom-planner"
        )
    raise SchemaOutOfDateError(
        f"database schema at {state.current or BASE} is behind this planner ({state.head}): "
        "run 'planner db upgrade'"
    )


def _lock_for_migration(conn: Connection) -> None:
    """Serialise schema changes between processes (SQLite: BEGIN IMMEDIATE already did)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": _PG_MIGRATION_LOCK})


def alembic_command(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
    """Run Alembic's command ``name`` (``upgrade``, ``downgrade``, ...) on ``config`` while no other
    thread of this process runs one (``_ALEMBIC_LOCK``)."""
    from alembic import command

    with _ALEMBIC_LOCK:
        return getattr(command, name)(config, *args, **kwargs)


def _upgrade_on(conn: Connection, *, url: str) -> None:
    alembic_command("upgrade", alembic_config(url=url, connection=conn), "head")


def _stamped_at_head(conn: Connection) -> bool:
    """Whether the database's revision stamp is ``HEAD_REVISION`` (no Alembic needed)."""
    if not inspect(conn).has_table(VERSION_TABLE):
        return False
    stamped = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return stamped == [HEAD_REVISION]


def ensure_schema(engine: Engine, *, url: str, create: bool) -> None:
    """Create the schema of a brand-new database (when ``create``); refuse one that is behind."""
    with engine.connect() as conn:
        if _stamped_at_head(conn):
            return
        state = schema_state(conn)
    if state.up_to_date:
        return
    if not (state.brand_new and create):
        check_schema(state, url=url)
    # Several processes may meet the same new database: the first to take the lock creates it,
    # the others find it at head once they get the lock.
    with engine.execution_options(**{WRITE_OPTION: True}).begin() as conn:
        _lock_for_migration(conn)
        state = schema_state(conn)
        if state.brand_new:
            _upgrade_on(conn, url=url)
        else:
            check_schema(state, url=url)


def upgrade(engine: Engine, *, url: str) -> tuple[str | None, str]:
    """Apply every pending migration; returns (revision before, revision after)."""
    with engine.execution_options(**{WRITE_OPTION: True}).begin() as conn:
        _lock_for_migration(conn)
        before = schema_state(conn)
        if before.current is not None and not _is_known(before.current):
            check_schema(before, url=url)
        if not before.up_to_date:
            _upgrade_on(conn, url=url)
    return before.current, head_revision()


__all__ = [
    "BASE",
    "HEAD_REVISION",
    "SchemaState",
    "alembic_command",
    "alembic_config",
    "check_schema",
    "ensure_schema",
    "head_revision",
    "migrations_dir",
    "schema_state",
    "upgrade",
]
