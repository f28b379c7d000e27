"""Evidence of every outbound provider call: one ``provider_call`` row per request.

The row is written and committed *before* the request goes out (``start``),
so even a process killed mid-call leaves a trace (outcome NULL: "sent, no
answer recorded"). ``finish`` fills in what came back in the same transaction
that applies the outcome, and the payment's ``status_source`` then names the
row (``call:<id>`` or ``query:<id>``).

``finish`` also counts the call in ``payments.infra.metrics`` (provider, operation,
outcome, latency): ``start`` remembers the first two in memory for the call in
flight, so the metrics cost no read of the row.
"""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, insert, select, update

from payments.infra import metrics
from payments.infra.db import update_each
from payments.infra.schema import provider_call
from payments.providers.base import Failed, Mismatch, QueryOutcome, Unknown

_IN_FLIGHT: dict[int, tuple[str, str]] = {}
"""call id -> (provider, operation) between ``start`` and ``finish`` in this process (for the metrics' labels)."""
_IN_FLIGHT_MAX = 10_000
"""Calls started but never finished here (a crash between the two) are forgotten past this many."""
_in_flight_lock = threading.Lock()
_START = insert(provider_call)
_FINISH = update(provider_call).where(provider_call.c.id == bindparam("p_call_id"))
"""Built once (the columns come with the parameters): every call runs both."""


