"""The sandbox platform's settlement CSV, read as ``payments.providers.settlement`` lines (pure).

Layout (as the platform publishes it, ``GET /v1/settlements/<YYYY-MM-DD>.csv``):
UTF-8, comma-separated, ``\\n`` line endings, a header line, then one line per
completed charge or refund created that UTC day::

    provider_transaction_id,merchant_transaction_id,type,amount,fee,currency,status,created_at
    ch_…,pay_…,charge,1000,6,CNY,succeeded,2024-03-01T10:00:00Z
    re_…,re_…,refund,300,0,CNY,succeeded,2024-03-01T11:00:00Z

``merchant_transaction_id`` is our payment_id on charge lines and our
refund_id on refund lines (the charge's payment_id if the refund carried
none). Amounts and fees are whole minor units; only succeeded charges pay a
fee. The layout is written down here from the platform's documentation, not
imported from ``sandbox/`` (an outside party).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from typing import BinaryIO

from payments.providers.settlement import (
    CHARGE,
    INFO,
    INVALID,
    REFUND,
    STATUSES,
    SettlementFormatError,
    SettlementLine,
    csv_records,
)

FORMAT = "sandbox_csv"
COLUMNS = (
    "provider_transaction_id",
    "merchant_transaction_id",
    "type",
    "amount",
    "fee",
    "currency",
    "status",
    "created_at",
)
_TYPES = {"charge": CHARGE, "refund": REFUND}
_WHOLE = re.compile(r"-?\d{1,18}", re.ASCII)
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z", re.ASCII)


def parse(stream: BinaryIO) -> Iterator[SettlementLine]:
    """Every record of a sandbox settlement file, header first; SettlementFormatError if it is not one.

    Lines come out as read; the importer passes each through ``payments.providers.settlement.checked``.
    """
    records = csv_records(stream, "utf-8")
    first = next(records, None)
    if first is None:
        raise SettlementFormatError("empty file: no header line")
    line_no, raw, fields = first
    if tuple(fields) != COLUMNS:
        raise SettlementFormatError(f"line {line_no}: not a sandbox settlement header: {raw[:120]!r}")
    yield SettlementLine(line_no, raw, INFO)
    for line_no, raw, fields in records:
        yield read_line(line_no, raw, fields)


def read_line(line_no: int, raw: str, fields: list[str]) -> SettlementLine:
    """One data record; an unreadable one comes back as ``invalid`` with the reason."""
    if not fields or fields == [""]:
        return SettlementLine(line_no, raw, INFO)
    if len(fields) != len(COLUMNS):
        return _bad(line_no, raw, f"expected {len(COLUMNS)} fields, got {len(fields)}")
    provider_reference, merchant_reference, type_, amount, fee, currency, status, stamp = fields
    kind = _TYPES.get(type_)
    if kind is None:
        return _bad(line_no, raw, f"unknown type {type_[:20]!r}")
    if status not in STATUSES:
        return _bad(line_no, raw, f"unknown status {status[:20]!r}")
    if not _WHOLE.fullmatch(amount) or not _WHOLE.fullmatch(fee):
        return _bad(line_no, raw, "amount and fee must be whole minor units")
    if not _TIME.fullmatch(stamp):
        return _bad(line_no, raw, "created_at must be YYYY-MM-DDTHH:MM:SSZ")
    try:  # by hand: strptime costs more than the rest of the line together
        occurred = datetime(
            int(stamp[0:4]), int(stamp[5:7]), int(stamp[8:10]), int(stamp[11:13]), int(stamp[14:16]), int(stamp[17:19])
        )
    except ValueError:
        return _bad(line_no, raw, "created_at is not a real time")
    # Field by field only; payments.providers.settlement.checked (run by the importer on every line) holds the rest.
    return SettlementLine(
        line_no,
        raw,
        kind,
        status,
        provider_reference or None,
        merchant_reference or None,
        int(amount),
        int(fee),
        currency,
        occurred,
    )


def _bad(line_no: int, raw: str, reason: str) -> SettlementLine:
    return SettlementLine(line_no, raw, INVALID, error=reason)
