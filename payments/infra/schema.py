"""The tables, as SQLAlchemy Core metadata: the one definition of the schema.

``schema.sql`` is generated from this (``python -m payments schema-sql``) and a
test checks that the file, applied to MariaDB, gives what ``init_db`` gives.

All timestamps are naive UTC with microseconds, written by paysync itself
(never by the database clock), so SQLite and MariaDB agree on every comparison.
Money is BIGINT minor units.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Date,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeDecorator

from payments.states import (
    BreakerState,
    CallbackStatus,
    DeliveryStatus,
    NotificationStatus,
    OutboxStatus,
    PaymentStatus,
    ReconciliationRunStatus,
    ReviewStatus,
    SettlementFileStatus,
)

metadata = MetaData()

ID = BigInteger().with_variant(Integer(), "sqlite")  # SQLite autoincrements INTEGER PRIMARY KEY only
TS = DateTime().with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")
BLOB = LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb")
LONGTEXT = Text().with_variant(mysql.MEDIUMTEXT(), "mysql", "mariadb")
MYSQL = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4", "mysql_collate": "utf8mb4_bin"}


class StatusCode(TypeDecorator):
    """A SMALLINT status column whose values are an IntEnum: binds the member as a plain int.

    PyMySQL escapes an int subclass as a quoted string; the database would
    coerce it, but a comparison with a string on an indexed integer column is
    nothing to rely on.
    """

    impl = SmallInteger
    cache_ok = True

    def process_bind_param(self, value, dialect):  # noqa: ANN001, ANN201
        return None if value is None else int(value)


def _in(column: str, values: type[IntEnum] | type[StrEnum]) -> str:
    """The CHECK text allowing exactly an enum's values."""
    items = ", ".join(str(int(v)) if isinstance(v, int) else f"'{v.value}'" for v in values)
    return f"{column} IN ({items})"


# Where a stored delivery came from (payment_callback_log.source).
SOURCE_WEBHOOK = "webhook"
"""The provider POSTed it to the gateway; it is verified by its signature."""
SOURCE_API = "api"
"""A paysync job fetched it from the provider's API (e.g. Stripe's catch_up); the authenticated call vouches for it."""


payment_callback_log = Table(
    "payment_callback_log",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False, comment="provider name from the URL"),
    Column("callback_data", BLOB, nullable=False, comment="raw request body, byte for byte"),
    Column("headers", Text, nullable=False, comment="JSON object of the selected request headers"),
    Column("remote_addr", String(64), nullable=True),
    Column(
        "source",
        String(16),
        nullable=False,
        default=SOURCE_WEBHOOK,
        server_default=SOURCE_WEBHOOK,
        comment="webhook: POSTed to the gateway (signature checked); api: fetched by paysync from the provider's API",
    ),
    Column("order_no", String(64), nullable=True, comment="our payment_id (or refund_id) named by the callback"),
    Column("payment_order_no", String(128), nullable=True, comment="the provider's transaction id"),
    Column("provider_event_id", String(128), nullable=True),
    Column("event_type", String(64), nullable=True),
    Column(
        "status",
        StatusCode,
        nullable=False,
        default=CallbackStatus.PENDING,
        comment="0 pending 1 processed 2 failed 3 rejected 4 gave up",
    ),
    Column("result", String(500), nullable=True, comment="what processing did, or why it failed"),
    Column("retry_count", Integer, nullable=False, default=0),
    Column("last_retry_time", TS, nullable=True),
    Column("next_retry_at", TS, nullable=False, comment="earliest time a sweep may take the row"),
    Column("create_time", TS, nullable=False),
    Column("update_time", TS, nullable=False),
    Column(
        "request_id",
        String(64),
        nullable=True,
        comment="the gateway request that stored it (X-Request-Id): log lines of every process carry it",
    ),
    CheckConstraint(_in("status", CallbackStatus), name="ck_callback_status"),
    Index("idx_callback_sweep", "status", "next_retry_at"),
    Index("idx_callback_order_no", "order_no"),
    Index("idx_callback_event", "provider", "provider_event_id"),
    Index("idx_callback_create_time", "create_time"),
    comment="Every callback delivery exactly as received; the truth the consumer and compensator work from.",
    **MYSQL,
)

