"""Stripe: callback source (webhook or api), payment.payment_method, provider_cursor.

Drafted by `python -m payments migration-diff` (on sqlite) from:
- column payment.payment_method: in payments/schema.py, not in the database
- column payment_callback_log.source: in payments/schema.py, not in the database
- table provider_cursor: in payments/schema.py, not in the database

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "provider_cursor",
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False, comment="what the cursor tracks, e.g. events"),
        sa.Column("value", sa.String(length=255), nullable=False, comment="where the job left off, e.g. a unix time"),
        sa.Column(
            "updated_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("provider", "name"),
        comment=(
            "Where a job reading a provider's API left off (Stripe catch_up: created time of the newest event listed)."
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    with op.batch_alter_table("payment", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "payment_method",
                sa.String(length=255),
                nullable=True,
                comment="what the provider is to charge, as the merchant named it (Stripe: a PaymentMethod id pm_…)",
            )
        )
    with op.batch_alter_table("payment_callback_log", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "source",
                sa.String(length=16),
                server_default="webhook",
                nullable=False,
                comment=(
                    "webhook: POSTed to the gateway (signature checked); "
                    "api: fetched by paysync from the provider's API"
                ),
            )
        )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
