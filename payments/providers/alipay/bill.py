"""Alipay's trade bill (业务明细): a GBK CSV inside a zip, parsed as it streams.

What ``alipay.data.dataservice.bill.downloadurl.query`` (bill_type ``trade``)
hands out is a zip holding two GBK-encoded CSV files, their Chinese names
GBK-encoded too without the zip UTF-8 flag: ``<PID>_<yyyyMMdd>_业务明细.csv``
(one line per trade and per refund) and ``…_业务明细(汇总).csv`` (per-store
totals, not read here). The detail file::

    #支付宝业务明细查询
    #账号：[20881234567890120156]
    #起始日期：[2024年01月15日 00:00:00]   终止日期：[2024年01月16日 00:00:00]
    #-----------------------------------------业务明细列表----------------------------------------
    支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,…,订单金额（元）,商家实收（元）,…,退款批次号/请求号,服务费（元）,分润（元）,备注
    2024011522001412345678901234	,pay_01H…	,交易	,…
    #-----------------------------------------业务明细列表结束------------------------------------
    #交易合计：2笔，商家实收共：30.00元，商家优惠共：0.00元
    #退款合计：1笔，商家实收退款共：-10.00元，商家优惠退款共：0.00元
    #导出时间：[2024年01月16日 09:12:33]

Every value carries a trailing tab (so spreadsheets keep long numbers as
text). Lines starting with ``#`` (the header block and the summary lines)
never become settlement lines. Columns are found by their header names, not
positions. Refund lines (业务类型 退款) have a negative 商家实收 and a positive
服务费 (the fee given back).

``read_settlement`` is the reconciliation's parser (``payments.reconciliation.reconcile.PARSERS``):
the zip's bytes in, every line of the detail CSV out as a
``payments.providers.settlement.SettlementLine`` (the ``#`` block and the header as
info, a line that cannot be read as invalid).
"""

from __future__ import annotations

import contextlib
import csv
import io
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import IO, BinaryIO, Literal

from payments.errors import PaysyncError
from payments.providers.settlement import (
    CHARGE,
    INFO,
    INVALID,
    REFUND,
    SUCCEEDED,
    SettlementFormatError,
    SettlementLine,
)

COLUMNS = {
    "trade_no": "支付宝交易号",
    "out_trade_no": "商户订单号",
    "biz_type": "业务类型",
    "subject": "商品名称",
    "created": "创建时间",
    "finished": "完成时间",
    "order_amount": "订单金额（元）",
    "net_amount": "商家实收（元）",
    "out_request_no": "退款批次号/请求号",
    "fee": "服务费（元）",
}
"""The columns read, by their header text in the file."""
REQUIRED = ("trade_no", "out_trade_no", "biz_type", "finished", "order_amount", "net_amount", "fee")
KINDS = {"交易": "charge", "退款": "refund"}
"""业务类型 → our line kind."""
DETAIL_SUFFIX = "业务明细.csv"
BEIJING = timezone(timedelta(hours=8), "Asia/Shanghai")
"""The bill's clock: its days and its times."""
FORMAT = "alipay_trade_bill"
"""settlement_file.format of these files."""


class BillFormatError(PaysyncError):
    """The bill does not follow Alipay's published layout; says which line and why."""

    code = "bill_format"
    permanent = True


@dataclass(frozen=True)
class AlipayBillLine:
    """One trade or refund line of the bill, normalised (amounts in fen), with the raw text and line number."""

    line_no: int
    raw: str
    kind: Literal["charge", "refund"]
    provider_transaction_id: str
    """支付宝交易号 (the trade's; a refund line names the trade it refunds)."""
    merchant_reference: str
    """商户订单号: our payment_id."""
    refund_reference: str | None
    """退款批次号/请求号: our refund_id on refund lines."""
    amount_minor: int
    """Positive: the order amount for a charge, the refunded amount for a refund."""
    net_minor: int
    """商家实收, signed as in the file (negative for refunds)."""
    fee_minor: int
    """服务费 taken (positive), or given back on a refund (negative)."""
    currency: str
    status: str
    """The raw 业务类型 (交易 / 退款)."""
    occurred_at: str
    """完成时间 in ISO form, Beijing time (+08:00)."""
    subject: str