payment = Table(
    "payment",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("payment_id", String(40), nullable=False, comment="business number, fixed for life (pay_<ULID>)"),
    Column("order_no", String(64), nullable=False, comment="the merchant's order number"),
    Column("amount_minor", BigInteger, nullable=False, comment="integer minor units"),
    Column("currency", String(3), nullable=False),
    Column("provider", String(32), nullable=False),
    Column("provider_transaction_id", String(128), nullable=True),
    Column("status", String(16), nullable=False),
    Column("idempotency_key", String(255), nullable=True, comment="the merchant's key; also sent to the provider"),
    Column("request_digest", String(64), nullable=True, comment="sha256 of the canonical create request"),
    Column("description", String(500), nullable=True),
    Column("error_code", String(64), nullable=True),
    Column(
        "status_source",
        String(128),
        nullable=True,
        comment="what caused the last status change: callback:<id>, call:<id>, query:<id>",
    ),
    Column("next_query_at", TS, nullable=True),
    Column("query_attempts", Integer, nullable=False, default=0),
    Column("deadline_at", TS, nullable=True, comment="after this an unresolved payment goes to manual review"),
    Column("qr_code", String(512), nullable=True, comment="what the buyer scans (Alipay qr_code, WeChat code_url)"),
    Column(
        "payment_method",
        String(255),
        nullable=True,
        comment="what the provider is to charge, as the merchant named it (Stripe: a PaymentMethod id pm_…)",
    ),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    UniqueConstraint("payment_id", name="uq_payment_payment_id"),
    UniqueConstraint("provider_transaction_id", name="uq_payment_provider_txn"),
    UniqueConstraint("idempotency_key", name="uq_payment_idempotency_key"),
    CheckConstraint("amount_minor > 0", name="ck_payment_amount_positive"),
    CheckConstraint(_in("status", PaymentStatus), name="ck_payment_status"),
    Index("idx_payment_status_query", "status", "next_query_at"),
    Index("idx_payment_order_no", "order_no"),
    comment="One row per payment; status changes only through the state machine's guarded UPDATEs.",
    **MYSQL,
)

refund = Table(
    "refund",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("refund_id", String(40), nullable=False, comment="business number, fixed for life (re_<ULID>)"),
    Column("payment_id", String(40), nullable=False),
    Column("amount_minor", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("provider", String(32), nullable=False),
    Column("provider_refund_id", String(128), nullable=True),
    Column("status", String(16), nullable=False),
    Column("idempotency_key", String(255), nullable=True),
    Column("request_digest", String(64), nullable=True),
    Column("error_code", String(64), nullable=True),
    Column("status_source", String(128), nullable=True),
    Column("next_query_at", TS, nullable=True),
    Column("query_attempts", Integer, nullable=False, default=0),
    Column("deadline_at", TS, nullable=True),
    Column("reason", String(500), nullable=True, comment="why the merchant refunds, as given to POST …/refunds"),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    UniqueConstraint("refund_id", name="uq_refund_refund_id"),
    UniqueConstraint("provider_refund_id", name="uq_refund_provider_refund_id"),
    UniqueConstraint("idempotency_key", name="uq_refund_idempotency_key"),
    CheckConstraint("amount_minor > 0", name="ck_refund_amount_positive"),
    CheckConstraint(_in("status", PaymentStatus), name="ck_refund_status"),
    Index("idx_refund_payment", "payment_id"),
    Index("idx_refund_status_query", "status", "next_query_at"),
    comment="One row per refund; same state machine as payments.",
    **MYSQL,
)

processed_event = Table(
    "processed_event",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False),
    Column("provider_event_id", String(128), nullable=False),
    Column("callback_log_id", BigInteger, nullable=False, comment="the delivery that was applied"),
    Column("processed_at", TS, nullable=False),
    UniqueConstraint("provider", "provider_event_id", name="uq_processed_event"),
    comment="The inbox: one row per provider event ever applied; makes processing idempotent.",
    **MYSQL,
)

outbox = Table(
    "outbox",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("event_id", String(40), nullable=False, comment="unique id receivers dedupe on (evt_<ULID>)"),
    Column("event_type", String(64), nullable=False, comment="ChargeRequested, RefundRequested, PaymentSucceeded, …"),
    Column("aggregate_id", String(40), nullable=False, comment="payment_id or refund_id"),
    Column("payload", Text, nullable=False, comment="JSON"),
    Column(
        "status", StatusCode, nullable=False, default=OutboxStatus.PENDING, comment="0 pending 1 done 2 dead (manual)"
    ),
    Column("attempts", Integer, nullable=False, default=0),
    Column("next_attempt_at", TS, nullable=False),
    Column("last_error", String(500), nullable=True),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    UniqueConstraint("event_id", name="uq_outbox_event_id"),
    Index("idx_outbox_due", "status", "next_attempt_at"),
    Index("idx_outbox_aggregate", "aggregate_id"),
    comment="Work to send, written in the same transaction as the change that caused it.",
    **MYSQL,
)

