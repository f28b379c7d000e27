"""The platform's books: charges, refunds, idempotency keys and webhook events in one SQLite database.

One connection, one lock, one ``BEGIN IMMEDIATE`` transaction per unit of
work. The sandbox is a single process, so a Python lock is the cheapest way
to serialise writers, and it makes "two concurrent requests with one key never
create two charges" hold by construction; the UNIQUE index on the key is the
last line of defence. A charge, its idempotency record and its webhook event
(when it is already complete) are written in the same transaction, so a crash
can never leave a charge nobody will hear about.

``":memory:"`` keeps everything in memory (tests); a path keeps it in a file in
WAL mode, which survives a restart: processing charges complete and pending
webhooks are retried after it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandbox import model
from sandbox.faults import Plan, WebhookPlan
from sandbox.ids import new_id
from sandbox.settlement import SettlementRow

SCHEMA = """
CREATE TABLE IF NOT EXISTS charges (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    merchant_transaction_id TEXT NOT NULL,
    amount INTEGER NOT NULL CHECK (amount > 0),
    currency TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('processing', 'succeeded', 'failed')),
    failure_code TEXT,
    final_status TEXT NOT NULL,          -- what a processing charge becomes
    final_failure_code TEXT,
    complete_at REAL,                    -- when a processing charge completes
    amount_refunded INTEGER NOT NULL DEFAULT 0,
    idempotency_key TEXT NOT NULL,
    webhook_plan TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_charges_merchant ON charges (merchant_transaction_id);
CREATE INDEX IF NOT EXISTS idx_charges_processing ON charges (status, complete_at);
CREATE INDEX IF NOT EXISTS idx_charges_created ON charges (created_at);

CREATE TABLE IF NOT EXISTS refunds (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    charge_id TEXT NOT NULL REFERENCES charges (id),
    merchant_refund_id TEXT,
    merchant_transaction_id TEXT NOT NULL,  -- the charge's, copied for events and the settlement file
    amount INTEGER NOT NULL CHECK (amount > 0),
    currency TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('processing', 'succeeded', 'failed')),
    failure_code TEXT,
    final_status TEXT NOT NULL,
    final_failure_code TEXT,
    complete_at REAL,
    idempotency_key TEXT NOT NULL,
    webhook_plan TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_refunds_merchant ON refunds (merchant_refund_id);
CREATE INDEX IF NOT EXISTS idx_refunds_charge ON refunds (charge_id);
CREATE INDEX IF NOT EXISTS idx_refunds_processing ON refunds (status, complete_at);
CREATE INDEX IF NOT EXISTS idx_refunds_created ON refunds (created_at);

-- The first answer given to each key, replayed verbatim.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    status_code INTEGER NOT NULL,
    body TEXT NOT NULL,
    created_at REAL NOT NULL
);

-- Webhook events: the exact body sent at every attempt, and where delivery stands.
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    type TEXT NOT NULL,
    object_id TEXT NOT NULL,
    body TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'failed', 'dropped')),
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL,
    reorder_hold INTEGER NOT NULL DEFAULT 0,
    duplicate INTEGER NOT NULL DEFAULT 0,
    signature_seed INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_events_due ON events (status, next_attempt_at);

-- Every delivery attempt and the answer it got.
CREATE TABLE IF NOT EXISTS deliveries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    duplicate INTEGER NOT NULL DEFAULT 0,
    url TEXT NOT NULL,
    status_code INTEGER,
    error TEXT,
    bad_signature INTEGER NOT NULL DEFAULT 0,
    duration_ms REAL NOT NULL,
    at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_deliveries_event ON deliveries (event_id);
"""

TABLES = ("charges", "refunds", "idempotency_keys", "events", "deliveries")


@dataclass(frozen=True)
class Answer:
    """What a POST answers: the HTTP status and JSON body, and whether it is a replay of the key's first."""

    status_code: int
    body: dict[str, Any]
    replayed: bool = False


@dataclass(frozen=True)
class DueEvent:
    """An event the dispatcher should attempt now."""

    id: str
    body: str
    attempts: int
    duplicate: bool
    signature_seed: int


