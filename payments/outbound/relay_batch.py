"""Charges relayed in groups: the usual first send prepared and applied set-wise, anything else one by one.

``payments.outbound.protocol.relay_charge`` sends one ChargeRequested row with a
transaction of its own before the call (prepare) and one after it (apply):
about fifteen statements and two COMMITs per payment. Under load nearly every
row is the same simple case, so ``relay_outbox`` hands its claimed rows here:

- ``prepare_charges``: in one transaction for the whole claim, the rows that
  are a first send of a Created payment (no earlier charge call, deadline not
  passed, adapter present, breaker closed, a provider that dedupes a re-send:
  ``_plain_first_send``) get what ``outbound_protocol.relay_charge``'s
  prepare gives them: the provider_call row, Created → Pending naming it, the
  lease renewed for the call and the attempt counted. A handful of statements
  whatever the count. Every other row is left to ``relay_charge``, which
  judges it afresh (re-sends, deadlines, reviews, a breaker that is not closed).
- ``send_prepared`` makes the call in the relay's worker thread, outside any
  transaction, then hands the outcome to a ``GroupCommit`` whose group is
  written by ``apply_charges``.
- ``apply_charges``: in one transaction for the group, every outcome that
  moves its payment on plainly (or finds it already terminal, the
  notification having won the race) gets what ``relay``'s apply gives it: the
  call row finished, the state-machine change with its ledger and domain
  event, the outbox row done. Anything else (a retry, a contradiction, a
  report for a person, a report that changes nothing on an open payment) is
  left out and applied by ``relay``'s own per-row apply, as is the whole group
  if its transaction fails (a deadlock, say).

The effects on each payment are exactly those of ``relay_charge``; only the
number of statements and COMMITs differs (``tests/test_relay_batch.py``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import Connection, bindparam, select, update

from payments.infra.db import utcnow
from payments.infra.group_commit import GroupCommit
from payments.infra.schema import outbox, payment, provider_call
from payments.lifecycle.transitions import PlannedChange, apply_planned, plan_decision
from payments.outbound import breaker, provider_calls
from payments.outbound.charges import CHARGE_REQUESTED
from payments.outbound.protocol import (
    Context,
    Result,
    apply_call,
    assess,
    charge_params,
    count,
    lock_payment,
    send_charge,
)
from payments.providers.base import Failed, Provider, QueryOutcome
from payments.states import TERMINAL, BreakerState, OutboxStatus, PaymentStatus, Verdict, decide

log = logging.getLogger("paysync.relay")

Turn = Callable[[], AbstractContextManager[object]]

_LOCK_OUTBOX_ROWS = (
    select(outbox.c.id, outbox.c.status, outbox.c.next_attempt_at, outbox.c.event_type, outbox.c.payload)
    .where(outbox.c.id.in_(bindparam("ids", expanding=True)))
    .with_for_update()
)
_LOCK_PAYMENTS = (
    select(payment).where(payment.c.payment_id.in_(bindparam("payment_ids", expanding=True))).with_for_update()
)
_CHARGED_BEFORE = select(provider_call.c.payment_id).where(
    provider_call.c.payment_id.in_(bindparam("payment_ids", expanding=True)),
    provider_call.c.operation == "charge",
)
_LEASE_FOR_CALLS = (
    update(outbox)
    .where(outbox.c.id.in_(bindparam("ids", expanding=True)), outbox.c.status == OutboxStatus.PENDING)
    .values(attempts=outbox.c.attempts + 1, next_attempt_at=bindparam("p_lease"), updated_at=bindparam("p_now"))
)
_DEFER = (
    update(outbox)
    .where(outbox.c.id == bindparam("p_id"), outbox.c.status == OutboxStatus.PENDING)
    .values(next_attempt_at=bindparam("p_retry_at"), updated_at=bindparam("p_now"))
)
# The fence before a prepared charge goes out: only while the row still carries our lease token and that
# lease has not run out, and then the lease is renewed for the call itself.
_RENEW_LEASE = (
    update(outbox)
    .where(
        outbox.c.id == bindparam("p_id"),
        outbox.c.status == OutboxStatus.PENDING,
        outbox.c.next_attempt_at == bindparam("p_token"),
        outbox.c.next_attempt_at > bindparam("p_now"),
    )
    .values(next_attempt_at=bindparam("p_lease"), updated_at=bindparam("p_now"))
)
LEASE_LOST = "not_sent_lease_lost"
"""The error code of a prepared call withdrawn because its lease ran out or passed to another relay before the send."""
_FINISH_OUTBOX_ROWS = (
    update(outbox)
    .where(outbox.c.id.in_(bindparam("ids", expanding=True)))
    .values(status=OutboxStatus.DONE, last_error=None, updated_at=bindparam("p_now"))
)


@dataclass(frozen=True)
class PreparedCharge:
    """A ChargeRequested row prepared by ``prepare_charges``: its call is on file and may go out."""

    outbox_id: int
    call_id: int
    current: dict[str, Any]
    """The payment as it was locked, before it moved to Pending."""
    provider: Provider
    gate: breaker.Gate
    lease_until: datetime
    """The lease token the prepare wrote: the charge goes out only while the row still carries it, unexpired."""


def prepare_charges(
    ctx: Context, claimed: Sequence[tuple[int, str, datetime]]
) -> tuple[list[PreparedCharge], list[int]]:
    """Prepare the plain first sends among claimed (outbox id, provider, lease token) rows in one transaction.

    Returns the prepared charges and the outbox ids of the other rows, which
    are still claimed (under their lease) and go to ``outbound_protocol.relay_charge``.
    """
    now = utcnow()
    gates = _closed_gates(ctx, claimed)
    tokens = {outbox_id: lease for outbox_id, name, lease in claimed if name in gates}
    everyone = [outbox_id for outbox_id, _, _ in claimed]
    if not tokens:
        return [], everyone
    lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
    names = {outbox_id: name for outbox_id, name, _ in claimed}
    prepared: list[PreparedCharge] = []
    try:
        with ctx.engine.begin() as conn:
            plain = _plain_rows(ctx, conn, tokens, names, now)
            if not plain:
                return [], everyone
            prepared = _start_sends(ctx, conn, plain, gates, lease, now)
    except Exception:  # noqa: BLE001 - nothing was written: every row goes the per-row way, which judges it afresh
        log.warning("preparing %s charges together failed; each goes on its own", len(tokens), exc_info=True)
        return [], everyone
    done = {p.outbox_id for p in prepared}
    return prepared, [outbox_id for outbox_id in everyone if outbox_id not in done]


def _closed_gates(ctx: Context, claimed: Sequence[tuple[int, str, datetime]]) -> dict[str, breaker.Gate]:
    """An ALLOW gate for each claimed row's provider whose breaker is closed (only those are sent together)."""
    gates: dict[str, breaker.Gate] = {}
    for name in {provider_name for _, provider_name, _ in claimed}:
        provider = ctx.providers.get(name)
        if provider is not None:
            snapshot = breaker.read(ctx.engine, name)
            if snapshot.state == BreakerState.CLOSED:
                gates[name] = breaker.Gate(breaker.Admission.ALLOW, snapshot)
    return gates


