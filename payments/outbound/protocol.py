"""The outbound protocol: every call paysync makes to a provider about one payment or refund, in one place.

A charge and a refund (sent by the relay from their outbox rows) and a query
(sent by ``query_unresolved`` for an Unknown or long-Pending row) go through
the same three steps, and a crash between any two is harmless:

1. **Prepare** (one short transaction): lock the row (the outbox row first,
   for a send), decide whether a call may go out at all (the lease is still
   ours, the deadline, the adapter's capabilities, the circuit breaker),
   record the ``provider_call`` row and, for a send, move Created → Pending
   and renew the lease for the call itself; committed before the request
   leaves, so the call is on file even if we die.
2. **Call** the adapter outside any transaction, with the row's fixed
   idempotency key (invariant 6): a slow provider never holds a database lock.
3. **Apply** (one transaction): complete the provider_call row and put the
   outcome through ``states.decide`` and ``transitions.apply_decision``
   (``apply_outcome``); a send's outbox row is finished in the same
   transaction. If we die before this commits, the lease runs out and the
   relay sends the same key again; the provider replays its first answer.

Unknown never becomes Failed (invariant 5): it moves the row to Unknown and
schedules a query. A call after an earlier one whose outcome was lost is a
re-send: its refusal (a 4xx) is Unknown, not a decline (``reported_status``).
Such a re-send goes only to a provider that dedupes it
(``Capabilities.may_resend``) and, if it dedupes by key, only while it still
keeps the key (``key_outlived``: PROVIDER_KEY_LIFETIME_SECONDS). Any other
provider never gets the same payment twice: the row is left Unknown for the
query job, or, if the provider cannot be queried either, goes to the manual
queue.

A query that finds the charge (or refund) applies it like a call's answer; a
NotFound sends it again under the same key, if the provider dedupes a
re-send and the last send is older than QUERY_NOT_FOUND_GRACE_SECONDS
(``_not_found``); still unresolved at the row's deadline → manual review and
an alert. A refund row has the same status, query and deadline columns as a
payment's, so one ``_Subject`` per kind is all that tells the two apart.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple

from sqlalchemy import Connection, Engine, Row, Table, and_, bindparam, exists, or_, select, update

from payments.escalation.review import Escalation, escalate
from payments.infra import failpoints
from payments.infra.backoff import compute_backoff
from payments.infra.db import claim_rows, utcnow
from payments.infra.schema import outbox as outbox_table
from payments.infra.schema import payment, provider_call, refund
from payments.infra.settings import Settings
from payments.lifecycle import outbox
from payments.lifecycle.transitions import TARGETS, Kind, apply_decision
from payments.outbound import breaker, provider_calls, query_schedule
from payments.outbound.charges import CHARGE_REQUESTED
from payments.outbound.refunds import REFUND_REQUESTED
from payments.providers.base import (
    REVIEW_PREFIX,
    ChargeRequest,
    Dedupe,
    Failed,
    Mismatch,
    NotFound,
    Pending,
    Provider,
    QueryOutcome,
    RefundRequest,
    Unknown,
    is_answer,
    reported_status,
)
from payments.states import TERMINAL, Decision, OutboxStatus, PaymentStatus, Verdict, decide

log = logging.getLogger("paysync.outbound")

Turn = Callable[[], AbstractContextManager[object]]
"""A wait for a turn at the database (``relay_outbox`` bounds how many units are in a transaction at once)."""


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


def admission(ctx: Context, provider: Provider | None, now: datetime | None = None) -> breaker.Gate:
    """The breaker's say on calling ``provider`` now (ALLOW when there is no provider to call).

    A PROBE gate holds the breaker's one probe slot: the caller either makes
    the call and ``count``s it, or ``release``s the slot.
    """
    if provider is None:
        return breaker.Gate()
    return breaker.admit(ctx.engine, provider.name, now or utcnow(), ctx.probe_seconds)


def release(ctx: Context, provider: Provider | None, gate: breaker.Gate) -> None:
    """No call was made after all (skipped, reviewed, deferred, failed): give a probe slot back at once."""
    if provider is None or not gate.probe:
        return
    try:
        breaker.release(ctx.engine, provider.name, gate, utcnow())
    except Exception:  # noqa: BLE001 - the slot expires on its own; the breaker is advisory
        log.warning("could not release the probe slot of %s", provider.name, exc_info=True)


def count(
    ctx: Context,
    provider: Provider,
    outcome: QueryOutcome,
    gate: breaker.Gate,
    db_turn: breaker.Turn = nullcontext,
    now: datetime | None = None,
) -> None:
    """Tell the breaker how the call went (its own transaction, within ``db_turn()``, after the outcome is applied).

    Only the call that held the probe slot counts as a probe: a failed probe
    reopens the breaker for longer. Other calls while open (the query
    budget's) count as failures or as healthy answers, never as probes.
    """
    try:
        breaker.record_call(
            ctx.engine,
            provider.name,
            gate,
            healthy=is_answer(outcome),
            settings=ctx.settings,
            now=now or utcnow(),
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
            delay = query_schedule.query_delay(settings, attempts + 1)
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
    seen = assess(ctx.settings, current, provider, outcome, now, query=query, resend=resend)
    if seen.needs_review is not None:
        # Still resolved by query like any Unknown; a person is told once per payment.
        review(conn, current, "provider_answer_needs_review", f"{source}: {seen.needs_review}", now)
    if seen.contradiction is not None:
        _contradicted(ctx, conn, current, seen.contradiction, source, now, query)
        return Result.REVIEW
    if seen.decision.verdict == Verdict.NOOP:
        _unchanged(conn, current, seen, now)
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


def _contradicted(
    ctx: Context, conn: Connection, current: Mapping[str, Any], reason: str, source: str, now: datetime, query: bool
) -> None:
    """Escalate a contradicting answer (once per subject); an unresolved row is looked at again after a backoff."""
    conflict(conn, current, reason, source, now)
    if PaymentStatus(current["status"]) in TERMINAL:
        return
    # Looked at again after a backoff, like any unresolved payment; never as soon as the lease ends.
    table = TARGETS[kind_of(current)].table
    attempts = current["query_attempts"] + (1 if query else 0)
    conn.execute(
        update(table)
        .where(table.c.id == current["id"])
        .values(
            next_query_at=now + timedelta(seconds=query_schedule.query_delay(ctx.settings, attempts + 1)),
            query_attempts=attempts,
            updated_at=now,
        )
    )


def _unchanged(conn: Connection, current: Mapping[str, Any], seen: Assessment, now: datetime) -> None:
    """An outcome that moves nothing still schedules an unresolved row's next query and keeps the provider's id."""
    if PaymentStatus(current["status"]) in TERMINAL:
        return
    spec = TARGETS[kind_of(current)]
    table, ref_column = spec.table, spec.provider_ref.name
    values = dict(seen.values)
    if seen.reference and not current[ref_column]:
        values[ref_column] = seen.reference
    if values:
        values["updated_at"] = now
        conn.execute(update(table).where(table.c.id == current["id"]).values(**values))


def hold_for_query(ctx: Context, conn: Connection, current: Mapping[str, Any], call_id: int, now: datetime) -> None:
    """Mark a payment (or refund) whose call's outcome was lost Unknown (if it is not already); schedule its query."""
    kind = kind_of(current)
    table = TARGETS[kind].table
    delay = query_schedule.query_delay(ctx.settings, current["query_attempts"] + 1)
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


# --- what tells a payment's calls from a refund's -------------------------------------------------------------


@dataclass(frozen=True)
class _Subject:
    """A payment or a refund as the protocol sees it: its table, its number, its calls and its re-send."""

    kind: Kind
    noun: str
    """What a send of it is called: "charge" or "refund"."""
    key: str
    """Our number's column (and the outbox payload's field): payment_id or refund_id."""
    table: Table
    event_type: str
    """The outbox event that sends it."""
    lock: Callable[[Connection, str], dict[str, Any] | None]
    last_call: Callable[[Connection, str], Row | None]
    last_send: Callable[[Connection, str], Row | None]
    """The latest send that may have reached the provider (one turned away with a 429 did not)."""
    payload: Callable[[Mapping[str, Any]], dict[str, Any]]
    """A re-send's outbox payload."""


_CHARGE = _Subject(
    "payment",
    "charge",
    "payment_id",
    payment,
    CHARGE_REQUESTED,
    lock_payment,
    last_charge_call,
    last_charge_send,
    lambda row: {"payment_id": row["payment_id"], "provider": row["provider"], "resend": True},
)
_REFUND = _Subject(
    "refund",
    "refund",
    "refund_id",
    refund,
    REFUND_REQUESTED,
    lock_refund,
    last_refund_call,
    last_refund_send,
    lambda row: {
        "refund_id": row["refund_id"],
        "payment_id": row["payment_id"],
        "provider": row["provider"],
        "resend": True,
    },
)


def _call_params(what: _Subject, current: Mapping[str, Any], request: RefundRequest | None) -> dict[str, Any]:
    """The business fields of a send, as its provider_call row's request digest covers them."""
    if request is None:
        return charge_params(current)
    return {
        "merchant_refund_id": current["refund_id"],
        "charge": request.provider_transaction_id,
        "amount": request.amount_minor,
        "currency": request.currency,
    }


def charge_params(current: Mapping[str, Any]) -> dict[str, Any]:
    """The business fields of a charge call, as its provider_call row's request digest covers them."""
    return {
        "merchant_transaction_id": current["payment_id"],
        "amount": int(current["amount_minor"]),
        "currency": current["currency"],
    }


def _refs(what: _Subject, current: Mapping[str, Any]) -> dict[str, Any]:
    """The provider_call row's references to the payment (and the refund) a call is about."""
    if what.kind == "refund":
        return {"payment_id": current["payment_id"], "refund_id": current["refund_id"]}
    return {"payment_id": current["payment_id"]}


def _retry_after_breaker(gate: breaker.Gate, now: datetime) -> datetime:
    """When a call the open breaker turned away comes back: at its retry time, spread over a second."""
    return max(gate.snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))