class Store:
    """Thread-safe access to the sandbox database."""

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
        self._conn.row_factory = sqlite3.Row
        if path != ":memory:":
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power cut may lose the last commits, never corrupt; fine for a sandbox.
            self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.executescript(SCHEMA)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def close(self) -> None:
        """Close the connection (after the server and dispatcher stopped)."""
        with self._lock:
            self._conn.close()

    def reset(self) -> None:
        """Delete everything (tests)."""
        with self._tx() as conn:
            for table in TABLES:
                conn.execute(f"DELETE FROM {table}")  # noqa: S608 - fixed table names

    # --- idempotency -------------------------------------------------------------------------

    def _replay(self, conn: sqlite3.Connection, key: str, fp: str) -> Answer | None:
        sql = "SELECT fingerprint, status_code, body FROM idempotency_keys WHERE key = ?"
        row = conn.execute(sql, (key,)).fetchone()
        if row is None:
            return None
        if row["fingerprint"] != fp:
            return Answer(409, _error("idempotency_key_reuse", _REUSE_MESSAGE), replayed=True)
        return Answer(row["status_code"], json.loads(row["body"]), replayed=True)

    def replay(self, key: str, fp: str) -> Answer | None:
        """The stored answer for ``key`` (or a 409 if it was used with other parameters); None if unused."""
        with self._lock:
            return self._replay(self._conn, key, fp)

    def _remember(self, conn: sqlite3.Connection, key: str, fp: str, answer: Answer, now: float) -> None:
        conn.execute(
            "INSERT INTO idempotency_keys (key, fingerprint, status_code, body, created_at) VALUES (?, ?, ?, ?, ?)",
            (key, fp, answer.status_code, json.dumps(answer.body), now),
        )

    # --- charges -----------------------------------------------------------------------------

    def create_charge(self, key: str, fp: str, req: model.ChargeRequest, plan: Plan, now: float) -> Answer:
        """Make the charge ``plan`` decided, remember the answer under ``key``; or replay the key's answer."""
        final_status, final_code = ("failed", "card_declined") if plan.decline else ("succeeded", None)
        status, code = ("processing", None) if plan.processing else (final_status, final_code)
        charge_id = new_id("ch")
        with self._tx() as conn:
            replayed = self._replay(conn, key, fp)
            if replayed is not None:
                return replayed
            conn.execute(
                "INSERT INTO charges (id, merchant_transaction_id, amount, currency, status, failure_code,"
                " final_status, final_failure_code, complete_at, idempotency_key, webhook_plan, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    charge_id,
                    req.merchant_transaction_id,
                    req.amount,
                    req.currency,
                    status,
                    code,
                    final_status,
                    final_code,
                    now + plan.processing_seconds if plan.processing else None,
                    key,
                    json.dumps(asdict(plan.webhook)),
                    now,
                    now,
                ),
            )
            row = _get(conn, "charges", charge_id)
            if status != "processing":
                self._add_event(conn, "charge", row, plan.webhook, now)
            answer = Answer(200, model.charge_view(row))
            self._remember(conn, key, fp, answer, now)
            return answer

    def charge(self, charge_id: str) -> dict[str, Any] | None:
        """One charge by its id, as the API shows it."""
        with self._lock:
            row = _get(self._conn, "charges", charge_id)
        return model.charge_view(row) if row else None

    def charge_by_merchant_id(self, merchant_transaction_id: str) -> dict[str, Any] | None:
        """The latest charge made for a merchant number."""
        with self._lock:
            row = self._conn.execute(
                "SELECT * FROM charges WHERE merchant_transaction_id = ? ORDER BY seq DESC LIMIT 1",
                (merchant_transaction_id,),
            ).fetchone()
        return model.charge_view(dict(row)) if row else None

    # --- refunds -----------------------------------------------------------------------------

    def create_refund(self, key: str, fp: str, req: model.RefundRequest, plan: Plan, now: float) -> Answer:
        """Refund part or all of a succeeded charge; a refund past what is left is declined (status failed).

        Raises BadRequest (nothing stored) for an unknown charge or a currency that is not the charge's.
        """
        refund_id = new_id("re")
        with self._tx() as conn:
            replayed = self._replay(conn, key, fp)
            if replayed is not None:
                return replayed
            charge = _get(conn, "charges", req.charge)
            if charge is None:
                raise model.BadRequest(f"no such charge: {req.charge}")
            if req.currency is not None and req.currency != charge["currency"]:
                raise model.BadRequest(f"currency must be the charge's ({charge['currency']})")
            # Money already promised: succeeded refunds and those still processing.
            promised = conn.execute(
                "SELECT COALESCE(SUM(amount), 0) FROM refunds WHERE charge_id = ? AND status != 'failed'",
                (req.charge,),
            ).fetchone()[0]
            if charge["status"] != "succeeded":
                final_status, final_code = "failed", "charge_not_refundable"
            elif req.amount > charge["amount"] - promised:
                final_status, final_code = "failed", "amount_exceeds_refundable"
            else:
                final_status, final_code = "succeeded", None
            processing = plan.processing and final_status == "succeeded"
            status, code = ("processing", None) if processing else (final_status, final_code)
            conn.execute(
                "INSERT INTO refunds (id, charge_id, merchant_refund_id, merchant_transaction_id, amount, currency,"
                " status, failure_code, final_status, final_failure_code, complete_at, idempotency_key, webhook_plan,"
                " created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    refund_id,
                    req.charge,
                    req.merchant_refund_id,
                    charge["merchant_transaction_id"],
                    req.amount,
                    charge["currency"],
                    status,
                    code,
                    final_status,
                    final_code,
                    now + plan.processing_seconds if processing else None,
                    key,
                    json.dumps(asdict(plan.webhook)),
                    now,
                    now,
                ),
            )
            row = _get(conn, "refunds", refund_id)
            if status == "succeeded":
                self._refunded(conn, req.charge, req.amount, now)
            if status != "processing":
                self._add_event(conn, "refund", row, plan.webhook, now)
            answer = Answer(200, model.refund_view(row))
            self._remember(conn, key, fp, answer, now)
            return answer

    @staticmethod
    def _refunded(conn: sqlite3.Connection, charge_id: str, amount: int, now: float) -> None:
        conn.execute(
            "UPDATE charges SET amount_refunded = amount_refunded + ?, updated_at = ? WHERE id = ?",
            (amount, now, charge_id),
        )

    def refund(self, refund_id: str) -> dict[str, Any] | None:
        """One refund by its id, as the API shows it."""
        with self._lock:
            row = _get(self._conn, "refunds", refund_id)
        return model.refund_view(row) if row else None

    def refund_by_merchant_id(self, merchant_refund_id: str) -> dict[str, Any] | None:
        """The latest refund made under a merchant refund number."""
        with self._lock:
            row = self._conn.execute(
                "SELECT * FROM refunds WHERE merchant_refund_id = ? ORDER BY seq DESC LIMIT 1", (merchant_refund_id,)
            ).fetchone()
        return model.refund_view(dict(row)) if row else None

    # --- completion of processing charges and refunds ----------------------------------------

    def complete_due(self, now: float) -> int:
        """Complete every processing charge and refund whose time has come; queue their events. Returns count."""
        done = 0
        with self._lock:
            # The dispatcher asks after every send: skip the write transaction when nothing is due.
            if (
                self._conn.execute(
                    "SELECT EXISTS (SELECT 1 FROM charges WHERE status = 'processing' AND complete_at <= ?)"
                    " OR EXISTS (SELECT 1 FROM refunds WHERE status = 'processing' AND complete_at <= ?)",
                    (now, now),
                ).fetchone()[0]
                == 0
            ):
                return 0
        with self._tx() as conn:
            for table, kind in (("charges", "charge"), ("refunds", "refund")):
                due = conn.execute(
                    f"SELECT id FROM {table} WHERE status = 'processing' AND complete_at <= ?",  # noqa: S608
                    (now,),
                ).fetchall()
                for (object_id,) in due:
                    conn.execute(
                        f"UPDATE {table} SET status = final_status, failure_code = final_failure_code,"  # noqa: S608
                        " updated_at = ? WHERE id = ? AND status = 'processing'",
                        (now, object_id),
                    )
                    row = _get(conn, table, object_id)
                    if kind == "refund" and row["status"] == "succeeded":
                        self._refunded(conn, row["charge_id"], row["amount"], now)
                    plan = WebhookPlan(**json.loads(row["webhook_plan"]))
                    self._add_event(conn, kind, row, plan, now)
                    done += 1
        return done

    # --- webhook events ------------------------------------------------------------------------

    def _add_event(self, conn: sqlite3.Connection, kind: str, row: dict[str, Any], plan: WebhookPlan, now: float):  # noqa: ANN202
        event_id = new_id("evt")
        build = model.charge_event if kind == "charge" else model.refund_event
        event = build(event_id, row, int(now))
        conn.execute(
            "INSERT INTO events (id, type, object_id, body, status, next_attempt_at, reorder_hold, duplicate,"
            " signature_seed, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                event_id,
                event["type"],
                row["id"],
                json.dumps(event, separators=(",", ":")),
                "dropped" if plan.drop else "pending",
                now + plan.delay_seconds,
                int(plan.reorder),
                int(plan.duplicate),
                plan.signature_seed,
                now,
                now,
            ),
        )

    def due_events(self, now: float, limit: int, exclude: set[str], reorder_max_hold: float) -> list[DueEvent]:
        """Pending events whose attempt is due, oldest first, leaving out those in flight.

        An event held back for reordering waits until a later event has had an
        attempt, or until it has waited ``reorder_max_hold`` seconds.
        """
        with self._lock:
            rows = self._conn.execute(
                "SELECT id, body, attempts, duplicate, signature_seed FROM events e"
                " WHERE status = 'pending' AND next_attempt_at <= ?"
                " AND (reorder_hold = 0 OR created_at <= ?"
                "      OR EXISTS (SELECT 1 FROM events l WHERE l.seq > e.seq AND l.attempts > 0))"
                " ORDER BY next_attempt_at, seq LIMIT ?",
                (now, now - reorder_max_hold, limit + len(exclude)),
            ).fetchall()
        due = [DueEvent(r["id"], r["body"], r["attempts"], bool(r["duplicate"]), r["signature_seed"]) for r in rows]
        return [e for e in due if e.id not in exclude][:limit]

    def next_due_at(self) -> float | None:
        """When the earliest pending event or processing charge/refund is due, or None."""
        with self._lock:
            row = self._conn.execute(
                "SELECT MIN(t) FROM ("
                " SELECT MIN(next_attempt_at) AS t FROM events WHERE status = 'pending'"
                " UNION ALL SELECT MIN(complete_at) FROM charges WHERE status = 'processing'"
                " UNION ALL SELECT MIN(complete_at) FROM refunds WHERE status = 'processing')"
            ).fetchone()
        return row[0]

    def record_attempt(
        self,
        event_id: str,
        attempt: int,
        *,
        url: str,
        status_code: int | None,
        error: str | None,
        bad_signature: bool,
        duration_ms: float,
        now: float,
        next_status: str,
        next_attempt_at: float | None = None,
        duplicate: bool = False,
    ) -> None:
        """Log one delivery attempt and move the event on (delivered, failed, or retry at ``next_attempt_at``)."""
        with self._tx() as conn:
            if conn.execute("SELECT 1 FROM events WHERE id = ?", (event_id,)).fetchone() is None:
                return  # wiped by a reset while the attempt was in flight
            conn.execute(
                "INSERT INTO deliveries (event_id, attempt, duplicate, url, status_code, error, bad_signature,"
                " duration_ms, at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event_id, attempt, int(duplicate), url, status_code, error, int(bad_signature), duration_ms, now),
            )
            if duplicate:
                return
            conn.execute(
                "UPDATE events SET attempts = ?, status = ?, next_attempt_at = COALESCE(?, next_attempt_at),"
                " reorder_hold = 0, updated_at = ? WHERE id = ? AND status = 'pending'",
                (attempt, next_status, next_attempt_at, now, event_id),
            )

    def deliveries(self, event_id: str | None = None) -> list[dict[str, Any]]:
        """Every event (or one) with its delivery attempts, oldest first."""
        with self._lock:
            where, args = ("WHERE id = ?", (event_id,)) if event_id else ("", ())
            events = self._conn.execute(
                "SELECT seq, id, type, object_id, body, status, attempts, next_attempt_at, created_at"  # noqa: S608
                f" FROM events {where} ORDER BY seq",
                args,
            ).fetchall()
            where, args = ("WHERE event_id = ?", (event_id,)) if event_id else ("", ())
            attempts = self._conn.execute(
                "SELECT event_id, attempt, duplicate, url, status_code, error, bad_signature, duration_ms, at"  # noqa: S608
                f" FROM deliveries {where} ORDER BY seq",
                args,
            ).fetchall()
        by_event: dict[str, list[dict[str, Any]]] = {}
        for a in attempts:
            item = dict(a)
            item["duplicate"] = bool(item["duplicate"])
            item["bad_signature"] = bool(item["bad_signature"])
            by_event.setdefault(item.pop("event_id"), []).append(item)
        result = []
        for e in events:
            item = dict(e)
            body = json.loads(item.pop("body"))
            item["data"] = body["data"]
            item["attempt_log"] = by_event.get(item["id"], [])
            result.append(item)
        return result

    # --- reports -----------------------------------------------------------------------------------

    def settlement_rows(self, start: float, end: float) -> list[SettlementRow]:
        """Completed charges and refunds created in [start, end)."""
        with self._lock:
            charges = self._conn.execute(
                "SELECT id, merchant_transaction_id, amount, currency, status, created_at FROM charges"
                " WHERE created_at >= ? AND created_at < ? AND status != 'processing'",
                (start, end),
            ).fetchall()
            refunds = self._conn.execute(
                "SELECT id, COALESCE(merchant_refund_id, merchant_transaction_id), amount, currency, status,"
                " created_at FROM refunds WHERE created_at >= ? AND created_at < ? AND status != 'processing'",
                (start, end),
            ).fetchall()
        rows = [SettlementRow(r[0], r[1], "charge", r[2], r[3], r[4], r[5]) for r in charges]
        rows += [SettlementRow(r[0], r[1], "refund", r[2], r[3], r[4], r[5]) for r in refunds]
        return rows

    def truth(self) -> dict[str, Any]:
        """What was really charged and refunded, and how many charges each merchant number got."""
        with self._lock:
            charges = [
                dict(r)
                for r in self._conn.execute(
                    "SELECT id, merchant_transaction_id, amount, currency, status, failure_code, amount_refunded,"
                    " idempotency_key, created_at FROM charges ORDER BY seq"
                )
            ]
            refunds = [
                dict(r)
                for r in self._conn.execute(
                    "SELECT id, charge_id AS charge, merchant_refund_id, merchant_transaction_id, amount, currency,"
                    " status, failure_code, idempotency_key, created_at FROM refunds ORDER BY seq"
                )
            ]
        counts: dict[str, int] = {}
        succeeded: dict[str, int] = {}
        for c in charges:
            mtid = c["merchant_transaction_id"]
            counts[mtid] = counts.get(mtid, 0) + 1
            if c["status"] == "succeeded":
                succeeded[mtid] = succeeded.get(mtid, 0) + 1
        return {
            "charges": charges,
            "refunds": refunds,
            "charge_counts": counts,
            "succeeded_charge_counts": succeeded,
            "multiple_charges": sorted(m for m, n in counts.items() if n > 1),
        }


_REUSE_MESSAGE = "this Idempotency-Key was already used with different parameters"


def _error(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _get(conn: sqlite3.Connection, table: str, object_id: str) -> dict[str, Any] | None:
    row = conn.execute(f"SELECT * FROM {table} WHERE id = ?", (object_id,)).fetchone()  # noqa: S608
    return dict(row) if row else None
