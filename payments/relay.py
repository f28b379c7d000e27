"""Sending a ChargeRequested (or a RefundRequested) to its provider: prepare, call, apply (``payments/calls.py``).

1. **Prepare** locks the outbox row and the payment, checks the deadline, the
   adapter's capabilities and the circuit breaker, records the
   ``provider_call`` row and moves Created → Pending, and commits.
2. **Call** the adapter with the payment's fixed idempotency key (invariant 6).
   A call after an earlier one whose outcome was lost is a re-send: its
   refusal (a 4xx) is Unknown, not a decline (``reported_status``).
3. **Apply** the outcome, complete the provider_call row and mark the outbox
   row done, together. If we die before this commits, the outbox row's lease
   runs out and the relay sends the same key again; the provider replays its
   first answer.

A charge whose outcome was lost (a previous call on file) is sent again only
to a provider that dedupes it (``Capabilities.may_resend``), and, if it
dedupes by key, only while it still keeps the key (``calls.key_outlived``:
PROVIDER_KEY_LIFETIME_SECONDS). Any other provider never gets the same
payment twice: the payment is left Unknown for the query job, or, if the
provider cannot be queried either, goes to the manual queue.

A RefundRequested goes the same way (``relay_refund``), under the refund's
own fixed idempotency key and our refund number.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from payments import breaker, failpoints, provider_calls
from payments.backoff import compute_backoff
from payments.calls import (
    KEY_OUTLIVED,
    Context,
    Result,
    admission,
    apply_outcome,
    count,
    give_up_ambiguous,
    hold_for_query,
    key_outlived,
    last_charge_call,
    last_refund_call,
    lock_payment,
    lock_refund,
    refund_request,
    release,
    review,
)
from payments.db import claim_rows, utcnow
from payments.providers.base import ChargeRequest, Failed, Provider, QueryOutcome, RefundRequest
from payments.schema import outbox as outbox_table
from payments.states import TERMINAL, OutboxStatus, PaymentStatus, Verdict, decide
from payments.transitions import apply_decision

log = logging.getLogger("paysync.relay")

Turn = Callable[[], AbstractContextManager[object]]
"""A wait for a turn at the database (``relay_outbox`` bounds how many units are in a transaction at once)."""

# Every send runs these: built once (SET columns come with the parameters), not rebuilt per row.
_LOCK_OUTBOX = select(outbox_table).where(outbox_table.c.id == bindparam("p_outbox_id")).with_for_update()
_UPDATE_OUTBOX = update(outbox_table).where(outbox_table.c.id == bindparam("p_outbox_id"))
_LEASE_FOR_CALL = _UPDATE_OUTBOX.values(attempts=outbox_table.c.attempts + 1)


def relay_charge(
    ctx: Context, outbox_id: int, provider_name: str, lease_until: datetime, db_turn: Turn = nullcontext
) -> Result:
    """Send one claimed ChargeRequested row to its provider and apply the answer (module docstring).

    ``provider_name`` comes from the row's payload (read by the claim), so the
    breaker is consulted before any row lock is taken. ``lease_until`` is the
    claim's token: if the row no longer carries it, the lease ran out and
    another worker holds the row now, and nothing is sent. The prepare and
    the apply each wait for a ``db_turn``; the call in between holds none.
    """
    provider = ctx.providers.get(provider_name)
    with db_turn():
        gate = admission(ctx, provider)
        prepared: Result | tuple[int, dict[str, Any], bool, datetime | None] = Result.SKIPPED
        try:
            prepared = _prepare(ctx, outbox_id, lease_until, provider, gate)
        finally:
            if isinstance(prepared, Result):
                release(ctx, provider, gate)  # no call goes out: a probe slot we took is free again
    if isinstance(prepared, Result):
        return prepared
    call_id, current, resend, sent_before = prepared
    outcome = send_charge(ctx, provider, current, sent_before)
    with db_turn():
        lock = partial(lock_payment, payment_id=current["payment_id"])
        result = apply_call(ctx, outbox_id, call_id, lock, provider, outcome, resend)
        count(ctx, provider, outcome, gate)
    return result


def send_charge(
    ctx: Context, provider: Provider, current: Mapping[str, Any], sent_before: datetime | None = None
) -> QueryOutcome:
    """The charge call itself, outside any transaction, with the payment's fixed idempotency key (invariant 6).

    ``sent_before``: when the payment's previous charge call started (None: this is its first).
    """
    outcome = provider.charge(
        ChargeRequest(
            current["payment_id"],
            int(current["amount_minor"]),
            current["currency"],
            description=current["description"],
            created_at=current["created_at"],
            payment_method=current["payment_method"],
            provider_transaction_id=current["provider_transaction_id"],
            sent_before=sent_before,
        ),
        current["idempotency_key"],
        ctx.settings.provider_timeout_seconds,
    )
    failpoints.hit("relay.after_provider_call")
    return outcome


def relay_charge_inline(
    ctx: Context, event_id: str, provider_name: str, budget_seconds: float, throttle: Callable[[str], bool]
) -> bool:
    """Send the ChargeRequested outbox row ``event_id`` now, as relay_outbox would; True if done within the budget.

    For POST /payments to answer with the QR code. The row is claimed and
    leased the way ``relay_outbox`` claims it, and ``relay_charge`` sends it,
    so a compensator relaying the same row gets nothing to send. ``throttle``
    takes one of this process's calls to the provider, or refuses (then the
    row is left for the relay). The send runs on a thread of its own: past
    ``budget_seconds`` the caller goes on and the send finishes under its lease.
    """
    done = threading.Event()

    def send() -> None:
        try:
            if not throttle(provider_name):
                return
            lease_until = utcnow() + timedelta(seconds=ctx.settings.call_lease_seconds)
            t = outbox_table
            claimed = claim_rows(
                ctx.engine,
                select(t.c.id).where(
                    t.c.event_id == event_id, t.c.status == OutboxStatus.PENDING, t.c.next_attempt_at <= utcnow()
                ),
                t,
                t.c.next_attempt_at,
                lease_until,
            )
            if claimed:
                relay_charge(ctx, claimed[0].id, provider_name, lease_until)
        except Exception:  # noqa: BLE001 - the row stays with the relay, which sends it when the lease runs out
            log.warning("inline charge of %s failed; left to the relay", event_id, exc_info=True)
        finally:
            done.set()

    threading.Thread(target=send, name=f"charge-inline-{event_id}", daemon=True).start()
    return done.wait(budget_seconds)


def _prepare(
    ctx: Context,
    outbox_id: int,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
) -> Result | tuple[int, dict[str, Any], bool, datetime | None]:
    now = utcnow()
    with ctx.engine.begin() as conn:
        row = conn.execute(_LOCK_OUTBOX, {"p_outbox_id": outbox_id}).first()
        if row is None or row.status != OutboxStatus.PENDING or row.next_attempt_at != lease_until:
            return Result.SKIPPED  # done, or our lease ran out and another worker holds the row now
        payment_id = json.loads(row.payload)["payment_id"]
        current = lock_payment(conn, payment_id)
        if current is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no payment {payment_id}")
            return Result.SKIPPED
        if PaymentStatus(current["status"]) in TERMINAL:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"payment already {current['status']}")
            return Result.SKIPPED
        if provider is None or provider.name != current["provider"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no adapter for {current['provider']}")
            review(conn, current, "unknown_provider", f"no adapter registered for {current['provider']}", now)
            return Result.REVIEW
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, "deadline passed before the charge was confirmed")
            review(conn, current, "unresolved_payment", "deadline passed before the charge was sent or confirmed", now)
            return Result.REVIEW
        previous = last_charge_call(conn, payment_id)
        # A re-send: an earlier send may have charged (its answer lost or unclear). One the provider refused
        # (Failed, e.g. our credentials) charged nothing, and the next send is as good as a first one.
        resend = previous is not None and previous.outcome != "Failed"
        outlived = resend and key_outlived(ctx.settings, provider, current, now)
        if resend and (not provider.capabilities.may_resend or outlived):
            # A charge may already be on its way or done, and this provider would take a re-send as a second one
            # (it does not dedupe, or may have forgotten the key).
            why = KEY_OUTLIVED if outlived else "provider does not dedupe"
            if provider.capabilities.query_by_merchant_id:
                hold_for_query(ctx, conn, current, previous.id, now)
                _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; queried")
                return Result.NOT_RESENT
            give_up_ambiguous(conn, current, previous.id, now, "earlier charge call has no recorded outcome")
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; cannot be queried")
            return Result.REVIEW
        if gate.admission == breaker.Admission.DENY:
            retry_at = max(gate.snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            conn.execute(
                update(outbox_table)
                .where(outbox_table.c.id == outbox_id)
                .values(next_attempt_at=retry_at, updated_at=now)
            )
            return Result.DEFERRED
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="charge",
            params=charge_params(current),
            now=now,
            payment_id=payment_id,
            idempotency_key=current["idempotency_key"],
        )
        decision = decide(PaymentStatus(current["status"]), PaymentStatus.PENDING)
        if decision.verdict == Verdict.APPLY:
            apply_decision(conn, "payment", current, decision, source=f"call:{call_id}", now=now)
        # The lease now covers the call itself, however long the wait for the rate limiter was.
        lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(_LEASE_FOR_CALL, {"p_outbox_id": outbox_id, "next_attempt_at": lease, "updated_at": now})
    # The previous call, a 429 included: a later time than the last send that reached the provider only makes a
    # lookup by our number more careful.
    return call_id, current, resend, previous.started_at if previous is not None else None


def apply_call(
    ctx: Context,
    outbox_id: int,
    call_id: int,
    lock: Callable[[Connection], Mapping[str, Any] | None],
    provider: Provider,
    outcome: QueryOutcome,
    resend: bool,
) -> Result:
    """Record the call's outcome and apply it to the payment or refund ``lock`` locks and reads, in one transaction.

    A failure that is not definitive leaves the outbox row to retry after a backoff; anything else goes through
    the state machine (``apply_outcome``) and finishes the row.
    """
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = lock(conn)
        if isinstance(outcome, Failed) and not outcome.definitive:
            s = ctx.settings
            attempts = conn.execute(select(outbox_table.c.attempts).where(outbox_table.c.id == outbox_id)).scalar()
            delay = compute_backoff(max(1, attempts or 0), s.retry_base_seconds, s.retry_max_seconds)
            conn.execute(
                update(outbox_table)
                .where(outbox_table.c.id == outbox_id, outbox_table.c.status == OutboxStatus.PENDING)
                .values(
                    next_attempt_at=now + timedelta(seconds=delay),
                    last_error=f"{outcome.code} (not definitive)"[:500],
                    updated_at=now,
                )
            )
            return Result.RETRY
        result = apply_outcome(ctx, conn, current, provider, outcome, f"call:{call_id}", now, resend=resend)
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, None)
    return result


def charge_params(current: Mapping[str, Any]) -> dict[str, Any]:
    """The business fields of a charge call, as its provider_call row's request digest covers them."""
    return {
        "merchant_transaction_id": current["payment_id"],
        "amount": int(current["amount_minor"]),
        "currency": current["currency"],
    }