event_delivery = Table(
    "event_delivery",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("event_id", String(40), nullable=False, comment="outbox.event_id of a domain event"),
    Column("destination", String(16), nullable=False, comment="amqp (the paysync.events exchange) or webhook"),
    Column(
        "status",
        StatusCode,
        nullable=False,
        default=DeliveryStatus.PENDING,
        comment="0 pending 1 delivered 2 gave up (manual)",
    ),
    Column("attempts", Integer, nullable=False, default=0, comment="failed attempts so far"),
    Column("next_attempt_at", TS, nullable=False),
    Column("last_error", String(500), nullable=True),
    Column("last_http_status", SmallInteger, nullable=True, comment="webhook: the merchant's last answer"),
    Column("delivered_at", TS, nullable=True),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    UniqueConstraint("event_id", "destination", name="uq_event_delivery"),
    CheckConstraint(_in("status", DeliveryStatus), name="ck_event_delivery_status"),
    comment="Per-destination delivery state of domain events, so one destination's outage never re-sends the other.",
    **MYSQL,
)

provider_call = Table(
    "provider_call",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("payment_id", String(40), nullable=True),
    Column("refund_id", String(40), nullable=True),
    Column("provider", String(32), nullable=False),
    Column("operation", String(16), nullable=False, comment="charge, query, refund, settlement"),
    Column("idempotency_key", String(255), nullable=True, comment="the key sent with the call, if any"),
    Column("request_digest", String(64), nullable=False, comment="sha256 of the canonical request parameters"),
    Column("http_status", SmallInteger, nullable=True, comment="NULL: no HTTP answer (timeout, reset)"),
    Column("response", Text, nullable=True, comment="raw answer, scrubbed of secrets and truncated"),
    Column("error_code", String(64), nullable=True, comment="decline code or why the answer was Unknown"),
    Column("latency_ms", Integer, nullable=True),
    Column(
        "outcome",
        String(16),
        nullable=True,
        comment="Succeeded, Failed, Pending, Unknown, Mismatch, NotFound; NULL: sent, no outcome recorded (crash)",
    ),
    Column("started_at", TS, nullable=False, comment="written and committed before the request goes out"),
    Column("finished_at", TS, nullable=True),
    Index("idx_provider_call_payment", "payment_id"),
    Index("idx_provider_call_refund", "refund_id"),
    Index("idx_provider_call_started", "started_at"),
    comment="Evidence of every outbound call; payment.status_source names the call:<id> or query:<id> that moved it.",
    **MYSQL,
)

provider_breaker = Table(
    "provider_breaker",
    metadata,
    Column("provider", String(32), primary_key=True),
    Column("state", String(16), nullable=False, comment="closed, open"),
    Column("consecutive_failures", Integer, nullable=False, default=0),
    Column("open_count", Integer, nullable=False, default=0, comment="opens since it last closed: drives the backoff"),
    Column("opened_at", TS, nullable=True),
    Column("retry_at", TS, nullable=True, comment="while open: when the next probe may go out"),
    Column("updated_at", TS, nullable=False),
    CheckConstraint(_in("state", BreakerState), name="ck_provider_breaker_state"),
    comment="Circuit breaker per provider, shared by every compensator process.",
    **MYSQL,
)

query_hint = Table(
    "query_hint",
    metadata,
    Column("provider", String(32), primary_key=True, comment="the adapter the payment was made through"),
    Column("payment_id", String(40), primary_key=True),
    Column("hinted_at", TS, nullable=False, comment="when a hint last brought the payment's query forward"),
    Column("callback_log_id", ID, nullable=True, comment="the refused delivery that hinted it"),
    Index("idx_query_hint_provider_time", "provider", "hinted_at"),
    comment="Unverified notifications that scheduled a query (payments.hints): the per-payment and per-provider "
    "rate limits read it.",
    **MYSQL,
)

provider_cursor = Table(
    "provider_cursor",
    metadata,
    Column("provider", String(32), primary_key=True),
    Column("name", String(64), primary_key=True, comment="what the cursor tracks, e.g. events"),
    Column("value", String(255), nullable=False, comment="where the job left off, e.g. a unix time"),
    Column("updated_at", TS, nullable=False),
    comment="Where a job reading a provider's API left off (Stripe catch_up: created time of the newest event listed).",
    **MYSQL,
)

