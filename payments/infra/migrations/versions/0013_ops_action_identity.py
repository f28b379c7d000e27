"""ops_action.identity and ops_action.ops_session_id: who acted, as authenticated, beside the name typed.

``actor`` is whatever name was typed at login or given as ``--actor``.
``identity`` records what vouches for it: the console session (its number,
role and the fingerprint of the token that opened it) or, for the command
line, the operating-system user running it; ``ops_session_id`` links a
console action to its ``ops_session`` row. Actions recorded before this
revision have neither. ADD COLUMN on both databases: SQLite keeps the table,
and with it the append-only triggers.

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ops_action", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "identity",
                sa.String(length=160),
                nullable=True,
                comment="who, as authenticated: the console session and its token, or the command's OS user",
            )
        )
        batch_op.add_column(
            sa.Column(
                "ops_session_id",
                sa.BigInteger(),
                nullable=True,
                comment="the console session that acted (ops_session.id)",
            )
        )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
