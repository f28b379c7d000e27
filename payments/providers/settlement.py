"""Settlement files as streams of normalised lines: the interface every provider's bill parser plugs into.

A parser is a pure function ``parse(stream) -> Iterator[SettlementLine]``: it
reads a binary file object (the bytes exactly as the provider served them)
and yields one ``SettlementLine`` per record of the file, in file order,
*every* record included: headers, comments and totals come out as
``kind="info"`` (stored, never matched), and a record it cannot read comes
out as ``kind="invalid"`` with ``error`` set (stored raw, sent to a person)
instead of stopping the import. Only a file that is not this format at all
(wrong header, wrong encoding) raises ``SettlementFormatError``. A parser
never holds more than one record in memory, so files of any size stream.

Parsers live in ``payments/providers/<provider>/bill.py``; ``payments.reconciliation.reconcile.PARSERS``
registers them (one line per provider).
"""

from __future__ import annotations

import contextlib
import csv
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from typing import BinaryIO

CHARGE = "charge"
"""Money the provider took from a customer for us."""
REFUND = "refund"
"""Money the provider gave back to a customer out of what it holds for us."""
FEE = "fee"
"""A fee line on its own (fees can also ride on a charge or refund line: ``fee_minor``)."""
INFO = "info"
"""Not a transaction: a header, a comment, a total, a blank line. Stored, not matched."""
INVALID = "invalid"
"""A record the parser could not read; ``error`` says why."""
KINDS = (CHARGE, REFUND, FEE, INFO, INVALID)

SUCCEEDED = "succeeded"
FAILED = "failed"
STATUSES = (SUCCEEDED, FAILED)

_CURRENCY = re.compile(r"[A-Z]{3}", re.ASCII)
_RATE = re.compile(r"(?=.*[1-9])[0-9]{1,15}(\.[0-9]{1,15})?", re.ASCII)
"""A positive decimal of at most 31 characters (settlement_line.exchange_rate holds 32)."""


class SettlementFormatError(ValueError):
    """The file is not in the parser's format at all (wrong header, wrong encoding): nothing of it is matched."""


@dataclass(frozen=True)
class SettlementLine:
    """One record of a settlement file: where it stands, its text unchanged, and its normalised fields."""

    line_no: int
    """The file line the record starts on, 1-based (the header is usually line 1)."""
    raw: str
    """The record's text exactly as in the file, without its line ending."""
    kind: str
    """charge, refund, fee, info or invalid."""
    status: str | None = None
    """succeeded or failed (charge and refund lines)."""
    provider_reference: str | None = None
    """The provider's id of the charge (or of the refund, for refund lines)."""
    merchant_reference: str | None = None
    """Our payment_id (or refund_id, for refund lines), when the provider echoes it."""
    amount_minor: int | None = None
    """Magnitude in minor units (> 0; the kind says which way the money went). Unused on fee lines."""
    fee_minor: int = 0
    """Fee the provider kept on this line; negative when it gave a fee back. A fee line's fee is here too."""
    currency: str | None = None
    occurred_at: datetime | None = None
    """Naive UTC."""
    error: str | None = None
    """Why an invalid line could not be read."""
    settlement_amount_minor: int | None = None
    """Cross-currency lines: the magnitude that reached our balance at the provider, in ``settlement_currency``
    (``amount_minor`` and ``currency`` are the charge's or refund's own, what we match on)."""
    settlement_currency: str | None = None
    """Cross-currency lines: the currency of the provider's balance; ``fee_minor`` is in it too."""
    exchange_rate: str | None = None
    """Cross-currency lines: the provider's rate as it wrote it (amount in currency x rate = settlement amount)."""

    def __init__(  # noqa: PLR0913 - the fields above, in order, with their defaults (a test holds them together)
        self,
        line_no: int,
        raw: str,
        kind: str,
        status: str | None = None,
        provider_reference: str | None = None,
        merchant_reference: str | None = None,
        amount_minor: int | None = None,
        fee_minor: int = 0,
        currency: str | None = None,
        occurred_at: datetime | None = None,
        error: str | None = None,
        settlement_amount_minor: int | None = None,
        settlement_currency: str | None = None,
        exchange_rate: str | None = None,
    ) -> None:
        # By hand: the frozen dataclass's own __init__ sets each field through object.__setattr__, a third of
        # a sandbox line's parse. Stored straight into the instance dict instead, in field order, so the dict
        # keeps sharing its keys with every other line's (a third of the memory of a dict built apart).
        fields = self.__dict__
        fields["line_no"] = line_no
        fields["raw"] = raw
        fields["kind"] = kind
        fields["status"] = status
        fields["provider_reference"] = provider_reference
        fields["merchant_reference"] = merchant_reference
        fields["amount_minor"] = amount_minor
        fields["fee_minor"] = fee_minor
        fields["currency"] = currency
        fields["occurred_at"] = occurred_at
        fields["error"] = error
        fields["settlement_amount_minor"] = settlement_amount_minor
        fields["settlement_currency"] = settlement_currency
        fields["exchange_rate"] = exchange_rate

    @property
    def fee_currency(self) -> str | None:
        """The currency ``fee_minor`` is in: the settlement's on a cross-currency line, else the line's."""
        return self.settlement_currency or self.currency


