"""What differs between a live database and a schema definition, in words.

Tables, columns (type, nullability, comment), indexes and unique constraints
are compared by Alembic's autogenerate comparison; check constraints by name
and the ledger's triggers by name, table, timing, event and body, which
Alembic does not look at. Column order is not compared: ``ALTER TABLE … ADD
COLUMN`` appends, wherever the column sits in payments/infra/schema.py.
"""

from __future__ import annotations

import re
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, Connection, MetaData, inspect, text

VERSION_TABLE = "alembic_version"

_TRIGGER = re.compile(
    r"CREATE\s+TRIGGER\s+(?:IF\s+NOT\s+EXISTS\s+)?[`\"]?(\w+)[`\"]?\s+(BEFORE|AFTER)\s+(INSERT|UPDATE|DELETE)"
    r"\s+ON\s+[`\"]?(\w+)[`\"]?\s+FOR\s+EACH\s+ROW\s+(.*)",
    re.IGNORECASE | re.DOTALL,
)


def differences(
    conn: Connection,
    metadata: MetaData,
    trigger_statements: list[str],
    *,
    expected: str,
    other_tables: bool,
) -> list[str]:
    """Every way the database on ``conn`` differs from ``metadata`` plus ``trigger_statements``; empty if none.

    ``expected`` names the definition in the messages (e.g. "payments/infra/schema.py").
    With ``other_tables`` False, tables the definition does not have are ignored
    (a database may hold tables that are not paysync's).
    """
    wanted = set(metadata.tables)

    def include_name(name: str | None, type_: str, _parent: Any) -> bool:
        return other_tables or type_ != "table" or name in wanted

    context = MigrationContext.configure(conn, opts={"compare_type": True, "include_name": include_name})
    lines = [_describe(diff, expected) for diff in _flatten(compare_metadata(context, metadata))]
    lines += _check_differences(conn, metadata, expected)
    lines += _trigger_differences(conn, trigger_statements, expected, None if other_tables else wanted)
    return sorted(lines)


def _flatten(diffs: list) -> list[tuple]:
    # Alembic groups the changes to one column in a list; everything else is a tuple.
    flat: list[tuple] = []
    for diff in diffs:
        flat.extend(diff if isinstance(diff, list) else [diff])
    return flat


def _describe(diff: tuple, expected: str) -> str:
    kind = diff[0]
    only_expected = f"in {expected}, not in the database"
    only_database = f"in the database, not in {expected}"
    if kind in ("add_table", "remove_table"):
        return f"table {diff[1].name}: {only_expected if kind == 'add_table' else only_database}"
    if kind in ("add_column", "remove_column"):
        where = only_expected if kind == "add_column" else only_database
        return f"column {diff[2]}.{diff[3].name}: {where}"
    if kind in ("add_index", "remove_index", "add_constraint", "remove_constraint"):
        item = diff[1]
        what = "index" if "index" in kind else "constraint"
        columns = ", ".join(c.name for c in item.columns)
        where = only_expected if kind.startswith("add") else only_database
        return f"{what} {item.name} on {item.table.name} ({columns}): {where}"
    if kind in ("add_table_comment", "remove_table_comment"):
        table = diff[1]
        return f"table {table.name}: comment {diff[2]!r} in the database, {table.comment!r} in {expected}"
    if kind.startswith("modify_"):
        _, _, table, column, _, database_value, expected_value = diff
        attribute = kind.removeprefix("modify_") + " "
        if attribute == "nullable ":
            attribute = ""
            database_value = "NULL" if database_value else "NOT NULL"
            expected_value = "NULL" if expected_value else "NOT NULL"
        return f"column {table}.{column}: {attribute}{database_value} in the database, {expected_value} in {expected}"
    return f"{kind}: {diff[1:]!r}"


def _check_differences(conn: Connection, metadata: MetaData, expected: str) -> list[str]:
    inspector = inspect(conn)
    existing = set(inspector.get_table_names())
    lines = []
    for table in metadata.tables.values():
        if table.name not in existing:
            continue  # already reported as a missing table
        wanted = {c.name for c in table.constraints if isinstance(c, CheckConstraint) and c.name}
        present = {c["name"] for c in inspector.get_check_constraints(table.name) if c.get("name")}
        lines += [f"check {name} on {table.name}: in {expected}, not in the database" for name in wanted - present]
        lines += [f"check {name} on {table.name}: in the database, not in {expected}" for name in present - wanted]
    return lines


def parse_trigger(statement: str) -> tuple[str, tuple[str, str, str, str]] | None:
    """``(name, (table, timing, event, body))`` of a CREATE TRIGGER statement, or None for any other statement."""
    match = _TRIGGER.match(statement.strip())
    if match is None:
        return None
    name, timing, event, table, body = match.groups()
    return name, (table, timing.upper(), event.upper(), " ".join(body.split()))


def database_triggers(conn: Connection) -> dict[str, tuple[str, str, str, str]]:
    """The triggers in the database, as :func:`parse_trigger` describes them."""
    if conn.dialect.name == "sqlite":
        rows = conn.execute(text("SELECT sql FROM sqlite_master WHERE type = 'trigger'")).scalars()
        return dict(parsed for parsed in map(parse_trigger, rows) if parsed)
    rows = conn.execute(
        text(
            "SELECT TRIGGER_NAME, EVENT_OBJECT_TABLE, ACTION_TIMING, EVENT_MANIPULATION, ACTION_STATEMENT"
            " FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE()"
        )
    )
    return {name: (table, timing, event, " ".join(body.split())) for name, table, timing, event, body in rows}


def _trigger_differences(conn: Connection, statements: list[str], expected: str, tables: set[str] | None) -> list[str]:
    wanted = dict(parsed for parsed in map(parse_trigger, statements) if parsed)
    present = {name: t for name, t in database_triggers(conn).items() if tables is None or t[0] in tables}
    lines = []
    for name in sorted(wanted.keys() | present.keys()):
        if name not in present:
            lines.append(f"trigger {name}: in {expected}, not in the database")
        elif name not in wanted:
            lines.append(f"trigger {name}: in the database, not in {expected}")
        elif present[name] != wanted[name]:
            lines.append(f"trigger {name}: {present[name]} in the database, {wanted[name]} in {expected}")
    return lines