# --- sends: the relay's ChargeRequested and RefundRequested rows ------------------------------------------------

SENDS = (CHARGE_REQUESTED, REFUND_REQUESTED)
"""The outbox commands the relay sends (``relay_charge``, ``relay_refund``), in the order its claim lists them."""


def claim_sends(
    engine: Engine, now: datetime, limit: int, lease_seconds: float
) -> list[tuple[int, str, datetime, str]]:
    """The relay's claim: up to ``limit`` due command rows, leased; (outbox id, provider, lease token, event type) each.

    The lease token is the ``next_attempt_at`` the claim wrote: the relay
    sends only while the row still carries it (``relay_charge``, ``relay_refund``).
    """
    t = outbox_table
    query = (
        select(t.c.id, t.c.payload, t.c.event_type)
        .where(t.c.status == OutboxStatus.PENDING, t.c.next_attempt_at <= now, t.c.event_type.in_(SENDS))
        .order_by(t.c.next_attempt_at, t.c.id)
        .limit(limit)
    )
    lease_until = now + timedelta(seconds=lease_seconds)
    rows = claim_rows(engine, query, t, t.c.next_attempt_at, lease_until)
    return [(r.id, json.loads(r.payload).get("provider", ""), lease_until, r.event_type) for r in rows]


# Every send runs these: built once (SET columns come with the parameters), not rebuilt per row.
_LOCK_OUTBOX = select(outbox_table).where(outbox_table.c.id == bindparam("p_outbox_id")).with_for_update()
_UPDATE_OUTBOX = update(outbox_table).where(outbox_table.c.id == bindparam("p_outbox_id"))
_LEASE_FOR_CALL = _UPDATE_OUTBOX.values(attempts=outbox_table.c.attempts + 1)