idempotency_request = Table(
    "idempotency_request",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("scope", String(32), nullable=False, comment="the endpoint family, e.g. payments"),
    Column("idempotency_key", String(255), nullable=False),
    Column("request_digest", String(64), nullable=False, comment="sha256 of the canonical request"),
    Column("status", String(16), nullable=False, comment="started (in flight), done"),
    Column("response_status", SmallInteger, nullable=True),
    Column("response_body", Text, nullable=True, comment="the first answer, replayed verbatim"),
    Column("payment_id", String(40), nullable=True),
    Column("locked_at", TS, nullable=False, comment="a started request older than the lock timeout may be taken over"),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    UniqueConstraint("scope", "idempotency_key", name="uq_idempotency_request_key"),
    CheckConstraint("status IN ('started', 'done')", name="ck_idempotency_request_status"),
    comment="Merchant Idempotency-Key records: in-flight detection (409) and replay of the first answer.",
    **MYSQL,
)

ledger_event = Table(
    "ledger_event",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column(
        "event_type",
        String(40),
        nullable=False,
        comment="PaymentRequested, PaymentConfirmed, PaymentFailed, Refund…, ReconciliationAdjusted",
    ),
    Column("payment_id", String(40), nullable=True),
    Column("refund_id", String(40), nullable=True),
    Column("amount_minor", BigInteger, nullable=False),
    Column("currency", String(3), nullable=False),
    Column("source_type", String(32), nullable=False, comment="api, callback, provider_call, query, reconciliation"),
    Column("source_id", String(64), nullable=True),
    Column(
        "dedupe_key", String(191), nullable=False, comment="one business effect, one row: e.g. PaymentConfirmed:pay_…"
    ),
    Column("details", Text, nullable=True, comment="JSON: the path walked, the previous status, …"),
    Column("created_at", TS, nullable=False),
    UniqueConstraint("dedupe_key", name="uq_ledger_event_dedupe"),
    Index("idx_ledger_event_payment", "payment_id"),
    # Reconciliation finds the day's confirmations (local-only check, aging) without an index on hot payment rows.
    Index("idx_ledger_event_type_time", "event_type", "created_at"),
    comment="Append-only business events; UPDATE and DELETE are refused by triggers.",
    **MYSQL,
)

ledger_entry = Table(
    "ledger_entry",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("ledger_event_id", BigInteger, nullable=False),
    Column("account", String(64), nullable=False),
    Column(
        "amount_minor", BigInteger, nullable=False, comment="signed: debit > 0, credit < 0; an event's lines sum to 0"
    ),
    Column("currency", String(3), nullable=False),
    Index("idx_ledger_entry_event", "ledger_event_id"),
    Index("idx_ledger_entry_account", "account"),
    comment="Double-entry lines of ledger events; append-only like ledger_event.",
    **MYSQL,
)

ledger_seal = Table(
    "ledger_seal",
    metadata,
    Column("seq", ID, primary_key=True, autoincrement=False, comment="position in the chain: 1, 2, 3, … without gaps"),
    Column("ledger_event_id", BigInteger, nullable=False, comment="the sealed event (each event is sealed once)"),
    Column("event_digest", String(64), nullable=False, comment="sha256 of the event's canonical content and lines"),
    Column("prev_hash", String(64), nullable=False, comment="chain_hash of seq - 1 (64 zeros for seq 1)"),
    Column("chain_hash", String(64), nullable=False, comment="sha256 of prev_hash, seq, event id, digest"),
    Column(
        "max_event_id",
        BigInteger,
        nullable=False,
        comment="highest ledger_event_id sealed up to this seq: new events are the ids above it",
    ),
    Column("sealed_at", TS, nullable=False),
    UniqueConstraint("ledger_event_id", name="uq_ledger_seal_event"),
    comment="Tamper evidence: a SHA-256 chain over ledger events in the order the sealer saw them committed.",
    **MYSQL,
)

ledger_seal_gap = Table(
    "ledger_seal_gap",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("from_event_id", BigInteger, nullable=False, comment="first ledger_event id the sealer skipped"),
    Column("to_event_id", BigInteger, nullable=False, comment="last one (a range: ids are not always dense)"),
    Column("noticed_at", TS, nullable=False, comment="watched for late commits until LATE_COMMIT_SECONDS after this"),
    Index("idx_ledger_seal_gap_noticed", "noticed_at"),
    comment="Work list of the sealer: ids skipped while sealing in id order (uncommitted then, or rolled back).",
    **MYSQL,
)

