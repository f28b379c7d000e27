"""Querying an unresolved payment by our business number, and acting on the answer.

Unknown payments (and Pending ones past QUERY_PENDING_AFTER_SECONDS) are
looked up at their provider with backoff (``query_delay``). Found → applied
through the state machine like a call's answer (``payments.calls.apply_outcome``).
Not found → sent again with the same idempotency key, if the provider
dedupes a re-send and the last send is more than QUERY_NOT_FOUND_GRACE_SECONDS
old; otherwise queried again. Still unresolved at the payment's deadline →
manual review and an alert.

Unknown and long-Pending refunds are looked up the same way by our refund
number (``query_refund``); a NotFound refund is sent again under its own key.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, and_, exists, or_, select, update

from payments import breaker, outbox, provider_calls
from payments.calls import (
    KEY_OUTLIVED,
    Context,
    Result,
    admission,
    apply_outcome,
    count,
    give_up_ambiguous,
    key_outlived,
    last_charge_call,
    last_charge_send,
    last_refund_call,
    last_refund_send,
    lock_payment,
    lock_refund,
    reach_ends,
    refund_request,
    release,
    review,
)
from payments.charges import CHARGE_REQUESTED
from payments.db import utcnow
from payments.providers.base import ChargeRequest, NotFound, Pending, Provider, QueryOutcome, RefundRequest
from payments.query_schedule import query_delay
from payments.refunds import REFUND_REQUESTED
from payments.schema import outbox as outbox_table
from payments.schema import payment, refund
from payments.states import TERMINAL, OutboxStatus, PaymentStatus


def due_for_query(now: datetime, pending_after_seconds: float) -> Any:
    """The WHERE clause of payments query_unresolved should look at now."""
    return or_(
        and_(
            payment.c.status.in_((PaymentStatus.UNKNOWN.value, PaymentStatus.PENDING.value)),
            payment.c.next_query_at <= now,
        ),
        and_(
            payment.c.status == PaymentStatus.PENDING.value,
            payment.c.next_query_at.is_(None),
            payment.c.updated_at <= now - timedelta(seconds=pending_after_seconds),
        ),
    )


def query_payment(
    ctx: Context, payment_id: str, provider_name: str, lease_until: datetime, *, budget_ok: bool = False
) -> Result:
    """Query one claimed Unknown (or long-Pending) payment by our number and act on the answer.

    ``lease_until`` is the claim's token (the ``next_query_at`` it wrote): if
    the payment no longer carries it, another worker holds it now, and nothing
    is sent. ``budget_ok``: the caller's query budget allows a query even
    while the provider's breaker is open.
    """
    provider = ctx.providers.get(provider_name)
    if provider is not None and not provider.capabilities.query_by_merchant_id:
        provider = None  # an adapter that cannot look a charge up by our number is as good as none here
    gate = admission(ctx, provider)
    prepared: Result | tuple[int, dict[str, Any], datetime | None] = Result.SKIPPED
    try:
        prepared = _prepare(ctx, payment_id, lease_until, provider, gate, budget_ok)
    finally:
        if isinstance(prepared, Result):
            release(ctx, provider, gate)  # no query goes out: a probe slot we took is free again
    if isinstance(prepared, Result):
        return prepared
    call_id, current, sent_before = prepared
    expected = ChargeRequest(
        current["payment_id"],
        int(current["amount_minor"]),
        current["currency"],
        created_at=current["created_at"],
        provider_transaction_id=current["provider_transaction_id"],
        sent_before=sent_before,
    )
    outcome = provider.query(payment_id, ctx.settings.provider_timeout_seconds, expected)
    now = utcnow()
    if _unpaid_past_expiry(provider, outcome, current, now):
        call_id, outcome = _close_expired(ctx, provider, call_id, outcome, expected)
        now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = lock_payment(conn, payment_id)
        if isinstance(outcome, NotFound):
            result = _not_found(ctx, conn, current, provider, now, _CHARGE)
        else:
            result = apply_outcome(ctx, conn, current, provider, outcome, f"query:{call_id}", now, query=True)
    count(ctx, provider, outcome, gate)
    return result


EXPIRY_MARGIN = timedelta(seconds=30)
"""How long past an order's expiry (by our clock) before we close it: the provider's clock is the one that counts."""


def _unpaid_past_expiry(provider: Provider, outcome: QueryOutcome, current: Mapping[str, Any], now: datetime) -> bool:
    """True when a payer-driven order (a QR code) is still unpaid, or was never made, past its expiry."""
    if not isinstance(outcome, NotFound | Pending):
        return False
    expires_at = provider.order_expires_at(current["created_at"])
    return expires_at is not None and now >= expires_at + EXPIRY_MARGIN


def _closable_in(provider: Provider, current: Mapping[str, Any], now: datetime) -> float | None:
    """Seconds until an unpaid QR order may be closed (``_unpaid_past_expiry``); None if it never expires or may now.

    The next query comes no later than that: then it closes the order and settles the payment, however far its
    backoff has grown. Once the moment has passed (a close that did not settle it) the backoff alone decides.
    """
    expires_at = provider.order_expires_at(current["created_at"])
    if expires_at is None:
        return None
    seconds = (expires_at + EXPIRY_MARGIN - now).total_seconds()
    return seconds if seconds > 0 else None


def _close_expired(
    ctx: Context, provider: Provider, query_call_id: int, found: QueryOutcome, expected: ChargeRequest
) -> tuple[int, QueryOutcome]:
    """Close the unpaid order at the provider before it is marked Failed; return (close call id, its outcome).

    The query that found it unpaid is recorded first; the close is its own
    provider_call (operation ``close``), and what the adapter's close-then-query
    says is what gets applied: Failed only once the provider confirms it.
    """
    payment_id = expected.payment_id
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, query_call_id, found, utcnow())
        close_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="close",
            params={"merchant_transaction_id": payment_id},
            now=utcnow(),
            payment_id=payment_id,
        )
    return close_id, provider.expire(payment_id, ctx.settings.provider_timeout_seconds, expected)


def _prepare(
    ctx: Context,
    payment_id: str,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
    budget_ok: bool,
) -> Result | tuple[int, dict[str, Any], datetime | None]:
    """Lock the payment, decide whether the query may go out, and record it.

    Returns (call id, payment, when its newest charge call started or None).
    """
    now = utcnow()
    with ctx.engine.begin() as conn:
        current = lock_payment(conn, payment_id)
        if current is None or PaymentStatus(current["status"]) not in (PaymentStatus.UNKNOWN, PaymentStatus.PENDING):
            return Result.SKIPPED
        if current["next_query_at"] != lease_until:
            return Result.SKIPPED  # our lease ran out and another worker holds it, or an answer came meanwhile
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            review(conn, current, "unresolved_payment", f"still {current['status']} at its deadline", now)
            conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=None))
            return Result.REVIEW
        if provider is None:  # no adapter, or one that cannot look a charge up by our number
            previous = last_charge_call(conn, payment_id)
            call_id = previous.id if previous else None
            give_up_ambiguous(conn, current, call_id, now, "provider cannot be queried by our number")
            return Result.REVIEW
        if gate.admission == breaker.Admission.DENY and not budget_ok:
            retry_at = max(gate.snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=retry_at))
            return Result.DEFERRED
        sent = last_charge_send(conn, payment_id)  # a send turned away with a 429 made nothing
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="query",
            params={"merchant_transaction_id": payment_id},
            now=now,
            payment_id=payment_id,
        )
        # The lease now covers the call itself, however long the wait for the rate limiter was.
        call_lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=call_lease))
    return call_id, current, sent.started_at if sent is not None else None


@dataclass(frozen=True)
class _Resend:
    """What a NotFound answer may send again: a charge or a refund, each under its own fixed key."""

    table: Table
    key: str
    """Our number's column: payment_id or refund_id."""
    event_type: str
    last_send: Callable[[Connection, str], Any]
    """The latest send that may have reached the provider (one turned away with a 429 did not)."""
    payload: Callable[[Mapping[str, Any]], dict[str, Any]]