def _finish_outbox(conn: Connection, outbox_id: int, now: datetime, status: OutboxStatus, error: str | None) -> None:
    conn.execute(
        _UPDATE_OUTBOX,
        {"p_outbox_id": outbox_id, "status": status, "last_error": error[:500] if error else None, "updated_at": now},
    )


def relay_refund(
    ctx: Context, outbox_id: int, provider_name: str, lease_until: datetime, db_turn: Turn = nullcontext
) -> Result:
    """Send one claimed RefundRequested row to its provider and apply the answer, as ``relay_charge`` does a charge.

    The refund goes out under its own fixed idempotency key (``refund.idempotency_key``)
    and our refund number; an answer whose outcome is lost leaves the refund
    Unknown for the query job, which looks it up by our refund number.
    """
    provider = ctx.providers.get(provider_name)
    with db_turn():
        gate = admission(ctx, provider)
        prepared: Result | tuple[int, dict[str, Any], RefundRequest, bool] = Result.SKIPPED
        try:
            prepared = _prepare_refund(ctx, outbox_id, lease_until, provider, gate)
        finally:
            if isinstance(prepared, Result):
                release(ctx, provider, gate)
    if isinstance(prepared, Result):
        return prepared
    call_id, current, request, resend = prepared
    outcome = provider.refund(request, current["idempotency_key"], ctx.settings.provider_timeout_seconds)
    failpoints.hit("relay.after_provider_call")
    with db_turn():
        lock = partial(lock_refund, refund_id=current["refund_id"])
        result = apply_call(ctx, outbox_id, call_id, lock, provider, outcome, resend)
        count(ctx, provider, outcome, gate)
    return result


