"""Verification: why a plan has its status, when it changed, the verifying driver's lease; model
ids as long as a real path.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22

* ``status_reason``: why a plan is ``failed`` (or what verified it), shown by ``planner show``.
* ``status_changed_at``: when the status last changed ("verified 2026-11-22 14:03 UTC").
* ``lease_until``: a ``verifying`` plan's driver renews this while it runs; a plan read after its
  lease ran out is marked ``failed`` (its driver died), so no row stays ``verifying`` forever.
* ``model_id`` goes from 255 to 1024 characters: a config path may be longer than 255, which
  SQLite stored and PostgreSQL refused (``value too long for type character varying(255)``);
  both now keep 1024 and the planner refuses longer ids before printing anything.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _sqlite_offline() -> bool:
    """``alembic upgrade --sql`` on SQLite: batch mode cannot reflect the table there. SQLite
    ignores VARCHAR lengths, so the generated script may leave model_id's declared length alone."""
    return op.get_context().as_sql and op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    op.add_column("plan_requests", sa.Column("status_reason", sa.Text(), nullable=True))
    op.add_column("plan_requests", sa.Column("status_changed_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("plan_requests", sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    if not _sqlite_offline():
        with op.batch_alter_table("plan_requests") as batch:
            batch.alter_column("model_id", existing_type=sa.String(length=255), type_=sa.String(length=1024),
                               existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("plan_requests") as batch:
        batch.alter_column("model_id", existing_type=sa.String(length=1024), type_=sa.String(length=255),
                           existing_nullable=False)
        batch.drop_column("lease_until")
        batch.drop_column("status_changed_at")
        batch.drop_column("status_reason")
