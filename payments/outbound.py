"""Calling the provider for a payment: send a ChargeRequested, query an unresolved payment.

Both follow the same three steps, and a crash between any two is harmless:

1. **Prepare** (one short transaction): lock the payment, decide whether a
   call may go out at all (deadline, capabilities, circuit breaker), record
   the ``provider_call`` row and, for a first send, move Created → Pending.
   Committed before the request leaves, so the call is on file even if we die.
2. **Call** the adapter with the payment's fixed idempotency key (invariant 6),
   outside any transaction: a slow provider never holds a database lock.
3. **Apply** (one transaction): the outcome through ``states.decide`` and
   ``transitions.apply_decision``, the provider_call row completed, and the
   outbox row marked done, together. If we die before this commits, the
   outbox row's lease runs out and the relay sends the same key again; the
   provider replays its first answer.

Unknown never becomes Failed (invariant 5): it moves the payment to Unknown
and schedules a query. A provider that can neither dedupe by key nor be
queried by our number is never sent the same payment twice: an ambiguous
outcome goes to the manual queue.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, Engine, and_, exists, func, or_, select, update

from payments import alerts, breaker, failpoints, outbox, provider_calls
from payments.backoff import compute_backoff
from payments.charges import CHARGE_REQUESTED
from payments.db import utcnow
from payments.providers.base import (
    AMOUNT_MISMATCH,
    ChargeRequest,
    Failed,
    NotFound,
    Pending,
    Provider,
    QueryOutcome,
    Succeeded,
    Unknown,
)
from payments.review import open_review
from payments.schema import manual_review, payment, provider_call
from payments.schema import outbox as outbox_table
from payments.settings import Settings
from payments.states import TERMINAL, OutboxStatus, PaymentStatus, ReviewStatus, Verdict, decide
from payments.transitions import apply_decision

log = logging.getLogger("paysync.outbound")


class Result(StrEnum):
    """What one relay or query step did (for logs and tests)."""

    APPLIED = "applied"
    """The outcome moved the payment."""
    UNCHANGED = "unchanged"
    """Called; the outcome did not move the payment (Pending, stale, already applied)."""
    RETRY = "retry"
    """Not final; the outbox row comes back after a backoff."""
    DEFERRED = "deferred"
    """Not called: the provider's circuit breaker is open."""
    SKIPPED = "skipped"
    """Nothing to do (row done, payment final, another worker has it)."""
    REVIEW = "review"
    """Handed to the manual queue (deadline passed, or a re-send would be unsafe)."""
    RESEND = "resend"
    """Query found nothing: the charge was queued to be sent again with the same key."""


@dataclass(frozen=True)
class Context:
    """What a relay or query step needs: the engine, the adapters and the settings."""

    engine: Engine
    providers: Mapping[str, Provider]
    settings: Settings
    rng: random.Random | None = None

    @property
    def probe_seconds(self) -> float:
        """How long one probe holds the breaker's probe slot."""
        return self.settings.provider_timeout_seconds + 5.0


def query_delay(settings: Settings, attempt: int, rng: random.Random | None = None) -> float:
    """Seconds before query number ``attempt`` (1-based): exponential with jitter."""
    return compute_backoff(max(1, attempt), settings.query_base_seconds, settings.query_max_seconds, rng)


# --------------------------------------------------------------------------------------------- relay


def relay_charge(ctx: Context, outbox_id: int, provider_name: str) -> Result:
    """Send one claimed ChargeRequested row to its provider and apply the answer (module docstring).

    ``provider_name`` comes from the row's payload (read by the claim), so the
    breaker is consulted before any row lock is taken.
    """
    provider = ctx.providers.get(provider_name)
    snapshot, admission = _admission(ctx, provider)
    prepared = _prepare_charge(ctx, outbox_id, provider, snapshot, admission)
    if isinstance(prepared, Result):
        return prepared
    call_id, current = prepared
    outcome = provider.charge(
        ChargeRequest(current["payment_id"], int(current["amount_minor"]), current["currency"]),
        current["idempotency_key"],
        ctx.settings.provider_timeout_seconds,
    )
    failpoints.hit("relay.after_provider_call")
    result = _apply_charge(ctx, outbox_id, call_id, current["payment_id"], provider, outcome)
    _count(ctx, provider, outcome, admission, snapshot)
    return result


def _admission(ctx: Context, provider: Provider | None) -> tuple[breaker.Snapshot, breaker.Admission]:
    if provider is None:
        return breaker.Snapshot(), breaker.Admission.ALLOW
    snapshot = breaker.read(ctx.engine, provider.name)
    return snapshot, breaker.admit(ctx.engine, provider.name, snapshot, utcnow(), ctx.probe_seconds)