settlement_file = Table(
    "settlement_file",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False),
    Column("settlement_date", Date, nullable=False, comment="the day the provider's file covers"),
    Column("format", String(32), nullable=False, comment="the parser that read it, e.g. sandbox_csv"),
    Column("source", String(500), nullable=False, comment="download (through the adapter) or file:<path>"),
    Column("sha256", String(64), nullable=False, comment="of the file's bytes exactly as received"),
    Column("size_bytes", BigInteger, nullable=False),
    Column("line_count", Integer, nullable=True, comment="records stored; NULL until the import finished"),
    Column("status", String(16), nullable=False, comment="importing, imported"),
    Column("superseded_at", TS, nullable=True, comment="set when a newer file for the same day was imported"),
    Column("created_at", TS, nullable=False),
    Column("imported_at", TS, nullable=True),
    UniqueConstraint("provider", "settlement_date", "sha256", name="uq_settlement_file"),
    CheckConstraint(_in("status", SettlementFileStatus), name="ck_settlement_file_status"),
    comment="Each provider settlement file imported: what, from where, its digest; the same bytes are imported once.",
    **MYSQL,
)

settlement_line = Table(
    "settlement_line",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("settlement_file_id", BigInteger, nullable=False),
    Column("line_no", Integer, nullable=False, comment="line of the file the record starts on (1-based)"),
    Column("kind", String(16), nullable=False, comment="charge, refund, fee, info (header, totals), invalid"),
    Column("status", String(16), nullable=True, comment="succeeded, failed (normalised)"),
    Column("provider_reference", String(128), nullable=True, comment="the provider's transaction (or refund) id"),
    Column("merchant_reference", String(128), nullable=True, comment="our payment_id (or refund_id)"),
    Column("amount_minor", BigInteger, nullable=True, comment="magnitude in minor units; kind says the direction"),
    Column("fee_minor", BigInteger, nullable=True, comment="fee the provider took (negative: returned)"),
    Column("currency", String(3), nullable=True),
    Column("occurred_at", TS, nullable=True),
    Column("parse_error", String(255), nullable=True, comment="why an invalid line could not be read"),
    Column(
        "settlement_amount_minor",
        BigInteger,
        nullable=True,
        comment="cross-currency lines: the magnitude that reached our balance (and fee_minor's currency)",
    ),
    Column(
        "settlement_currency",
        String(3),
        nullable=True,
        comment="cross-currency lines: the balance's currency (amount_minor and currency are the charge's)",
    ),
    Column(
        "exchange_rate",
        String(32),
        nullable=True,
        comment="cross-currency lines: the provider's rate, as written (amount x rate = settlement amount)",
    ),
    Column("raw", LONGTEXT, nullable=False, comment="the record exactly as in the file, without its line ending"),
    UniqueConstraint("settlement_file_id", "line_no", name="uq_settlement_line"),
    # Cover "does a current file name this transaction?" (local-only, aging) without reading the rows.
    Index("idx_settlement_line_provider_ref", "provider_reference", "kind", "settlement_file_id"),
    Index("idx_settlement_line_merchant_ref", "merchant_reference", "kind", "settlement_file_id"),
    comment="Every record of every settlement file, unchanged, with its normalised fields; append-only.",
    **MYSQL,
)

# Reconciliation item categories (reconciliation_item.category).
RECON_MATCHED = "matched"
"""Both sides agree (succeeded and the same money, or both failed)."""
RECON_RESOLVED = "resolved"
"""Locally unresolved (Created/Pending/Unknown); the provider's line settled it through the state machine."""
RECON_AMOUNT_MISMATCH = "amount_mismatch"
"""Same transaction, another amount or currency."""
RECON_STATUS_MISMATCH = "status_mismatch"
"""A terminal local status the provider contradicts (a Failed payment it settled, a success it failed)."""
RECON_PROVIDER_ONLY = "provider_only"
"""Money the provider moved that we hold no record of (or a second charge for one of our numbers)."""
RECON_LOCAL_ONLY = "local_only"
"""We hold a success the provider's files do not have."""
RECON_FEE = "fee"
"""A fee line (booked with the day's fees as FeeCharged)."""
RECON_IGNORED = "ignored"
"""A failed transaction we hold no record of: no money moved, nothing to do."""
RECON_UNREADABLE = "unreadable"
"""A line the parser could not read: kept raw, sent to a person."""
RECON_CATEGORIES = (
    RECON_MATCHED,
    RECON_RESOLVED,
    RECON_AMOUNT_MISMATCH,
    RECON_STATUS_MISMATCH,
    RECON_PROVIDER_ONLY,
    RECON_LOCAL_ONLY,
    RECON_FEE,
    RECON_IGNORED,
    RECON_UNREADABLE,
)
UNEXPLAINED = (RECON_AMOUNT_MISMATCH, RECON_STATUS_MISMATCH, RECON_PROVIDER_ONLY, RECON_LOCAL_ONLY, RECON_UNREADABLE)
"""Categories a person must look at (reconciliation escalates each; the alert evaluators count them)."""