_CHARGE = _Resend(
    payment,
    "payment_id",
    CHARGE_REQUESTED,
    last_charge_send,
    lambda row: {"payment_id": row["payment_id"], "provider": row["provider"], "resend": True},
)
_REFUND = _Resend(
    refund,
    "refund_id",
    REFUND_REQUESTED,
    last_refund_send,
    lambda row: {
        "refund_id": row["refund_id"],
        "payment_id": row["payment_id"],
        "provider": row["provider"],
        "resend": True,
    },
)


def _not_found(
    ctx: Context, conn: Connection, current: Mapping[str, Any], provider: Provider, now: datetime, what: _Resend
) -> Result:
    """The provider says it never saw the charge (or refund): send it again with the same key, if we believe it.

    A provider that does not dedupe is only queried again (until the
    deadline): its NotFound may be a charge not visible yet. Where a re-send
    is allowed, a NotFound within QUERY_NOT_FOUND_GRACE_SECONDS of the end of
    the last send (``reach_ends``) is not believed yet either: the next query
    comes after the grace.
    Nor is one about a send the provider answered Pending: it has the order,
    which it shows to a query only once the payer starts (an Alipay QR code
    nobody scanned yet); re-sending it would only make the same order again,
    once a grace period, for as long as it lives. A send the provider turned
    away with a 429 (rate limited) did nothing there, so it starts no grace:
    the send before it, if any, is the one that counts.
    """
    attempts = current["query_attempts"] + 1
    closable_in = _closable_in(provider, current, now) if what is _CHARGE else None
    next_query_at = now + timedelta(seconds=query_delay(ctx.settings, attempts, settles_in=closable_in))
    last = what.last_send(conn, current[what.key])
    # Counted from the end of the last send that may have reached the provider, not from when it was prepared:
    # a call can wait for a slot, and hang until its timeout, after its row was written.
    grace = timedelta(seconds=ctx.settings.query_not_found_grace_seconds)
    grace_ends = reach_ends(ctx.settings, last) + grace if last else now
    accepted = last is not None and last.outcome == Pending.__name__  # as provider_calls.outcome_name writes it
    may_resend = provider.capabilities.may_resend and not accepted
    believed = may_resend and now >= grace_ends
    if may_resend and not believed:
        next_query_at = max(next_query_at, grace_ends)
    values = {"query_attempts": attempts, "next_query_at": next_query_at, "updated_at": now}
    conn.execute(update(what.table).where(what.table.c.id == current["id"]).values(**values))
    if PaymentStatus(current["status"]) in TERMINAL or not believed:
        return Result.UNCHANGED
    if key_outlived(ctx.settings, provider, current, now):
        # A re-send under a key the provider may have forgotten could be a second charge, and a NotFound is not
        # a failure: a person settles it. The queries go on meanwhile (until the deadline), once a backoff.
        review(conn, current, "unresolved_not_resendable", f"not found, and {KEY_OUTLIVED}; not re-sent", now)
        return Result.REVIEW
    queued = conn.execute(
        select(
            exists().where(
                outbox_table.c.aggregate_id == current[what.key],
                outbox_table.c.event_type == what.event_type,
                outbox_table.c.status == OutboxStatus.PENDING,
            )
        )
    ).scalar()
    if not queued:
        outbox.enqueue(
            conn, event_type=what.event_type, aggregate_id=current[what.key], now=now, payload=what.payload(current)
        )
    return Result.RESEND


