"""The append-only double-entry ledger.

Each business event is one ``ledger_event`` row plus zero or more
``ledger_entry`` lines whose signed amounts (debit > 0, credit < 0) sum to
zero. Rows are never updated or deleted (triggers refuse it); a correction is
a new event. ``dedupe_key`` is UNIQUE, so one business effect can be recorded
once only, whatever races above it. ``compensator/seal_ledger.py`` chains the
committed events into a SHA-256 chain shortly after they are written.

Chart of accounts (docs/flows/ledger.md has the table of which event posts what):

- ``assets:provider:<provider>``: provider receivable, the money a provider
  holds for us (confirmed charges minus confirmed refunds and fees, plus or
  minus reconciliation adjustments);
- ``income:payments``: sales income, credited by confirmed charges;
- ``income:refunds``: contra-income, debited by confirmed refunds;
- ``expenses:provider_fees``: the fees in the providers' settlement files;
- ``suspense:reconciliation``: what the provider's books say and ours do not
  (or the other way round), parked by reconciliation until a person decides;
- ``clearing:fx_conversion``: the other side of the provider's currency
  conversions (a EUR charge settled in USD): per currency, what conversions
  took out of or put into the receivable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, func, insert, select

from payments.infra.schema import ledger_entry, ledger_event
from payments.states import PaymentStatus, StatusChange

INCOME_PAYMENTS = "income:payments"
"""Credited when a payment is confirmed."""
INCOME_REFUNDS = "income:refunds"
"""Debited when a refund is confirmed (contra-income)."""
EXPENSE_FEES = "expenses:provider_fees"
"""Debited with the provider's fees found by reconciliation."""
SUSPENSE_RECONCILIATION = "suspense:reconciliation"
"""The other side of every ReconciliationAdjusted: differences waiting for a person."""
FX_CONVERSION = "clearing:fx_conversion"
"""The other side of every FxConverted: one currency left the receivable, another came in."""
INCOME_ACCOUNTS = (INCOME_PAYMENTS, INCOME_REFUNDS)

FEE_CHARGED = "FeeCharged"
"""Fees of a settlement day: Dr expenses:provider_fees, Cr the provider's receivable."""
RECONCILIATION_ADJUSTED = "ReconciliationAdjusted"
"""The provider's books differ from ours: the receivable moved to what the provider says, the difference in suspense."""
FX_CONVERTED = "FxConverted"
"""The provider settled a transaction in another currency: one event per currency of the conversion, each balanced
in its own currency against FX_CONVERSION."""


def provider_account(provider: str) -> str:
    """The asset account for money held by a provider on our behalf."""
    return f"assets:provider:{provider}"


class UnbalancedEntries(ValueError):
    """The lines of one ledger event do not sum to zero."""


Entries = list[tuple[str, int]]

CONFIRMED_EVENTS = {"payment": "PaymentConfirmed", "refund": "RefundConfirmed"}
"""The ledger event a Succeeded payment or refund books."""
FAILED_EVENTS = {"payment": "PaymentFailed", "refund": "RefundFailed"}
"""The ledger event a Failed payment or refund books (no lines: no money moved)."""
SOURCE_TYPES = {"callback": "callback", "call": "provider_call", "query": "query"}
"""ledger_event.source_type for each kind of status_source."""


# The posting functions: the lines each kind of event books (pure). Every ledger line paysync writes comes from one
# of these five; status_change_postings picks between the first two, reconciliation uses the last three.


def payment_confirmed_entries(provider: str, amount: int) -> Entries:
    """PaymentConfirmed: the provider now holds ``amount`` for us; we earned it."""
    return [(provider_account(provider), amount), (INCOME_PAYMENTS, -amount)]


def refund_confirmed_entries(provider: str, amount: int) -> Entries:
    """RefundConfirmed: the provider gave ``amount`` back to the customer out of what it holds for us."""
    return [(INCOME_REFUNDS, amount), (provider_account(provider), -amount)]


def fee_entries(provider: str, fee: int) -> Entries:
    """FeeCharged: the provider kept ``fee`` (negative: it gave fees back)."""
    return [(EXPENSE_FEES, fee), (provider_account(provider), -fee)]


def adjustment_entries(provider: str, delta: int) -> Entries:
    """ReconciliationAdjusted: move our receivable by ``delta`` to what the provider says; park it in suspense."""
    return [(provider_account(provider), delta), (SUSPENSE_RECONCILIATION, -delta)]


