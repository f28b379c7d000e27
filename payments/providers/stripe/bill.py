"""Stripe's balance transactions, read as settlement lines (pure, streaming).

Stripe has no daily bill file for an account's own payments; the ledger of
money is the balance transaction list (``GET /v1/balance_transactions``, one
object per movement of the balance). The adapter pages through a day's list
(``created[gte]``/``created[lt]``, ``expand[]=data.source``) and hands this
parser JSON lines: one balance transaction object per line, as the API gave
it. The object (https://docs.stripe.com/api/balance_transactions/object)::

    {"id": "txn_…", "object": "balance_transaction", "amount": 1000, "fee": 59,
     "net": 941, "currency": "usd", "created": 1714557600, "available_on": …,
     "status": "pending", "type": "charge", "reporting_category": "charge",
     "fee_details": [{"amount": 59, "currency": "usd", "type": "stripe_fee", …}],
     "source": "ch_…"  (or, expanded, the Charge / Refund / … object)}

``amount`` is signed in the currency's Stripe unit (a refund is negative),
``fee`` is what Stripe kept (negative when a fee was given back) and ``net`` =
amount − fee, all in the balance's currency.

**Cross-currency lines.** A charge in EUR on an account that settles in USD
has a USD balance transaction with ``exchange_rate`` set (EUR amount × rate =
USD amount). Our payment is the EUR one, so the line's ``amount_minor`` and
``currency`` are the charge's (the expanded source's ``amount_captured`` or
``amount``, and ``currency``; a refund's ``amount``), and what reached the
balance is kept beside them: ``settlement_amount_minor``,
``settlement_currency``, ``exchange_rate`` (as Stripe wrote it); ``fee_minor``
and ``net_minor`` stay in the settlement currency. A converted line whose source
is not expanded cannot be matched and is ``invalid``. Types read here:

- ``charge`` / ``payment`` → kind ``charge``, succeeded; the reference is the
  source charge's ``payment_intent`` (our provider_transaction_id);
- ``refund`` / ``payment_refund`` → kind ``refund``, succeeded (failed when
  the expanded Refund is failed or canceled: the bank sent it back);
  ``refund_failure`` (the money came back) → kind ``refund``, failed; the
  reference is the refund id and ``metadata.refund_id`` our number;
- ``stripe_fee``, ``stripe_fx_fee``, ``tax_fee``, ``network_cost`` → kind
  ``fee`` (fee_minor = what was taken);
- ``adjustment``, ``payment_reversal`` → kind ``adjustment``; ``payout`` and
  its cancel/failure → kind ``payout``; any other type → ``other``.

Amounts come out as paysync minor units (``stripe_money.from_stripe``), always
non-negative: the kind says which way the money went. A line that cannot be
read comes out as ``invalid`` with the reason and its text, never dropped.
The fields are named like ``payments.providers.settlement.SettlementLine``, so
``settlement_line`` (the mapping ``read_settlement``, the reconciliation's
parser, applies) is one step: adjustments, payouts and other types are info
there (money moved that is not a charge, refund or fee of ours).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, BinaryIO

from payments.providers.settlement import CHARGE, FEE, INFO, INVALID, REFUND, SettlementLine
from payments.providers.stripe.money import AmountError, from_stripe, iso_currency

CHARGE_TYPES = frozenset({"charge", "payment"})
REFUND_TYPES = frozenset({"refund", "payment_refund"})
REFUND_FAILURE_TYPES = frozenset({"refund_failure"})
FEE_TYPES = frozenset({"stripe_fee", "stripe_fx_fee", "tax_fee", "network_cost"})
ADJUSTMENT_TYPES = frozenset({"adjustment", "payment_reversal"})
PAYOUT_TYPES = frozenset({"payout", "payout_cancel", "payout_failure"})
FORMAT = "stripe_balance_transactions"
"""settlement_file.format of these files (JSON lines, one balance transaction each)."""
MAX_LINE_BYTES = 1 << 20
"""A line longer than this is invalid (a balance transaction with its source is a few kilobytes)."""


@dataclass(frozen=True)
class BalanceLine:
    """One balance transaction as a settlement line: where it stands, its text, its normalised fields."""

    line_no: int
    """1-based line of the JSON-lines stream."""
    raw: str
    """The line's text exactly as in the stream, without the line ending."""
    kind: str
    """charge, refund, fee, adjustment, payout, other, info (a blank line) or invalid."""
    status: str | None = None
    """succeeded or failed (charge and refund lines)."""
    provider_reference: str | None = None
    """Charge lines: the PaymentIntent id (or the charge id if the source was not expanded); refund lines: re_…."""
    merchant_reference: str | None = None
    """Our payment_id / refund_id, when the source carries it in its metadata."""
    amount_minor: int | None = None
    """Magnitude in paysync minor units (>= 0)."""
    fee_minor: int = 0
    """Fee Stripe kept on this line (negative: a fee given back). A fee line's fee is its amount."""
    currency: str | None = None
    occurred_at: datetime | None = None
    """``created``, naive UTC."""
    error: str | None = None
    """Why an invalid line could not be read."""
    transaction_id: str | None = None
    """The balance transaction's txn_… id."""
    type: str | None = None
    """Stripe's ``type``, unchanged."""
    net_minor: int | None = None
    """Stripe's ``net`` (signed) in paysync minor units, in the balance's currency."""
    settlement_amount_minor: int | None = None
    """Cross-currency lines: the magnitude that reached the balance, in ``settlement_currency``."""
    settlement_currency: str | None = None
    """Cross-currency lines: the balance's currency (``currency`` is the charge's or refund's)."""
    exchange_rate: str | None = None
    """Cross-currency lines: Stripe's ``exchange_rate``, exactly as written."""