def due_refunds_for_query(now: datetime, pending_after_seconds: float) -> Any:
    """The WHERE clause of refunds query_unresolved should look at now (the same rule as ``due_for_query``)."""
    return or_(
        and_(
            refund.c.status.in_((PaymentStatus.UNKNOWN.value, PaymentStatus.PENDING.value)),
            refund.c.next_query_at <= now,
        ),
        and_(
            refund.c.status == PaymentStatus.PENDING.value,
            refund.c.next_query_at.is_(None),
            refund.c.updated_at <= now - timedelta(seconds=pending_after_seconds),
        ),
    )


def query_refund(
    ctx: Context, refund_id: str, provider_name: str, lease_until: datetime, *, budget_ok: bool = False
) -> Result:
    """Query one claimed Unknown (or long-Pending) refund by our refund number and act on the answer.

    As ``query_payment``: found → applied through the state machine; not
    found → sent again under the refund's own key if the provider dedupes it
    and the last send is past QUERY_NOT_FOUND_GRACE_SECONDS; still unresolved
    at the refund's deadline → manual review and an alert.
    """
    provider = ctx.providers.get(provider_name)
    if provider is not None and not provider.capabilities.query_by_merchant_id:
        provider = None
    gate = admission(ctx, provider)
    prepared: Result | tuple[int, dict[str, Any], RefundRequest] = Result.SKIPPED
    try:
        prepared = _prepare_refund(ctx, refund_id, lease_until, provider, gate, budget_ok)
    finally:
        if isinstance(prepared, Result):
            release(ctx, provider, gate)
    if isinstance(prepared, Result):
        return prepared
    call_id, current, request = prepared
    outcome = provider.query_refund(refund_id, ctx.settings.provider_timeout_seconds, request)
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = lock_refund(conn, refund_id)
        if isinstance(outcome, NotFound):
            result = _not_found(ctx, conn, current, provider, now, _REFUND)
        else:
            result = apply_outcome(ctx, conn, current, provider, outcome, f"query:{call_id}", now, query=True)
    count(ctx, provider, outcome, gate)
    return result


def _prepare_refund(
    ctx: Context,
    refund_id: str,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
    budget_ok: bool,
) -> Result | tuple[int, dict[str, Any], RefundRequest]:
    """Lock the refund, decide whether the query may go out, and record it; return (call id, refund, request)."""
    now = utcnow()
    with ctx.engine.begin() as conn:
        current = lock_refund(conn, refund_id)
        if current is None or PaymentStatus(current["status"]) not in (PaymentStatus.UNKNOWN, PaymentStatus.PENDING):
            return Result.SKIPPED
        if current["next_query_at"] != lease_until:
            return Result.SKIPPED
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            review(conn, current, "unresolved_refund", f"still {current['status']} at its deadline", now)
            conn.execute(update(refund).where(refund.c.id == current["id"]).values(next_query_at=None))
            return Result.REVIEW
        request = refund_request(conn, current)
        if provider is None or request is None:
            previous = last_refund_call(conn, refund_id)
            give_up_ambiguous(
                conn, current, previous.id if previous else None, now, "provider cannot be queried by our number"
            )
            return Result.REVIEW
        if gate.admission == breaker.Admission.DENY and not budget_ok:
            retry_at = max(gate.snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            conn.execute(update(refund).where(refund.c.id == current["id"]).values(next_query_at=retry_at))
            return Result.DEFERRED
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="query",
            params={"merchant_refund_id": refund_id},
            now=now,
            payment_id=current["payment_id"],
            refund_id=refund_id,
        )
        call_lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(update(refund).where(refund.c.id == current["id"]).values(next_query_at=call_lease))
    return call_id, current, request
