"""WeChat Pay's trade bill (交易账单, ``bill_type=ALL``): a pure streaming parser.

Layout, from "交易账单文件格式说明" (pay.weixin.qq.com/docs/merchant/products/bill-download/format-trade.html):
four parts, every field separated by an ASCII comma —

1. the detail header: column names, no prefix (the file may open with a UTF-8 BOM);
2. detail lines: every field prefixed with a back-quote (`` ` ``) so spreadsheets
   keep long numbers intact; one line per payment (交易状态 SUCCESS, or
   REVOKED) and one per refund (交易状态 REFUND, with the refund columns);
3. the summary header, which starts ``总交易单数`` ("number of transactions");
4. the summary line (back-quoted too): counts and totals, never a settlement line.

Columns are read by name, not position, since the column set has grown over
the years (订单金额, 申请退款金额 and 费率备注 came with the 2018
free-recharge-coupon settlement). Amounts are yuan as decimal strings, turned
into fen with Decimal; a fee may carry more than two decimals and is rounded
half up to fen, which is what is actually settled. Times are Beijing time
(UTC+8). A detail line that does not fit the header, a missing summary, or a
summary whose count disagrees with the detail lines raises BillFormatError
with the line number: a bill that does not add up is never half-trusted.

``read_settlement`` is the reconciliation's parser (``payments.reconciliation.reconcile.PARSERS``):
the bill's bytes in, every line out as a ``payments.providers.settlement.SettlementLine``.
It reads the file twice (it is the seekable copy reconciliation keeps): once
to check the header, the summary and its count, so that a bill that does not
add up is refused before any line of it is matched; then line by line, a
detail line that cannot be read coming out as invalid.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from typing import BinaryIO, Literal

from payments.providers.settlement import (
    CHARGE,
    FAILED,
    INFO,
    INVALID,
    REFUND,
    SUCCEEDED,
    SettlementFormatError,
    SettlementLine,
)

BEIJING = timezone(timedelta(hours=8), "Asia/Shanghai")
"""The bill's clock."""
SUMMARY_MARKER = "总交易单数"
"""First column of the summary header: everything after it is totals."""
REQUIRED = ("交易时间", "微信订单号", "商户订单号", "交易状态", "货币种类", "应结订单金额", "退款金额", "手续费")
"""Detail columns every trade bill carries."""
REFUND_COLUMNS = ("微信退款单号", "商户退款单号", "退款状态")
"""Needed by refund lines (present in ALL and REFUND bills)."""

FORMAT = "wechatpay_trade_bill"
"""settlement_file.format of these files."""
FINAL_STATUSES = {
    "charge": {"SUCCESS": SUCCEEDED, "REVOKED": FAILED},
    "refund": {"SUCCESS": SUCCEEDED, "CLOSED": FAILED, "REFUNDCLOSE": FAILED},
}
"""A line's status as a settlement status; PROCESSING is not final yet, anything else (ABNORMAL) needs a person."""

_FEN = Decimal("0.01")


class BillFormatError(ValueError):
    """The bill does not follow the published layout; ``line_number`` says where (1-based)."""

    def __init__(self, line_number: int, message: str) -> None:
        super().__init__(f"line {line_number}: {message}")
        self.line_number = line_number


@dataclass(frozen=True)
class BillLine:
    """One payment or refund line of the bill, normalised; ``raw`` and ``line_number`` point back to the file."""

    line_number: int
    raw: str
    kind: Literal["charge", "refund"]
    provider_transaction_id: str
    """微信订单号: WeChat's transaction id (of the payment, also on its refund lines)."""
    merchant_reference: str
    """商户订单号: our payment_id."""
    provider_refund_id: str | None
    """微信退款单号, refund lines only."""
    merchant_refund_id: str | None
    """商户退款单号: our refund_id, refund lines only."""
    amount_minor: int
    """Charge: 订单金额 (what the order asked for); refund: 申请退款金额 (what we asked back). Fen."""
    settled_minor: int
    """Charge: 应结订单金额 (order less non-recharge coupons); refund: 退款金额. Fen."""
    currency: str
    status: str
    """Charge: 交易状态 (SUCCESS, REVOKED); refund: 退款状态 (SUCCESS, PROCESSING, …)."""
    fee_minor: int
    """手续费 in fen, rounded half up; negative when a refund gives fee back."""
    occurred_at: datetime
    """交易时间 as an aware UTC datetime (payment time, or refund time for refunds)."""
    description: str
    """商品名称, as the payer saw it."""


@dataclass(frozen=True)
class BillSummary:
    """The totals WeChat Pay states at the end of the bill."""

    line_number: int
    count: int
    """总交易单数: detail lines in the bill."""
    settled_total_minor: int | None
    """应结订单总金额."""
    refund_total_minor: int | None
    """退款总金额."""
    fee_total_minor: int | None
    """手续费总金额 (rounded half up to fen)."""


