"""The merchant's side of refunds: request one idempotently, and show them.

``create_refund`` is what ``POST /payments/<payment_id>/refunds`` does, with
the Idempotency-Key semantics of ``POST /payments`` (``payments.outbound.idempotency``:
same key and body → the first answer; another body → 422; in flight → 409).
In ONE transaction it locks the payment row (``SELECT … FOR UPDATE``), checks
that the payment is Succeeded and that the amount fits in what is left
(confirmed amount minus refunds Succeeded or still in flight: every refund
not Failed), and writes the refund (status Created, its own fixed provider
idempotency key, a deadline), the ``RefundRequested`` outbox row the relay
sends and the ``RefundRequested`` ledger event. The row lock is what makes
concurrent refunds of one payment safe: the second waits for the first to
commit and then sees its refund in the sum, so two that together exceed the
amount cannot both pass. A refusal writes nothing and frees the key.

A refund is a new fact: the charge's ledger events stay as they are, and a
confirmed refund books ``RefundConfirmed`` (``payments.money.ledger``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select

from payments.infra.db import utcnow
from payments.infra.ids import new_id
from payments.infra.schema import payment, refund
from payments.lifecycle import outbox
from payments.money import ledger
from payments.outbound import idempotency, provider_calls
from payments.outbound.idempotency import Answer, InvalidRequest, minor_units, request_object
from payments.states import PaymentStatus

log = logging.getLogger("paysync.refunds")

SCOPE = "refunds"
"""The idempotency_request scope of POST /payments/<id>/refunds."""
REFUND_REQUESTED = "RefundRequested"
"""The outbox event (and the ledger event) of a new refund; the relay turns the outbox row into a provider call."""
MAX_REASON_LENGTH = 500
IN_FLIGHT_OR_DONE = (
    PaymentStatus.CREATED.value,
    PaymentStatus.PENDING.value,
    PaymentStatus.UNKNOWN.value,
    PaymentStatus.SUCCEEDED.value,
)
"""Refund states that hold money back: every one but Failed (an Unknown refund may have gone through)."""


class PaymentNotFound(InvalidRequest):
    """No payment with that id."""


def parse_refund(raw: bytes) -> tuple[int, str | None]:
    """Validate a refund request body (pure): ``(amount, reason)``, or InvalidRequest naming the field."""
    data = request_object(raw)
    extra = sorted(set(data) - {"amount", "reason"})
    if extra:
        raise InvalidRequest(f"unknown field {extra[0][:40]!r}")
    # Money is integer minor units (invariant 7): 1000, 1000.0 or 1e3 (exactly), never 10.5, "10" or true.
    amount = minor_units(data.get("amount"))
    if amount is None:
        raise InvalidRequest("amount must be an integer number of minor units", "invalid_amount")
    if amount <= 0:
        raise InvalidRequest("amount must be greater than zero", "invalid_amount")
    if amount >= 2**63:
        raise InvalidRequest("amount is larger than any payment", "amount_exceeds_refundable", 422)
    reason = data.get("reason")
    if reason is not None and (not isinstance(reason, str) or len(reason) > MAX_REASON_LENGTH):
        raise InvalidRequest(f"reason must be a string of at most {MAX_REASON_LENGTH} characters")
    return amount, reason


def digest(payment_id: str, amount: int, reason: str | None) -> str:
    """sha256 of the canonical refund request: the payment it is for, the amount and the reason."""
    canonical = json.dumps(
        {"payment_id": payment_id, "amount": amount, "reason": reason}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def create_refund(
    engine: Engine,
    payment_id: str,
    amount: int,
    reason: str | None,
    key: str,
    *,
    deadline_seconds: float,
    lock_seconds: float,
    now: datetime | None = None,
) -> Answer:
    """Request a refund of ``amount`` of ``payment_id`` under the merchant's ``key`` (module docstring).

    Raises InvalidRequest: PaymentNotFound (404), ``payment_not_succeeded``
    (409), ``amount_exceeds_refundable`` (422); and the key's 409/422.
    """
    now = now or utcnow()
    refund_id = new_id("re")

    def work(conn: Connection) -> idempotency.Stored:
        charge = conn.execute(select(payment).where(payment.c.payment_id == payment_id).with_for_update()).first()
        if charge is None:
            raise PaymentNotFound("no such payment", "not_found", 404)
        if charge.status != PaymentStatus.SUCCEEDED:
            raise InvalidRequest(
                f"only a Succeeded payment can be refunded; this one is {charge.status}", "payment_not_succeeded", 409
            )
        # After the payment's row lock: every refund committed before us is in this sum (READ COMMITTED),
        # and no other refund of this payment can commit until we do.
        held = refundable(conn, charge.payment_id, int(charge.amount_minor))
        if amount > held:
            raise InvalidRequest(
                f"amount {amount} is more than is left to refund ({held} of {charge.amount_minor} "
                f"{charge.currency}, counting refunds succeeded or in flight)",
                "amount_exceeds_refundable",
                422,
            )
        body = _write_refund(conn, charge._mapping, refund_id, amount, reason, now, deadline_seconds)
        return idempotency.Stored(201, json.dumps(body, sort_keys=True), payment_id)

    answer = idempotency.run(
        engine,
        scope=SCOPE,
        key=key,
        digest=digest(payment_id, amount, reason),
        lock_seconds=lock_seconds,
        work=work,
        now=now,
    )
    if not answer.replayed:
        log.info("refund requested", extra={"payment_id": payment_id, "refund_id": refund_id})
    return answer


def refundable(conn: Connection, payment_id: str, amount: int) -> int:
    """What is left to refund of a payment of ``amount``: minus every refund Succeeded or in flight."""
    held = conn.execute(
        select(func.coalesce(func.sum(refund.c.amount_minor), 0)).where(
            refund.c.payment_id == payment_id, refund.c.status.in_(IN_FLIGHT_OR_DONE)
        )
    ).scalar()
    return amount - int(held)


def _write_refund(
    conn: Connection,
    charge: Mapping[str, Any],
    refund_id: str,
    amount: int,
    reason: str | None,
    now: datetime,
    deadline_seconds: float,
) -> dict[str, Any]:
    values = {
        "refund_id": refund_id,
        "payment_id": charge["payment_id"],
        "amount_minor": amount,
        "currency": charge["currency"],
        "provider": charge["provider"],
        "status": PaymentStatus.CREATED.value,
        # Our own key for the provider, fixed for life (invariant 6): the merchant's key is theirs, scoped to
        # this API, and may be the same string as one of their payment keys.
        "idempotency_key": f"refund-{refund_id}",
        "request_digest": digest(charge["payment_id"], amount, reason),
        "reason": reason,
        "query_attempts": 0,
        "deadline_at": now + timedelta(seconds=deadline_seconds),
        "created_at": now,
        "updated_at": now,
    }
    conn.execute(insert(refund).values(**values))
    outbox.enqueue(
        conn,
        event_type=REFUND_REQUESTED,
        aggregate_id=refund_id,
        now=now,
        payload={"refund_id": refund_id, "payment_id": charge["payment_id"], "provider": charge["provider"]},
    )
    ledger.append(
        conn,
        event_type=REFUND_REQUESTED,
        dedupe_key=f"{REFUND_REQUESTED}:{refund_id}",
        amount_minor=amount,
        currency=charge["currency"],
        source_type="api",
        source_id=None,
        now=now,
        payment_id=charge["payment_id"],
        refund_id=refund_id,
        details={"provider": charge["provider"], "reason": reason} if reason else {"provider": charge["provider"]},
    )
    return view({**values, "provider_refund_id": None, "error_code": None, "status_source": None})


def view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A refund as the merchant API shows it."""
    return {
        "refund_id": row["refund_id"],
        "payment_id": row["payment_id"],
        "amount": int(row["amount_minor"]),
        "currency": row["currency"],
        "reason": row["reason"],
        "status": row["status"],
        "status_source": row["status_source"],
        "provider_refund_id": row["provider_refund_id"],
        "error_code": row["error_code"],
        "deadline_at": _iso(row["deadline_at"]),
        "created_at": _iso(row["created_at"]),
        "updated_at": _iso(row["updated_at"]),
    }


def refunds_of(conn: Connection, payment_id: str) -> list[dict[str, Any]]:
    """Every refund of a payment, oldest first, as ``view`` shows them."""
    rows = conn.execute(select(refund).where(refund.c.payment_id == payment_id).order_by(refund.c.id)).mappings()
    return [view(r) for r in rows]


def get_refund(engine: Engine, payment_id: str, refund_id: str) -> dict[str, Any] | None:
    """One refund of ``payment_id`` with its ledger events and provider calls; None if there is none."""
    with engine.connect() as conn:
        row = (
            conn.execute(select(refund).where(refund.c.refund_id == refund_id, refund.c.payment_id == payment_id))
            .mappings()
            .first()
        )
        if row is None:
            return None
        history = [e for e in ledger.history(conn, payment_id) if e["refund_id"] == refund_id]
        calls = provider_calls.for_refund(conn, refund_id)
    return {
        **view(row),
        "next_query_at": _iso(row["next_query_at"]),
        "query_attempts": row["query_attempts"],
        "ledger": history,
        "provider_calls": calls,
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() + "Z" if value is not None else None