reconciliation_run = Table(
    "reconciliation_run",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("provider", String(32), nullable=False),
    Column("settlement_date", Date, nullable=False),
    Column("settlement_file_id", BigInteger, nullable=True),
    Column("started_by", String(16), nullable=False, comment="daily (the compensator) or manual (the command)"),
    Column("status", String(16), nullable=False, comment="running, completed, failed"),
    Column("line_count", Integer, nullable=False, default=0, comment="records read from the file"),
    Column("new_lines", Integer, nullable=False, default=0, comment="records stored by this run (0: seen before)"),
    Column("resolved", Integer, nullable=False, default=0, comment="payments and refunds moved by the state machine"),
    Column("adjustments", Integer, nullable=False, default=0, comment="ReconciliationAdjusted events posted"),
    Column("reviews", Integer, nullable=False, default=0, comment="manual reviews opened"),
    Column("summary", Text, nullable=True, comment="JSON: count and amounts per currency for each category; fees"),
    Column("error", String(500), nullable=True),
    Column("started_at", TS, nullable=False),
    Column("finished_at", TS, nullable=True),
    CheckConstraint(_in("status", ReconciliationRunStatus), name="ck_reconciliation_run_status"),
    Index("idx_reconciliation_run_day", "provider", "settlement_date"),
    comment="One reconciliation of one provider's day: the summary an operator reads first.",
    **MYSQL,
)

reconciliation_item = Table(
    "reconciliation_item",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("run_id", BigInteger, nullable=False),
    Column("category", String(24), nullable=False),
    Column("kind", String(16), nullable=False, comment="charge, refund, fee, invalid"),
    Column("settlement_file_id", BigInteger, nullable=True, comment="NULL for local_only items"),
    Column("line_no", Integer, nullable=True),
    Column("payment_id", String(40), nullable=True),
    Column("refund_id", String(40), nullable=True),
    Column("provider_reference", String(128), nullable=True),
    Column("merchant_reference", String(128), nullable=True),
    Column("currency", String(3), nullable=True),
    Column("provider_amount_minor", BigInteger, nullable=True),
    Column("local_amount_minor", BigInteger, nullable=True),
    Column("fee_minor", BigInteger, nullable=True),
    Column("provider_status", String(16), nullable=True),
    Column("local_status", String(16), nullable=True, comment="the local status when the line was matched"),
    Column("action", String(16), nullable=False, comment="none, resolved, adjusted, review"),
    Column("manual_review_id", BigInteger, nullable=True),
    Column("details", Text, nullable=True, comment="JSON: why, the adjustment posted, …"),
    Column("created_at", TS, nullable=False),
    CheckConstraint(
        "category IN (" + ", ".join(f"'{c}'" for c in RECON_CATEGORIES) + ")", name="ck_reconciliation_item_category"
    ),
    Index("idx_reconciliation_item_run", "run_id", "category"),
    Index("idx_reconciliation_item_payment", "payment_id"),
    comment="The result for each settlement line (and each local-only success) of a run; the source of its effects.",
    **MYSQL,
)

manual_review = Table(
    "manual_review",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("kind", String(40), nullable=False, comment="callback_gave_up, conflicting_report, unresolved_payment, …"),
    Column(
        "subject",
        String(150),
        nullable=True,
        comment="what it is about: payment:<id>, refund:<id>, callback:<id>, event:<id>:<destination>",
    ),
    Column("payment_id", String(40), nullable=True),
    Column("refund_id", String(40), nullable=True),
    Column("callback_log_id", BigInteger, nullable=True),
    Column("reason", String(500), nullable=False),
    Column("details", Text, nullable=True, comment="JSON"),
    Column("status", String(16), nullable=False, default=ReviewStatus.OPEN.value, comment="open, resolved"),
    Column(
        "open_key",
        String(191),
        nullable=True,
        comment="<kind>:<subject> while open, NULL once resolved: one open review per subject",
    ),
    Column("occurrences", Integer, nullable=False, default=1, comment="how often the subject was escalated while open"),
    Column("resolution", String(500), nullable=True),
    Column("resolved_by", String(64), nullable=True),
    Column("created_at", TS, nullable=False),
    Column("last_seen_at", TS, nullable=False, comment="the latest escalation of this subject"),
    Column("resolved_at", TS, nullable=True),
    Column(
        "alert_key",
        String(191),
        nullable=True,
        comment="dedupe key of the alert the review raised: resolving the review resolves it",
    ),
    Column("acked_at", TS, nullable=True, comment="a person took it (its alert stops reminding too)"),
    Column("acked_by", String(64), nullable=True),
    Column("silenced_until", TS, nullable=True, comment="its alert sends no notice before this time"),
    Column("assignee", String(64), nullable=True, comment="who is on it"),
    UniqueConstraint("open_key", name="uq_manual_review_open_key"),
    Index("idx_manual_review_status", "status", "created_at"),
    Index("idx_manual_review_payment", "payment_id"),
    comment="The manual queue: what automation refused to decide.",
    **MYSQL,
)

