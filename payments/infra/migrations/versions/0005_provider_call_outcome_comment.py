"""provider_call.outcome: its comment lists Mismatch.

Drafted by `python -m payments migration-diff` (on mysql) from:
- column provider_call.outcome: comment Succeeded, Failed, Pending, Unknown, NotFound; NULL: sent, no outcome
  recorded (crash) in the database, Succeeded, Failed, Pending, Unknown, Mismatch, NotFound; NULL: sent, no
  outcome recorded (crash) in payments/schema.py

Only MariaDB/MySQL keep column comments; on SQLite there is nothing to change
(a batch alter there would copy the whole table for it).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.alter_column(
        "provider_call",
        "outcome",
        existing_type=sa.String(length=16),
        existing_nullable=True,
        comment="Succeeded, Failed, Pending, Unknown, Mismatch, NotFound; NULL: sent, no outcome recorded (crash)",
        existing_comment="Succeeded, Failed, Pending, Unknown, NotFound; NULL: sent, no outcome recorded (crash)",
    )


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
