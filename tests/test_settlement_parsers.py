"""Settlement parsers are pure streaming functions: every record out, raw text unchanged, bad lines marked."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.providers.sandbox import bill as sandbox_bill
from payments.providers.settlement import (
    CHARGE,
    FEE,
    INFO,
    INVALID,
    REFUND,
    SettlementFormatError,
    SettlementLine,
    checked,
    csv_records,
)
from sandbox import settlement as platform  # the outside party's own writer: the two must agree

HEADER = ",".join(sandbox_bill.COLUMNS)

references = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=40)
rows = st.builds(
    platform.SettlementRow,
    provider_transaction_id=references.map(lambda s: f"ch_{s}"),
    merchant_transaction_id=references.map(lambda s: f"pay_{s}"),
    type=st.sampled_from(["charge", "refund"]),
    amount=st.integers(1, 10**12),
    currency=st.sampled_from(["CNY", "USD", "EUR"]),
    status=st.sampled_from(["succeeded", "failed"]),
    created_at=st.integers(946684800, 4102444799).map(float),
)


def parse(text: str | bytes) -> list[SettlementLine]:
    """What the importer gets: the parser's lines, each checked."""
    data = text.encode() if isinstance(text, str) else text
    return [checked(line) for line in sandbox_bill.parse(io.BytesIO(data))]


@given(st.lists(rows, max_size=30), st.sampled_from(["0", "0.006", "0.029"]))
def test_what_the_platform_writes_the_parser_reads_back_line_for_line(rows, rate):
    text = platform.build_csv(rows, Decimal(rate))
    lines = list(sandbox_bill.parse(io.BytesIO(text.encode())))  # unchecked: the parser's own output
    physical = text.splitlines()
    assert [line.raw for line in lines] == physical
    assert [line.line_no for line in lines] == list(range(1, len(physical) + 1))
    assert lines[0].kind == INFO
    ordered = sorted(rows, key=lambda r: (r.created_at, r.provider_transaction_id))
    for line, row in zip(lines[1:], ordered, strict=True):
        assert line.kind == (CHARGE if row.type == "charge" else REFUND)
        assert line.provider_reference == row.provider_transaction_id
        assert line.merchant_reference == row.merchant_transaction_id
        assert line.amount_minor == row.amount
        assert line.fee_minor == platform.row_fee(row, Decimal(rate))
        assert (line.currency, line.status) == (row.currency, row.status)
        assert line.occurred_at == datetime.fromtimestamp(row.created_at, UTC).replace(tzinfo=None, microsecond=0)
        assert checked(line) is line


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ("ch_1,pay_1,charge,10,0,CNY,succeeded", "expected 8 fields"),
        ("ch_1,pay_1,payout,10,0,CNY,succeeded,2024-03-01T00:00:00Z", "unknown type"),
        ("ch_1,pay_1,charge,10,0,CNY,processing,2024-03-01T00:00:00Z", "unknown status"),
        ("ch_1,pay_1,charge,10.5,0,CNY,succeeded,2024-03-01T00:00:00Z", "whole minor units"),
        ("ch_1,pay_1,charge,-10,0,CNY,succeeded,2024-03-01T00:00:00Z", "positive integer"),
        ("ch_1,pay_1,charge,0,0,CNY,succeeded,2024-03-01T00:00:00Z", "positive integer"),
        ("ch_1,pay_1,charge,10,0,cny,succeeded,2024-03-01T00:00:00Z", "ISO 4217"),
        ("ch_1,pay_1,charge,10,0,CNY,succeeded,2024-02-30T00:00:00Z", "not a real time"),
        ("ch_1,pay_1,charge,10,0,CNY,succeeded,yesterday", "YYYY-MM-DD"),
        (",,charge,10,0,CNY,succeeded,2024-03-01T00:00:00Z", "reference"),
        ('"ch_1,pay_1,charge,10,0,CNY,succeeded,2024-03-01T00:00:00Z', "expected 8 fields"),
    ],
)
def test_a_line_it_cannot_read_is_kept_raw_and_marked_invalid_and_the_rest_still_reads(record, reason):
    good = "ch_2,pay_2,charge,20,0,CNY,succeeded,2024-03-01T00:00:00Z"
    lines = parse(f"{HEADER}\n{record}\n{good}\n" if not record.startswith('"') else f"{HEADER}\n{good}\n{record}\n")
    bad = next(line for line in lines if line.kind == INVALID)
    assert reason in bad.error
    assert bad.raw == record
    assert any(line.kind == CHARGE and line.provider_reference == "ch_2" for line in lines)


