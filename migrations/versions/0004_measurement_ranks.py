"""Multi-rank runs: each rank's own measurement beside the run's.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26

A candidate of N GPUs is verified by N ranks (``planner.verify.ranks``); the run's row keeps the
run's result (the worst rank's peak, or the cause of the rank that failed it) in its columns as
before, and ``ranks`` keeps every rank's: a JSON list, one object per rank in rank order
(``planner.store.codec.rank_values``). NULL for a one-process run and for every row stored before
this revision, which read back with no ranks.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("plan_measurements", sa.Column("ranks", sa.JSON(), nullable=True))


def downgrade() -> None:
    # batch mode: SQLite before 3.35 has no DROP COLUMN (Alembic copies the table there)
    with op.batch_alter_table("plan_measurements") as batch:
        batch.drop_column("ranks")