def _prepare_charge(
    ctx: Context,
    outbox_id: int,
    provider: Provider | None,
    snapshot: breaker.Snapshot,
    admission: breaker.Admission,
) -> Result | tuple[int, dict[str, Any]]:
    now = utcnow()
    with ctx.engine.begin() as conn:
        row = conn.execute(select(outbox_table).where(outbox_table.c.id == outbox_id).with_for_update()).first()
        if row is None or row.status != OutboxStatus.PENDING:
            return Result.SKIPPED
        payment_id = json.loads(row.payload)["payment_id"]
        current = _lock_payment(conn, payment_id)
        if current is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no payment {payment_id}")
            return Result.SKIPPED
        if PaymentStatus(current["status"]) in TERMINAL:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"payment already {current['status']}")
            return Result.SKIPPED
        if provider is None or provider.name != current["provider"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no adapter for {current['provider']}")
            _review(conn, current, "unknown_provider", f"no adapter registered for {current['provider']}", now)
            return Result.REVIEW
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, "deadline passed before the charge was confirmed")
            _review(conn, current, "unresolved_payment", "deadline passed before the charge was sent or confirmed", now)
            return Result.REVIEW
        previous = _last_charge_call(conn, payment_id)
        if previous is not None and not provider.capabilities.safe_to_resend:
            # A charge may already be on its way or done; without keys or queries a re-send could charge twice.
            _give_up_ambiguous(conn, current, previous, now, "earlier charge call has no recorded outcome")
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, "not re-sent: provider cannot dedupe or be queried")
            return Result.REVIEW
        if admission == breaker.Admission.DENY:
            retry_at = max(snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
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
            params=_charge_params(current),
            now=now,
            payment_id=payment_id,
            idempotency_key=current["idempotency_key"],
        )
        decision = decide(PaymentStatus(current["status"]), PaymentStatus.PENDING)
        if decision.verdict == Verdict.APPLY:
            apply_decision(conn, "payment", current, decision, source=f"call:{call_id}", now=now)
        conn.execute(
            update(outbox_table)
            .where(outbox_table.c.id == outbox_id)
            .values(attempts=outbox_table.c.attempts + 1, updated_at=now)
        )
    return call_id, current


def _apply_charge(
    ctx: Context, outbox_id: int, call_id: int, payment_id: str, provider: Provider, outcome: QueryOutcome
) -> Result:
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = _lock_payment(conn, payment_id)
        row = conn.execute(
            select(outbox_table.c.status, outbox_table.c.attempts).where(outbox_table.c.id == outbox_id)
        ).first()
        if isinstance(outcome, Failed) and not outcome.definitive:
            s = ctx.settings
            delay = compute_backoff(max(1, row.attempts), s.retry_base_seconds, s.retry_max_seconds, ctx.rng)
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
        result = _apply_outcome(ctx, conn, current, provider, outcome, f"call:{call_id}", now)
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, None)
    return result


# --------------------------------------------------------------------------------------------- query


def query_payment(ctx: Context, payment_id: str, provider_name: str, *, budget_ok: bool = False) -> Result:
    """Query one claimed Unknown (or long-Pending) payment by our number and act on the answer.

    ``budget_ok``: the caller's query budget allows a query even while the
    provider's breaker is open (the answer then counts as a probe).
    """
    provider = ctx.providers.get(provider_name)
    capable = provider is not None and provider.capabilities.query_by_merchant_id
    snapshot, admission = _admission(ctx, provider if capable else None)
    now = utcnow()
    with ctx.engine.begin() as conn:
        current = _lock_payment(conn, payment_id)
        if current is None or PaymentStatus(current["status"]) not in (PaymentStatus.UNKNOWN, PaymentStatus.PENDING):
            return Result.SKIPPED
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            _review(conn, current, "unresolved_payment", f"still {current['status']} at its deadline", now)
            conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=None))
            return Result.REVIEW
        if not capable:
            previous = _last_charge_call(conn, payment_id)
            _give_up_ambiguous(conn, current, previous, now, "provider cannot be queried by our number")
            return Result.REVIEW
        if admission == breaker.Admission.DENY and not budget_ok:
            retry_at = max(snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=retry_at))
            return Result.DEFERRED
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation="query",
            params={"merchant_transaction_id": payment_id},
            now=now,
            payment_id=payment_id,
        )
    expected = ChargeRequest(current["payment_id"], int(current["amount_minor"]), current["currency"])
    outcome = provider.query(payment_id, ctx.settings.provider_timeout_seconds, expected)
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = _lock_payment(conn, payment_id)
        if isinstance(outcome, NotFound):
            result = _not_found(ctx, conn, current, provider, now)
        else:
            result = _apply_outcome(ctx, conn, current, provider, outcome, f"query:{call_id}", now, query=True)
    _count(ctx, provider, outcome, breaker.Admission.PROBE if budget_ok else admission, snapshot)
    return result