def request_digest(operation: str, params: dict[str, Any]) -> str:
    """sha256 of the canonical request parameters (business fields only: never credentials)."""
    canonical = json.dumps({"operation": operation, **params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def outcome_name(outcome: QueryOutcome) -> str:
    """The outcome's name as stored in provider_call.outcome."""
    return type(outcome).__name__


def outcome_code(outcome: QueryOutcome) -> str | None:
    """The decline code or the reason an answer was Unknown."""
    if isinstance(outcome, Failed):
        return outcome.code[:64]
    if isinstance(outcome, Unknown | Mismatch):
        return outcome.reason[:64]
    return None


def _start_row(
    provider: str,
    operation: str,
    params: dict[str, Any],
    now: datetime,
    payment_id: str | None,
    refund_id: str | None,
    idempotency_key: str | None,
) -> dict[str, Any]:
    return {
        "payment_id": payment_id,
        "refund_id": refund_id,
        "provider": provider,
        "operation": operation,
        "idempotency_key": idempotency_key,
        "request_digest": request_digest(operation, params),
        "started_at": now,
    }


def _in_flight(call_id: int, provider: str, operation: str) -> None:
    with _in_flight_lock:
        if len(_IN_FLIGHT) >= _IN_FLIGHT_MAX:
            _IN_FLIGHT.clear()
        _IN_FLIGHT[call_id] = (provider, operation)


def start(
    conn: Connection,
    *,
    provider: str,
    operation: str,
    params: dict[str, Any],
    now: datetime,
    payment_id: str | None = None,
    refund_id: str | None = None,
    idempotency_key: str | None = None,
) -> int:
    """Record that a call is about to go out, in the caller's transaction; return the row id."""
    row = _start_row(provider, operation, params, now, payment_id, refund_id, idempotency_key)
    call_id = int(conn.execute(_START, row).inserted_primary_key[0])
    _in_flight(call_id, provider, operation)
    return call_id


_CHARGE_CALLS_STARTED = select(provider_call.c.payment_id, provider_call.c.id).where(
    provider_call.c.payment_id.in_(bindparam("payment_ids", expanding=True)),
    provider_call.c.operation == "charge",
    provider_call.c.started_at == bindparam("p_started_at"),
)


def start_first_charges(
    conn: Connection, calls: list[tuple[str, str, str, dict[str, Any]]], now: datetime
) -> dict[str, int]:
    """``start`` for several first charge calls at once: (payment_id, provider, idempotency key, params) each.

    Two statements whatever the count: one multi-row INSERT and one SELECT of
    the new ids by payment (portable: no RETURNING, no reliance on consecutive
    AUTO_INCREMENT values). The caller holds every payment's lock and has
    seen no charge call for any of them, so each payment has exactly one
    charge call started at ``now``: anything else raises RuntimeError, which
    rolls the caller back. Returns payment_id -> call id.
    """
    if not calls:
        return {}
    rows = [
        _start_row(provider, "charge", params, now, payment_id, None, key)
        for payment_id, provider, key, params in calls
    ]
    conn.execute(_START, rows)
    payment_ids = [payment_id for payment_id, _, _, _ in calls]
    found = conn.execute(_CHARGE_CALLS_STARTED, {"payment_ids": payment_ids, "p_started_at": now}).all()
    ids = {payment_id: int(call_id) for payment_id, call_id in found}
    if len(found) != len(calls) or set(ids) != set(payment_ids):
        raise RuntimeError(f"{len(found)} charge calls found for {len(calls)} started")
    for payment_id, provider, _, _ in calls:
        _in_flight(ids[payment_id], provider, "charge")
    return ids


def _finish_values(outcome: QueryOutcome, now: datetime) -> dict[str, Any]:
    evidence = outcome.evidence
    return {
        "outcome": outcome_name(outcome),
        "error_code": outcome_code(outcome),
        "http_status": evidence.http_status if evidence else None,
        "response": evidence.response if evidence else None,
        "latency_ms": evidence.latency_ms if evidence else None,
        "finished_at": now,
    }


def _count(call_id: int, outcome: QueryOutcome) -> None:
    with _in_flight_lock:
        labels = _IN_FLIGHT.pop(call_id, None)
    if labels is not None:
        evidence = outcome.evidence
        latency = evidence.latency_ms / 1000 if evidence and evidence.latency_ms is not None else None
        metrics.provider_call(*labels, outcome_name(outcome), latency)


def finish(conn: Connection, call_id: int, outcome: QueryOutcome, now: datetime) -> None:
    """Record what the call came back with, in the transaction that applies it."""
    conn.execute(_FINISH, {"p_call_id": call_id, **_finish_values(outcome, now)})
    _count(call_id, outcome)


_SENT = update(provider_call).where(provider_call.c.id == bindparam("p_call_id"), provider_call.c.outcome.is_(None))


def sent(conn: Connection, call_id: int, now: datetime) -> None:
    """Record that a call started earlier (prepared in a group) goes out now: its ``started_at`` becomes ``now``.

    So ``started_at`` is always the moment the request left, however long it waited for a provider slot.
    """
    conn.execute(_SENT, {"p_call_id": call_id, "started_at": now})


NOT_SENT_PREFIX = "not_sent_"
"""How the error code of a withdrawn call begins: such a call never reached the provider."""


def withdraw(conn: Connection, call_id: int, reason: str, now: datetime) -> None:
    """Record that a started call never went out after all (``reason``): outcome Failed, charged nothing.

    A later send of the same payment is then a first send, not a re-send
    (``relay``: only a call that may have reached the provider makes one).
    Not counted in the metrics: no request was made. ``reason`` begins with NOT_SENT_PREFIX.
    """
    conn.execute(
        _FINISH,
        {
            "p_call_id": call_id,
            "outcome": "Failed",
            "error_code": reason[:64],
            "http_status": None,
            "response": None,
            "latency_ms": None,
            "finished_at": now,
        },
    )
    with _in_flight_lock:
        _IN_FLIGHT.pop(call_id, None)


def finish_many(conn: Connection, finished: list[tuple[int, QueryOutcome]], now: datetime) -> None:
    """``finish`` for several calls of one operation kind at once: one UPDATE, each row its own values."""
    if not finished:
        return
    rows = {call_id: _finish_values(outcome, now) for call_id, outcome in finished}
    operations = ["charge", "refund", "query"]
    if update_each(conn, provider_call, rows, provider_call.c.operation, operations) != len(rows):
        raise RuntimeError("a provider_call row to finish is missing")
    for call_id, outcome in finished:
        _count(call_id, outcome)


def for_payment(conn: Connection, payment_id: str) -> list[dict[str, Any]]:
    """Every call made for a payment (its refunds' included), oldest first, as shown by GET /payments/<id>."""
    return _listed(conn, provider_call.c.payment_id == payment_id)


def for_refund(conn: Connection, refund_id: str) -> list[dict[str, Any]]:
    """Every call made for a refund, oldest first, as shown by GET /payments/<id>/refunds/<refund_id>."""
    return _listed(conn, provider_call.c.refund_id == refund_id)


def _listed(conn: Connection, where: Any) -> list[dict[str, Any]]:
    rows = conn.execute(select(provider_call).where(where).order_by(provider_call.c.id)).mappings()
    return [
        {
            "id": r["id"],
            "source": f"{'query' if r['operation'] == 'query' else 'call'}:{r['id']}",
            "operation": r["operation"],
            "refund_id": r["refund_id"],
            "idempotency_key": r["idempotency_key"],
            "request_digest": r["request_digest"],
            "http_status": r["http_status"],
            "outcome": r["outcome"],
            "error_code": r["error_code"],
            "latency_ms": r["latency_ms"],
            "started_at": r["started_at"].isoformat() + "Z",
            "finished_at": r["finished_at"].isoformat() + "Z" if r["finished_at"] else None,
        }
        for r in rows
    ]
