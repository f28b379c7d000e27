"""payment_callback_log.request_id: the gateway request that stored a callback, for log correlation.

Drafted by `python -m payments migration-diff` (on sqlite) from:
- column payment_callback_log.request_id: in payments/schema.py, not in the database

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("payment_callback_log", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "request_id",
                sa.String(length=64),
                nullable=True,
                comment="the gateway request that stored it (X-Request-Id): log lines of every process carry it",
            )
        )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