Parser = Callable[[BinaryIO], Iterator[SettlementLine]]
"""``parse(stream)``: a pure generator over a binary file object."""


def checked(line: SettlementLine) -> SettlementLine:
    """The line if its normalised fields hold together, else the same record as ``invalid`` with the reason.

    A guard against a parser's bug: nothing malformed reaches matching or the ledger.
    """
    problem = _problem(line)
    if problem is None:
        return line
    return SettlementLine(line.line_no, line.raw, INVALID, error=problem[:255])


def _problem(line: SettlementLine) -> str | None:
    if not isinstance(line.line_no, int) or line.line_no < 1:
        return "line number must be a positive integer"
    if line.kind not in KINDS:
        return f"unknown kind {line.kind!r}"
    if line.kind == INVALID:
        return None if line.error else "invalid line without a reason"
    if line.kind == INFO:
        return None
    if line.kind == FEE:
        if not _is_int(line.fee_minor) or line.fee_minor == 0:
            return "a fee line needs a non-zero fee_minor (negative: a fee given back)"
        if not isinstance(line.currency, str) or not _CURRENCY.fullmatch(line.currency):
            return "currency must be an ISO 4217 code"
        return None
    if line.status not in STATUSES:
        return f"status must be one of {', '.join(STATUSES)}"
    for name, limit in (("provider_reference", 128), ("merchant_reference", 128)):
        value = getattr(line, name)
        if value is not None and (not isinstance(value, str) or not value or len(value) > limit):
            return f"{name} must be a non-empty string of at most {limit} characters"
    if not (line.provider_reference or line.merchant_reference):
        return "a charge or refund line needs the provider's or our reference"
    if not _is_int(line.amount_minor) or line.amount_minor <= 0:
        return "amount must be a positive integer in minor units"
    if not _is_int(line.fee_minor):
        return "fee must be an integer in minor units"
    if not isinstance(line.currency, str) or not _CURRENCY.fullmatch(line.currency):
        return "currency must be an ISO 4217 code"
    return _settlement_problem(line)


def _settlement_problem(line: SettlementLine) -> str | None:
    """What is wrong with a line's settlement side (all three fields, or none)."""
    given = (line.settlement_amount_minor, line.settlement_currency, line.exchange_rate)
    if all(value is None for value in given):
        return None
    if not _is_int(line.settlement_amount_minor) or line.settlement_amount_minor <= 0:
        return "settlement amount must be a positive integer in minor units"
    currency = line.settlement_currency
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency) or currency == line.currency:
        return "settlement currency must be an ISO 4217 code other than the line's currency"
    if not isinstance(line.exchange_rate, str) or not _RATE.fullmatch(line.exchange_rate):
        return "exchange rate must be a positive decimal number"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def invalid(line: SettlementLine, reason: str) -> SettlementLine:
    """The same record, marked unreadable."""
    return replace(line, kind=INVALID, error=reason[:255])


def csv_records(stream: BinaryIO, encoding: str = "utf-8") -> Iterator[tuple[int, str, list[str]]]:
    """(first line number, raw text without the line ending, fields) for each CSV record of ``stream``.

    A quoted field may span lines; the raw text is then every physical line
    of the record, joined as they were. Raises SettlementFormatError on bytes
    that are not ``encoding``.
    """
    text = io.TextIOWrapper(stream, encoding=encoding, newline="")
    consumed: list[str] = []
    physical = 0

    def lines() -> Iterator[str]:
        nonlocal physical
        for line in text:
            physical += 1
            consumed.append(line)
            yield line

    start = 1
    try:
        # Not strict: a stray quote makes a record with the wrong fields (invalid), not a failed file; the csv
        # module's field size limit (128 KiB) bounds what an unclosed quote can swallow.
        for fields in csv.reader(lines()):
            raw = "".join(consumed)
            consumed.clear()
            yield start, _strip_newline(raw), fields
            start = physical + 1
    except UnicodeDecodeError as exc:
        raise SettlementFormatError(f"line {physical + 1} is not valid {encoding}: {exc.reason}") from None
    except csv.Error as exc:
        raise SettlementFormatError(f"line {start}: {exc}") from None
    finally:
        # The caller owns the stream: the wrapper, collected, must not close it (if the caller has not already).
        with contextlib.suppress(ValueError):
            text.detach()


def _strip_newline(raw: str) -> str:
    if raw.endswith("\r\n"):
        return raw[:-2]
    if raw.endswith(("\n", "\r")):
        return raw[:-1]
    return raw