def refund_reference(trade_no: str, refund_id: str) -> str:
    """Alipay has no refund id of its own: (trade_no, out_request_no) names a refund, in its bill too."""
    return f"{trade_no}:{refund_id}"


def _cell(value: str) -> str:
    # The trailing tab (and stray spaces, a BOM on the first cell) are formatting, not data.
    return value.strip().strip("\t").strip().lstrip("\ufeff")


def _fen(text: str, line_no: int, column: str) -> int:
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise BillFormatError(f"line {line_no}: {column} {text[:32]!r} is not an amount") from None
    if not value.is_finite() or value != value.quantize(Decimal("0.01")):
        raise BillFormatError(f"line {line_no}: {column} {text[:32]!r} has more than two decimals")
    return int(value * 100)


def parse_trade_bill(lines: Iterable[str]) -> Iterator[AlipayBillLine]:
    """Yield every trade and refund line of a decoded 业务明细 file, one input line at a time (pure).

    Raises BillFormatError (naming the line) on a line that cannot be read;
    everything before it has been yielded.
    """
    for _, _, item in records(lines):
        if isinstance(item, BillFormatError):
            raise item
        if item is not None:
            yield item


Record = tuple[int, str, "AlipayBillLine | BillFormatError | None"]
"""(line number, raw text, the trade or refund line; why it cannot be read; or None: not a transaction)."""


def records(lines: Iterable[str]) -> Iterator[Record]:
    """Every line of a decoded 业务明细 file, read (pure): the one loop both parsers share.

    Raises BillFormatError for the file as a whole (no header, a header
    without the columns read); a data line that cannot be read comes out
    with its error instead.
    """
    header: dict[str, int] | None = None
    for line_no, raw_line in enumerate(lines, start=1):
        raw = raw_line.rstrip("\r\n")
        text = raw.lstrip("\ufeff")
        if not text.strip() or text.startswith("#"):
            yield line_no, raw, None  # header block, list markers, summary lines, blank lines
            continue
        cells = [_cell(c) for c in next(csv.reader([text]))]
        if header is None:
            header = {name: i for i, name in enumerate(cells)}
            missing = [COLUMNS[key] for key in REQUIRED if COLUMNS[key] not in header]
            if missing:
                raise BillFormatError(f"line {line_no}: header lacks {', '.join(missing)}")
            yield line_no, raw, None
            continue
        item: AlipayBillLine | BillFormatError
        try:
            item = _line(cells, header, line_no, raw)
        except BillFormatError as exc:
            item = exc
        yield line_no, raw, item
    if header is None:
        raise BillFormatError("no 业务明细 header line found")


def _line(cells: list[str], header: dict[str, int], line_no: int, raw: str) -> AlipayBillLine:
    def get(key: str) -> str:
        index = header.get(COLUMNS[key])
        return cells[index] if index is not None and index < len(cells) else ""

    biz_type = get("biz_type")
    kind = KINDS.get(biz_type)
    if kind is None:
        raise BillFormatError(f"line {line_no}: unknown 业务类型 {biz_type[:16]!r}")
    trade_no, out_trade_no = get("trade_no"), get("out_trade_no")
    if not trade_no or not out_trade_no:
        raise BillFormatError(f"line {line_no}: 支付宝交易号 and 商户订单号 are required")
    net = _fen(get("net_amount"), line_no, COLUMNS["net_amount"])
    fee = -_fen(get("fee") or "0", line_no, COLUMNS["fee"])  # the file shows the fee as money out: -0.06
    if kind == "charge":
        amount = _fen(get("order_amount"), line_no, COLUMNS["order_amount"])
    else:
        amount = -net
    if amount <= 0:
        raise BillFormatError(f"line {line_no}: a {biz_type} line must move a positive amount")
    refund_reference = get("out_request_no") or None
    if kind == "refund" and refund_reference is None:
        raise BillFormatError(f"line {line_no}: a refund line needs 退款批次号/请求号")
    finished = get("finished")
    try:
        occurred = datetime.strptime(finished, "%Y-%m-%d %H:%M:%S").isoformat() + "+08:00"
    except ValueError:
        raise BillFormatError(f"line {line_no}: 完成时间 {finished[:32]!r} is not yyyy-MM-dd HH:mm:ss") from None
    return AlipayBillLine(
        line_no=line_no,
        raw=raw,
        kind=kind,  # type: ignore[arg-type]
        provider_transaction_id=trade_no,
        merchant_reference=out_trade_no,
        refund_reference=refund_reference if kind == "refund" else None,
        amount_minor=amount,
        net_minor=net,
        fee_minor=fee,
        currency="CNY",
        status=biz_type,
        occurred_at=occurred,
        subject=get("subject"),
    )