def conversion_entries(provider: str, delta: int) -> Entries:
    """FxConverted: the receivable in one currency moves by ``delta`` (a conversion took it out, or put it in)."""
    return [(provider_account(provider), delta), (FX_CONVERSION, -delta)]


def status_change_postings(change: StatusChange) -> tuple[str, Entries] | None:
    """The ledger event type and lines a status change books (pure); None when it books nothing.

    Only terminal states are booked. A confirmed payment or refund books
    ``payment_confirmed_entries`` / ``refund_confirmed_entries``; a failure is
    an event with no lines.
    """
    if change.target == PaymentStatus.SUCCEEDED:
        entries = payment_confirmed_entries if change.kind == "payment" else refund_confirmed_entries
        return CONFIRMED_EVENTS[change.kind], entries(change.provider, change.amount_minor)
    if change.target == PaymentStatus.FAILED:
        return FAILED_EVENTS[change.kind], []
    return None


def status_change_record(
    change: StatusChange, now: datetime, details: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The ``append`` arguments that book a status change (pure; see ``status_change_postings``), or None."""
    postings = status_change_postings(change)
    if postings is None:
        return None
    event_type, entries = postings
    source_type, _, source_id = change.source.partition(":")
    return {
        "event_type": event_type,
        "dedupe_key": f"{event_type}:{change.reference}",
        "amount_minor": change.amount_minor,
        "currency": change.currency,
        "source_type": SOURCE_TYPES.get(source_type, source_type),
        "source_id": source_id or None,
        "now": now,
        "entries": entries,
        "payment_id": change.payment_id,
        "refund_id": change.reference if change.kind == "refund" else None,
        "details": {"from": change.previous.value, "path": [s.value for s in change.path], **(details or {})},
    }


# Built once: every confirmed payment appends here (values are execute-time parameters).
_INSERT_EVENT = insert(ledger_event)
_INSERT_ENTRY = insert(ledger_entry)
_EVENT_IDS = select(ledger_event.c.dedupe_key, ledger_event.c.id).where(
    ledger_event.c.dedupe_key.in_(bindparam("keys", expanding=True))
)


def append(
    conn: Connection,
    *,
    event_type: str,
    dedupe_key: str,
    amount_minor: int,
    currency: str,
    source_type: str,
    source_id: str | None,
    now: datetime,
    entries: Sequence[tuple[str, int]] = (),
    payment_id: str | None = None,
    refund_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> int:
    """Append one event and its lines in the caller's transaction; return the event id.

    Raises UnbalancedEntries before writing anything if the lines do not sum to
    zero, and IntegrityError (rolling back the caller) if ``dedupe_key`` exists.
    """
    _check_balanced(event_type, entries)
    row = _event_row(
        event_type, dedupe_key, amount_minor, currency, source_type, source_id, now, payment_id, refund_id, details
    )
    event_id = conn.execute(_INSERT_EVENT, row).inserted_primary_key[0]
    if entries:
        conn.execute(_INSERT_ENTRY, _entry_rows(event_id, entries, currency))
    return event_id


def append_many(conn: Connection, records: Sequence[Mapping[str, Any]]) -> list[int]:
    """``append`` for several events at once (each record holds ``append``'s arguments); return their ids.

    Three statements whatever the count: one multi-row INSERT of the events, one
    SELECT of their ids by ``dedupe_key`` (portable: no RETURNING, no reliance on
    consecutive AUTO_INCREMENT values), one multi-row INSERT of every line. The
    rows written are exactly those ``append`` writes one by one, lines in the
    same order, so the seal digests are the same. Raises like ``append`` (an
    existing ``dedupe_key`` fails the whole statement).
    """
    if not records:
        return []
    for r in records:
        _check_balanced(r["event_type"], r.get("entries", ()))
    conn.execute(
        _INSERT_EVENT,
        [
            _event_row(
                r["event_type"],
                r["dedupe_key"],
                r["amount_minor"],
                r["currency"],
                r["source_type"],
                r["source_id"],
                r["now"],
                r.get("payment_id"),
                r.get("refund_id"),
                r.get("details"),
            )
            for r in records
        ],
    )
    keys = [r["dedupe_key"] for r in records]
    ids = dict(conn.execute(_EVENT_IDS, {"keys": keys}).all())
    lines = [line for r in records for line in _entry_rows(ids[r["dedupe_key"]], r.get("entries", ()), r["currency"])]
    if lines:
        conn.execute(_INSERT_ENTRY, lines)
    return [ids[key] for key in keys]


def _check_balanced(event_type: str, entries: Sequence[tuple[str, int]]) -> None:
    if any(not isinstance(amount, int) or isinstance(amount, bool) for _, amount in entries):
        raise UnbalancedEntries("ledger amounts must be integer minor units")
    if sum(amount for _, amount in entries) != 0:
        raise UnbalancedEntries(f"{event_type} lines sum to {sum(a for _, a in entries)}, not 0")


def _event_row(
    event_type: str,
    dedupe_key: str,
    amount_minor: int,
    currency: str,
    source_type: str,
    source_id: str | None,
    now: datetime,
    payment_id: str | None,
    refund_id: str | None,
    details: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "event_type": event_type,
        "payment_id": payment_id,
        "refund_id": refund_id,
        "amount_minor": amount_minor,
        "currency": currency,
        "source_type": source_type,
        "source_id": source_id,
        "dedupe_key": dedupe_key,
        "details": json.dumps(details, sort_keys=True) if details else None,
        "created_at": now,
    }


def _entry_rows(event_id: int, entries: Sequence[tuple[str, int]], currency: str) -> list[dict[str, Any]]:
    return [
        {"ledger_event_id": event_id, "account": account, "amount_minor": amount, "currency": currency}
        for account, amount in entries
    ]


def history(conn: Connection, payment_id: str) -> list[dict[str, Any]]:
    """Ledger events of a payment (and its refunds), oldest first, each with its lines."""
    events = conn.execute(
        select(ledger_event).where(ledger_event.c.payment_id == payment_id).order_by(ledger_event.c.id)
    ).mappings()
    out = []
    for ev in events:
        lines = conn.execute(
            select(ledger_entry.c.account, ledger_entry.c.amount_minor)
            .where(ledger_entry.c.ledger_event_id == ev["id"])
            .order_by(ledger_entry.c.id)
        ).all()
        out.append(
            {
                "event_type": ev["event_type"],
                "amount": ev["amount_minor"],
                "currency": ev["currency"],
                "refund_id": ev["refund_id"],
                "source": f"{ev['source_type']}:{ev['source_id']}" if ev["source_id"] else ev["source_type"],
                "created_at": ev["created_at"].isoformat() + "Z",
                "entries": [{"account": a, "amount": m} for a, m in lines],
            }
        )
    return out


def payment_balance(conn: Connection, payment_id: str) -> dict[str, int]:
    """What a payment earned, by currency, as the ledger derives it: confirmed charge minus confirmed refunds.

    Read from the income accounts only, so fees (expenses) and reconciliation
    adjustments (suspense) never change it.
    """
    rows = conn.execute(
        select(ledger_entry.c.currency, func.sum(ledger_entry.c.amount_minor))
        .join(ledger_event, ledger_event.c.id == ledger_entry.c.ledger_event_id)
        .where(ledger_event.c.payment_id == payment_id, ledger_entry.c.account.in_(INCOME_ACCOUNTS))
        .group_by(ledger_entry.c.currency)
    ).all()
    return {currency: -int(total) for currency, total in rows if total}


def balances(conn: Connection) -> dict[tuple[str, str], int]:
    """The trial balance: (account, currency) -> signed total; every currency's totals sum to zero."""
    rows = conn.execute(
        select(ledger_entry.c.account, ledger_entry.c.currency, func.sum(ledger_entry.c.amount_minor)).group_by(
            ledger_entry.c.account, ledger_entry.c.currency
        )
    ).all()
    return {(account, currency): int(total) for account, currency, total in rows}


def unbalanced_events(conn: Connection, limit: int = 10) -> list[int]:
    """Ids of events whose lines do not sum to zero in some currency (there should be none)."""
    rows = conn.execute(
        select(ledger_entry.c.ledger_event_id)
        .group_by(ledger_entry.c.ledger_event_id, ledger_entry.c.currency)
        .having(func.sum(ledger_entry.c.amount_minor) != 0)
        .order_by(ledger_entry.c.ledger_event_id)
        .limit(limit)
    ).scalars()
    return list(rows)
