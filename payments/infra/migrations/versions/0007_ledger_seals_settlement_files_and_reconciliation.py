"""Ledger seals, settlement files and reconciliation: six tables, an index on ledger_event, two more append-only tables.

- ``ledger_seal`` (the SHA-256 chain over ledger events) and ``ledger_seal_gap``
  (ids the sealer stepped over, watched for late commits): compensator/seal_ledger.py;
- ``settlement_file`` and ``settlement_line`` (every record of every provider
  file, unchanged), ``reconciliation_run`` and ``reconciliation_item``:
  payments/reconcile.py;
- ``idx_ledger_event_type_time``: the day's confirmations without a scan;
- ``ledger_seal`` and ``settlement_line`` refuse UPDATE and DELETE (triggers,
  as revision 0001 made them for the ledger).

New tables only, nothing existing is altered, so the revision is one change:
a failure halfway leaves some of the new (empty) tables to drop by hand.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The column types and table options of payments/schema.py at this revision.
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
LONGTEXT = sa.Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}

APPEND_ONLY = ("ledger_seal", "settlement_line")
"""Tables this revision makes append-only, as 0001 did the ledger's (invariant 8)."""


def _triggers(dialect_name: str) -> list[str]:
    statements = []
    for table in APPEND_ONLY:
        for operation in ("UPDATE", "DELETE"):
            name = f"{table}_no_{operation.lower()}"
            head = f"CREATE TRIGGER IF NOT EXISTS {name} BEFORE {operation} ON {table} FOR EACH ROW"
            message = f"{table} is append-only"
            if dialect_name == "sqlite":
                statements.append(f"{head} BEGIN SELECT RAISE(ABORT, '{message}'); END")
            else:
                statements.append(f"{head} SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{message}'")
    return statements


