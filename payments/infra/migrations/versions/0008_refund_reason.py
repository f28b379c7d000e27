"""refund.reason: why the merchant refunds, as POST /payments/<id>/refunds was given it.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable, no default: an ADD COLUMN that InnoDB does in place, and SQLite without copying the table.
    op.add_column(
        "refund",
        sa.Column(
            "reason",
            sa.String(length=500),
            nullable=True,
            comment="why the merchant refunds, as given to POST …/refunds",
        ),
    )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
