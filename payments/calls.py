"""What the relay (``payments/relay.py``) and the query job (``payments/query.py``) share.

Both call a provider about one payment in three steps, and a crash between
any two is harmless:

1. **Prepare** (one short transaction): lock the payment, decide whether a
   call may go out at all (deadline, capabilities, circuit breaker) and
   record the ``provider_call`` row, committed before the request leaves, so
   the call is on file even if we die.
2. **Call** the adapter outside any transaction: a slow provider never holds
   a database lock.
3. **Apply** (one transaction): ``apply_outcome`` below, with the
   provider_call row completed in the same transaction.

This module holds the step's context and result, the breaker's admission and
count, and ``apply_outcome``: the outcome through ``states.decide`` and
``transitions.apply_decision``. Unknown never becomes Failed (invariant 5):
it moves the payment to Unknown and schedules a query. A refund goes through
the same steps (``kind="refund"``: its row, locked by ``lock_refund``, has
the same status, query and deadline columns as a payment's).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, Engine, Row, and_, bindparam, or_, select, update

from payments import breaker, provider_calls, query_schedule
from payments.db import utcnow
from payments.providers.base import (
    REVIEW_PREFIX,
    Dedupe,
    Failed,
    Mismatch,
    Pending,
    Provider,
    QueryOutcome,
    RefundRequest,
    Unknown,
    is_answer,
    reported_status,
)
from payments.review import Escalation, escalate
from payments.schema import payment, provider_call, refund
from payments.settings import Settings
from payments.states import TERMINAL, Decision, PaymentStatus, Verdict, decide
from payments.transitions import TARGETS, Kind, apply_decision

log = logging.getLogger("paysync.calls")


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
    NOT_RESENT = "not_resent"
    """An earlier send's outcome is lost and the provider does not dedupe: left Unknown for the query job."""


@dataclass(frozen=True)
class Context:
    """What a relay or query step needs: the engine, the adapters and the settings."""

    engine: Engine
    providers: Mapping[str, Provider]
    settings: Settings

    @property
    def probe_seconds(self) -> float:
        """How long one probe holds the breaker's probe slot."""
        return self.settings.provider_timeout_seconds + 5.0


def query_delay(settings: Settings, attempt: int) -> float:
    """Seconds before query number ``attempt`` (1-based): ``payments.query_schedule`` with the settings' figures."""
    return query_schedule.query_delay(settings, attempt)


def admission(ctx: Context, provider: Provider | None) -> breaker.Gate:
    """The breaker's say on calling ``provider`` now (ALLOW when there is no provider to call).

    A PROBE gate holds the breaker's one probe slot: the caller either makes
    the call and ``count``s it, or ``release``s the slot.
    """
    if provider is None:
        return breaker.Gate()
    return breaker.admit(ctx.engine, provider.name, utcnow(), ctx.probe_seconds)


def release(ctx: Context, provider: Provider | None, gate: breaker.Gate) -> None:
    """No call was made after all (skipped, reviewed, deferred, failed): give a probe slot back at once."""
    if provider is None or not gate.probe:
        return
    try:
        breaker.release(ctx.engine, provider.name, gate, utcnow())
    except Exception:  # noqa: BLE001 - the slot expires on its own; the breaker is advisory
        log.warning("could not release the probe slot of %s", provider.name, exc_info=True)


def count(
    ctx: Context, provider: Provider, outcome: QueryOutcome, gate: breaker.Gate, db_turn: breaker.Turn = nullcontext
) -> None:
    """Tell the breaker how the call went (its own transaction, within ``db_turn()``, after the outcome is applied).

    Only the call that held the probe slot counts as a probe: a failed probe
    reopens the breaker for longer. Other calls while open (the query
    budget's) count as failures or as healthy answers, never as probes.
    """
    try:
        breaker.record(
            ctx.engine,
            provider.name,
            healthy=is_answer(outcome),
            probe=gate.probe,
            snapshot=gate.snapshot,
            settings=ctx.settings,
            now=utcnow(),
            turn=db_turn,
        )
    except Exception:  # noqa: BLE001 - the breaker is advisory; the payment's state is already safe
        log.warning("could not update the circuit breaker for %s", provider.name, exc_info=True)