def member_name(info: zipfile.ZipInfo) -> str:
    """A zip member's real name: Alipay writes GBK bytes without the UTF-8 flag, which zipfile reads as cp437."""
    if info.flag_bits & 0x800:
        return info.filename
    try:
        return info.filename.encode("cp437").decode("gbk")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return info.filename


def detail_member(archive: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The 业务明细 CSV of a trade-bill zip (not the 汇总 one); BillFormatError if there is none."""
    for info in archive.infolist():
        name = member_name(info)
        if name.endswith(DETAIL_SUFFIX) and "汇总" not in name:
            return info
    raise BillFormatError("the bill zip holds no 业务明细.csv")


@contextlib.contextmanager
def _detail_text(fileobj: IO[bytes]) -> Iterator[io.TextIOWrapper]:
    """The trade-bill zip's detail CSV as text, decoded from GBK as it is read."""
    try:
        archive = zipfile.ZipFile(fileobj)
    except zipfile.BadZipFile:
        raise BillFormatError("the bill is not a zip file") from None
    with archive, archive.open(detail_member(archive)) as member:
        # gb18030 is GBK's superset: a GBK file decodes the same, and nothing is replaced silently.
        text = io.TextIOWrapper(member, encoding="gb18030", errors="strict", newline="")
        try:
            yield text
        except UnicodeDecodeError as exc:
            raise BillFormatError(f"the detail CSV is not GBK text ({exc.reason})") from None
        finally:
            with contextlib.suppress(ValueError):
                text.detach()  # the archive closes the member; the wrapper must not close it twice


def parse_trade_bill_zip(fileobj: IO[bytes]) -> Iterator[AlipayBillLine]:
    """Open the trade-bill zip and stream its detail CSV, decoded from GBK, through ``parse_trade_bill``."""
    with _detail_text(fileobj) as text:
        yield from parse_trade_bill(text)


def read_settlement(stream: BinaryIO) -> Iterator[SettlementLine]:
    """A trade-bill zip as settlement lines: every line of its detail CSV, in order (``payments.providers.settlement``).

    SettlementFormatError when it is not a trade bill at all (not a zip, no
    detail CSV, no header, not GBK).
    """
    try:
        with _detail_text(stream) as text:
            for line_no, raw, item in records(text):
                yield settlement_line(line_no, raw, item)
    except (BillFormatError, zipfile.BadZipFile) as exc:
        raise SettlementFormatError(str(exc)) from None


def settlement_line(line_no: int, raw: str, item: AlipayBillLine | BillFormatError | None) -> SettlementLine:
    """One record of ``records`` as a settlement line (pure).

    Every bill line is a completed trade or refund (succeeded). A charge
    names the trade (支付宝交易号) and our payment_id; a refund names what
    the adapter stores as its provider_refund_id (``refund_reference``) and
    our refund_id (退款批次号/请求号).
    """
    if item is None:
        return SettlementLine(line_no, raw, INFO)
    if isinstance(item, BillFormatError):
        return SettlementLine(line_no, raw, INVALID, error=str(item)[:255])
    refund = item.kind == "refund"
    return SettlementLine(
        line_no,
        raw,
        REFUND if refund else CHARGE,
        status=SUCCEEDED,
        provider_reference=(
            refund_reference(item.provider_transaction_id, item.refund_reference or "")
            if refund
            else item.provider_transaction_id
        ),
        merchant_reference=item.refund_reference if refund else item.merchant_reference,
        amount_minor=item.amount_minor,
        fee_minor=item.fee_minor,
        currency=item.currency,
        occurred_at=datetime.fromisoformat(item.occurred_at).astimezone(UTC).replace(tzinfo=None),
    )