def parse_balance_transactions(stream: Iterable[bytes]) -> Iterator[BalanceLine]:
    """Every line of a JSON-lines stream of balance transactions (a binary file or an iterable of chunks)."""
    for line_no, data in enumerate(_lines(stream), start=1):
        yield read_line(line_no, data)


def _lines(stream: Iterable[bytes]) -> Iterator[bytes]:
    pending = b""
    for chunk in stream:
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.removesuffix(b"\r")
    if pending:
        yield pending.removesuffix(b"\r")


def read_line(line_no: int, data: bytes) -> BalanceLine:
    """One line; an unreadable one comes back as ``invalid`` with the reason (pure)."""
    raw = data.decode("utf-8", "replace")
    if not raw.strip():
        return BalanceLine(line_no, raw, "info")
    if len(data) > MAX_LINE_BYTES:
        return _bad(line_no, raw[:1000], "line too long")
    try:
        # parse_float: exchange_rate is a JSON number, kept exact (an amount with a fraction stays invalid).
        txn = json.loads(data, parse_float=Decimal)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return _bad(line_no, raw, "not a JSON object")
    if not isinstance(txn, dict) or txn.get("object") != "balance_transaction":
        return _bad(line_no, raw, "not a balance_transaction object")
    txn_id = txn.get("id")
    txn_type = txn.get("type")
    if not isinstance(txn_id, str) or not txn_id or len(txn_id) > 128:
        return _bad(line_no, raw, "id must be a string")
    if not isinstance(txn_type, str) or not txn_type:
        return _bad(line_no, raw, "type must be a string")
    try:
        currency = iso_currency(txn.get("currency"))
        amount = from_stripe(txn.get("amount"), currency)
        fee = from_stripe(txn.get("fee"), currency)
        net = from_stripe(txn.get("net"), currency)
    except AmountError as exc:
        return _bad(line_no, raw, str(exc))
    if amount - fee != net:
        return _bad(line_no, raw, "net is not amount - fee")
    created = txn.get("created")
    if not isinstance(created, int) or isinstance(created, bool) or created <= 0:
        return _bad(line_no, raw, "created must be a unix timestamp")
    common: dict[str, Any] = {
        "currency": currency,
        "occurred_at": datetime.fromtimestamp(created, UTC).replace(tzinfo=None),
        "transaction_id": txn_id,
        "type": txn_type,
        "net_minor": net,
    }
    source = txn.get("source")
    if txn_type in CHARGE_TYPES or txn_type in REFUND_TYPES or txn_type in REFUND_FAILURE_TYPES:
        converted = _converted(
            txn, source, currency, abs(amount), "amount_captured" if txn_type in CHARGE_TYPES else None
        )
        if isinstance(converted, str):
            return _bad(line_no, raw, converted)
        if converted:
            common.update(converted)
            amount = converted["currency_amount"] if amount > 0 else -converted["currency_amount"]
            del common["currency_amount"]
    if txn_type in CHARGE_TYPES:
        if amount <= 0:
            return _bad(line_no, raw, "a charge must add to the balance")
        return BalanceLine(
            line_no,
            raw,
            "charge",
            status="succeeded",
            provider_reference=_charge_reference(source),
            merchant_reference=_metadata(source, "payment_id"),
            amount_minor=amount,
            fee_minor=fee,
            **common,
        )
    if txn_type in REFUND_TYPES or txn_type in REFUND_FAILURE_TYPES:
        failed = txn_type in REFUND_FAILURE_TYPES
        if (amount > 0) != failed or amount == 0:
            return _bad(line_no, raw, "a refund takes from the balance; a refund failure gives back")
        # The expanded Refund is its state now: one the bank sent back has a refund_failure line giving the
        # money back, so its refund line is the failed refund's too (the two net to nothing at Stripe).
        sent_back = isinstance(source, Mapping) and source.get("status") in ("failed", "canceled")
        return BalanceLine(
            line_no,
            raw,
            "refund",
            status="failed" if failed or sent_back else "succeeded",
            provider_reference=_source_id(source),
            merchant_reference=_metadata(source, "refund_id"),
            amount_minor=abs(amount),
            fee_minor=fee,
            **common,
        )
    if txn_type in FEE_TYPES:
        reference = _source_id(source)
        return BalanceLine(
            line_no, raw, "fee", provider_reference=reference, amount_minor=abs(amount), fee_minor=-amount, **common
        )
    kind = "adjustment" if txn_type in ADJUSTMENT_TYPES else "payout" if txn_type in PAYOUT_TYPES else "other"
    return BalanceLine(
        line_no, raw, kind, provider_reference=_source_id(source), amount_minor=abs(amount), fee_minor=fee, **common
    )


