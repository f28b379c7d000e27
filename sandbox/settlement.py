"""Settlement files: one CSV per UTC day of every completed charge and refund, with fees. Pure functions.

Fees: a succeeded charge pays ``amount * rate`` rounded half up to whole minor
units (Decimal, never float). A failed charge moved no money and pays none. A
refund pays none and gives none back: like most card platforms, the fee of the
original charge is kept and no new fee is taken, so the file's fee column is
exactly what the platform earned that day.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal

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
"""The header of every settlement file, in order."""

_DAY = re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII)


@dataclass(frozen=True)
class SettlementRow:
    """One completed charge or refund, as the platform's books hold it."""

    provider_transaction_id: str
    merchant_transaction_id: str
    type: str
    """"charge" or "refund"."""
    amount: int
    currency: str
    status: str
    """"succeeded" or "failed"."""
    created_at: float
    """Unix seconds."""


def fee(amount: int, rate: Decimal) -> int:
    """The platform's fee on ``amount`` minor units: ``amount * rate`` rounded half up."""
    return int((Decimal(amount) * rate).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def row_fee(row: SettlementRow, rate: Decimal) -> int:
    """The fee of one row: only succeeded charges pay one."""
    if row.type == "charge" and row.status == "succeeded":
        return fee(row.amount, rate)
    return 0


def parse_day(text: str) -> date:
    """A ``YYYY-MM-DD`` day; raise ValueError for anything else."""
    # fromisoformat alone also takes "20240101" and "2024-W01-1".
    if not _DAY.fullmatch(text):
        raise ValueError("date must be YYYY-MM-DD")
    return date.fromisoformat(text)


def day_bounds(day: date) -> tuple[float, float]:
    """Unix seconds of the start of ``day`` (UTC) and of the next day."""
    start = datetime.combine(day, time(0), tzinfo=UTC)
    return start.timestamp(), (start + timedelta(days=1)).timestamp()


def iso(ts: float) -> str:
    """Unix seconds as ISO 8601 UTC with a Z, to the second."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_csv(rows: Iterable[SettlementRow], rate: Decimal) -> str:
    """The settlement file: the header, then one line per row in creation order."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for row in sorted(rows, key=lambda r: (r.created_at, r.provider_transaction_id)):
        writer.writerow(
            [
                row.provider_transaction_id,
                row.merchant_transaction_id,
                row.type,
                row.amount,
                row_fee(row, rate),
                row.currency,
                row.status,
                iso(row.created_at),
            ]
        )
    return out.getvalue()
