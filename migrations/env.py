"""Alembic environment of the plan store.

Run from code (``planner.store.schema``), the connection to migrate comes in
``config.attributes["connection"]`` already inside the caller's transaction; run from the
``alembic`` command line, the URL is ``sqlalchemy.url`` of alembic.ini or, when that is empty,
the planner's own default (``PLANNER_DATABASE_URL`` or the SQLite file in the data directory).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from planner.store.dbmodels import VERSION_TABLE, Base

config = context.config
if config.config_file_name is not None:  # the alembic command line: use alembic.ini's logging
    from logging.config import fileConfig

    fileConfig(config.config_file_name)
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from planner.store.engine import default_database_url

    return default_database_url()


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things: later revisions use batch mode (copy and move).
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return

    from planner.store.engine import make_engine

    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _configure(connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