def _converted(
    txn: Mapping[str, Any], source: Any, currency: str, settled: int, captured_field: str | None
) -> dict[str, Any] | str | None:
    """The charge side of a cross-currency line (fields for BalanceLine), None if not converted, or why not readable.

    ``settled``: the line's magnitude in the balance's ``currency``.
    """
    rate = txn.get("exchange_rate")
    own = source.get("currency") if isinstance(source, Mapping) else None
    if rate is None and (own is None or str(own).upper() == currency):
        return None
    if not isinstance(source, Mapping):
        return "converted from another currency, but the source is not expanded: its own amount is unknown"
    if isinstance(rate, bool) or not isinstance(rate, int | Decimal) or not rate > 0:
        return "exchange_rate must be a positive number"
    try:
        own_currency = iso_currency(own)
        own_value = source.get(captured_field) if captured_field else None
        if own_value is None:
            own_value = source.get("amount")
        own_amount = from_stripe(own_value, own_currency)
    except AmountError as exc:
        return f"source amount/currency: {exc}"
    if own_currency == currency or own_amount <= 0:
        return "a converted line's source must be a positive amount in another currency"
    text = format(Decimal(rate), "f")
    if len(text) > 31:
        return "exchange_rate has too many digits"
    return {
        "currency": own_currency,
        "currency_amount": own_amount,
        "settlement_amount_minor": settled,
        "settlement_currency": currency,
        "exchange_rate": text,
    }


def _source_id(source: Any) -> str | None:
    value = source.get("id") if isinstance(source, Mapping) else source
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None


def _charge_reference(source: Any) -> str | None:
    if isinstance(source, Mapping):
        intent = source.get("payment_intent")
        intent = intent.get("id") if isinstance(intent, Mapping) else intent
        if isinstance(intent, str) and 0 < len(intent) <= 128:
            return intent
    return _source_id(source)


def _metadata(source: Any, key: str) -> str | None:
    metadata = source.get("metadata") if isinstance(source, Mapping) else None
    value = metadata.get(key) if isinstance(metadata, Mapping) else None
    return value if isinstance(value, str) and 0 < len(value) <= 64 else None


def _bad(line_no: int, raw: str, reason: str) -> BalanceLine:
    return BalanceLine(line_no, raw, "invalid", error=reason[:255])


SETTLEMENT_KINDS = {"charge": CHARGE, "refund": REFUND, "fee": FEE, "invalid": INVALID}
"""BalanceLine kinds that are settlement kinds as they are; every other kind is info."""


def read_settlement(stream: BinaryIO) -> Iterator[SettlementLine]:
    """A day's balance transactions (JSON lines) as settlement lines, every line in order (pure, streaming)."""
    return (settlement_line(line) for line in parse_balance_transactions(iter(lambda: stream.read(1 << 16), b"")))


def settlement_line(line: BalanceLine) -> SettlementLine:
    """A balance line as a settlement line: the same fields; adjustments, payouts and other types as info (pure)."""
    kind = SETTLEMENT_KINDS.get(line.kind)
    if kind is None:
        return SettlementLine(line.line_no, line.raw, INFO)
    return SettlementLine(
        line.line_no,
        line.raw,
        kind,
        status=line.status,
        provider_reference=line.provider_reference,
        merchant_reference=line.merchant_reference,
        amount_minor=line.amount_minor,
        fee_minor=line.fee_minor,
        currency=line.currency,
        occurred_at=line.occurred_at,
        error=line.error,
        settlement_amount_minor=line.settlement_amount_minor,
        settlement_currency=line.settlement_currency,
        exchange_rate=line.exchange_rate,
    )
