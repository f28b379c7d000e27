"""The Alipay trade-bill parser on fixtures built to the published layout: GBK text in a zip, # lines, summaries."""

from __future__ import annotations

import io
import zipfile
from datetime import datetime
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.providers.alipay.bill import (
    BillFormatError,
    member_name,
    parse_trade_bill,
    parse_trade_bill_zip,
    read_settlement,
    refund_reference,
)
from payments.providers.settlement import CHARGE, INFO, INVALID, REFUND, SUCCEEDED, SettlementFormatError, checked

HEADER = (
    "支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,门店编号,门店名称,操作员,终端号,对方账户,"
    "订单金额（元）,商家实收（元）,支付宝红包（元）,集分宝（元）,支付宝优惠（元）,商家优惠（元）,券核销金额（元）,"
    "券名称,商家红包消费金额（元）,卡消费金额（元）,退款批次号/请求号,服务费（元）,分润（元）,备注"
)


def row(trade_no, out_trade_no, kind, subject, finished, order, net, request_no="", fee="-0.06"):
    cells = [trade_no, out_trade_no, kind, subject, "2024-01-15 09:59:00", finished, "", "杭州一店", "", "",
             "159****5620", order, net, "0.00", "0.00", "0.00", "0.00", "0.00", "", "0.00", "0.00", request_no,
             fee, "0.00", "备注，含逗号"]  # fmt: skip
    return ",".join(f'"{c}\t"' if "," in c else f"{c}\t" for c in cells)


def detail_text(rows):
    return "\r\n".join(
        [
            "#支付宝业务明细查询",
            "#账号：[20881234567890120156]",
            "#起始日期：[2024年01月15日 00:00:00]   终止日期：[2024年01月16日 00:00:00]",
            "#-----------------------------------------业务明细列表----------------------------------------",
            HEADER,
            *rows,
            "#-----------------------------------------业务明细列表结束------------------------------------",
            "#交易合计：2笔，商家实收共：30.00元，商家优惠共：0.00元",
            "#退款合计：1笔，商家实收退款共：-5.00元，商家优惠退款共：0.00元",
            "#导出时间：[2024年01月16日 09:12:33]",
            "",
        ]
    )


ROWS = [
    row("2024011522001412345678901234", "pay_01", "交易", "测试商品·一", "2024-01-15 10:00:01", "10.00", "10.00"),
    row("2024011522001412345678905678", "pay_02", "交易", "中文商品二", "2024-01-15 11:30:00", "20.00", "20.00"),
    row(
        "2024011522001412345678901234",
        "pay_01",
        "退款",
        "测试商品·一",
        "2024-01-15 12:00:00",
        "10.00",
        "-5.00",
        "re_01",
        "0.03",
    ),  # fmt: skip
]


SUMMARY = "#支付宝业务汇总查询\r\n门店编号,交易订单总笔数\r\n合计,3\r\n"
"""The 汇总 file's content: totals per store, never settlement lines."""


def gbk_zip(members: dict[str, str], utf8_names: bool = False) -> io.BytesIO:
    """A zip of GBK files, names written as GBK bytes without the UTF-8 flag (as Alipay's are)."""

    class GbkName(zipfile.ZipInfo):
        def _encodeFilenameFlags(self):  # noqa: N802, ANN202
            return self.filename.encode("gbk"), self.flag_bits & ~0x800

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in members.items():
            info = zipfile.ZipInfo(name) if utf8_names else GbkName(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, text.encode("gbk"))
    buffer.seek(0)
    return buffer


def test_trade_and_refund_lines_are_read_and_header_and_summary_lines_are_not():
    archive = gbk_zip(
        {
            "20881234567890120156_20240115_业务明细.csv": detail_text(ROWS),
            "20881234567890120156_20240115_业务明细(汇总).csv": SUMMARY,
        }
    )
    lines = list(parse_trade_bill_zip(archive))
    assert [(x.kind, x.merchant_reference, x.amount_minor, x.net_minor, x.fee_minor) for x in lines] == [
        ("charge", "pay_01", 1000, 1000, 6),
        ("charge", "pay_02", 2000, 2000, 6),
        ("refund", "pay_01", 500, -500, -3),
    ]
    assert lines[0].subject == "测试商品·一" and lines[0].provider_transaction_id == "2024011522001412345678901234"
    assert lines[2].refund_reference == "re_01" and lines[0].refund_reference is None
    assert lines[0].occurred_at == "2024-01-15T10:00:01+08:00" and lines[0].currency == "CNY"
    assert [x.line_no for x in lines] == [6, 7, 8]
    assert lines[1].raw == ROWS[1]
    assert all(not x.raw.startswith("#") for x in lines)


def test_columns_are_found_by_name_not_position():
    header = HEADER.split(",")
    order = list(reversed(range(len(header))))
    swapped = [",".join(header[i] for i in order)]
    for line in ROWS:
        cells = next(__import__("csv").reader([line]))
        swapped.append(",".join(f'"{cells[i]}"' for i in order))
    lines = list(parse_trade_bill(["#支付宝业务明细查询", *swapped, "#交易合计：2笔"]))
    assert [x.amount_minor for x in lines] == [1000, 2000, 500]