alert = Table(
    "alert",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("rule", String(64), nullable=False, comment="callback_backlog, callback_failure_rate, callback_gave_up, …"),
    Column("dedupe_key", String(191), nullable=False),
    Column("open_key", String(191), nullable=True, comment="= dedupe_key while pending/firing, NULL once resolved"),
    Column("severity", String(16), nullable=False, default="warning"),
    Column("status", String(16), nullable=False, comment="pending (condition seen, not long enough), firing, resolved"),
    Column("message", String(500), nullable=False),
    Column("details", Text, nullable=True, comment="JSON"),
    Column("first_seen_at", TS, nullable=False),
    Column("last_seen_at", TS, nullable=False),
    Column("fired_at", TS, nullable=True),
    Column("resolved_at", TS, nullable=True),
    Column("notified_at", TS, nullable=True, comment="when channels were last told"),
    Column("acked_at", TS, nullable=True, comment="a person took it: no more reminders for this incident"),
    Column("acked_by", String(64), nullable=True, comment="who acknowledged it (ops_action has the rest)"),
    Column("silenced_until", TS, nullable=True, comment="no notice about it is sent before this time"),
    Column("assignee", String(64), nullable=True, comment="who is on it"),
    UniqueConstraint("open_key", name="uq_alert_open_key"),
    Index("idx_alert_status", "status"),
    comment="Alerts: at most one open row per dedupe key; resolved rows stay as history.",
    **MYSQL,
)

alert_notification = Table(
    "alert_notification",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("alert_id", BigInteger, nullable=False, comment="alert.id this notification is about"),
    Column(
        "channel", String(16), nullable=False, comment="email, sms, aliyun_sms, dingtalk, feishu, wecom, slack, webhook"
    ),
    Column("kind", String(16), nullable=False, comment="firing (once per incident), repeat (each cooldown), resolved"),
    Column("seq", Integer, nullable=False, default=0, comment="repeat number (1, 2, …); 0 for firing and resolved"),
    Column(
        "status",
        String(16),
        nullable=False,
        comment="held (resolved notice waiting for the alert to clear), pending, sent, gave_up, cancelled",
    ),
    Column("attempts", Integer, nullable=False, default=0, comment="failed attempts so far"),
    Column("next_attempt_at", TS, nullable=False, comment="earliest time a notifier may try (backoff after a failure)"),
    Column("lease_until", TS, nullable=True, comment="a notifier is sending it until then (claimed, SKIP LOCKED)"),
    Column("last_error", String(500), nullable=True, comment="why the last attempt failed (no URL, no secret)"),
    Column("sent_at", TS, nullable=True),
    Column("created_at", TS, nullable=False),
    Column("updated_at", TS, nullable=False),
    Column(
        "group_key",
        String(191),
        nullable=True,
        comment="firing notices of one cause share it (payment:<id> or group:<rule group>): one notice for them all",
    ),
    Column(
        "grouped_into",
        BigInteger,
        nullable=True,
        comment="alert_notification.id of the notice that carries this one; it is never sent by itself",
    ),
    UniqueConstraint("alert_id", "channel", "kind", "seq", name="uq_alert_notification"),
    CheckConstraint("kind IN ('firing', 'repeat', 'resolved')", name="ck_alert_notification_kind"),
    CheckConstraint(_in("status", NotificationStatus), name="ck_alert_notification_status"),
    Index("idx_alert_notification_due", "status", "next_attempt_at"),
    Index("idx_alert_notification_group", "group_key", "channel"),
    Index("idx_alert_notification_grouped_into", "grouped_into"),
    comment="Per alert, channel and kind: the delivery state of notifications, so one dead channel never holds up "
    "another.",
    **MYSQL,
)