class _PreparedSend(NamedTuple):
    """A send prepare let go out: its provider_call row, the locked row as it was, and what the call needs."""

    call_id: int
    current: dict[str, Any]
    resend: bool
    """An earlier send may have reached the provider (its refusal is then Unknown, ``reported_status``)."""
    sent_before: datetime | None
    """When the previous call started (None: this is the first)."""
    request: RefundRequest | None
    """A refund's request (None for a charge: ``send_charge`` builds its own)."""


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
    return _relay(ctx, outbox_id, provider_name, lease_until, db_turn, _CHARGE)


def relay_refund(
    ctx: Context, outbox_id: int, provider_name: str, lease_until: datetime, db_turn: Turn = nullcontext
) -> Result:
    """Send one claimed RefundRequested row to its provider and apply the answer, as ``relay_charge`` does a charge.

    The refund goes out under its own fixed idempotency key (``refund.idempotency_key``)
    and our refund number; an answer whose outcome is lost leaves the refund
    Unknown for the query job, which looks it up by our refund number.
    """
    return _relay(ctx, outbox_id, provider_name, lease_until, db_turn, _REFUND)


def _relay(
    ctx: Context, outbox_id: int, provider_name: str, lease_until: datetime, db_turn: Turn, what: _Subject
) -> Result:
    """Prepare, call and apply one send (``relay_charge``, ``relay_refund``)."""
    provider = ctx.providers.get(provider_name)
    with db_turn():
        now = utcnow()  # one clock reading for the breaker and the prepare: they run back to back
        gate = admission(ctx, provider, now)
        prepared: Result | _PreparedSend = Result.SKIPPED
        try:
            prepared = _prepare_send(ctx, outbox_id, lease_until, provider, gate, what, now)
        finally:
            if isinstance(prepared, Result):
                release(ctx, provider, gate)  # no call goes out: a probe slot we took is free again
    if isinstance(prepared, Result):
        return prepared
    if prepared.request is None:
        outcome = send_charge(ctx, provider, prepared.current, prepared.sent_before)
    else:
        outcome = provider.refund(
            prepared.request, prepared.current["idempotency_key"], ctx.settings.provider_timeout_seconds
        )
        failpoints.hit("relay.after_provider_call")
    with db_turn():
        number = prepared.current[what.key]
        result, now = _apply_send(ctx, outbox_id, prepared.call_id, what, number, provider, outcome, prepared.resend)
        count(ctx, provider, outcome, gate, now=now)
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