def test_a_bad_line_names_its_number_after_the_good_ones_were_yielded():
    bad = row("2024011522001412345678909999", "pay_03", "交易", "坏行", "2024-01-15 13:00:00", "1.001", "1.00")
    lines = parse_trade_bill(detail_text([ROWS[0], bad]).split("\r\n"))
    assert next(lines).merchant_reference == "pay_01"
    with pytest.raises(BillFormatError, match="line 7"):
        next(lines)
    unknown_kind = row("2024011522001412345678909999", "pay_03", "冻结", "x", "2024-01-15 13:00:00", "1.00", "1.00")
    with pytest.raises(BillFormatError, match="业务类型"):
        list(parse_trade_bill(detail_text([unknown_kind]).split("\r\n")))
    with pytest.raises(BillFormatError, match="header"):
        list(parse_trade_bill(["#only comments", "#交易合计：0笔"]))
    with pytest.raises(BillFormatError, match="lacks"):
        list(parse_trade_bill(["支付宝交易号,商户订单号", "1,2"]))


def test_the_parser_streams_one_line_at_a_time():
    def lines():
        yield from detail_text(ROWS[:1]).split("\r\n")[:6]
        raise RuntimeError("read past the first line")

    assert next(parse_trade_bill(lines())).merchant_reference == "pay_01"


def test_a_zip_without_a_detail_file_or_not_a_zip_is_a_clear_error():
    with pytest.raises(BillFormatError, match="业务明细.csv"):
        list(parse_trade_bill_zip(gbk_zip({"x_业务明细(汇总).csv": "#\r\n"})))
    with pytest.raises(BillFormatError, match="not a zip"):
        list(parse_trade_bill_zip(io.BytesIO(b"PK not really")))
    utf8 = gbk_zip({"x_20240115_业务明细.csv": detail_text(ROWS)}, utf8_names=True)
    assert len(list(parse_trade_bill_zip(utf8))) == 3
    with zipfile.ZipFile(gbk_zip({"甲_业务明细.csv": ""})) as archive:
        assert member_name(archive.infolist()[0]) == "甲_业务明细.csv"


_subject = st.text(st.sampled_from("支付宝测试商品订单中文ABCabc123 ·（）"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10**8), _subject, st.booleans()), min_size=0, max_size=8))
def test_any_bill_in_the_published_layout_round_trips(entries):
    rows = []
    for i, (fen, subject, is_refund) in enumerate(entries):
        yuan = str((Decimal(fen) / 100).quantize(Decimal("0.01")))
        kind, net, request_no = ("退款", f"-{yuan}", f"re_{i}") if is_refund else ("交易", yuan, "")
        rows.append(row(f"20240115220014{i:014d}", f"pay_{i}", kind, subject, "2024-01-15 10:00:00", yuan, net,
                        request_no))  # fmt: skip
    lines = list(parse_trade_bill_zip(gbk_zip({"p_20240115_业务明细.csv": detail_text(rows)})))
    # Cells are trimmed (the trailing tab and any padding are formatting), so compare trimmed subjects.
    assert [(x.amount_minor, x.subject, x.kind == "refund") for x in lines] == [
        (fen, subject.strip(), refund) for fen, subject, refund in entries
    ]


# --------------------------------------------------------------------------------------------- as settlement lines


def test_as_settlement_lines_every_line_of_the_detail_csv_comes_out_and_a_bad_one_is_invalid():
    bad = row("2024011522001412345678909999", "pay_03", "交易", "x", "2024-01-15 13:00:00", "1.234", "1.23")
    archive = gbk_zip({"p_20240115_业务明细.csv": detail_text([*ROWS, bad])})
    lines = list(read_settlement(archive))
    assert [x.line_no for x in lines] == list(range(1, len(lines) + 1))
    assert all(checked(x) == x for x in lines)
    moving = [x for x in lines if x.kind not in (INFO, INVALID)]
    assert [(x.kind, x.status, x.merchant_reference, x.amount_minor, x.fee_minor) for x in moving] == [
        (CHARGE, SUCCEEDED, "pay_01", 1000, 6),
        (CHARGE, SUCCEEDED, "pay_02", 2000, 6),
        (REFUND, SUCCEEDED, "re_01", 500, -3),
    ]
    assert moving[0].provider_reference == "2024011522001412345678901234"
    assert moving[2].provider_reference == refund_reference("2024011522001412345678901234", "re_01")
    assert moving[0].occurred_at == datetime(2024, 1, 15, 2, 0, 1)  # Beijing 10:00:01, naive UTC
    (invalid,) = [x for x in lines if x.kind == INVALID]
    assert "two decimals" in invalid.error and invalid.raw.startswith("2024011522001412345678909999")
    assert lines[0].kind == INFO and lines[0].raw == "#支付宝业务明细查询"


def test_as_settlement_lines_a_file_that_is_not_a_trade_bill_is_refused_whole():
    with pytest.raises(SettlementFormatError, match="not a zip"):
        list(read_settlement(io.BytesIO(b"PK not really")))
    with pytest.raises(SettlementFormatError, match="header"):
        list(read_settlement(gbk_zip({"p_业务明细.csv": "#only comments\r\n支付宝交易号,商户订单号\r\n1,2\r\n"})))
