"""The plan store: every request, candidate and real measurement, kept in SQL.

SQLite in the user's data directory by default (``PLANNER_DATABASE_URL`` or ``--db`` select
another database, e.g. ``postgresql+psycopg://user@host/db``); the schema is managed by Alembic
(``migrations/``). Every store answers ``PlanStore`` (``planner.store.interface``) and hands
back the frozen entities of ``planner.store.entities`` and ``planner.results``, never ORM rows::

    with open_plan_store() as store:
        plan_id = store.save_plan(result=result)
        plan = store.get_plan(plan_id=plan_id[:8])

Alembic is imported only when a schema has to be checked or migrated.
"""

from __future__ import annotations

from planner.lazy import lazy_exports

#: name -> module that defines it. Imported on first use (PEP 562), so that importing an entity
#: (``planner.store.entities``) or the SQLite path of the one-shot commands does not import
#: SQLAlchemy through ``planner.store.api``.
_EXPORTS = {
    **dict.fromkeys(("Store", "database_revision", "open_store", "parse_since", "upgrade_database"), "planner.store.api"),
    "constraints_hash": "planner.store.codec",
    "default_database_url": "planner.store.engine",
    **dict.fromkeys(("PlanStore", "open_plan_store"), "planner.store.interface"),
    **dict.fromkeys(("HistoryCursor", "MeasuredRun", "PlanStatus", "PlanSummary", "StoredCandidate", "StoredMeasurement", "StoredPlan",
                     "parse_status"), "planner.store.entities"),
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = sorted(_EXPORTS)
