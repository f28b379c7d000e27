"""WeChat Pay's trade bill parser on the published layout: back-quoted fields, Chinese text, a summary apart.

The hand-written fixture follows "交易账单文件格式说明" (ALL type, the
27-column layout of merchants since 2018): a BOM, the column header,
back-quoted detail lines for a payment, a refund of it and a revoked
payment, then the summary header and the summary line, with CRLF endings.
The property test renders random bills with the fake platform's own writer.
"""

from __future__ import annotations

import functools
import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.providers.settlement import (
    CHARGE,
    FAILED,
    INFO,
    INVALID,
    REFUND,
    SUCCEEDED,
    SettlementFormatError,
    checked,
)
from payments.providers.wechatpay.bill import BillFormatError, TradeBill, parse_trade_bill, read_settlement
from sandbox.fakes import wechatpay as fake

HEADER = (
    "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,"
    "应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,"
    "手续费,费率,订单金额,申请退款金额,费率备注"
)
FIXTURE = (
    "\ufeff" + HEADER + "\r\n"
    "`2024-05-01 10:00:00,`wxd678efh567hg6787,`1900000109,`0,`,`4200000001202405011234567890,"
    "`pay_01HWXYZ0000000000000000001,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`NATIVE,`SUCCESS,`OTHERS,`CNY,`10.00,`0.00,`0,"
    "`0,`0.00,`0.00,`,`,`腾讯充值中心-QQ会员充值,`,`0.06000,`0.60%,`10.00,`0.00,`\r\n"
    "`2024-05-01 11:30:05,`wxd678efh567hg6787,`1900000109,`0,`,`4200000001202405011234567890,"
    "`pay_01HWXYZ0000000000000000001,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`NATIVE,`REFUND,`OTHERS,`CNY,`0.00,`0.00,"
    "`50000000382019052709732678859,`re_01HWXYZ000000000000000001,`4.00,`0.00,`ORIGINAL,`SUCCESS,"
    "`腾讯充值中心-QQ会员充值,`,`-0.02400,`0.60%,`0.00,`4.00,`\r\n"
    "`2024-05-01 23:59:59,`wxd678efh567hg6787,`1900000109,`0,`,`4200000001202405019999999999,"
    "`pay_01HWXYZ0000000000000000002,`oUpF8uMuAJO_M2pxb1Q9zNjWeS6o,`NATIVE,`REVOKED,`CMB_CREDIT,`CNY,`0.01,`0.00,`0,"
    "`0,`0.00,`0.00,`,`,`饮料，每瓶 3.5 元, 含税,`备注,`0.00006,`0.60%,`0.01,`0.00,`\r\n"
    "总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额\r\n"
    "`3,`10.01,`4.00,`0.00,`0.03606,`10.01,`4.00\r\n"
)


def test_the_published_layout_parses_into_settlement_lines_and_the_summary_is_not_one():
    bill = TradeBill(FIXTURE.splitlines(keepends=True))
    lines = list(bill)
    assert [(line.kind, line.status, line.amount_minor, line.fee_minor) for line in lines] == [
        ("charge", "SUCCESS", 1000, 6),
        ("refund", "SUCCESS", 400, -2),
        ("charge", "REVOKED", 1, 0),
    ]
    charge, refund, revoked = lines
    assert charge.merchant_reference == "pay_01HWXYZ0000000000000000001"
    assert charge.provider_transaction_id == "4200000001202405011234567890"
    assert charge.occurred_at == datetime(2024, 5, 1, 2, 0, 0, tzinfo=UTC)  # Beijing 10:00 is 02:00 UTC
    assert charge.description == "腾讯充值中心-QQ会员充值" and charge.currency == "CNY"
    assert refund.merchant_refund_id == "re_01HWXYZ000000000000000001"
    assert refund.provider_refund_id == "50000000382019052709732678859"
    assert refund.merchant_reference == charge.merchant_reference and refund.settled_minor == 400
    assert revoked.description == "饮料，每瓶 3.5 元, 含税"  # an ASCII comma inside a field is not a separator
    assert [line.line_number for line in lines] == [2, 3, 4]
    assert lines[0].raw.startswith("`2024-05-01 10:00:00,`wxd678efh567hg6787")
    assert bill.summary is not None
    assert (bill.summary.count, bill.summary.settled_total_minor, bill.summary.refund_total_minor) == (3, 1001, 400)
    assert bill.summary.fee_total_minor == 4
    assert not any(line.merchant_reference.startswith("`") or "总" in line.raw for line in lines)


