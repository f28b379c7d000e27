"""The schema as it stood when migrations were introduced: every table, index and the ledger's triggers.

Written out in full rather than taken from payments/schema.py, which keeps
changing: this revision must create the same tables for as long as it exists.
A database made by ``init-db`` before migrations (tables, no alembic_version)
is recognised as this revision when it matches it exactly, and stamped.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The column types and table options of payments/schema.py at this revision.
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = sa.DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BLOB = sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}

# The ledger is append-only and the database itself refuses changes (invariant 8).
MYSQL_TRIGGERS = [
    "CREATE TRIGGER IF NOT EXISTS ledger_event_no_update BEFORE UPDATE ON ledger_event FOR EACH ROW"
    " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_event is append-only'",
    "CREATE TRIGGER IF NOT EXISTS ledger_event_no_delete BEFORE DELETE ON ledger_event FOR EACH ROW"
    " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_event is append-only'",
    "CREATE TRIGGER IF NOT EXISTS ledger_entry_no_update BEFORE UPDATE ON ledger_entry FOR EACH ROW"
    " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_entry is append-only'",
    "CREATE TRIGGER IF NOT EXISTS ledger_entry_no_delete BEFORE DELETE ON ledger_entry FOR EACH ROW"
    " SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'ledger_entry is append-only'",
]
SQLITE_TRIGGERS = [
    "CREATE TRIGGER IF NOT EXISTS ledger_event_no_update BEFORE UPDATE ON ledger_event FOR EACH ROW"
    " BEGIN SELECT RAISE(ABORT, 'ledger_event is append-only'); END",
    "CREATE TRIGGER IF NOT EXISTS ledger_event_no_delete BEFORE DELETE ON ledger_event FOR EACH ROW"
    " BEGIN SELECT RAISE(ABORT, 'ledger_event is append-only'); END",
    "CREATE TRIGGER IF NOT EXISTS ledger_entry_no_update BEFORE UPDATE ON ledger_entry FOR EACH ROW"
    " BEGIN SELECT RAISE(ABORT, 'ledger_entry is append-only'); END",
    "CREATE TRIGGER IF NOT EXISTS ledger_entry_no_delete BEFORE DELETE ON ledger_entry FOR EACH ROW"
    " BEGIN SELECT RAISE(ABORT, 'ledger_entry is append-only'); END",
]


def upgrade() -> None:
    op.create_table(
        "payment_callback_log",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("provider", sa.String(32), nullable=False, comment="provider name from the URL"),
        sa.Column("callback_data", BLOB, nullable=False, comment="raw request body, byte for byte"),
        sa.Column("headers", sa.Text(), nullable=False, comment="JSON object of the selected request headers"),
        sa.Column("remote_addr", sa.String(64), nullable=True),
        sa.Column(
            "order_no", sa.String(64), nullable=True, comment="our payment_id (or refund_id) named by the callback"
        ),
        sa.Column("payment_order_no", sa.String(128), nullable=True, comment="the provider's transaction id"),
        sa.Column("provider_event_id", sa.String(128), nullable=True),
        sa.Column("event_type", sa.String(64), nullable=True),
        sa.Column(
            "status", sa.SmallInteger(), nullable=False, comment="0 pending 1 processed 2 failed 3 rejected 4 gave up"
        ),
        sa.Column("result", sa.String(500), nullable=True, comment="what processing did, or why it failed"),
        sa.Column("retry_count", sa.Integer(), nullable=False),
        sa.Column("last_retry_time", TS, nullable=True),
        sa.Column("next_retry_at", TS, nullable=False, comment="earliest time a sweep may take the row"),
        sa.Column("create_time", TS, nullable=False),
        sa.Column("update_time", TS, nullable=False),
        sa.CheckConstraint("status IN (0, 1, 2, 3, 4)", name="ck_callback_status"),
        sa.Index("idx_callback_create_time", "create_time"),
        sa.Index("idx_callback_event", "provider", "provider_event_id"),
        sa.Index("idx_callback_order_no", "order_no"),
        sa.Index("idx_callback_sweep", "status", "next_retry_at"),
        comment="Every callback delivery exactly as received; the truth the consumer and compensator work from.",
        **MYSQL,
    )
    op.create_table(
        "payment",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("payment_id", sa.String(40), nullable=False, comment="business number, fixed for life (pay_<ULID>)"),
        sa.Column("order_no", sa.String(64), nullable=False, comment="the merchant's order number"),
        sa.Column("amount_minor", sa.BigInteger(), nullable=False, comment="integer minor units"),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("provider_transaction_id", sa.String(128), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column(
            "idempotency_key", sa.String(255), nullable=True, comment="the merchant's key; also sent to the provider"
        ),
        sa.Column("request_digest", sa.String(64), nullable=True, comment="sha256 of the canonical create request"),
        sa.Column("description", sa.String(500), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column(
            "status_source",
            sa.String(128),
            nullable=True,
            comment="what caused the last status change: callback:<id>, call:<id>, query:<id>",
        ),
        sa.Column("next_query_at", TS, nullable=True),
        sa.Column("query_attempts", sa.Integer(), nullable=False),
        sa.Column("deadline_at", TS, nullable=True, comment="after this an unresolved payment goes to manual review"),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("payment_id", name="uq_payment_payment_id"),
        sa.UniqueConstraint("provider_transaction_id", name="uq_payment_provider_txn"),
        sa.UniqueConstraint("idempotency_key", name="uq_payment_idempotency_key"),
        sa.CheckConstraint(
            "status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown')", name="ck_payment_status"
        ),
        sa.CheckConstraint("amount_minor > 0", name="ck_payment_amount_positive"),
        sa.Index("idx_payment_order_no", "order_no"),
        sa.Index("idx_payment_status_query", "status", "next_query_at"),
        comment="One row per payment; status changes only through the state machine's guarded UPDATEs.",
        **MYSQL,
    )
    op.create_table(
        "refund",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("refund_id", sa.String(40), nullable=False, comment="business number, fixed for life (re_<ULID>)"),
        sa.Column("payment_id", sa.String(40), nullable=False),
        sa.Column("amount_minor", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("provider_refund_id", sa.String(128), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_digest", sa.String(64), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("status_source", sa.String(128), nullable=True),
        sa.Column("next_query_at", TS, nullable=True),
        sa.Column("query_attempts", sa.Integer(), nullable=False),
        sa.Column("deadline_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("refund_id", name="uq_refund_refund_id"),
        sa.UniqueConstraint("provider_refund_id", name="uq_refund_provider_refund_id"),
        sa.UniqueConstraint("idempotency_key", name="uq_refund_idempotency_key"),
        sa.CheckConstraint(
            "status IN ('Created', 'Pending', 'Succeeded', 'Failed', 'Unknown')", name="ck_refund_status"
        ),
        sa.CheckConstraint("amount_minor > 0", name="ck_refund_amount_positive"),
        sa.Index("idx_refund_payment", "payment_id"),
        sa.Index("idx_refund_status_query", "status", "next_query_at"),
        comment="One row per refund; same state machine as payments.",
        **MYSQL,
    )
    op.create_table(
        "processed_event",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("provider_event_id", sa.String(128), nullable=False),
        sa.Column("callback_log_id", sa.BigInteger(), nullable=False, comment="the delivery that was applied"),
        sa.Column("processed_at", TS, nullable=False),
        sa.UniqueConstraint("provider", "provider_event_id", name="uq_processed_event"),
        comment="The inbox: one row per provider event ever applied; makes processing idempotent.",
        **MYSQL,
    )
    op.create_table(
        "outbox",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(40), nullable=False, comment="unique id receivers dedupe on (evt_<ULID>)"),
        sa.Column(
            "event_type", sa.String(64), nullable=False, comment="ChargeRequested, RefundRequested, PaymentSucceeded, …"
        ),
        sa.Column("aggregate_id", sa.String(40), nullable=False, comment="payment_id or refund_id"),
        sa.Column("payload", sa.Text(), nullable=False, comment="JSON"),
        sa.Column("status", sa.SmallInteger(), nullable=False, comment="0 pending 1 done 2 dead (manual)"),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("event_id", name="uq_outbox_event_id"),
        sa.Index("idx_outbox_aggregate", "aggregate_id"),
        sa.Index("idx_outbox_due", "status", "next_attempt_at"),
        comment="Work to send, written in the same transaction as the change that caused it.",
        **MYSQL,
    )
    op.create_table(
        "event_delivery",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(40), nullable=False, comment="outbox.event_id of a domain event"),
        sa.Column(
            "destination", sa.String(16), nullable=False, comment="amqp (the paysync.events exchange) or webhook"
        ),
        sa.Column("status", sa.SmallInteger(), nullable=False, comment="0 pending 1 delivered 2 gave up (manual)"),
        sa.Column("attempts", sa.Integer(), nullable=False, comment="failed attempts so far"),
        sa.Column("next_attempt_at", TS, nullable=False),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("last_http_status", sa.SmallInteger(), nullable=True, comment="webhook: the merchant's last answer"),
        sa.Column("delivered_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("event_id", "destination", name="uq_event_delivery"),
        sa.CheckConstraint("status IN (0, 1, 2)", name="ck_event_delivery_status"),
        comment=(
            "Per-destination delivery state of domain events, so one destination's outage never re-sends the other."
        ),
        **MYSQL,
    )
    op.create_table(
        "provider_call",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("payment_id", sa.String(40), nullable=True),
        sa.Column("refund_id", sa.String(40), nullable=True),
        sa.Column("provider", sa.String(32), nullable=False),
        sa.Column("operation", sa.String(16), nullable=False, comment="charge, query, refund, settlement"),
        sa.Column("idempotency_key", sa.String(255), nullable=True, comment="the key sent with the call, if any"),
        sa.Column(
            "request_digest", sa.String(64), nullable=False, comment="sha256 of the canonical request parameters"
        ),
        sa.Column("http_status", sa.SmallInteger(), nullable=True, comment="NULL: no HTTP answer (timeout, reset)"),
        sa.Column("response", sa.Text(), nullable=True, comment="raw answer, scrubbed of secrets and truncated"),
        sa.Column("error_code", sa.String(64), nullable=True, comment="decline code or why the answer was Unknown"),
        sa.Column("latency_ms", sa.Integer(), nullable=True),
        sa.Column(
            "outcome",
            sa.String(16),
            nullable=True,
            comment="Succeeded, Failed, Pending, Unknown, NotFound; NULL: sent, no outcome recorded (crash)",
        ),
        sa.Column("started_at", TS, nullable=False, comment="written and committed before the request goes out"),
        sa.Column("finished_at", TS, nullable=True),
        sa.Index("idx_provider_call_payment", "payment_id"),
        sa.Index("idx_provider_call_refund", "refund_id"),
        sa.Index("idx_provider_call_started", "started_at"),
        comment=(
            "Evidence of every outbound call; payment.status_source names the call:<id> or query:<id> that moved it."
        ),
        **MYSQL,
    )
    op.create_table(
        "provider_breaker",
        sa.Column("provider", sa.String(32), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, comment="closed, open"),
        sa.Column("consecutive_failures", sa.Integer(), nullable=False),
        sa.Column("open_count", sa.Integer(), nullable=False, comment="opens since it last closed: drives the backoff"),
        sa.Column("opened_at", TS, nullable=True),
        sa.Column("retry_at", TS, nullable=True, comment="while open: when the next probe may go out"),
        sa.Column("updated_at", TS, nullable=False),
        sa.CheckConstraint("state IN ('closed', 'open')", name="ck_provider_breaker_state"),
        comment="Circuit breaker per provider, shared by every compensator process.",
        **MYSQL,
    )
    op.create_table(
        "idempotency_request",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("scope", sa.String(32), nullable=False, comment="the endpoint family, e.g. payments"),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("request_digest", sa.String(64), nullable=False, comment="sha256 of the canonical request"),
        sa.Column("status", sa.String(16), nullable=False, comment="started (in flight), done"),
        sa.Column("response_status", sa.SmallInteger(), nullable=True),
        sa.Column("response_body", sa.Text(), nullable=True, comment="the first answer, replayed verbatim"),
        sa.Column("payment_id", sa.String(40), nullable=True),
        sa.Column(
            "locked_at", TS, nullable=False, comment="a started request older than the lock timeout may be taken over"
        ),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("updated_at", TS, nullable=False),
        sa.UniqueConstraint("scope", "idempotency_key", name="uq_idempotency_request_key"),
        sa.CheckConstraint("status IN ('started', 'done')", name="ck_idempotency_request_status"),
        comment="Merchant Idempotency-Key records: in-flight detection (409) and replay of the first answer.",
        **MYSQL,
    )
    op.create_table(
        "ledger_event",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column(
            "event_type",
            sa.String(40),
            nullable=False,
            comment="PaymentRequested, PaymentConfirmed, PaymentFailed, Refund…, ReconciliationAdjusted",
        ),
        sa.Column("payment_id", sa.String(40), nullable=True),
        sa.Column("refund_id", sa.String(40), nullable=True),
        sa.Column("amount_minor", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column(
            "source_type", sa.String(32), nullable=False, comment="api, callback, provider_call, query, reconciliation"
        ),
        sa.Column("source_id", sa.String(64), nullable=True),
        sa.Column(
            "dedupe_key",
            sa.String(191),
            nullable=False,
            comment="one business effect, one row: e.g. PaymentConfirmed:pay_…",
        ),
        sa.Column("details", sa.Text(), nullable=True, comment="JSON: the path walked, the previous status, …"),
        sa.Column("created_at", TS, nullable=False),
        sa.UniqueConstraint("dedupe_key", name="uq_ledger_event_dedupe"),
        sa.Index("idx_ledger_event_payment", "payment_id"),
        comment="Append-only business events; UPDATE and DELETE are refused by triggers.",
        **MYSQL,
    )
    op.create_table(
        "ledger_entry",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column("ledger_event_id", sa.BigInteger(), nullable=False),
        sa.Column("account", sa.String(64), nullable=False),
        sa.Column(
            "amount_minor",
            sa.BigInteger(),
            nullable=False,
            comment="signed: debit > 0, credit < 0; an event's lines sum to 0",
        ),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Index("idx_ledger_entry_account", "account"),
        sa.Index("idx_ledger_entry_event", "ledger_event_id"),
        comment="Double-entry lines of ledger events; append-only like ledger_event.",
        **MYSQL,
    )
    op.create_table(
        "manual_review",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column(
            "kind", sa.String(40), nullable=False, comment="callback_gave_up, conflicting_report, unresolved_payment, …"
        ),
        sa.Column("payment_id", sa.String(40), nullable=True),
        sa.Column("refund_id", sa.String(40), nullable=True),
        sa.Column("callback_log_id", sa.BigInteger(), nullable=True),
        sa.Column("reason", sa.String(500), nullable=False),
        sa.Column("details", sa.Text(), nullable=True, comment="JSON"),
        sa.Column("status", sa.String(16), nullable=False, comment="open, resolved"),
        sa.Column("resolution", sa.String(500), nullable=True),
        sa.Column("resolved_by", sa.String(64), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("resolved_at", TS, nullable=True),
        sa.Index("idx_manual_review_payment", "payment_id"),
        sa.Index("idx_manual_review_status", "status", "created_at"),
        comment="The manual queue: what automation refused to decide.",
        **MYSQL,
    )
    op.create_table(
        "alert",
        sa.Column("id", ID, primary_key=True, autoincrement=True),
        sa.Column(
            "rule",
            sa.String(64),
            nullable=False,
            comment="callback_backlog, callback_failure_rate, callback_gave_up, …",
        ),
        sa.Column("dedupe_key", sa.String(191), nullable=False),
        sa.Column(
            "open_key", sa.String(191), nullable=True, comment="= dedupe_key while pending/firing, NULL once resolved"
        ),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column(
            "status",
            sa.String(16),
            nullable=False,
            comment="pending (condition seen, not long enough), firing, resolved",
        ),
        sa.Column("message", sa.String(500), nullable=False),
        sa.Column("details", sa.Text(), nullable=True, comment="JSON"),
        sa.Column("first_seen_at", TS, nullable=False),
        sa.Column("last_seen_at", TS, nullable=False),
        sa.Column("fired_at", TS, nullable=True),
        sa.Column("resolved_at", TS, nullable=True),
        sa.Column("notified_at", TS, nullable=True, comment="when channels were last told"),
        sa.UniqueConstraint("open_key", name="uq_alert_open_key"),
        sa.Index("idx_alert_status", "status"),
        comment="Alerts: at most one open row per dedupe key; resolved rows stay as history.",
        **MYSQL,
    )

    triggers = SQLITE_TRIGGERS if op.get_context().dialect.name == "sqlite" else MYSQL_TRIGGERS
    for statement in triggers:
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