callback_attempt = Table(
    "callback_attempt",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("callback_log_id", BigInteger, nullable=False, comment="payment_callback_log.id this attempt processed"),
    Column(
        "outcome",
        String(16),
        nullable=False,
        comment="what processing did: applied, noop, duplicate, conflict, rejected, retry, gave_up, replayed",
    ),
    Column("status", SmallInteger, nullable=False, comment="the row's status after this attempt (0-4)"),
    Column("result", String(500), nullable=True, comment="what processing said (the row's result then)"),
    Column("attempt_by", String(64), nullable=True, comment="who ran it: web, consumer, compensator, or the replayer"),
    Column("created_at", TS, nullable=False),
    Index("idx_callback_attempt_log", "callback_log_id", "id"),
    comment="Every processing attempt of a callback and what it said, one row each; only ever inserted.",
    **MYSQL,
)

ops_session = Table(
    "ops_session",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("sid_hash", String(64), nullable=False, comment="SHA-256 (hex) of the session id in the signed cookie"),
    Column("role", String(16), nullable=False, comment="operator or readonly"),
    Column("actor", String(64), nullable=False, comment="the name typed at login"),
    Column(
        "token_fingerprint", String(32), nullable=False, comment="which ops token logged in (gateway.ops.fingerprint)"
    ),
    Column("remote_addr", String(64), nullable=True, comment="the client's address at login"),
    Column("created_at", TS, nullable=False),
    Column("expires_at", TS, nullable=False, comment="login time plus the session lifetime (12 h)"),
    Column("revoked_at", TS, nullable=True, comment="logout: the cookie is worth nothing from then on"),
    UniqueConstraint("sid_hash", name="uq_ops_session_sid_hash"),
    Index("idx_ops_session_expires", "expires_at"),
    comment="Ops console logins: a session is valid only while its row is unexpired and not revoked (logout).",
    **MYSQL,
)

ops_action = Table(
    "ops_action",
    metadata,
    Column("id", ID, primary_key=True, autoincrement=True),
    Column("action", String(16), nullable=False, comment="replay, apply, adjust, close, ack, silence, assign"),
    Column("actor", String(64), nullable=False, comment="who: the name given at console login, or --actor"),
    Column(
        "identity",
        String(160),
        nullable=True,
        comment="who, as authenticated: the console session and its token, or the command's OS user",
    ),
    Column("ops_session_id", BigInteger, nullable=True, comment="the console session that acted (ops_session.id)"),
    Column("via", String(16), nullable=False, comment="console or cli"),
    Column("subject", String(150), nullable=False, comment="what it acted on: callback:<id> or review:<id>"),
    Column("manual_review_id", BigInteger, nullable=True),
    Column("callback_log_id", BigInteger, nullable=True),
    Column("payment_id", String(40), nullable=True),
    Column("refund_id", String(40), nullable=True),
    Column("reason", String(500), nullable=False, comment="why: the operator's note"),
    Column("outcome", String(500), nullable=False, comment="what it did"),
    Column("details", Text, nullable=True, comment="JSON: previous status, ledger event posted, provider call, …"),
    Column("created_at", TS, nullable=False),
    Column("alert_id", BigInteger, nullable=True, comment="the alert acted on (ack, silence, assign)"),
    CheckConstraint(
        "action IN ('replay', 'apply', 'adjust', 'close', 'ack', 'silence', 'assign')", name="ck_ops_action_action"
    ),
    Index("idx_ops_action_review", "manual_review_id"),
    Index("idx_ops_action_callback", "callback_log_id"),
    Index("idx_ops_action_payment", "payment_id"),
    Index("idx_ops_action_created", "created_at"),
    Index("idx_ops_action_alert", "alert_id"),
    comment="Every ops console and review-command action: who, when, why and what it did; append-only (triggers).",
    **MYSQL,
)


# The ledger, its seals, the providers' settlement lines and the operators' actions are append-only; the database
# itself refuses changes (invariant 8).
APPEND_ONLY_TABLES = ("ledger_event", "ledger_entry", "ledger_seal", "settlement_line", "ops_action")


def trigger_ddl(dialect_name: str) -> list[str]:
    """CREATE TRIGGER statements that make the append-only tables refuse UPDATE and DELETE."""
    statements = []
    for table_name in APPEND_ONLY_TABLES:
        for op in ("UPDATE", "DELETE"):
            head = f"CREATE TRIGGER IF NOT EXISTS {table_name}_no_{op.lower()} BEFORE {op} ON {table_name} FOR EACH ROW"
            message = f"{table_name} is append-only"
            if dialect_name == "sqlite":
                statements.append(f"{head} BEGIN SELECT RAISE(ABORT, '{message}'); END")
            else:
                statements.append(f"{head} SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = '{message}'")
    return statements