def _plain_rows(
    ctx: Context, conn: Connection, tokens: Mapping[int, datetime], names: Mapping[int, str], now: datetime
) -> list[tuple[int, dict[str, Any], Provider]]:
    """Lock the rows still ours and their payments; the (outbox id, payment, adapter) of each plain first send."""
    wanted: dict[int, str] = {}  # outbox id -> payment id
    for row in conn.execute(_LOCK_OUTBOX_ROWS, {"ids": sorted(tokens)}):
        if (
            row.status == OutboxStatus.PENDING
            and row.next_attempt_at == tokens[row.id]
            and row.event_type == CHARGE_REQUESTED
        ):
            wanted[row.id] = json.loads(row.payload)["payment_id"]
    payment_ids = sorted(set(wanted.values()))
    if not payment_ids:
        return []
    currents = {p["payment_id"]: dict(p) for p in conn.execute(_LOCK_PAYMENTS, {"payment_ids": payment_ids}).mappings()}
    charged = set(conn.execute(_CHARGED_BEFORE, {"payment_ids": payment_ids}).scalars())
    plain: list[tuple[int, dict[str, Any], Provider]] = []
    for outbox_id, payment_id in wanted.items():
        current = currents.get(payment_id)
        provider = ctx.providers[names[outbox_id]]
        if _plain_first_send(current, provider, now) and payment_id not in charged:
            charged.add(payment_id)  # a second row for the same payment goes one by one
            plain.append((outbox_id, current, provider))  # type: ignore[arg-type]
    return plain