def _prepare_send(
    ctx: Context,
    outbox_id: int,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
    what: _Subject,
    now: datetime,
) -> Result | _PreparedSend:
    """Lock the outbox row and its payment (or refund), decide whether the send may go out, and record it."""
    with ctx.engine.begin() as conn:
        row = conn.execute(_LOCK_OUTBOX, {"p_outbox_id": outbox_id}).first()
        if row is None or row.status != OutboxStatus.PENDING or row.next_attempt_at != lease_until:
            return Result.SKIPPED  # done, or our lease ran out and another worker holds the row now
        number = json.loads(row.payload)[what.key]
        current = what.lock(conn, number)
        if current is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no {what.kind} {number}")
            return Result.SKIPPED
        stopped = _send_stopped(ctx, conn, outbox_id, current, provider, what, now)
        if stopped is not None:
            return stopped
        request = refund_request(conn, current) if what.kind == "refund" else None
        if what.kind == "refund" and request is None:
            _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no payment {current['payment_id']}")
            review(conn, current, "unresolved_refund", "the refunded payment is missing", now)
            return Result.REVIEW
        previous = what.last_call(conn, number)
        # A re-send: an earlier send may have charged (its answer lost or unclear). One the provider refused
        # (Failed, e.g. our credentials) charged nothing, and the next send is as good as a first one.
        resend = previous is not None and previous.outcome != "Failed"
        if resend:
            held = _hold_unsafe_resend(ctx, conn, outbox_id, current, provider, previous.id, what, now)
            if held is not None:
                return held
        if gate.admission == breaker.Admission.DENY:
            retry_at = _retry_after_breaker(gate, now)
            conn.execute(_UPDATE_OUTBOX, {"p_outbox_id": outbox_id, "next_attempt_at": retry_at, "updated_at": now})
            return Result.DEFERRED
        call_id = provider_calls.start(
            conn,
            provider=provider.name,
            operation=what.noun,
            params=_call_params(what, current, request),
            now=now,
            idempotency_key=current["idempotency_key"],
            **_refs(what, current),
        )
        decision = decide(PaymentStatus(current["status"]), PaymentStatus.PENDING)
        if decision.verdict == Verdict.APPLY:
            apply_decision(conn, what.kind, current, decision, source=f"call:{call_id}", now=now)
        # The lease now covers the call itself, however long the wait for the rate limiter was.
        lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(_LEASE_FOR_CALL, {"p_outbox_id": outbox_id, "next_attempt_at": lease, "updated_at": now})
    # The previous call, a 429 included: a later time than the last send that reached the provider only makes a
    # lookup by our number more careful.
    return _PreparedSend(call_id, current, resend, previous.started_at if previous is not None else None, request)


