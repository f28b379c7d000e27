"""query_hint: unverified notifications that brought a payment's query forward (rate limits).

Drafted by `python -m payments migration-diff` (on sqlite) from:
- index idx_query_hint_provider_time on query_hint (provider, hinted_at): in payments/schema.py, not in the database
- table query_hint: in payments/schema.py, not in the database

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "query_hint",
        sa.Column("provider", sa.String(length=32), nullable=False, comment="the adapter the payment was made through"),
        sa.Column("payment_id", sa.String(length=40), nullable=False),
        sa.Column(
            "hinted_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=False,
            comment="when a hint last brought the payment's query forward",
        ),
        sa.Column(
            "callback_log_id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=True,
            comment="the refused delivery that hinted it",
        ),
        sa.PrimaryKeyConstraint("provider", "payment_id"),
        comment=(
            "Unverified notifications that scheduled a query (payments.hints): "
            "the per-payment and per-provider rate limits read it."
        ),
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    with op.batch_alter_table("query_hint", schema=None) as batch_op:
        batch_op.create_index("idx_query_hint_provider_time", ["provider", "hinted_at"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