# The relay's and the query job's statements on every call, built once: building a statement and its cache key
# anew each time cost as much interpreter time as executing it.
_LOCK_PAYMENT = select(payment).where(payment.c.payment_id == bindparam("p_payment_id")).with_for_update()
_LOCK_REFUND = select(refund).where(refund.c.refund_id == bindparam("p_refund_id")).with_for_update()
_LAST_CALL = select(
    provider_call.c.id, provider_call.c.started_at, provider_call.c.finished_at, provider_call.c.outcome
).order_by(provider_call.c.id.desc())
_LAST_CHARGE_CALL = _LAST_CALL.where(
    provider_call.c.payment_id == bindparam("p_payment_id"), provider_call.c.operation == "charge"
).limit(1)
_LAST_REFUND_CALL = _LAST_CALL.where(
    provider_call.c.refund_id == bindparam("p_refund_id"), provider_call.c.operation == "refund"
).limit(1)
# A 429 (rate limited, or Stripe's lock_timeout) is a provider turning the request away before doing anything;
# a withdrawn call (provider_calls.withdraw) never left. Spelled out for NULLs: a call in flight has no outcome.
_MAY_HAVE_REACHED = and_(
    or_(provider_call.c.http_status.is_(None), provider_call.c.http_status != 429),
    or_(
        provider_call.c.outcome.is_(None),
        provider_call.c.outcome != "Failed",
        provider_call.c.http_status.is_not(None),
        provider_call.c.error_code.is_(None),
        provider_call.c.error_code.not_like(f"{provider_calls.NOT_SENT_PREFIX}%"),
    ),
)
_LAST_CHARGE_SEND = _LAST_CHARGE_CALL.where(_MAY_HAVE_REACHED)
_LAST_REFUND_SEND = _LAST_REFUND_CALL.where(_MAY_HAVE_REACHED)


def lock_payment(conn: Connection, payment_id: str) -> dict[str, Any] | None:
    """The payment row, locked FOR UPDATE until the caller's transaction ends; None if there is none."""
    row = conn.execute(_LOCK_PAYMENT, {"p_payment_id": payment_id}).mappings().first()
    return dict(row) if row is not None else None


def lock_refund(conn: Connection, refund_id: str) -> dict[str, Any] | None:
    """The refund row, locked FOR UPDATE until the caller's transaction ends; None if there is none."""
    row = conn.execute(_LOCK_REFUND, {"p_refund_id": refund_id}).mappings().first()
    return dict(row) if row is not None else None


def kind_of(current: Mapping[str, Any]) -> Kind:
    """ "refund" for a refund row, "payment" for a payment row."""
    return "refund" if "refund_id" in current else "payment"


def refund_request(conn: Connection, current: Mapping[str, Any]) -> RefundRequest | None:
    """What the provider is sent for the refund ``current``: our numbers, the charge's id and the amounts."""
    charge = conn.execute(
        select(payment.c.provider_transaction_id, payment.c.amount_minor).where(
            payment.c.payment_id == current["payment_id"]
        )
    ).first()
    if charge is None:
        return None
    return RefundRequest(
        current["refund_id"],
        current["payment_id"],
        charge.provider_transaction_id or "",
        int(current["amount_minor"]),
        current["currency"],
        payment_amount_minor=int(charge.amount_minor),
    )


def last_refund_call(conn: Connection, refund_id: str) -> Row | None:
    """The latest refund call recorded for a refund (id, started_at, outcome), or None if it was never sent."""
    return conn.execute(_LAST_REFUND_CALL, {"p_refund_id": refund_id}).first()


def last_charge_call(conn: Connection, payment_id: str) -> Row | None:
    """The latest charge call recorded for a payment (id, started_at, outcome), or None if it was never sent."""
    return conn.execute(_LAST_CHARGE_CALL, {"p_payment_id": payment_id}).first()


def last_refund_send(conn: Connection, refund_id: str) -> Row | None:
    """As ``last_refund_call``, leaving out calls that cannot have reached the provider (a 429, a withdrawn call)."""
    return conn.execute(_LAST_REFUND_SEND, {"p_refund_id": refund_id}).first()


def last_charge_send(conn: Connection, payment_id: str) -> Row | None:
    """As ``last_charge_call``, leaving out calls that cannot have reached the provider (a 429, a withdrawn call)."""
    return conn.execute(_LAST_CHARGE_SEND, {"p_payment_id": payment_id}).first()


def key_outlived(settings: Settings, provider: Provider, current: Mapping[str, Any], now: datetime) -> bool:
    """True when the payment's (or refund's) idempotency key may be forgotten by its provider: never re-send it.

    Only a provider that dedupes by key forgets (Stripe after about 24 hours: then the same key is a new
    charge); one that dedupes by our number keeps it. Counted from the row's creation, which no use of its key
    precedes, so the key is never younger at the provider than here.
    """
    if provider.capabilities.dedupe != Dedupe.KEY:
        return False
    return now >= current["created_at"] + timedelta(seconds=settings.provider_key_lifetime_seconds)