def _prepare_refund(
    ctx: Context,
    outbox_id: int,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
) -> Result | tuple[int, dict[str, Any], RefundRequest, bool]:
    now = utcnow()
    with ctx.engine.begin() as conn:
        row = conn.execute(_LOCK_OUTBOX, {"p_outbox_id": outbox_id}).first()
        if row is None or row.status != OutboxStatus.PENDING or row.next_attempt_at != lease_until:
            return Result.SKIPPED
        refund_id = json.loads(row.payload)["refund_id"]
        current = lock_refund(conn, refund_id)
        if current is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no refund {refund_id}")
            return Result.SKIPPED
        if PaymentStatus(current["status"]) in TERMINAL:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"refund already {current['status']}")
            return Result.SKIPPED
        if provider is None or provider.name != current["provider"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no adapter for {current['provider']}")
            review(conn, current, "unknown_provider", f"no adapter registered for {current['provider']}", now)
            return Result.REVIEW
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, "deadline passed before the refund was confirmed")
            review(conn, current, "unresolved_refund", "deadline passed before the refund was sent or confirmed", now)
            return Result.REVIEW
        request = refund_request(conn, current)
        if request is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no payment {current['payment_id']}")
            review(conn, current, "unresolved_refund", "the refunded payment is missing", now)
            return Result.REVIEW
        previous = last_refund_call(conn, refund_id)
        resend = previous is not None and previous.outcome != "Failed"
        outlived = resend and key_outlived(ctx.settings, provider, current, now)
        if resend and (not provider.capabilities.may_resend or outlived):
            why = KEY_OUTLIVED if outlived else "provider does not dedupe"
            if provider.capabilities.query_by_merchant_id:
                hold_for_query(ctx, conn, current, previous.id, now)
                _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; queried")
                return Result.NOT_RESENT
            give_up_ambiguous(conn, current, previous.id, now, "earlier refund call has no recorded outcome")
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; cannot be queried")
            return Result.REVIEW
        if gate.admission == breaker.Admission.DENY:
            retry_at = max(gate.snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            conn.execute(
                update(outbox_table)
                .where(outbox_table.c.id == outbox_id)
                .values(next_attempt_at=retry_at, updated_at=now)
            )
            return Result.DEFERRED
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="refund",
            params={
                "merchant_refund_id": refund_id,
                "charge": request.provider_transaction_id,
                "amount": request.amount_minor,
                "currency": request.currency,
            },
            now=now,
            payment_id=current["payment_id"],
            refund_id=refund_id,
            idempotency_key=current["idempotency_key"],
        )
        decision = decide(PaymentStatus(current["status"]), PaymentStatus.PENDING)
        if decision.verdict == Verdict.APPLY:
            apply_decision(conn, "refund", current, decision, source=f"call:{call_id}", now=now)
        lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(_LEASE_FOR_CALL, {"p_outbox_id": outbox_id, "next_attempt_at": lease, "updated_at": now})
    return call_id, current, request, resend
