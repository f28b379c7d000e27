"""manual_review: one open review per subject (subject, open_key, occurrences, last_seen_at).

Drafted by `python -m payments migration-diff` (on sqlite) from:
- column manual_review.last_seen_at: in payments/schema.py, not in the database
- column manual_review.occurrences: in payments/schema.py, not in the database
- column manual_review.open_key: in payments/schema.py, not in the database
- column manual_review.subject: in payments/schema.py, not in the database
- constraint uq_manual_review_open_key on manual_review (open_key): in payments/schema.py, not in the database

The two NOT NULL columns are added in steps, since rows already exist: added
nullable, filled (each existing review was seen once, last when it was
opened), then made NOT NULL, without a server default, as in schema.py.
Existing reviews keep ``subject`` and ``open_key`` NULL: they were opened
before a review named its subject, so the next escalation of the same thing
opens one new review (which from then on holds the subject), and resolving
an old one works as before.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mariadb").with_variant(mysql.DATETIME(fsp=6), "mysql")
OCCURRENCES_COMMENT = "how often the subject was escalated while open"
LAST_SEEN_COMMENT = "the latest escalation of this subject"


def upgrade() -> None:
    with op.batch_alter_table("manual_review", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "subject",
                sa.String(length=150),
                nullable=True,
                comment="what it is about: payment:<id>, refund:<id>, callback:<id>, event:<id>:<destination>",
            )
        )
        batch_op.add_column(
            sa.Column(
                "open_key",
                sa.String(length=191),
                nullable=True,
                comment="<kind>:<subject> while open, NULL once resolved: one open review per subject",
            )
        )
        batch_op.add_column(sa.Column("occurrences", sa.Integer(), nullable=True, comment=OCCURRENCES_COMMENT))
        batch_op.add_column(sa.Column("last_seen_at", TS, nullable=True, comment=LAST_SEEN_COMMENT))
        batch_op.create_unique_constraint("uq_manual_review_open_key", ["open_key"])
    op.execute("UPDATE manual_review SET occurrences = 1, last_seen_at = created_at")
    with op.batch_alter_table("manual_review", schema=None) as batch_op:
        batch_op.alter_column(
            "occurrences", existing_type=sa.Integer(), nullable=False, existing_comment=OCCURRENCES_COMMENT
        )
        batch_op.alter_column("last_seen_at", existing_type=TS, nullable=False, existing_comment=LAST_SEEN_COMMENT)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
