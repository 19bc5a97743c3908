"""Which schema the store's database has: the revision table's name and this planner's head.

Kept apart from ``planner.store.schema`` (which imports SQLAlchemy and, when it must, Alembic) so
that the one-shot commands confirm a database is at head with one SELECT through the standard
library's sqlite3 (``planner.store.lite``).
"""

from __future__ import annotations

#: Alembic's revision table; named for the planner so a shared PostgreSQL database whose other
#: applications also use Alembic keeps one ``alembic_version`` each.
VERSION_TABLE = "planner_alembic_version"
#: The newest revision in migrations/versions (tests/store/test_migrations.py checks it is Alembic's
#: head). It lets the common case, a database already at head, be confirmed with one SELECT and
#: without importing Alembic and parsing the migration scripts (~0.15 s of a cold CLI start).
HEAD_REVISION = "0004"

__all__ = ["HEAD_REVISION", "VERSION_TABLE"]