def test_the_parser_streams_a_line_before_reading_the_rest():
    read = []

    def source():  # noqa: ANN202
        for text in FIXTURE.splitlines(keepends=True):
            read.append(text)
            yield text

    first = next(parse_trade_bill(source()))
    assert first.line_number == 2 and len(read) == 2


def test_a_bill_read_from_bytes_with_a_bom_and_crlf_parses(tmp_path):
    path = tmp_path / "bill.csv"
    path.write_bytes(FIXTURE.encode("utf-8"))
    with open(path, encoding="utf-8-sig", newline="") as handle:
        assert len(list(parse_trade_bill(handle))) == 3


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda text: text.rsplit("总交易单数", 1)[0], "no summary line"),
        (lambda text: text.replace("`3,`10.01", "`4,`10.01"), "summary counts 4 lines, the bill has 3"),
        (lambda text: text.replace("`10.00,`0.00,`0,", "`10.005,`0.00,`0,", 1), "fractions of a fen"),
        (lambda text: text.replace("`10.00,`0.00,`0,", "`ten,`0.00,`0,", 1), "is not an amount"),
        (lambda text: text.replace("`OTHERS,`CNY,`10.00", "`OTHERS,`10.00", 1), "26 fields, the header has 27"),
        (lambda text: text.replace("2024-05-01 10:00:00", "2024/05/01 10:00", 1), "not YYYY-MM-DD HH:MM:SS"),
        (lambda text: text.replace("交易时间,", "时间,", 1), "header lacks 交易时间"),
        (lambda text: text + "`extra\r\n", "text after the summary line"),
        (lambda text: text.replace("`re_01HWXYZ000000000000000001", "`0", 1), "refund line without"),
        (lambda text: "", "empty bill"),
    ],
)
def test_a_bill_off_the_layout_is_refused_with_its_line_number(mutate, message):
    with pytest.raises(BillFormatError, match=message):
        list(parse_trade_bill(mutate(FIXTURE).splitlines(keepends=True)))


@functools.cache
def _key():  # noqa: ANN202 - one RSA key for the module (slow to make); the platform never signs here
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _platform(rate: Decimal = Decimal("0.006")) -> fake.FakeWechatPay:
    config = fake.FakeConfig(
        mchid="1900000109",
        appid="wxd678efh567hg6787",
        apiv3_key=b"k" * 32,
        merchant_public_key=_key().public_key(),
        merchant_serial="ABC",
        platform_keys=[("ABC", _key())],
        fee_rate=rate,
    )
    return fake.FakeWechatPay(config)