class TradeBill:
    """Iterate a trade bill's lines of text into BillLine, lazily; ``summary`` is set once iteration ends.

    ``lines`` may be any iterable of text lines (a file opened with
    ``encoding="utf-8-sig"``, a list); line endings are ignored.
    """

    def __init__(self, lines: Iterable[str]) -> None:
        self._lines = lines
        self.summary: BillSummary | None = None

    def __iter__(self) -> Iterator[BillLine]:
        for _, _, item in self.records():
            if isinstance(item, BillFormatError):
                raise item
            if item is not None:
                yield item

    def records(self) -> Iterator[tuple[int, str, BillLine | BillFormatError | None]]:
        """Every line as (number, text, its BillLine, why it cannot be read, or None: not a detail line).

        Raises BillFormatError for what makes the bill as a whole unreadable:
        no header, no summary, a summary whose count is not the detail lines'.
        """
        columns: dict[str, int] | None = None
        summary_columns: list[str] | None = None
        details = 0
        for number, text in enumerate(self._lines, start=1):
            line = text.rstrip("\r\n")
            if number == 1:
                line = line.lstrip("\ufeff")
            item: BillLine | BillFormatError | None = None
            try:
                if not line.strip():
                    pass
                elif self.summary is not None:
                    raise BillFormatError(number, "text after the summary line")
                elif columns is None:
                    columns = _header(number, line)
                elif summary_columns is not None:
                    self.summary = _summary(number, line, summary_columns)
                elif not line.startswith("`") and line.split(",", 1)[0].strip() == SUMMARY_MARKER:
                    summary_columns = [name.strip() for name in line.split(",")]
                else:
                    details += 1
                    item = _detail(number, line, columns)
            except BillFormatError as exc:
                if columns is None or (summary_columns is not None and self.summary is None):
                    raise  # no header, or a summary that cannot be read: nothing of the bill adds up
                item = exc
            yield number, line, item
        if columns is None:
            raise BillFormatError(0, "empty bill: no header")
        if self.summary is None:
            raise BillFormatError(0, "no summary line: the bill is cut short")
        if self.summary.count != details:
            raise BillFormatError(
                self.summary.line_number, f"summary counts {self.summary.count} lines, the bill has {details}"
            )


def parse_trade_bill(lines: Iterable[str]) -> Iterator[BillLine]:
    """The settlement lines of a trade bill, streaming (see TradeBill); the summary is checked, never yielded."""
    return iter(TradeBill(lines))


def _header(number: int, line: str) -> dict[str, int]:
    if line.startswith("`"):
        raise BillFormatError(number, "expected the column header, found a data line")
    names = [name.strip() for name in line.split(",")]
    missing = [name for name in REQUIRED if name not in names]
    if missing:
        raise BillFormatError(number, f"header lacks {', '.join(missing)}")
    return {name: index for index, name in enumerate(names)}


def _fields(number: int, line: str, expected: int) -> list[str]:
    if not line.startswith("`"):
        raise BillFormatError(number, "data fields must start with a back-quote")
    # Every field starts with a back-quote, so ",`" separates fields even when a description holds a comma.
    fields = line[1:].split(",`")
    if len(fields) != expected:
        raise BillFormatError(number, f"{len(fields)} fields, the header has {expected}")
    return [f.strip() for f in fields]


def _detail(number: int, line: str, columns: dict[str, int]) -> BillLine:
    fields = _fields(number, line, len(columns))

    def get(name: str) -> str:
        index = columns.get(name)
        return fields[index] if index is not None else ""

    state = get("交易状态")
    if state == "REFUND":
        missing = [name for name in REFUND_COLUMNS if name not in columns]
        if missing:
            raise BillFormatError(number, f"refund line but the header lacks {', '.join(missing)}")
        refund_id = get("商户退款单号")
        if not refund_id or refund_id == "0":
            raise BillFormatError(number, "refund line without 商户退款单号")
        settled = _fen(number, "退款金额", get("退款金额"))
        asked = get("申请退款金额")
        kind: Literal["charge", "refund"] = "refund"
        amount = _fen(number, "申请退款金额", asked) if asked else settled
        status = get("退款状态")
        provider_refund_id: str | None = get("微信退款单号") or None
        merchant_refund_id: str | None = refund_id
    else:
        settled = _fen(number, "应结订单金额", get("应结订单金额"))
        total = get("订单金额")
        kind = "charge"
        amount = _fen(number, "订单金额", total) if total else settled
        status = state
        provider_refund_id = merchant_refund_id = None
    if not status:
        raise BillFormatError(number, "no status")
    transaction_id, reference = get("微信订单号"), get("商户订单号")
    if not transaction_id or not reference:
        raise BillFormatError(number, "微信订单号 and 商户订单号 are required")
    currency = get("货币种类")
    if len(currency) != 3 or not currency.isascii() or not currency.isalpha():
        raise BillFormatError(number, f"货币种类 {currency[:10]!r} is not a currency code")
    return BillLine(
        line_number=number,
        raw=line,
        kind=kind,
        provider_transaction_id=transaction_id,
        merchant_reference=reference,
        provider_refund_id=provider_refund_id,
        merchant_refund_id=merchant_refund_id,
        amount_minor=amount,
        settled_minor=settled,
        currency=currency.upper(),
        status=status,
        fee_minor=_fen(number, "手续费", get("手续费"), exact=False),
        occurred_at=_time(number, get("交易时间")),
        description=get("商品名称"),
    )


