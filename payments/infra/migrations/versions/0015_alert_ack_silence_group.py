"""Ack, silence and assign for alerts and reviews; grouped notifications; ops_action records the new actions.

- ``alert`` and ``manual_review``: ``acked_at``/``acked_by`` (a person took
  it: no more reminders), ``silenced_until`` (no notice before then) and
  ``assignee``.
- ``alert_notification``: ``group_key`` and ``grouped_into``, so the firing
  notices of one cause (one payment, or one rule group within its wait) go out
  as one notice that lists them.
- ``ops_action``: ``alert_id`` and the actions ``ack``, ``silence`` and
  ``assign`` in its CHECK. Changing a CHECK makes SQLite copy the table, which
  drops its triggers: they are made again here, as revision 0010 made them.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
ACTIONS = "action IN ('replay', 'apply', 'adjust', 'close', 'ack', 'silence', 'assign')"


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
    with op.batch_alter_table("alert", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("acked_at", TS, nullable=True, comment="a person took it: no more reminders for this incident")
        )
        batch_op.add_column(
            sa.Column(
                "acked_by", sa.String(length=64), nullable=True, comment="who acknowledged it (ops_action has the rest)"
            )
        )
        batch_op.add_column(
            sa.Column("silenced_until", TS, nullable=True, comment="no notice about it is sent before this time")
        )
        batch_op.add_column(sa.Column("assignee", sa.String(length=64), nullable=True, comment="who is on it"))
    with op.batch_alter_table("manual_review", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("acked_at", TS, nullable=True, comment="a person took it (its alert stops reminding too)")
        )
        batch_op.add_column(sa.Column("acked_by", sa.String(length=64), nullable=True))
        batch_op.add_column(
            sa.Column("silenced_until", TS, nullable=True, comment="its alert sends no notice before this time")
        )
        batch_op.add_column(sa.Column("assignee", sa.String(length=64), nullable=True, comment="who is on it"))
    with op.batch_alter_table("alert_notification", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "group_key",
                sa.String(length=191),
                nullable=True,
                comment="firing notices of one cause share it (payment:<id> or group:<rule group>): "
                "one notice for them all",
            )
        )
        batch_op.add_column(
            sa.Column(
                "grouped_into",
                sa.BigInteger(),
                nullable=True,
                comment="alert_notification.id of the notice that carries this one; it is never sent by itself",
            )
        )
        batch_op.create_index("idx_alert_notification_group", ["group_key", "channel"], unique=False)
        batch_op.create_index("idx_alert_notification_grouped_into", ["grouped_into"], unique=False)
    with op.batch_alter_table("ops_action", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("alert_id", sa.BigInteger(), nullable=True, comment="the alert acted on (ack, silence, assign)")
        )
        batch_op.alter_column(
            "action",
            existing_type=sa.String(length=16),
            existing_nullable=False,
            comment="replay, apply, adjust, close, ack, silence, assign",
            existing_comment="replay, apply, adjust, close",
        )
        batch_op.drop_constraint("ck_ops_action_action", type_="check")
        batch_op.create_check_constraint("ck_ops_action_action", sa.text(ACTIONS))
        batch_op.create_index("idx_ops_action_alert", ["alert_id"], unique=False)
    for statement in _triggers(op.get_context().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