def _start_sends(
    ctx: Context,
    conn: Connection,
    plain: list[tuple[int, dict[str, Any], Provider]],
    gates: Mapping[str, breaker.Gate],
    lease: datetime,
    now: datetime,
) -> list[PreparedCharge]:
    """Record the plain sends' calls, move their payments Created -> Pending and lease their rows for the call."""
    call_ids = provider_calls.start_first_charges(
        conn,
        [(c["payment_id"], provider.name, c["idempotency_key"], charge_params(c)) for _, c, provider in plain],
        now,
    )
    pending = decide(PaymentStatus.CREATED, PaymentStatus.PENDING)
    apply_planned(
        conn,
        [
            plan_decision("payment", c, pending, source=f"call:{call_ids[c['payment_id']]}", now=now)
            for _, c, _ in plain
        ],
        now,
    )
    conn.execute(_LEASE_FOR_CALLS, {"ids": [outbox_id for outbox_id, _, _ in plain], "p_lease": lease, "p_now": now})
    return [
        PreparedCharge(outbox_id, call_ids[c["payment_id"]], c, provider, gates[provider.name], lease)
        for outbox_id, c, provider in plain
    ]


def _plain_first_send(current: dict[str, Any] | None, provider: Provider, now: datetime) -> bool:
    """True for a Created payment of ``provider`` whose deadline has not passed: ``relay``'s prepare would send it.

    Only for a provider that dedupes a re-send. A grouped prepare puts its calls on file before their wait for a
    provider slot, and a crash in that wait leaves them without an outcome: a provider that dedupes gets them
    again under the same key, but one that does not could only hand each to a person. Its charges are prepared
    one by one, right before each send, where that window is a few milliseconds wide.
    """
    return (
        provider.capabilities.may_resend
        and current is not None
        and current["status"] == PaymentStatus.CREATED
        and current["provider"] == provider.name
        and (current["deadline_at"] is None or now < current["deadline_at"])
    )


def send_prepared(
    ctx: Context,
    charge: PreparedCharge,
    group: GroupCommit[tuple[PreparedCharge, QueryOutcome], Result | None],
    db_turn: Turn,
) -> Result:
    """Send a prepared charge with the payment's fixed idempotency key and have its outcome applied.

    The wait for a provider slot since the prepare is not bounded by the lease: a charge whose lease no longer
    leaves a whole call, or whose breaker opened, goes out only if ``_fence`` found the lease still ours (and
    renewed it) and the breaker closed; else nothing is sent.
    """
    current = charge.current
    # While the lease the prepare wrote still has a whole call ahead of it (by the clock that wrote it), no
    # other relay can have claimed the row, which needs the lease run out: no statement, no database turn.
    room = utcnow() + timedelta(seconds=ctx.settings.call_seconds) <= charge.lease_until
    # A re-read of the breaker row (its cache ran out while the charge waited for a slot) waits for a turn at the
    # database like every other statement of the relay's: RELAY_DB_CONCURRENCY bounds connections, not just units.
    if not room or breaker.read(ctx.engine, charge.provider.name, db_turn).state != BreakerState.CLOSED:
        with db_turn():
            withheld = _fence(ctx, charge, breaker.read(ctx.engine, charge.provider.name))
        if withheld is not None:
            return withheld
    outcome = send_charge(ctx, charge.provider, current)
    result = group.submit((charge, outcome))
    if result is None:
        with db_turn():
            lock = partial(lock_payment, payment_id=current["payment_id"])
            result = apply_call(ctx, charge.outbox_id, charge.call_id, lock, charge.provider, outcome, resend=False)
    count(ctx, charge.provider, outcome, charge.gate, db_turn)
    return result