def _send_stopped(
    ctx: Context,
    conn: Connection,
    outbox_id: int,
    current: Mapping[str, Any],
    provider: Provider | None,
    what: _Subject,
    now: datetime,
) -> Result | None:
    """Why a send must not go out at all (already final, no adapter, past its deadline), handled; None: it may."""
    if PaymentStatus(current["status"]) in TERMINAL:
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"{what.kind} already {current['status']}")
        return Result.SKIPPED
    if provider is None or provider.name != current["provider"]:
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, f"no adapter for {current['provider']}")
        review(conn, current, "unknown_provider", f"no adapter registered for {current['provider']}", now)
        return Result.REVIEW
    if current["deadline_at"] is not None and now >= current["deadline_at"]:
        why = f"deadline passed before the {what.noun} was confirmed"
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DEAD, why)
        reason = f"deadline passed before the {what.noun} was sent or confirmed"
        review(conn, current, "unresolved_refund" if what.kind == "refund" else "unresolved_payment", reason, now)
        return Result.REVIEW
    return None


def _hold_unsafe_resend(
    ctx: Context,
    conn: Connection,
    outbox_id: int,
    current: Mapping[str, Any],
    provider: Provider,
    previous_id: int,
    what: _Subject,
    now: datetime,
) -> Result | None:
    """A re-send this provider would take as a second one: held for the query job or a person; None: send it.

    A charge may already be on its way or done, and such a provider does not
    dedupe, or may have forgotten the key.
    """
    outlived = key_outlived(ctx.settings, provider, current, now)
    if provider.capabilities.may_resend and not outlived:
        return None
    why = KEY_OUTLIVED if outlived else "provider does not dedupe"
    if provider.capabilities.query_by_merchant_id:
        hold_for_query(ctx, conn, current, previous_id, now)
        _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; queried")
        return Result.NOT_RESENT
    give_up_ambiguous(conn, current, previous_id, now, f"earlier {what.noun} call has no recorded outcome")
    _finish_outbox(conn, outbox_id, now, OutboxStatus.DONE, f"not re-sent: {why}; cannot be queried")
    return Result.REVIEW


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
        return _apply_locked(ctx, conn, outbox_id, call_id, lock(conn), provider, outcome, resend, now)


def _apply_send(
    ctx: Context,
    outbox_id: int,
    call_id: int,
    what: _Subject,
    number: str,
    provider: Provider,
    outcome: QueryOutcome,
    resend: bool,
) -> tuple[Result, datetime]:
    """``apply_call`` for the payment (or refund) ``number``; also returns the clock reading it applied at."""
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = what.lock(conn, number)
        return _apply_locked(ctx, conn, outbox_id, call_id, current, provider, outcome, resend, now), now


def _apply_locked(
    ctx: Context,
    conn: Connection,
    outbox_id: int,
    call_id: int,
    current: Mapping[str, Any] | None,
    provider: Provider,
    outcome: QueryOutcome,
    resend: bool,
    now: datetime,
) -> Result:
    """The apply step's writes, in the caller's transaction (see ``apply_call``)."""
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


def _finish_outbox(conn: Connection, outbox_id: int, now: datetime, status: OutboxStatus, error: str | None) -> None:
    conn.execute(
        _UPDATE_OUTBOX,
        {"p_outbox_id": outbox_id, "status": status, "last_error": error[:500] if error else None, "updated_at": now},
    )


# --- queries: Unknown and long-Pending payments and refunds looked up by our number ---------------------------