def _summary(number: int, line: str, names: list[str]) -> BillSummary:
    fields = _fields(number, line, len(names))
    values = dict(zip(names, fields, strict=True))
    try:
        count = int(values[SUMMARY_MARKER])
    except ValueError:
        raise BillFormatError(number, f"{SUMMARY_MARKER} is not a whole number") from None

    def money(name: str, exact: bool = True) -> int | None:
        return _fen(number, name, values[name], exact=exact) if name in values else None

    return BillSummary(
        line_number=number,
        count=count,
        settled_total_minor=money("应结订单总金额"),
        refund_total_minor=money("退款总金额"),
        fee_total_minor=money("手续费总金额", exact=False),
    )


def _fen(number: int, name: str, text: str, *, exact: bool = True) -> int:
    """Yuan text → fen. ``exact``: more than two decimals is an error (fees are rounded instead)."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise BillFormatError(number, f"{name} {text[:20]!r} is not an amount") from None
    if not value.is_finite():
        raise BillFormatError(number, f"{name} {text[:20]!r} is not an amount")
    fen = value * 100
    if exact and fen != fen.to_integral_value():
        raise BillFormatError(number, f"{name} {text[:20]!r} has fractions of a fen")
    return int(value.quantize(_FEN, rounding=ROUND_HALF_UP) * 100)


def _time(number: int, text: str) -> datetime:
    try:
        local = datetime.strptime(text, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        raise BillFormatError(number, f"交易时间 {text[:25]!r} is not YYYY-MM-DD HH:MM:SS") from None
    return local.replace(tzinfo=BEIJING).astimezone(UTC)


def read_settlement(stream: BinaryIO) -> Iterator[SettlementLine]:
    """A trade bill's bytes as settlement lines, every line in order (see the module docstring).

    An empty file is a day WeChat Pay has no bill for (NO_STATEMENT_EXIST):
    no lines. SettlementFormatError when the bill does not add up.
    """
    if not stream.read(1):
        return
    stream.seek(0)
    try:
        with _text(stream) as text:
            for _ in TradeBill(text).records():
                pass
        stream.seek(0)
        with _text(stream) as text:
            for number, line, item in TradeBill(text).records():
                yield settlement_line(number, line, item)
    except BillFormatError as exc:
        raise SettlementFormatError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise SettlementFormatError(f"the bill is not UTF-8 text ({exc.reason})") from None


@contextlib.contextmanager
def _text(stream: BinaryIO) -> Iterator[io.TextIOWrapper]:
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
    try:
        yield text
    finally:
        with contextlib.suppress(ValueError):
            text.detach()  # the caller owns the stream


def settlement_line(number: int, line: str, item: BillLine | BillFormatError | None) -> SettlementLine:
    """One record of ``TradeBill.records`` as a settlement line (pure).

    A charge names 微信订单号 and our payment_id; a refund 微信退款单号 and our
    refund_id (商户退款单号). The amount is what was asked (订单金额,
    申请退款金额), as our records hold it. A refund still PROCESSING is info
    (a later bill has its outcome); a status that is neither final nor that
    (ABNORMAL: WeChat Pay could not pay it back) is invalid: a person decides.
    """
    if item is None:
        return SettlementLine(number, line, INFO)
    if isinstance(item, BillFormatError):
        return SettlementLine(number, line, INVALID, error=str(item)[:255])
    refund = item.kind == "refund"
    status = FINAL_STATUSES[item.kind].get(item.status)
    if status is None:
        if refund and item.status == "PROCESSING":
            return SettlementLine(number, line, INFO)
        return SettlementLine(number, line, INVALID, error=f"{item.kind} status {item.status[:20]!r} is not final")
    return SettlementLine(
        number,
        line,
        REFUND if refund else CHARGE,
        status=status,
        provider_reference=item.provider_refund_id if refund else item.provider_transaction_id,
        merchant_reference=item.merchant_refund_id if refund else item.merchant_reference,
        amount_minor=item.amount_minor,
        fee_minor=item.fee_minor,
        currency=item.currency,
        occurred_at=item.occurred_at.astimezone(UTC).replace(tzinfo=None),
    )
