"""The bulk path's hand-written string literals (payments/infra/db.py ``_literals``) are safe: issue 21 item 24.

They are safe because of two facts this file checks: every connection is
utf8mb4 (in UTF-8 no byte of a multi-byte character is a quote or a
backslash, so the GBK-style escape bypass cannot happen), and under either
sql_mode (backslash escapes, or NO_BACKSLASH_ESCAPES with doubled quotes) any
text comes back from real MariaDB exactly as it was given.
"""

from __future__ import annotations

import uuid

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url

from payments.errors import ConfigError
from payments.infra import db
from payments.infra.schema import settlement_line
from payments.infra.settings import load_settings
from tests.conftest import TEST_DATABASE_URL

pytestmark = pytest.mark.mariadb

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=80)
"""Any text utf8mb4 holds: quotes, backslashes, NUL, Ctrl-Z, control characters, 4-byte characters."""

OTHER_CHARSETS = ["gbk", "big5", "sjis", "latin1", "utf8", "utf8mb3", "ascii"]


def _url_with(charset: str) -> str:
    return f"mysql+pymysql://u:p@127.0.0.1:3306/paysync?charset={charset}"


@pytest.mark.parametrize("charset", OTHER_CHARSETS)
def test_a_database_url_with_another_charset_stops_the_process(charset):
    with pytest.raises(ConfigError, match=r"DATABASE_URL charset=.* needs charset=utf8mb4"):
        load_settings({"DATABASE_URL": _url_with(charset)})
    with pytest.raises(ConfigError, match="needs charset=utf8mb4"):
        db.make_engine(_url_with(charset))


def test_utf8mb4_in_any_case_and_no_charset_at_all_are_accepted():
    assert load_settings({"DATABASE_URL": _url_with("UTF8MB4")}).database_url.endswith("UTF8MB4")
    assert db.make_engine("mysql+pymysql://u:p@127.0.0.1:3306/paysync").url.query["charset"] == "utf8mb4"


def _rows(file_id: int, raws: list[str]) -> dict[str, list]:
    count = len(raws)
    return {
        "settlement_file_id": [file_id] * count,
        "line_no": list(range(1, count + 1)),
        "kind": ["info"] * count,
        "raw": raws,
    }


def _stored(engine, file_id: int) -> list[str]:  # noqa: ANN001
    with engine.connect() as conn:
        query = select(settlement_line.c.raw).where(settlement_line.c.settlement_file_id == file_id)
        return list(conn.execute(query.order_by(settlement_line.c.line_no)).scalars())


def test_a_connection_in_another_charset_writes_no_literal(mariadb):
    # Not made by make_engine (which refuses the URL): the bulk path itself must refuse the connection.
    url = make_url(TEST_DATABASE_URL).set(query={"charset": "gbk"})
    foreign = create_engine(url)
    file_id = uuid.uuid4().int % 10**12
    try:
        with foreign.begin() as conn, pytest.raises(ConfigError, match="needs charset=utf8mb4"):
            db.insert_ignore_columns(conn, settlement_line, _rows(file_id, ["\u7e17' OR 1=1 -- "]))
    finally:
        foreign.dispose()
    assert _stored(mariadb, file_id) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(TEXT, min_size=1, max_size=20), st.booleans())
@example(["'", "\\", "\\'", "''", "\\\\'", '"', "\0", "\032", "\r\n", "%s", "\u7e17'", "\U0001f4b3'--"], False)
@example(["'", "\\", "\\'", "''", "\\\\'", '"', "\0", "\032", "\r\n", "%s", "\u7e17'", "\U0001f4b3'--"], True)
def test_any_text_comes_back_exactly_under_both_sql_modes(mariadb, raws, no_backslash_escapes):
    file_id = uuid.uuid4().int % 10**12  # not random: hypothesis seeds it alike for every example
    with mariadb.begin() as conn:
        original = conn.exec_driver_sql("SELECT @@SESSION.sql_mode").scalar_one()
        modes = [m for m in original.split(",") if m and m != "NO_BACKSLASH_ESCAPES"]
        if no_backslash_escapes:
            modes.append("NO_BACKSLASH_ESCAPES")
        conn.exec_driver_sql(f"SET SESSION sql_mode = '{','.join(modes)}'")
        try:
            dbapi_conn = conn.connection.dbapi_connection
            # The server says which quoting it expects in every reply, and the literals follow it.
            assert bool(dbapi_conn.server_status & db._NO_BACKSLASH_ESCAPES) is no_backslash_escapes
            assert db.insert_ignore_columns(conn, settlement_line, _rows(file_id, raws)) == len(raws)
        finally:
            conn.exec_driver_sql(f"SET SESSION sql_mode = '{original}'")  # pooled: the next user gets the default
    assert _stored(mariadb, file_id) == raws
