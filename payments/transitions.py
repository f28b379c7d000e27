"""Writing a state-machine decision: the one function every status change goes through.

A callback, a provider call's answer and a query's answer all end here once
``payments.states.decide`` said APPLY. ``apply_decision`` is the
compare-and-set (``UPDATE … WHERE status = current``); in the same
transaction it hands the change to the ledger (``ledger.post_status_change``:
a ledger event for a terminal state) and to the merchant's events
(``events.enqueue_status_change``: PaymentSucceeded, PaymentFailed,
PaymentUnknown, Refund… in the outbox). ``status_source`` names what caused
the change (``callback:<id>``, ``call:<id>``, ``query:<id>``), so an
operator can always answer "why is this payment Succeeded?".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Column, Connection, Table, update

from payments import events, ledger
from payments.errors import StaleTransition
from payments.schema import payment, refund
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
    if decision.verdict != Verdict.APPLY or decision.target is None:
        raise ValueError(f"apply_decision needs an APPLY decision, got {decision.verdict}")
    spec = TARGETS[kind]
    table = spec.table
    target = decision.target
    row: dict[str, Any] = {"status": target.value, "status_source": source, "updated_at": now}
    if target in TERMINAL:
        row["next_query_at"] = None
    row.update(values or {})
    if provider_reference and current[spec.provider_ref.name] is None:
        row[spec.provider_ref.name] = provider_reference
    if target == PaymentStatus.FAILED:
        row["error_code"] = failure_code or "declined"
    changed = conn.execute(
        update(table).where(table.c.id == current["id"], table.c.status == current["status"]).values(**row)
    ).rowcount
    if changed != 1:
        raise StaleTransition(f"{kind} {current[spec.key.name]} left {current['status']} under us")

    reference = current[spec.key.name]
    change = StatusChange(
        kind=kind,
        reference=reference,
        payment_id=current["payment_id"],
        provider=current["provider"],
        amount_minor=int(current["amount_minor"]),
        currency=current["currency"],
        previous=PaymentStatus(current["status"]),
        target=target,
        path=decision.path,
        source=source,
    )
    ledger.post_status_change(conn, change, now, details)
    events.enqueue_status_change(
        conn,
        change,
        now,
        order_no=current.get("order_no"),
        provider_reference=row.get(spec.provider_ref.name) or current[spec.provider_ref.name],
        failure_code=row.get("error_code"),
    )
    return target
