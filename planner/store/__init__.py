"""The plan store: every request, candidate and real measurement, kept in SQL.

SQLite in the user's data directory by default (``PLANNER_DATABASE_URL`` or ``--db`` select
another database, e.g. ``postgresql+psycopg://user@host/db``); the schema is managed by Alembic
(``migrations/``). The API hands back the frozen entities of ``planner.store.entities`` and
``planner.results``, never ORM rows::

    with open_store() as store:
        plan_id = store.save_plan(result=result)
        plan = store.get_plan(plan_id=plan_id[:8])

Alembic is imported only when a schema has to be checked or migrated.
"""

from planner.store.api import (
    Store,
    constraints_hash,
    database_revision,
    open_store,
    parse_since,
    upgrade_database,
)
from planner.store.engine import default_database_url
from planner.store.entities import (
    MeasuredRun,
    PlanStatus,
    PlanSummary,
    StoredCandidate,
    StoredMeasurement,
    StoredPlan,
    parse_status,
)

__all__ = [
    "MeasuredRun",
    "PlanStatus",
    "PlanSummary",
    "Store",
    "StoredCandidate",
    "StoredMeasurement",
    "StoredPlan",
    "constraints_hash",
    "database_revision",
    "default_database_url",
    "open_store",
    "parse_since",
    "parse_status",
    "upgrade_database",
]
