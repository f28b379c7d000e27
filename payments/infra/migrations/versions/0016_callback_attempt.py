"""callback_attempt: one row per processing attempt of a callback, and what processing said.

``payment_callback_log.result`` keeps only the latest word: a row that failed
twice, gave up, was replayed and then applied showed "applied" and nothing of
the rest. The console's callback page lists these rows, as a provider's
webhook-attempts page does. Each is one INSERT in the transaction that
changes the row's status (consumer, compensator, the gateway's inline path,
a replay); rows written before this revision have none.

Revision ID: 0016
Revises: 0015
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


def upgrade() -> None:
    op.create_table(
        "callback_attempt",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column(
            "callback_log_id",
            sa.BigInteger(),
            nullable=False,
            comment="payment_callback_log.id this attempt processed",
        ),
        sa.Column(
            "outcome",
            sa.String(length=16),
            nullable=False,
            comment="what processing did: applied, noop, duplicate, conflict, rejected, retry, gave_up, replayed",
        ),
        sa.Column("status", sa.SmallInteger(), nullable=False, comment="the row's status after this attempt (0-4)"),
        sa.Column(
            "result",
            sa.String(length=500),
            nullable=True,
            comment="what processing said (the row's result then)",
        ),
        sa.Column(
            "attempt_by",
            sa.String(length=64),
            nullable=True,
            comment="who ran it: web, consumer, compensator, or the replayer",
        ),
        sa.Column("created_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("id"),
        comment="Every processing attempt of a callback and what it said, one row each; only ever inserted.",
        **MYSQL,
    )
    with op.batch_alter_table("callback_attempt", schema=None) as batch_op:
        batch_op.create_index("idx_callback_attempt_log", ["callback_log_id", "id"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