def due_for_query(now: datetime, pending_after_seconds: float, table: Table = payment) -> Any:
    """The WHERE clause of the payments (or, with ``table=refund``, refunds) query_unresolved should look at now."""
    return or_(
        and_(
            table.c.status.in_((PaymentStatus.UNKNOWN.value, PaymentStatus.PENDING.value)),
            table.c.next_query_at <= now,
        ),
        and_(
            table.c.status == PaymentStatus.PENDING.value,
            table.c.next_query_at.is_(None),
            table.c.updated_at <= now - timedelta(seconds=pending_after_seconds),
        ),
    )


def claim_queries(
    engine: Engine, now: datetime, limit: int, lease_seconds: float, pending_after_seconds: float
) -> list[tuple[str, str, datetime, str]]:
    """The query job's claim: up to ``limit`` due payments (then refunds), leased: (number, provider, lease, kind).

    The lease token is the ``next_query_at`` the claim wrote: the query goes
    out only while the payment (or refund) still carries it (``query_payment``, ``query_refund``).
    """
    query = (
        select(payment.c.id, payment.c.payment_id, payment.c.provider)
        .where(due_for_query(now, pending_after_seconds))
        .order_by(payment.c.next_query_at, payment.c.id)
        .limit(limit)
    )
    lease_until = now + timedelta(seconds=lease_seconds)
    rows = claim_rows(engine, query, payment, payment.c.next_query_at, lease_until)
    claimed = [(r.payment_id, r.provider, lease_until, "payment") for r in rows]
    if len(claimed) < limit:
        query = (
            select(refund.c.id, refund.c.refund_id, refund.c.provider)
            .where(due_for_query(now, pending_after_seconds, refund))
            .order_by(refund.c.next_query_at, refund.c.id)
            .limit(limit - len(claimed))
        )
        rows = claim_rows(engine, query, refund, refund.c.next_query_at, lease_until)
        claimed += [(r.refund_id, r.provider, lease_until, "refund") for r in rows]
    return claimed


class _PreparedQuery(NamedTuple):
    """A query prepare let go out: its provider_call row, the locked row as it was, and what the query expects."""

    call_id: int
    current: dict[str, Any]
    expected: ChargeRequest | RefundRequest


def query_payment(
    ctx: Context, payment_id: str, provider_name: str, lease_until: datetime, *, budget_ok: bool = False
) -> Result:
    """Query one claimed Unknown (or long-Pending) payment by our number and act on the answer.

    ``lease_until`` is the claim's token (the ``next_query_at`` it wrote): if
    the payment no longer carries it, another worker holds it now, and nothing
    is sent. ``budget_ok``: the caller's query budget allows a query even
    while the provider's breaker is open.
    """
    return _query(ctx, payment_id, provider_name, lease_until, budget_ok, _CHARGE)


def query_refund(
    ctx: Context, refund_id: str, provider_name: str, lease_until: datetime, *, budget_ok: bool = False
) -> Result:
    """Query one claimed Unknown (or long-Pending) refund by our refund number and act on the answer.

    As ``query_payment``: found → applied through the state machine; not
    found → sent again under the refund's own key if the provider dedupes it
    and the last send is past QUERY_NOT_FOUND_GRACE_SECONDS; still unresolved
    at the refund's deadline → manual review and an alert.
    """
    return _query(ctx, refund_id, provider_name, lease_until, budget_ok, _REFUND)


