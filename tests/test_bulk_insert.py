"""payments.infra.db.insert_ignore_rows: the settlement import's bulk INSERT IGNORE stores exactly what it is given."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from payments.infra import db
from payments.infra.db import insert_ignore_rows
from payments.infra.schema import settlement_line

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)
"""Any text MariaDB's utf8mb4 holds: quotes, backslashes, NUL, %, control characters, 4-byte characters."""

ROWS = st.lists(
    st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["charge", "refund", "fee", "info", "invalid"]),
            "status": st.none() | st.sampled_from(["succeeded", "failed"]),
            "provider_reference": st.none() | TEXT.filter(bool),
            "merchant_reference": st.none() | TEXT.filter(bool),
            "amount_minor": st.none() | st.integers(-(2**62), 2**62),
            "fee_minor": st.none() | st.integers(-(2**40), 2**40),
            "currency": st.none() | st.text("ABCDEFXYZ", min_size=3, max_size=3),
            "occurred_at": st.none()
            | st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.none()),
            "parse_error": st.none() | TEXT,
            "settlement_amount_minor": st.none() | st.integers(-(2**62), 2**62),
            "settlement_currency": st.none() | st.text("ABCDEFXYZ", min_size=3, max_size=3),
            "exchange_rate": st.none() | st.from_regex(r"\A[0-9]{1,12}(\.[0-9]{1,12})?\Z"),
            "raw": TEXT,
        }
    ),
    min_size=1,
    max_size=40,
)


def stored(engine, file_id: int) -> list[dict]:
    columns = [c for c in settlement_line.c if c.name != "id"]
    with engine.connect() as conn:
        rows = conn.execute(
            select(*columns).where(settlement_line.c.settlement_file_id == file_id).order_by(settlement_line.c.line_no)
        )
        return [dict(row._mapping) for row in rows]


def numbered(rows: list[dict], file_id: int) -> list[dict]:
    return [{"settlement_file_id": file_id, "line_no": n + 1, **row} for n, row in enumerate(rows)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ROWS)
def test_every_value_comes_back_exactly_as_given(engine, rows):
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    given_rows = numbered(rows, file_id)
    with engine.begin() as conn:
        assert insert_ignore_rows(conn, settlement_line, given_rows) == len(given_rows)
    assert stored(engine, file_id) == given_rows


def test_existing_keys_are_ignored_and_only_new_rows_counted(engine):
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    rows = numbered([{"kind": "info", "raw": f"line {n}"} for n in range(10)], file_id)
    with engine.begin() as conn:
        assert insert_ignore_rows(conn, settlement_line, rows[:6]) == 6
    changed = [{**row, "raw": "a second import must not change this"} for row in rows]
    with engine.begin() as conn:
        assert insert_ignore_rows(conn, settlement_line, changed) == 4
        assert insert_ignore_rows(conn, settlement_line, changed) == 0
    assert [r["raw"] for r in stored(engine, file_id)] == [f"line {n}" for n in range(6)] + [
        "a second import must not change this"
    ] * 4


def test_a_long_batch_is_split_into_statements_under_the_limit_and_every_row_lands(engine, monkeypatch):
    monkeypatch.setattr(db, "BULK_STATEMENT_CHARS", 300)
    sent = []
    original = db._execute_literal
    monkeypatch.setattr(db, "_execute_literal", lambda conn, sql: sent.append(len(sql)) or original(conn, sql))
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    rows = numbered([{"kind": "info", "raw": "x" * (n % 50) + "'%s\\"} for n in range(200)], file_id)
    with engine.begin() as conn:
        assert insert_ignore_rows(conn, settlement_line, rows) == 200
    assert [{key: got[key] for key in row} for got, row in zip(stored(engine, file_id), rows, strict=True)] == rows
    if engine.dialect.driver == "pymysql":
        assert len(sent) > 10
        assert all(size <= 300 for size in sent[:-1])


def test_rows_with_different_columns_are_refused_before_anything_is_written(engine):
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    rows = numbered([{"kind": "info", "raw": "a"}, {"kind": "info", "raw": "b", "status": None}], file_id)
    with engine.begin() as conn, pytest.raises(ValueError, match="same columns"):
        insert_ignore_rows(conn, settlement_line, rows)
    assert stored(engine, file_id) == []


VALUES = (
    st.none() | st.integers() | st.booleans() | TEXT | st.datetimes(timezones=st.none() | st.just(UTC)) | st.dates()
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(VALUES, max_size=30), st.booleans())
def test_literals_are_written_exactly_as_the_driver_escapes_them(engine, values, doubled_quotes):
    if engine.dialect.driver != "pymysql":
        pytest.skip("the VALUES list is written by hand only on PyMySQL")
    with engine.connect() as conn:
        driver = conn.connection.dbapi_connection
        status = driver.server_status
        try:
            if doubled_quotes:  # as under sql_mode NO_BACKSLASH_ESCAPES
                driver.server_status |= db._NO_BACKSLASH_ESCAPES
            assert db._literals(values, driver) == [driver.escape(value) for value in values]
        finally:
            driver.server_status = status


def test_columns_store_the_same_rows(engine, monkeypatch):
    monkeypatch.setattr(db, "LITERAL_ROWS", 2)  # the rows' literals written two rows at a time
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    rows = numbered([{"kind": "info", "raw": f"it's line {n}", "status": None} for n in range(5)], file_id)
    columns = {name: [row[name] for row in rows] for name in rows[0]}
    with engine.begin() as conn:
        assert db.insert_ignore_columns(conn, settlement_line, columns) == 5
        assert db.insert_ignore_columns(conn, settlement_line, columns) == 0
        with pytest.raises(ValueError, match="a value for each row"):
            db.insert_ignore_columns(conn, settlement_line, {"kind": ["info"], "raw": []})
    assert [{key: got[key] for key in row} for got, row in zip(stored(engine, file_id), rows, strict=True)] == rows
