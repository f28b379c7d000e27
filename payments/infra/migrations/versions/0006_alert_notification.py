"""alert_notification: per-channel delivery state of alert notifications.

Drafted by `python -m payments migration-diff` (on sqlite) from:
- index idx_alert_notification_due on alert_notification (status, next_attempt_at): in payments/schema.py,
  not in the database
- table alert_notification: in payments/schema.py, not in the database

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_notification",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("alert_id", sa.BigInteger(), nullable=False, comment="alert.id this notification is about"),
        sa.Column(
            "channel",
            sa.String(length=16),
            nullable=False,
            comment="email, sms, aliyun_sms, dingtalk, feishu, wecom, slack, webhook",
        ),
        sa.Column(
            "kind",
            sa.String(length=16),
            nullable=False,
            comment="firing (once per incident), repeat (each cooldown), resolved",
        ),
        sa.Column("seq", sa.Integer(), nullable=False, comment="repeat number (1, 2, …); 0 for firing and resolved"),
        sa.Column(
            "status",
            sa.String(length=16),
            nullable=False,
            comment="held (resolved notice waiting for the alert to clear), pending, sent, gave_up, cancelled",
        ),
        sa.Column("attempts", sa.Integer(), nullable=False, comment="failed attempts so far"),
        sa.Column(
            "next_attempt_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=False,
            comment="earliest time a notifier may try (backoff after a failure)",
        ),
        sa.Column(
            "lease_until",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=True,
            comment="a notifier is sending it until then (claimed, SKIP LOCKED)",
        ),
        sa.Column(
            "last_error",
            sa.String(length=500),
            nullable=True,
            comment="why the last attempt failed (no URL, no secret)",
        ),
        sa.Column(
            "sent_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=True,
        ),
        sa.Column(
            "created_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql"),
            nullable=False,
        ),
        sa.CheckConstraint("kind IN ('firing', 'repeat', 'resolved')", name="ck_alert_notification_kind"),
        sa.CheckConstraint(
            "status IN ('held', 'pending', 'sent', 'gave_up', 'cancelled')", name="ck_alert_notification_status"
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("alert_id", "channel", "kind", "seq", name="uq_alert_notification"),
        comment="Per alert, channel and kind: the delivery state of notifications, so one dead channel never holds up "
        "another.",
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
        mysql_engine="InnoDB",
    )
    with op.batch_alter_table("alert_notification", schema=None) as batch_op:
        batch_op.create_index("idx_alert_notification_due", ["status", "next_attempt_at"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
