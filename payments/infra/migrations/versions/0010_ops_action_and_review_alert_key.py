"""ops_action (append-only record of operators' actions) and manual_review.alert_key.

- ``ops_action``: one row per action taken in the ops console or with
  ``python -m compensator review resolve`` (replay, apply, adjust, close):
  who, when, why and what it did. UPDATE and DELETE are refused by triggers,
  as revision 0001 made them for the ledger.
- ``manual_review.alert_key``: the dedupe key of the alert a review raised,
  so resolving the review resolves its alert. Reviews opened before this
  revision have none; resolving one clears the alert keyed ``<kind>:<subject>``.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


def _triggers(dialect_name: str) -> list[str]:
    statements = []
    for operation in ("UPDATE", "DELETE"):
        head = f"CREATE TRIGGER IF NOT EXISTS ops_action_no_{operation.lower()} BEFORE {operation} ON ops_action"
        if dialect_name == "sqlite":
            statements.append(f"{head} FOR EACH ROW BEGIN SELECT RAISE(ABORT, 'ops_action is append-only'); END")
        else:
            statements.append(
                f"{head} FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ops_action is append-only'"
            )
    return statements


def upgrade() -> None:
    op.create_table(
        "ops_action",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False, comment="replay, apply, adjust, close"),
        sa.Column(
            "actor", sa.String(length=64), nullable=False, comment="who: the name given at console login, or --actor"
        ),
        sa.Column("via", sa.String(length=16), nullable=False, comment="console or cli"),
        sa.Column(
            "subject",
            sa.String(length=150),
            nullable=False,
            comment="what it acted on: callback:<id> or review:<id>",
        ),
        sa.Column("manual_review_id", sa.BigInteger(), nullable=True),
        sa.Column("callback_log_id", sa.BigInteger(), nullable=True),
        sa.Column("payment_id", sa.String(length=40), nullable=True),
        sa.Column("refund_id", sa.String(length=40), nullable=True),
        sa.Column("reason", sa.String(length=500), nullable=False, comment="why: the operator's note"),
        sa.Column("outcome", sa.String(length=500), nullable=False, comment="what it did"),
        sa.Column(
            "details",
            sa.Text(),
            nullable=True,
            comment="JSON: previous status, ledger event posted, provider call, …",
        ),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("action IN ('replay', 'apply', 'adjust', 'close')", name="ck_ops_action_action"),
        sa.PrimaryKeyConstraint("id"),
        comment="Every ops console and review-command action: who, when, why and what it did; append-only (triggers).",
        **MYSQL,
    )
    with op.batch_alter_table("ops_action", schema=None) as batch_op:
        batch_op.create_index("idx_ops_action_callback", ["callback_log_id"], unique=False)
        batch_op.create_index("idx_ops_action_created", ["created_at"], unique=False)
        batch_op.create_index("idx_ops_action_payment", ["payment_id"], unique=False)
        batch_op.create_index("idx_ops_action_review", ["manual_review_id"], unique=False)
    with op.batch_alter_table("manual_review", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "alert_key",
                sa.String(length=191),
                nullable=True,
                comment="dedupe key of the alert the review raised: resolving the review resolves it",
            )
        )
    for statement in _triggers(op.get_context().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