def _not_found(ctx: Context, conn: Connection, current: Mapping[str, Any], provider: Provider, now: datetime) -> Result:
    """The provider never saw the charge: send it again with the same key, if that is safe."""
    attempts = current["query_attempts"] + 1
    values = {"query_attempts": attempts, "next_query_at": now + timedelta(seconds=query_delay(ctx.settings, attempts))}
    conn.execute(update(payment).where(payment.c.id == current["id"]).values(**values))
    if PaymentStatus(current["status"]) in TERMINAL:
        return Result.UNCHANGED
    if not provider.capabilities.safe_to_resend:
        _give_up_ambiguous(conn, current, None, now, "query found nothing and the provider cannot dedupe a re-send")
        return Result.REVIEW
    queued = conn.execute(
        select(
            exists().where(
                outbox_table.c.aggregate_id == current["payment_id"],
                outbox_table.c.event_type == CHARGE_REQUESTED,
                outbox_table.c.status == OutboxStatus.PENDING,
            )
        )
    ).scalar()
    if not queued:
        outbox.enqueue(
            conn,
            event_type=CHARGE_REQUESTED,
            aggregate_id=current["payment_id"],
            now=now,
            payload={"payment_id": current["payment_id"], "provider": current["provider"], "resend": True},
        )
    return Result.RESEND


# --------------------------------------------------------------------------------------------- shared


def _apply_outcome(
    ctx: Context,
    conn: Connection,
    current: Mapping[str, Any],
    provider: Provider,
    outcome: QueryOutcome,
    source: str,
    now: datetime,
    *,
    query: bool = False,
) -> Result:
    """Apply one call's or query's outcome to the locked payment ``current``, in ``conn``."""
    status = PaymentStatus(current["status"])
    reference = getattr(outcome, "provider_transaction_id", None)
    if isinstance(outcome, Unknown) and outcome.reason == AMOUNT_MISMATCH:
        # The provider holds a charge under our number for another amount: a human must look.
        _conflict(conn, current, "provider's charge is for another amount or currency than ours", source, now)
        return Result.REVIEW
    if isinstance(outcome, Succeeded):
        report = PaymentStatus.SUCCEEDED
    elif isinstance(outcome, Failed) and outcome.definitive:
        report = PaymentStatus.FAILED
    elif isinstance(outcome, Pending):
        report = PaymentStatus.PENDING
    else:  # Unknown, or a not-definitive failure seen by a query
        report = PaymentStatus.UNKNOWN
    known = current["provider_transaction_id"]
    if reference and known and reference != known:
        _conflict(conn, current, f"provider reports transaction {reference}, we have {known}", source, now)
        return Result.REVIEW
    decision = decide(status, report)
    if decision.verdict == Verdict.CONFLICT:
        _conflict(conn, current, decision.reason, source, now)
        return Result.REVIEW

    unresolved_values: dict[str, Any] = {}
    if report in (PaymentStatus.PENDING, PaymentStatus.UNKNOWN):
        attempts = current["query_attempts"] + (1 if query else 0)
        if report == PaymentStatus.PENDING and not query:
            delay = ctx.settings.query_pending_after_seconds
        else:
            delay = query_delay(ctx.settings, attempts + 1, ctx.rng)
        unresolved_values = {"next_query_at": now + timedelta(seconds=delay), "query_attempts": attempts}
        if report == PaymentStatus.UNKNOWN and not provider.capabilities.safe_to_resend:
            unresolved_values["next_query_at"] = None

    if decision.verdict == Verdict.NOOP:
        if status in TERMINAL:
            return Result.UNCHANGED
        values = dict(unresolved_values)
        if reference and not known:
            values["provider_transaction_id"] = reference
        if values:
            values["updated_at"] = now
            conn.execute(update(payment).where(payment.c.id == current["id"]).values(**values))
        return Result.UNCHANGED

    failure_code = outcome.code if isinstance(outcome, Failed) else None
    target = apply_decision(
        conn,
        "payment",
        current,
        decision,
        source=source,
        now=now,
        provider_reference=reference,
        failure_code=failure_code,
        values=unresolved_values,
        details={"outcome": type(outcome).__name__},
    )
    if target == PaymentStatus.UNKNOWN and not provider.capabilities.safe_to_resend:
        # Already Unknown with no query scheduled (unresolved_values): a person and reconciliation decide.
        reason = f"outcome unknown ({getattr(outcome, 'reason', '')}); not re-sent automatically, reconcile by hand"
        _review(conn, current, "unresolved_not_resendable", reason, now)
        return Result.REVIEW
    return Result.APPLIED