def _fence(ctx: Context, charge: PreparedCharge, snapshot: breaker.Snapshot) -> Result | None:
    """For a charge whose lease may not cover its call (or whose breaker opened): None if it may go out now.

    One transaction checks that the row still carries our unexpired lease
    and renews it for the call; the call's ``started_at`` becomes the moment
    the request leaves. So a call's request is always over by its
    ``started_at`` plus ``Settings.call_lease_seconds`` (``query`` counts a
    NotFound's grace from its end). A charge held back (lease lost, or
    breaker open) is recorded as never sent (``withdraw``), so the next send
    of the payment is a first send, not a re-send.
    """
    now = utcnow()
    lease = now + timedelta(seconds=ctx.settings.call_lease_seconds)
    params = {"p_id": charge.outbox_id, "p_token": charge.lease_until, "p_now": now, "p_lease": lease}
    with ctx.engine.begin() as conn:
        if conn.execute(_RENEW_LEASE, params).rowcount != 1:
            # Our lease ran out while we waited (another relay may hold the row now): send nothing.
            provider_calls.withdraw(conn, charge.call_id, LEASE_LOST, now)
            return Result.SKIPPED
        if snapshot.state != BreakerState.CLOSED:
            # The breaker opened while this charge waited for its turn: the row comes back at retry_at.
            retry_at = max(snapshot.retry_at or now, now) + timedelta(seconds=random.uniform(0, 1))
            provider_calls.withdraw(conn, charge.call_id, "not_sent_circuit_open", now)
            conn.execute(_DEFER, {"p_id": charge.outbox_id, "p_retry_at": retry_at, "p_now": now})
            return Result.DEFERRED
        provider_calls.sent(conn, charge.call_id, now)
    return None


def apply_charges(ctx: Context, finished: Sequence[tuple[PreparedCharge, QueryOutcome]]) -> list[Result | None]:
    """Apply a group of prepared charges' outcomes in one transaction; None for each one left to the per-row apply."""
    results: list[Result | None] = [None] * len(finished)
    # A failure that is not definitive is retried after a backoff: the per-row apply does that.
    candidates = [
        i for i, (_, outcome) in enumerate(finished) if not (isinstance(outcome, Failed) and not outcome.definitive)
    ]
    if not candidates:
        return results
    now = utcnow()
    try:
        with ctx.engine.begin() as conn:
            payment_ids = sorted({finished[i][0].current["payment_id"] for i in candidates})
            locked = {
                p["payment_id"]: dict(p) for p in conn.execute(_LOCK_PAYMENTS, {"payment_ids": payment_ids}).mappings()
            }
            plans: list[PlannedChange] = []
            taken: list[int] = []
            for i in candidates:
                charge, outcome = finished[i]
                current = locked.pop(charge.current["payment_id"], None)  # popped: a payment once per group
                result, plan = _plain_apply(ctx, charge, outcome, current, now)
                if result is None:
                    continue
                results[i] = result
                taken.append(i)
                if plan is not None:
                    plans.append(plan)
            if not taken:
                return results
            provider_calls.finish_many(conn, [(finished[i][0].call_id, finished[i][1]) for i in taken], now)
            apply_planned(conn, plans, now)
            conn.execute(_FINISH_OUTBOX_ROWS, {"ids": [finished[i][0].outbox_id for i in taken], "p_now": now})
    except Exception:  # noqa: BLE001 - rolled back: each outcome is applied on its own
        log.warning("applying %s charge outcomes together failed; each goes on its own", len(finished), exc_info=True)
        return [None] * len(finished)
    return results


def _plain_apply(
    ctx: Context, charge: PreparedCharge, outcome: QueryOutcome, current: dict[str, Any] | None, now: datetime
) -> tuple[Result | None, PlannedChange | None]:
    """What ``outbound_protocol.apply_outcome`` would do, when it is plain: (APPLIED, plan) or (UNCHANGED, None).

    (None, None) when it is not: the per-row apply takes it.
    """
    if current is None:
        return None, None
    seen = assess(ctx.settings, current, charge.provider, outcome, now)
    if seen.needs_review is not None or seen.contradiction is not None:
        return None, None
    if seen.decision.verdict == Verdict.NOOP:
        # Already terminal (the notification got there first): nothing to write but the call and the outbox row.
        return (Result.UNCHANGED, None) if PaymentStatus(current["status"]) in TERMINAL else (None, None)
    if seen.decision.target == PaymentStatus.UNKNOWN and not charge.provider.capabilities.query_by_merchant_id:
        return None, None  # a person must hear of it: the per-row apply opens the review
    plan = plan_decision(
        "payment",
        current,
        seen.decision,
        source=f"call:{charge.call_id}",
        now=now,
        provider_reference=seen.reference,
        failure_code=seen.failure_code,
        values=seen.values,
        details={"outcome": type(outcome).__name__},
    )
    return Result.APPLIED, plan