descriptions = st.text(alphabet=st.sampled_from("商品测试，,。 abcXYZ0123-_（）会员充值"), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    orders=st.lists(
        st.tuples(st.integers(min_value=1, max_value=10_000_000), descriptions, st.integers(0, 3)),
        min_size=1,
        max_size=8,
    )
)
def test_any_bill_the_fake_platform_writes_reads_back_to_its_orders_and_refunds(orders):
    platform = _platform()
    day_start = datetime(2024, 5, 1, tzinfo=fake.BEIJING).timestamp()
    expected = []
    for index, (total, description, refunds) in enumerate(orders):
        number = f"pay_{index:010d}"
        order = fake.Order(number, {}, "weixin://x", day_start, "http://n", total, description)
        order.trade_state, order.transaction_id, order.success_time = "SUCCESS", f"42{index:026d}", day_start + index
        platform.orders[number] = order
        expected.append(("charge", number, total, description.strip()))  # fields are read trimmed
        left = total
        for r in range(refunds):
            amount = left // 2
            if amount == 0:
                break
            left -= amount
            refund_no = f"re_{index:04d}_{r}"
            platform.refunds[refund_no] = fake.Refund(
                refund_no, f"50{index:04d}{r}", number, amount, total, None, day_start + 100 + r, "SUCCESS"
            )
            expected.append(("refund", refund_no, amount, description.strip()))
    data = platform.trade_bill("2024-05-01")
    assert data is not None
    bill = TradeBill(data.decode("utf-8-sig").splitlines(keepends=True))
    got = [
        (line.kind, line.merchant_refund_id or line.merchant_reference, line.amount_minor, line.description)
        for line in bill
    ]
    assert sorted(got) == sorted(expected)
    assert bill.summary is not None and bill.summary.count == len(expected)
    charged = sum(amount for kind, _, amount, _ in expected if kind == "charge")
    assert bill.summary.settled_total_minor == charged


def test_the_fee_is_rounded_half_up_to_the_fen_that_settles():
    text = FIXTURE.replace("`0.06000,", "`0.00500,", 1).replace("`0.00006,", "`0.00499,", 1)
    fees = [line.fee_minor for line in parse_trade_bill(text.splitlines())]
    assert fees == [1, -2, 0]


# --------------------------------------------------------------------------------------------- as settlement lines


def test_as_settlement_lines_every_line_comes_out_with_our_numbers_and_a_revoked_charge_failed():
    lines = list(read_settlement(io.BytesIO(FIXTURE.encode())))
    assert [x.line_no for x in lines] == [1, 2, 3, 4, 5, 6]
    assert all(checked(x) == x for x in lines)
    header, charge, refund, revoked, summary_header, summary = lines
    assert {header.kind, summary_header.kind, summary.kind} == {INFO}
    assert (charge.kind, charge.status, charge.merchant_reference, charge.amount_minor, charge.fee_minor) == (
        CHARGE,
        SUCCEEDED,
        "pay_01HWXYZ0000000000000000001",
        1000,
        6,
    )
    assert charge.provider_reference == "4200000001202405011234567890"
    assert charge.occurred_at == datetime(2024, 5, 1, 2, 0, 0)
    assert (refund.kind, refund.merchant_reference, refund.provider_reference) == (
        REFUND,
        "re_01HWXYZ000000000000000001",
        "50000000382019052709732678859",
    )
    assert (revoked.kind, revoked.status) == (CHARGE, FAILED)


def test_as_settlement_lines_a_refund_in_progress_is_info_and_an_abnormal_one_is_for_a_person():
    processing = FIXTURE.replace("`ORIGINAL,`SUCCESS", "`ORIGINAL,`PROCESSING")
    assert read_settlement_kinds(processing)[2] == INFO
    abnormal = FIXTURE.replace("`ORIGINAL,`SUCCESS", "`ORIGINAL,`ABNORMAL")
    line = list(read_settlement(io.BytesIO(abnormal.encode())))[2]
    assert line.kind == INVALID and "not final" in line.error


def read_settlement_kinds(text: str) -> list[str]:
    return [x.kind for x in read_settlement(io.BytesIO(text.encode()))]


def test_as_settlement_lines_a_bill_that_does_not_add_up_is_refused_before_any_line():
    short = FIXTURE.replace("`3,`10.01", "`4,`10.01")
    lines = read_settlement(io.BytesIO(short.encode()))
    with pytest.raises(SettlementFormatError, match="summary counts 4"):
        next(lines)
    bad_line = FIXTURE.replace("`NATIVE,`SUCCESS", "`NATIVE,`SUCCESS,`extra", 1)
    kinds = read_settlement_kinds(bad_line)
    assert kinds[1] == INVALID and kinds.count(CHARGE) == 1
    assert list(read_settlement(io.BytesIO(b""))) == []  # no bill for the day