KEY_OUTLIVED = "its idempotency key is past PROVIDER_KEY_LIFETIME_SECONDS"
"""Why a payment (or refund) whose key the provider may have forgotten is not sent again."""


def reach_ends(settings: Settings, call: Row) -> datetime:
    """The last moment a recorded send could have reached its provider: when its call ended.

    A call with no recorded end (in flight, or its process died) is over by
    its lease: the relay renews the lease for the call when it goes out.
    """
    if call.finished_at is not None:
        return call.finished_at
    return call.started_at + timedelta(seconds=settings.call_lease_seconds)


@dataclass(frozen=True)
class Assessment:
    """What an outcome means for the payment (or refund) it is about, before anything is written (``assess``)."""

    decision: Decision
    report: PaymentStatus
    contradiction: str | None
    """Why the answer contradicts what we hold (escalated, never applied), or None."""
    needs_review: str | None
    """An Unknown a person should hear about (``REVIEW_PREFIX``), or None."""
    values: dict[str, Any]
    """Columns an unresolved outcome sets beside the status (next query, attempts, QR code)."""
    reference: str | None
    """The provider's id for the charge or refund, as the outcome gives it."""
    failure_code: str | None


def assess(
    settings: Settings,
    current: Mapping[str, Any],
    provider: Provider,
    outcome: QueryOutcome,
    now: datetime,
    *,
    query: bool = False,
    resend: bool = False,
) -> Assessment:
    """Work out what ``outcome`` does to the row ``current`` (pure; ``apply_outcome`` writes it)."""
    kind = kind_of(current)
    status = PaymentStatus(current["status"])
    reference = getattr(outcome, "provider_transaction_id", None)
    known = current[TARGETS[kind].provider_ref.name]
    needs_review = None
    if isinstance(outcome, Unknown) and outcome.reason.startswith(REVIEW_PREFIX):
        needs_review = outcome.reason
    report = reported_status(outcome, resend=resend) or PaymentStatus.UNKNOWN
    decision = decide(status, report)
    if isinstance(outcome, Mismatch):
        contradiction = f"provider's {kind} is for another amount or currency than ours ({outcome.reason})"
    elif reference and known and reference != known:
        contradiction = f"provider reports {kind} {reference}, we have {known}"
    elif decision.verdict == Verdict.CONFLICT:
        contradiction = decision.reason
    else:
        contradiction = None
    values: dict[str, Any] = {}
    if report in (PaymentStatus.PENDING, PaymentStatus.UNKNOWN):
        attempts = current["query_attempts"] + (1 if query else 0)
        if report == PaymentStatus.PENDING and not query:
            delay = settings.query_pending_after_seconds
        else:
            delay = query_delay(settings, attempts + 1)
        values = {"next_query_at": now + timedelta(seconds=delay), "query_attempts": attempts}
        if report == PaymentStatus.UNKNOWN and not provider.capabilities.query_by_merchant_id:
            values["next_query_at"] = None
    if isinstance(outcome, Pending) and outcome.qr_code and kind == "payment":
        values["qr_code"] = outcome.qr_code  # shown by GET /payments/<id> until the payer scans it
    failure_code = outcome.code if isinstance(outcome, Failed) and report == PaymentStatus.FAILED else None
    return Assessment(decision, report, contradiction, needs_review, values, reference, failure_code)


