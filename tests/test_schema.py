"""schema.sql is the MySQL/MariaDB DDL the code creates: generated from it, and identical once applied.

Identical except for column order, which is not compared: init-db builds the schema through the
migrations, whose ADD COLUMN appends (tests/schema_describe.py).
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import text

from payments.infra.db import init_db, make_engine, schema_sql
from payments.infra.schema import APPEND_ONLY_TABLES
from tests.schema_describe import describe
from tests.support import ROOT

SCHEMA_FILE = ROOT / "schema.sql"


def test_schema_sql_is_what_the_code_generates():
    assert SCHEMA_FILE.read_text() == schema_sql(), (
        "schema.sql is stale: run `python -m payments schema-sql > schema.sql` after changing payments/infra/schema.py"
    )


def split_statements(sql: str) -> list[str]:
    """Statements of a DDL file: split on ';' at line ends, comment-only chunks dropped."""
    statements = []
    for chunk in re.split(r";[ \t]*$", sql, flags=re.MULTILINE):
        lines = [line for line in chunk.splitlines() if line.strip() and not line.strip().startswith("--")]
        if lines:
            statements.append("\n".join(lines))
    return statements


@pytest.fixture
def fresh_databases(mariadb_engine):
    """Two empty MariaDB databases beside the test database; dropped afterwards."""
    base = mariadb_engine.url.database
    names = [f"{base}_schema_file", f"{base}_schema_code"]
    with mariadb_engine.begin() as conn:
        for name in names:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
    url = mariadb_engine.url.render_as_string(hide_password=False)
    engines = [make_engine(url.replace(f"/{base}", f"/{name}", 1)) for name in names]
    yield engines
    for engine in engines:
        engine.dispose()
    with mariadb_engine.begin() as conn:
        for name in names:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


@pytest.mark.mariadb
def test_schema_sql_applied_to_mariadb_matches_what_init_db_creates(fresh_databases):
    from_file, from_code = fresh_databases
    statements = split_statements(SCHEMA_FILE.read_text())
    assert any(s.startswith("CREATE TRIGGER") for s in statements)
    with from_file.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
    init_db(from_code)
    init_db(from_code)  # and again: init-db is safe to re-run

    file_schema, code_schema = describe(from_file), describe(from_code)
    assert len(file_schema["tables"]) >= 10
    assert {t[0] for t in file_schema["tables"]} >= {
        "payment_callback_log",
        "payment",
        "processed_event",
        "ledger_event",
        "ledger_entry",
        "manual_review",
        "alert",
        "outbox",
        "ledger_seal",
        "settlement_file",
        "settlement_line",
        "reconciliation_run",
        "reconciliation_item",
    }
    assert len(file_schema["triggers"]) == 2 * len(APPEND_ONLY_TABLES)
    for part in file_schema:
        assert file_schema[part] == code_schema[part], part