def upgrade() -> None:
    op.create_table(
        "ledger_seal",
        sa.Column(
            "seq", ID, autoincrement=False, nullable=False, comment="position in the chain: 1, 2, 3, … without gaps"
        ),
        sa.Column(
            "ledger_event_id", sa.BigInteger(), nullable=False, comment="the sealed event (each event is sealed once)"
        ),
        sa.Column(
            "event_digest",
            sa.String(length=64),
            nullable=False,
            comment="sha256 of the event's canonical content and lines",
        ),
        sa.Column(
            "prev_hash", sa.String(length=64), nullable=False, comment="chain_hash of seq - 1 (64 zeros for seq 1)"
        ),
        sa.Column(
            "chain_hash", sa.String(length=64), nullable=False, comment="sha256 of prev_hash, seq, event id, digest"
        ),
        sa.Column(
            "max_event_id",
            sa.BigInteger(),
            nullable=False,
            comment="highest ledger_event_id sealed up to this seq: new events are the ids above it",
        ),
        sa.Column("sealed_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("ledger_event_id", name="uq_ledger_seal_event"),
        comment="Tamper evidence: a SHA-256 chain over ledger events in the order the sealer saw them committed.",
        **MYSQL,
    )
    op.create_table(
        "ledger_seal_gap",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("from_event_id", sa.BigInteger(), nullable=False, comment="first ledger_event id the sealer skipped"),
        sa.Column(
            "to_event_id", sa.BigInteger(), nullable=False, comment="last one (a range: ids are not always dense)"
        ),
        sa.Column(
            "noticed_at", TS, nullable=False, comment="watched for late commits until LATE_COMMIT_SECONDS after this"
        ),
        sa.PrimaryKeyConstraint("id"),
        comment="Work list of the sealer: ids skipped while sealing in id order (uncommitted then, or rolled back).",
        **MYSQL,
    )
    op.create_index("idx_ledger_seal_gap_noticed", "ledger_seal_gap", ["noticed_at"])
    op.create_table(
        "reconciliation_item",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("run_id", sa.BigInteger(), nullable=False),
        sa.Column("category", sa.String(length=24), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False, comment="charge, refund, fee, invalid"),
        sa.Column("settlement_file_id", sa.BigInteger(), nullable=True, comment="NULL for local_only items"),
        sa.Column("line_no", sa.Integer(), nullable=True),
        sa.Column("payment_id", sa.String(length=40), nullable=True),
        sa.Column("refund_id", sa.String(length=40), nullable=True),
        sa.Column("provider_reference", sa.String(length=128), nullable=True),
        sa.Column("merchant_reference", sa.String(length=128), nullable=True),
        sa.Column("currency", sa.String(length=3), nullable=True),
        sa.Column("provider_amount_minor", sa.BigInteger(), nullable=True),
        sa.Column("local_amount_minor", sa.BigInteger(), nullable=True),
        sa.Column("fee_minor", sa.BigInteger(), nullable=True),
        sa.Column("provider_status", sa.String(length=16), nullable=True),
        sa.Column(
            "local_status", sa.String(length=16), nullable=True, comment="the local status when the line was matched"
        ),
        sa.Column("action", sa.String(length=16), nullable=False, comment="none, resolved, adjusted, review"),
        sa.Column("manual_review_id", sa.BigInteger(), nullable=True),
        sa.Column("details", sa.Text(), nullable=True, comment="JSON: why, the adjustment posted, …"),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint(
            "category IN ('matched', 'resolved', 'amount_mismatch', 'status_mismatch', 'provider_only', "
            "'local_only', 'fee', 'ignored', 'unreadable')",
            name="ck_reconciliation_item_category",
        ),
        sa.PrimaryKeyConstraint("id"),
        comment=(
            "The result for each settlement line (and each local-only success) of a run; the source of its effects."
        ),
        **MYSQL,
    )
    op.create_index("idx_reconciliation_item_payment", "reconciliation_item", ["payment_id"])
    op.create_index("idx_reconciliation_item_run", "reconciliation_item", ["run_id", "category"])
    op.create_table(
        "reconciliation_run",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("settlement_date", sa.Date(), nullable=False),
        sa.Column("settlement_file_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "started_by",
            sa.String(length=16),
            nullable=False,
            comment="daily (the compensator) or manual (the command)",
        ),
        sa.Column("status", sa.String(length=16), nullable=False, comment="running, completed, failed"),
        sa.Column("line_count", sa.Integer(), nullable=False, comment="records read from the file"),
        sa.Column("new_lines", sa.Integer(), nullable=False, comment="records stored by this run (0: seen before)"),
        sa.Column("resolved", sa.Integer(), nullable=False, comment="payments and refunds moved by the state machine"),
        sa.Column("adjustments", sa.Integer(), nullable=False, comment="ReconciliationAdjusted events posted"),
        sa.Column("reviews", sa.Integer(), nullable=False, comment="manual reviews opened"),
        sa.Column(
            "summary", sa.Text(), nullable=True, comment="JSON: count and amounts per currency for each category; fees"
        ),
        sa.Column("error", sa.String(length=500), nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('running', 'completed', 'failed')", name="ck_reconciliation_run_status"),
        sa.PrimaryKeyConstraint("id"),
        comment="One reconciliation of one provider's day: the summary an operator reads first.",
        **MYSQL,
    )
    op.create_index("idx_reconciliation_run_day", "reconciliation_run", ["provider", "settlement_date"])
    op.create_table(
        "settlement_file",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("provider", sa.String(length=32), nullable=False),
        sa.Column("settlement_date", sa.Date(), nullable=False, comment="the day the provider's file covers"),
        sa.Column("format", sa.String(length=32), nullable=False, comment="the parser that read it, e.g. sandbox_csv"),
        sa.Column(
            "source", sa.String(length=500), nullable=False, comment="download (through the adapter) or file:<path>"
        ),
        sa.Column("sha256", sa.String(length=64), nullable=False, comment="of the file's bytes exactly as received"),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=True, comment="records stored; NULL until the import finished"),
        sa.Column("status", sa.String(length=16), nullable=False, comment="importing, imported"),
        sa.Column("superseded_at", TS, nullable=True, comment="set when a newer file for the same day was imported"),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("imported_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('importing', 'imported')", name="ck_settlement_file_status"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("provider", "settlement_date", "sha256", name="uq_settlement_file"),
        comment=(
            "Each provider settlement file imported: what, from where, its digest; the same bytes are imported once."
        ),
        **MYSQL,
    )
    op.create_table(
        "settlement_line",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("settlement_file_id", sa.BigInteger(), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False, comment="line of the file the record starts on (1-based)"),
        sa.Column(
            "kind", sa.String(length=16), nullable=False, comment="charge, refund, fee, info (header, totals), invalid"
        ),
        sa.Column("status", sa.String(length=16), nullable=True, comment="succeeded, failed (normalised)"),
        sa.Column(
            "provider_reference",
            sa.String(length=128),
            nullable=True,
            comment="the provider's transaction (or refund) id",
        ),
        sa.Column("merchant_reference", sa.String(length=128), nullable=True, comment="our payment_id (or refund_id)"),
        sa.Column(
            "amount_minor", sa.BigInteger(), nullable=True, comment="magnitude in minor units; kind says the direction"
        ),
        sa.Column("fee_minor", sa.BigInteger(), nullable=True, comment="fee the provider took (negative: returned)"),
        sa.Column("currency", sa.String(length=3), nullable=True),
        sa.Column("occurred_at", TS, nullable=True),
        sa.Column("parse_error", sa.String(length=255), nullable=True, comment="why an invalid line could not be read"),
        sa.Column(
            "raw", LONGTEXT, nullable=False, comment="the record exactly as in the file, without its line ending"
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("settlement_file_id", "line_no", name="uq_settlement_line"),
        comment="Every record of every settlement file, unchanged, with its normalised fields; append-only.",
        **MYSQL,
    )
    op.create_index(
        "idx_settlement_line_merchant_ref", "settlement_line", ["merchant_reference", "kind", "settlement_file_id"]
    )
    op.create_index(
        "idx_settlement_line_provider_ref", "settlement_line", ["provider_reference", "kind", "settlement_file_id"]
    )
    op.create_index("idx_ledger_event_type_time", "ledger_event", ["event_type", "created_at"])
    for statement in _triggers(op.get_context().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