def apply_outcome(
    ctx: Context,
    conn: Connection,
    current: Mapping[str, Any],
    provider: Provider,
    outcome: QueryOutcome,
    source: str,
    now: datetime,
    *,
    query: bool = False,
    resend: bool = False,
) -> Result:
    """Apply one call's or query's outcome to the locked payment (or refund) ``current``, in ``conn``.

    ``query``: the outcome is a query's answer; ``resend``: a charge's (or
    refund's) answer on a re-send (see ``reported_status``).

    An answer that contradicts what we hold (a Mismatch, another transaction
    id, a report against a terminal state) is escalated, once per payment,
    and an unresolved payment is then looked at again only after a query
    backoff: a conflicting answer never loops (invariant 13).
    """
    kind = kind_of(current)
    table, ref_column = TARGETS[kind].table, TARGETS[kind].provider_ref.name
    status = PaymentStatus(current["status"])
    seen = assess(ctx.settings, current, provider, outcome, now, query=query, resend=resend)
    if seen.needs_review is not None:
        # Still resolved by query like any Unknown; a person is told once per payment.
        review(conn, current, "provider_answer_needs_review", f"{source}: {seen.needs_review}", now)
    if seen.contradiction is not None:
        conflict(conn, current, seen.contradiction, source, now)
        if status not in TERMINAL:
            # Looked at again after a backoff, like any unresolved payment; never as soon as the lease ends.
            attempts = current["query_attempts"] + (1 if query else 0)
            conn.execute(
                update(table)
                .where(table.c.id == current["id"])
                .values(
                    next_query_at=now + timedelta(seconds=query_delay(ctx.settings, attempts + 1)),
                    query_attempts=attempts,
                    updated_at=now,
                )
            )
        return Result.REVIEW

    if seen.decision.verdict == Verdict.NOOP:
        if status in TERMINAL:
            return Result.UNCHANGED
        values = dict(seen.values)
        if seen.reference and not current[ref_column]:
            values[ref_column] = seen.reference
        if values:
            values["updated_at"] = now
            conn.execute(update(table).where(table.c.id == current["id"]).values(**values))
        return Result.UNCHANGED

    target = apply_decision(
        conn,
        kind,
        current,
        seen.decision,
        source=source,
        now=now,
        provider_reference=seen.reference,
        failure_code=seen.failure_code,
        values=seen.values,
        details={"outcome": type(outcome).__name__},
    )
    if target == PaymentStatus.UNKNOWN and not provider.capabilities.query_by_merchant_id:
        # Already Unknown with no query scheduled (see assess): a person and reconciliation decide.
        reason = f"outcome unknown ({getattr(outcome, 'reason', '')}); cannot be queried, reconcile by hand"
        review(conn, current, "unresolved_not_resendable", reason, now)
        return Result.REVIEW
    return Result.APPLIED


def hold_for_query(ctx: Context, conn: Connection, current: Mapping[str, Any], call_id: int, now: datetime) -> None:
    """Mark a payment (or refund) whose call's outcome was lost Unknown (if it is not already); schedule its query."""
    kind = kind_of(current)
    table = TARGETS[kind].table
    delay = query_delay(ctx.settings, current["query_attempts"] + 1)
    values = {"next_query_at": now + timedelta(seconds=delay)}
    decision = decide(PaymentStatus(current["status"]), PaymentStatus.UNKNOWN)
    if decision.verdict == Verdict.APPLY:
        apply_decision(conn, kind, current, decision, source=f"call:{call_id}", now=now, values=values)
    else:
        conn.execute(update(table).where(table.c.id == current["id"]).values(updated_at=now, **values))


def give_up_ambiguous(
    conn: Connection, current: Mapping[str, Any], call_id: int | None, now: datetime, reason: str
) -> None:
    """Mark an ambiguous payment (or refund) Unknown (if it is not already) and hand it to the manual queue, once."""
    kind = kind_of(current)
    table = TARGETS[kind].table
    status = PaymentStatus(current["status"])
    decision = decide(status, PaymentStatus.UNKNOWN)
    if decision.verdict == Verdict.APPLY:
        source = f"call:{call_id}" if call_id else (current["status_source"] or "relay")
        apply_decision(conn, kind, current, decision, source=source, now=now, values={"next_query_at": None})
    else:
        conn.execute(update(table).where(table.c.id == current["id"]).values(next_query_at=None))
    review(conn, current, "unresolved_not_resendable", f"{reason}; not re-sent automatically, reconcile by hand", now)


def _subject(current: Mapping[str, Any]) -> tuple[str, str]:
    """(what, its number): ("payment", payment_id) or ("refund", refund_id)."""
    kind = kind_of(current)
    return kind, current[TARGETS[kind].key.name]


def review(conn: Connection, current: Mapping[str, Any], kind: str, reason: str, now: datetime) -> Escalation:
    """Hand the payment (or refund) to a person (once per subject and kind, with one alert; ``review.escalate``)."""
    what, number = _subject(current)
    return escalate(
        conn,
        kind=kind,
        subject=f"{what}:{number}",
        alert_key=f"{kind}:{number}",
        reason=f"{what} {number} needs a person: {reason}",
        now=now,
        payment_id=current["payment_id"],
        refund_id=current.get("refund_id"),
        details={"status": current["status"], "provider": current["provider"]},
    )


def conflict(conn: Connection, current: Mapping[str, Any], reason: str, source: str, now: datetime) -> Escalation:
    """A provider's answer contradicts what we hold: one manual review and one critical alert per payment/refund."""
    what, number = _subject(current)
    return escalate(
        conn,
        kind="conflicting_report",
        subject=f"{what}:{number}",
        reason=f"conflicting report for {what} {number} ({source}): {reason}",
        now=now,
        severity="critical",
        payment_id=current["payment_id"],
        refund_id=current.get("refund_id"),
        details={"source": source, "our_status": current["status"]},
    )
