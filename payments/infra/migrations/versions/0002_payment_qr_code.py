"""payment.qr_code: what the payer scans (Alipay, WeChat Pay).

Drafted by `python -m payments migration-diff` (on sqlite) from:
- column payment.qr_code: in payments/schema.py, not in the database

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("payment", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "qr_code",
                sa.String(length=512),
                nullable=True,
                comment="what the buyer scans (Alipay qr_code, WeChat code_url)",
            )
        )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