def _count(
    ctx: Context,
    provider: Provider,
    outcome: QueryOutcome,
    admission: breaker.Admission,
    snapshot: breaker.Snapshot,
) -> None:
    """Tell the breaker how the call went (its own transaction, after the outcome is safely applied)."""
    try:
        breaker.record(
            ctx.engine,
            provider.name,
            healthy=provider_calls.is_answer(outcome),
            probe=admission == breaker.Admission.PROBE,
            snapshot=snapshot,
            settings=ctx.settings,
            now=utcnow(),
            rng=ctx.rng,
        )
    except Exception:  # noqa: BLE001 - the breaker is advisory; the payment's state is already safe
        log.warning("could not update the circuit breaker for %s", provider.name, exc_info=True)


def _lock_payment(conn: Connection, payment_id: str) -> Mapping[str, Any] | None:
    row = conn.execute(select(payment).where(payment.c.payment_id == payment_id).with_for_update()).mappings().first()
    return dict(row) if row is not None else None


def _last_charge_call(conn: Connection, payment_id: str) -> int | None:
    return conn.execute(
        select(func.max(provider_call.c.id)).where(
            provider_call.c.payment_id == payment_id, provider_call.c.operation == "charge"
        )
    ).scalar()


def _charge_params(current: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "merchant_transaction_id": current["payment_id"],
        "amount": int(current["amount_minor"]),
        "currency": current["currency"],
    }


def _finish_outbox(conn: Connection, outbox_id: int, now: datetime, status: OutboxStatus, error: str | None) -> None:
    conn.execute(
        update(outbox_table)
        .where(outbox_table.c.id == outbox_id)
        .values(status=status, last_error=error[:500] if error else None, updated_at=now)
    )


def _give_up_ambiguous(
    conn: Connection, current: Mapping[str, Any], call_id: int | None, now: datetime, reason: str
) -> None:
    """Mark an ambiguous payment Unknown (if it is not already) and hand it to the manual queue, once."""
    status = PaymentStatus(current["status"])
    decision = decide(status, PaymentStatus.UNKNOWN)
    if decision.verdict == Verdict.APPLY:
        source = f"call:{call_id}" if call_id else (current["status_source"] or "relay")
        apply_decision(conn, "payment", current, decision, source=source, now=now, values={"next_query_at": None})
    else:
        conn.execute(update(payment).where(payment.c.id == current["id"]).values(next_query_at=None))
    _review(conn, current, "unresolved_not_resendable", f"{reason}; not re-sent automatically, reconcile by hand", now)


def _review(conn: Connection, current: Mapping[str, Any], kind: str, reason: str, now: datetime) -> None:
    """Open a manual_review row (once per payment and kind) and fire an alert."""
    already = conn.execute(
        select(
            exists().where(
                manual_review.c.payment_id == current["payment_id"],
                manual_review.c.kind == kind,
                manual_review.c.status == ReviewStatus.OPEN,
            )
        )
    ).scalar()
    if already:
        return
    review_id = open_review(
        conn,
        kind=kind,
        reason=f"payment {current['payment_id']}: {reason}",
        now=now,
        payment_id=current["payment_id"],
        details={"status": current["status"], "provider": current["provider"]},
    )
    alerts.observe(
        conn,
        rule=kind,
        key=f"{kind}:{current['payment_id']}",
        message=f"payment {current['payment_id']} needs a person: {reason}",
        now=now,
        details={"manual_review_id": review_id},
    )
    log.warning("payment %s to manual review: %s", current["payment_id"], reason)


def _conflict(conn: Connection, current: Mapping[str, Any], reason: str, source: str, now: datetime) -> None:
    review_id = open_review(
        conn,
        kind="conflicting_report",
        reason=f"{source}: {reason}",
        now=now,
        payment_id=current["payment_id"],
        details={"source": source, "our_status": current["status"]},
    )
    alerts.observe(
        conn,
        rule="conflicting_report",
        key=f"conflicting_report:payment:{current['payment_id']}",
        message=f"conflicting report for payment {current['payment_id']}: {reason}",
        now=now,
        severity="critical",
        details={"manual_review_id": review_id, "source": source},
    )


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
