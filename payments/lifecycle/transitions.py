"""Writing a state-machine decision: the one function every status change goes through.

A callback, a provider call's answer and a query's answer all end here once
``payments.states.decide`` said APPLY. ``apply_decision`` is the
compare-and-set (``UPDATE … WHERE status = current``); in the same
transaction it books the change in the ledger (``ledger.status_change_record``:
a ledger event for a terminal state) and writes the merchant's event
(``events.status_change_event``: PaymentSucceeded, PaymentFailed,
PaymentUnknown, Refund… in the outbox). ``status_source`` names what caused
the change (``callback:<id>``, ``call:<id>``, ``query:<id>``), so an
operator can always answer "why is this payment Succeeded?".

``plan_decision`` works all of that out without writing (pure), so a batch of
decisions can be written set-wise by ``apply_planned``: the same rows, in a
handful of statements whatever the batch size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Column, Connection, Table, bindparam, update

from payments.errors import StaleTransition
from payments.infra.db import update_each
from payments.infra.schema import payment, refund
from payments.lifecycle import events, outbox
from payments.money import ledger
from payments.states import TERMINAL, Decision, PaymentStatus, StatusChange, Verdict

Kind = Literal["payment", "refund"]


@dataclass(frozen=True)
class Target:
    """Where a payment or a refund lives: its table, its business number and the provider's id for it."""

    table: Table
    key: Column
    provider_ref: Column


TARGETS: dict[str, Target] = {
    "payment": Target(payment, payment.c.payment_id, payment.c.provider_transaction_id),
    "refund": Target(refund, refund.c.refund_id, refund.c.provider_refund_id),
}
"""Payments and refunds share the state machine; this says which columns each uses."""


@dataclass(frozen=True)
class PlannedChange:
    """An APPLY decision worked out for one row, before anything is written (``plan_decision``)."""

    kind: Kind
    row_id: int
    expected: str
    """The status the guarded UPDATE requires the row to still have."""
    values: dict[str, Any]
    """The columns the UPDATE sets."""
    change: StatusChange
    ledger: dict[str, Any] | None
    """``ledger.append``'s arguments, or None when the change books nothing."""
    event: tuple[str, dict[str, Any]] | None
    """The domain event (type, payload) for the outbox, or None."""


def plan_decision(
    kind: Kind,
    current: Mapping[str, Any],
    decision: Decision,
    *,
    source: str,
    now: datetime,
    provider_reference: str | None = None,
    failure_code: str | None = None,
    details: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
) -> PlannedChange:
    """Everything ``apply_decision`` writes for an APPLY ``decision`` on the row ``current`` (pure)."""
    target = decision.target
    if decision.verdict != Verdict.APPLY or target is None:
        raise ValueError(f"apply_decision needs an APPLY decision, got {decision.verdict}")
    spec = TARGETS[kind]
    row: dict[str, Any] = {"status": target.value, "status_source": source, "updated_at": now}
    if target in TERMINAL:
        row["next_query_at"] = None
    row.update(values or {})
    if provider_reference and current[spec.provider_ref.name] is None:
        row[spec.provider_ref.name] = provider_reference
    if target == PaymentStatus.FAILED:
        row["error_code"] = failure_code or "declined"
    change = StatusChange(
        kind=kind,
        reference=current[spec.key.name],
        payment_id=current["payment_id"],
        provider=current["provider"],
        amount_minor=int(current["amount_minor"]),
        currency=current["currency"],
        previous=PaymentStatus(current["status"]),
        target=target,
        path=decision.path,
        source=source,
    )
    event = events.status_change_event(
        change,
        now,
        order_no=current.get("order_no"),
        provider_reference=row.get(spec.provider_ref.name) or current[spec.provider_ref.name],
        failure_code=row.get("error_code"),
    )
    return PlannedChange(
        kind=kind,
        row_id=current["id"],
        expected=current["status"],
        values=row,
        change=change,
        ledger=ledger.status_change_record(change, now, details),
        event=event,
    )


_GUARDED_UPDATE = {
    kind: update(target.table).where(
        target.table.c.id == bindparam("p_row_id"), target.table.c.status == bindparam("p_expected")
    )
    for kind, target in TARGETS.items()
}
"""apply_decision's UPDATE … WHERE id = ? AND status = ?, built once; the SET columns are the execute parameters
named as columns (building the statement and its cache key per call cost as much as running it)."""


def apply_decision(
    conn: Connection,
    kind: Kind,
    current: Mapping[str, Any],
    decision: Decision,
    *,
    source: str,
    now: datetime,
    provider_reference: str | None = None,
    failure_code: str | None = None,
    details: dict[str, Any] | None = None,
    values: dict[str, Any] | None = None,
) -> PaymentStatus:
    """Write an APPLY ``decision`` for the row ``current`` in the caller's transaction; return the new status.

    ``source`` is ``callback:<id>``, ``call:<id>`` or ``query:<id>``. ``values``
    adds columns to the UPDATE (e.g. ``next_query_at`` for Unknown; terminal
    states clear it). Raises StaleTransition if the row left ``current``'s
    status under us, which rolls the caller back.
    """
    plan = plan_decision(
        kind,
        current,
        decision,
        source=source,
        now=now,
        provider_reference=provider_reference,
        failure_code=failure_code,
        details=details,
        values=values,
    )
    params = {"p_row_id": plan.row_id, "p_expected": plan.expected, **plan.values}
    changed = conn.execute(_GUARDED_UPDATE[kind], params).rowcount
    if changed != 1:
        raise StaleTransition(f"{kind} {plan.change.reference} left {plan.expected} under us")
    if plan.ledger is not None:
        ledger.append(conn, **plan.ledger)
    if plan.event is not None:
        event_type, payload = plan.event
        outbox.enqueue(conn, event_type=event_type, aggregate_id=plan.change.reference, now=now, payload=payload)
    return plan.change.target


def apply_planned(conn: Connection, plans: Sequence[PlannedChange], now: datetime) -> None:
    """Write several planned changes set-wise, in the caller's transaction: what ``apply_decision`` does for each.

    One guarded UPDATE per (kind, status it leaves, columns it sets), each row
    with its own values (``db.update_each``); then every ledger event in one
    go (``ledger.append_many``) and every domain event in one multi-row
    INSERT. Raises StaleTransition if any row left its status under us, which
    rolls the caller back (to its savepoint).
    """
    groups: dict[tuple[str, str, tuple[str, ...]], dict[int, dict[str, Any]]] = {}
    for plan in plans:
        groups.setdefault((plan.kind, plan.expected, tuple(plan.values)), {})[plan.row_id] = plan.values
    for (kind, expected, _columns), rows in groups.items():
        table = TARGETS[kind].table
        changed = update_each(conn, table, rows, table.c.status, [expected])
        if changed != len(rows):
            raise StaleTransition(f"{len(rows) - changed} of {len(rows)} {kind} rows left {expected} under us")
    ledger.append_many(conn, [plan.ledger for plan in plans if plan.ledger is not None])
    outbox.enqueue_many(
        conn,
        [
            outbox.row(event_type=plan.event[0], aggregate_id=plan.change.reference, now=now, payload=plan.event[1])
            for plan in plans
            if plan.event is not None
        ],
    )
