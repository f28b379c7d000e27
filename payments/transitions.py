"""Writing a state-machine decision: the one function every status change goes through.

A callback, a provider call's answer and a query's answer all end here once
``payments.states.decide`` said APPLY: a guarded ``UPDATE … WHERE status =
current``, a ledger event for a terminal state, and a domain event
(PaymentSucceeded, PaymentFailed, PaymentUnknown, Refund…) in the outbox, all
in the caller's transaction. ``status_source`` names what caused the change
(``callback:<id>``, ``call:<id>``, ``query:<id>``), so an operator can always
answer "why is this payment Succeeded?".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Column, Connection, Table, update

from payments import ledger, outbox
from payments.errors import StaleTransition
from payments.schema import payment, refund
from payments.states import Decision, PaymentStatus, Verdict

Kind = Literal["payment", "refund"]


@dataclass(frozen=True)
class Target:
    """Where a payment or a refund lives and what its ledger events are called."""

    table: Table
    key: Column
    provider_ref: Column
    confirmed: str
    failed: str


TARGETS: dict[str, Target] = {
    "payment": Target(
        payment, payment.c.payment_id, payment.c.provider_transaction_id, "PaymentConfirmed", "PaymentFailed"
    ),
    "refund": Target(refund, refund.c.refund_id, refund.c.provider_refund_id, "RefundConfirmed", "RefundFailed"),
}
"""Payments and refunds share the state machine; this says which columns and ledger names each uses."""

DOMAIN_EVENTS = {
    ("payment", PaymentStatus.SUCCEEDED): "PaymentSucceeded",
    ("payment", PaymentStatus.FAILED): "PaymentFailed",
    ("payment", PaymentStatus.UNKNOWN): "PaymentUnknown",
    ("refund", PaymentStatus.SUCCEEDED): "RefundSucceeded",
    ("refund", PaymentStatus.FAILED): "RefundFailed",
    ("refund", PaymentStatus.UNKNOWN): "RefundUnknown",
}
"""Domain events for the merchant's own systems, by (kind, new status); Pending has none."""

_LEDGER_SOURCE = {"callback": "callback", "call": "provider_call", "query": "query"}


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
    if target in (PaymentStatus.SUCCEEDED, PaymentStatus.FAILED):
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
    payment_id = current["payment_id"]
    refund_id = reference if kind == "refund" else None
    amount = int(current["amount_minor"])
    source_type, _, source_id = source.partition(":")
    if target in (PaymentStatus.SUCCEEDED, PaymentStatus.FAILED):
        provider_acct = ledger.provider_account(current["provider"])
        if target == PaymentStatus.SUCCEEDED:
            if kind == "payment":
                entries = [(provider_acct, amount), (ledger.INCOME_PAYMENTS, -amount)]
            else:
                entries = [(ledger.INCOME_REFUNDS, amount), (provider_acct, -amount)]
            ledger_type = spec.confirmed
        else:
            entries = []
            ledger_type = spec.failed
        ledger.append(
            conn,
            event_type=ledger_type,
            dedupe_key=f"{ledger_type}:{reference}",
            amount_minor=amount,
            currency=current["currency"],
            source_type=_LEDGER_SOURCE.get(source_type, source_type),
            source_id=source_id or None,
            now=now,
            entries=entries,
            payment_id=payment_id,
            refund_id=refund_id,
            details={"from": current["status"], "path": [s.value for s in decision.path], **(details or {})},
        )
    domain_type = DOMAIN_EVENTS.get((kind, target))
    if domain_type:
        outbox.enqueue(
            conn,
            event_type=domain_type,
            aggregate_id=reference,
            now=now,
            payload={
                "type": domain_type,
                "payment_id": payment_id,
                "refund_id": refund_id,
                "order_no": current.get("order_no"),
                "amount": amount,
                "currency": current["currency"],
                "status": target.value,
                "provider": current["provider"],
                "provider_transaction_id": row.get(spec.provider_ref.name) or current[spec.provider_ref.name],
                "failure_code": row.get("error_code"),
                "source": source,
                "occurred_at": now.isoformat() + "Z",
            },
        )
    return target