def _query(
    ctx: Context, number: str, provider_name: str, lease_until: datetime, budget_ok: bool, what: _Subject
) -> Result:
    """Prepare, call and apply one query (``query_payment``, ``query_refund``)."""
    provider = ctx.providers.get(provider_name)
    if provider is not None and not provider.capabilities.query_by_merchant_id:
        provider = None  # an adapter that cannot look a charge up by our number is as good as none here
    gate = admission(ctx, provider)
    prepared: Result | _PreparedQuery = Result.SKIPPED
    try:
        prepared = _prepare_query(ctx, number, lease_until, provider, gate, budget_ok, what)
    finally:
        if isinstance(prepared, Result):
            release(ctx, provider, gate)  # no query goes out: a probe slot we took is free again
    if isinstance(prepared, Result):
        return prepared
    call_id, current, expected = prepared
    timeout = ctx.settings.provider_timeout_seconds
    if what.kind == "refund":
        outcome = provider.query_refund(number, timeout, expected)
    else:
        outcome = provider.query(number, timeout, expected)
        if _unpaid_past_expiry(provider, outcome, current, utcnow()):
            call_id, outcome = _close_expired(ctx, provider, call_id, outcome, expected)
    now = utcnow()
    with ctx.engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, now)
        current = what.lock(conn, number)
        if isinstance(outcome, NotFound):
            result = _not_found(ctx, conn, current, provider, now, what)
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


def _prepare_query(
    ctx: Context,
    number: str,
    lease_until: datetime,
    provider: Provider | None,
    gate: breaker.Gate,
    budget_ok: bool,
    what: _Subject,
) -> Result | _PreparedQuery:
    """Lock the payment (or refund), decide whether the query may go out, and record it."""
    now = utcnow()
    with ctx.engine.begin() as conn:
        current = what.lock(conn, number)
        if current is None or PaymentStatus(current["status"]) not in (PaymentStatus.UNKNOWN, PaymentStatus.PENDING):
            return Result.SKIPPED
        if current["next_query_at"] != lease_until:
            return Result.SKIPPED  # our lease ran out and another worker holds it, or an answer came meanwhile
        table = what.table
        if current["deadline_at"] is not None and now >= current["deadline_at"]:
            unresolved = "unresolved_refund" if what.kind == "refund" else "unresolved_payment"  # literals: alert rules
            review(conn, current, unresolved, f"still {current['status']} at its deadline", now)
            conn.execute(update(table).where(table.c.id == current["id"]).values(next_query_at=None))
            return Result.REVIEW
        request = refund_request(conn, current) if what.kind == "refund" else None
        if provider is None or (what.kind == "refund" and request is None):
            # No adapter, one that cannot look a charge up by our number, or a refund of a missing payment.
            previous = what.last_call(conn, number)
            call_id = previous.id if previous else None
            give_up_ambiguous(conn, current, call_id, now, "provider cannot be queried by our number")
            return Result.REVIEW
        if gate.admission == breaker.Admission.DENY and not budget_ok:
            retry_at = _retry_after_breaker(gate, now)
            conn.execute(update(table).where(table.c.id == current["id"]).values(next_query_at=retry_at))
            return Result.DEFERRED
        expected = request if request is not None else _expected_charge(conn, current)
        params = {"merchant_refund_id": number} if what.kind == "refund" else {"merchant_transaction_id": number}
        call_id = provider_calls.start(
            conn, provider=provider.name, operation="query", params=params, now=now, **_refs(what, current)
        )
        # The lease now covers the call itself, however long the wait for the rate limiter was.
        call_lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
        conn.execute(update(table).where(table.c.id == current["id"]).values(next_query_at=call_lease))
    return _PreparedQuery(call_id, current, expected)


def _expected_charge(conn: Connection, current: Mapping[str, Any]) -> ChargeRequest:
    """What a query should find for the payment ``current``, with when its newest send started."""
    sent = last_charge_send(conn, current["payment_id"])  # a send turned away with a 429 made nothing
    return ChargeRequest(
        current["payment_id"],
        int(current["amount_minor"]),
        current["currency"],
        created_at=current["created_at"],
        provider_transaction_id=current["provider_transaction_id"],
        sent_before=sent.started_at if sent is not None else None,
    )


def _not_found(
    ctx: Context, conn: Connection, current: Mapping[str, Any], provider: Provider, now: datetime, what: _Subject
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
    delay = query_schedule.query_delay(ctx.settings, attempts, settles_in=closable_in)
    next_query_at = now + timedelta(seconds=delay)
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
    _queue_resend(conn, current, what, now)
    return Result.RESEND


def _queue_resend(conn: Connection, current: Mapping[str, Any], what: _Subject, now: datetime) -> None:
    """Queue the send again (same key), unless one is already waiting in the outbox."""
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
