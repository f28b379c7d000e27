"""ops_session: server-side record of ops console logins, so logout revokes a session.

The console's cookie is signed, and used to be the whole session: a copy taken
before logout kept working until it expired (12 h). Each login now has a row,
found by the SHA-256 of the random session id the cookie carries; logout sets
``revoked_at``, and a session whose row is revoked, expired or missing is no
session. Sessions opened before this revision have no row: they end at once
(log in again).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


def upgrade() -> None:
    op.create_table(
        "ops_session",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column(
            "sid_hash",
            sa.String(length=64),
            nullable=False,
            comment="SHA-256 (hex) of the session id in the signed cookie",
        ),
        sa.Column("role", sa.String(length=16), nullable=False, comment="operator or readonly"),
        sa.Column("actor", sa.String(length=64), nullable=False, comment="the name typed at login"),
        sa.Column(
            "token_fingerprint",
            sa.String(length=32),
            nullable=False,
            comment="which ops token logged in (gateway.ops.fingerprint)",
        ),
        sa.Column("remote_addr", sa.String(length=64), nullable=True, comment="the client's address at login"),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False, comment="login time plus the session lifetime (12 h)"),
        sa.Column("revoked_at", TS, nullable=True, comment="logout: the cookie is worth nothing from then on"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sid_hash", name="uq_ops_session_sid_hash"),
        comment="Ops console logins: a session is valid only while its row is unexpired and not revoked (logout).",
        **MYSQL,
    )
    with op.batch_alter_table("ops_session", schema=None) as batch_op:
        batch_op.create_index("idx_ops_session_expires", ["expires_at"], unique=False)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
