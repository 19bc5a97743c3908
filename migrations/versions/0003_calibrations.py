"""Calibrations: the device constants ``planner calibrate`` fits from stored measurements.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

One row per fit of one device (``calibrations``): the fitted constants (MFU by matmul dtype,
memory-bandwidth efficiency, CUDA context), their defaults, the errors before and after, the
measurements it was fitted on. The newest active row of a GPU is what plans use; ``--reset`` and
a newer fit deactivate a row, never delete it.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("gpu", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("dropped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("measurements", sa.Integer(), nullable=False),
        sa.Column("constants", sa.JSON(), nullable=False),
        sa.Column("defaults", sa.JSON(), nullable=False),
        sa.Column("report", sa.JSON(), nullable=False),
        sa.Column("measurement_ids", sa.JSON(), nullable=False),
        sa.Column("planner_version", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_calibrations")),
    )
    op.create_index("ix_calibrations_gpu_active", "calibrations", ["gpu", "active", "id"])


def downgrade() -> None:
    op.drop_index("ix_calibrations_gpu_active", table_name="calibrations")
    op.drop_table("calibrations")