def test_crlf_line_endings_and_a_blank_last_line_are_read_and_kept():
    text = f"{HEADER}\r\nch_1,pay_1,charge,10,0,CNY,succeeded,2024-03-01T00:00:00Z\r\n\r\n"
    lines = parse(text)
    assert [line.kind for line in lines] == [INFO, CHARGE, INFO]
    assert lines[1].raw == "ch_1,pay_1,charge,10,0,CNY,succeeded,2024-03-01T00:00:00Z"


def test_a_quoted_field_spanning_lines_is_one_record_numbered_where_it_starts():
    records = list(csv_records(io.BytesIO(b'a,b\n"x\ny",z\nlast,1\n')))
    assert records == [(1, "a,b", ["a", "b"]), (2, '"x\ny",z', ["x\ny", "z"]), (4, "last,1", ["last", "1"])]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty file"),
        (b"id,amount\n1,2\n", "not a sandbox settlement header"),
        (HEADER.encode() + b"\nch_\xff,pay,charge,1,0,CNY,succeeded,2024-03-01T00:00:00Z\n", "not valid utf-8"),
    ],
)
def test_a_file_that_is_not_a_sandbox_settlement_file_is_refused_with_a_reason(data, message):
    with pytest.raises(SettlementFormatError, match=message):
        parse(data)


def test_parsing_streams_one_record_at_a_time():
    def endless():
        yield (HEADER + "\n").encode()
        n = 0
        while True:
            n += 1
            yield f"ch_{n},pay_{n},charge,{n},0,CNY,succeeded,2024-03-01T00:00:00Z\n".encode()

    class Stream(io.RawIOBase):
        def __init__(self):
            self.chunks = endless()
            self.pending = b""

        def readable(self):
            return True

        def readinto(self, buffer):
            while not self.pending:
                self.pending = next(self.chunks)
            n = min(len(buffer), len(self.pending))
            buffer[:n] = self.pending[:n]
            self.pending = self.pending[n:]
            return n

    lines = sandbox_bill.parse(io.BufferedReader(Stream()))
    first = [next(lines) for _ in range(1000)]  # an endless file: only a streaming parser gets here
    assert first[-1].provider_reference == "ch_999"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        (SettlementLine(1, "x", "payout"), "unknown kind"),
        (SettlementLine(1, "x", INVALID), "without a reason"),
        (SettlementLine(1, "x", FEE, fee_minor=0, currency="CNY"), "non-zero fee"),
        (SettlementLine(1, "x", FEE, fee_minor=5, currency="yuan"), "ISO 4217"),
        (SettlementLine(1, "x", CHARGE, "succeeded", "ch", None, 10, True, "CNY"), "fee must be an integer"),
        (SettlementLine(1, "x", CHARGE, "ok", "ch", None, 10, 0, "CNY"), "status"),
        (SettlementLine(0, "x", INFO), "line number"),
    ],
)
def test_checked_turns_a_plug_in_parsers_mistake_into_an_invalid_line(line, problem):
    result = checked(line)
    assert result.kind == INVALID and problem in result.error and result.raw == "x"
    assert checked(SettlementLine(1, "x", FEE, fee_minor=-3, currency="CNY")).kind == FEE


def test_the_hand_written_constructor_takes_the_dataclass_fields_in_order_with_their_defaults():
    import dataclasses
    import inspect

    parameters = list(inspect.signature(SettlementLine.__init__).parameters.values())[1:]
    fields = dataclasses.fields(SettlementLine)
    assert [p.name for p in parameters] == [f.name for f in fields]
    for parameter, field in zip(parameters, fields, strict=True):
        expected = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert parameter.default == expected, field.name
    line = SettlementLine(3, "raw", CHARGE, amount_minor=5)
    assert vars(line) == {f.name: getattr(line, f.name) for f in fields}
    with pytest.raises(dataclasses.FrozenInstanceError):
        line.kind = INFO  # type: ignore[misc]
    assert dataclasses.replace(line, kind=INVALID, error="x") == SettlementLine(
        3, "raw", INVALID, amount_minor=5, error="x"
    )
