"""A database's schema as comparable rows, read from the database itself (not through Alembic).

Column order is left out on purpose: a migration's ``ADD COLUMN`` appends, while
a fresh create from payments/infra/schema.py puts the column where the Table lists it.
The migrations' own version table is left out too.
"""

from __future__ import annotations

from sqlalchemy import inspect, text

from payments.infra.migrations import VERSION_TABLE

MARIADB_QUERIES = {
    "tables": """SELECT TABLE_NAME, ENGINE, TABLE_COLLATION, TABLE_COMMENT FROM information_schema.TABLES
                 WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME <> :version ORDER BY TABLE_NAME""",
    "columns": """SELECT TABLE_NAME, COLUMN_NAME, COLUMN_TYPE, IS_NULLABLE, COLUMN_DEFAULT,
                         EXTRA, CHARACTER_SET_NAME, COLLATION_NAME, COLUMN_COMMENT
                  FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME <> :version
                  ORDER BY TABLE_NAME, COLUMN_NAME""",
    "indexes": """SELECT TABLE_NAME, INDEX_NAME, NON_UNIQUE, SEQ_IN_INDEX, COLUMN_NAME, SUB_PART
                  FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME <> :version
                  ORDER BY TABLE_NAME, INDEX_NAME, SEQ_IN_INDEX""",
    "checks": """SELECT TABLE_NAME, CONSTRAINT_NAME, CHECK_CLAUSE FROM information_schema.CHECK_CONSTRAINTS
                 WHERE CONSTRAINT_SCHEMA = DATABASE() ORDER BY TABLE_NAME, CONSTRAINT_NAME""",
    "triggers": """SELECT TRIGGER_NAME, EVENT_MANIPULATION, EVENT_OBJECT_TABLE, ACTION_TIMING, ACTION_ORIENTATION,
                          ACTION_STATEMENT
                   FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = DATABASE() ORDER BY TRIGGER_NAME""",
}


def describe(engine) -> dict[str, list[tuple]]:
    """Tables, columns, indexes, unique and check constraints and triggers of the engine's database."""
    if engine.dialect.name == "sqlite":
        return _describe_sqlite(engine)
    with engine.connect() as conn:
        return {
            name: [tuple(row) for row in conn.execute(text(sql), {"version": VERSION_TABLE})]
            for name, sql in MARIADB_QUERIES.items()
        }


def _describe_sqlite(engine) -> dict[str, list[tuple]]:
    described: dict[str, list[tuple]] = {"tables": [], "columns": [], "indexes": [], "checks": [], "triggers": []}
    with engine.connect() as conn:
        inspector = inspect(conn)
        for table in sorted(set(inspector.get_table_names()) - {VERSION_TABLE}):
            described["tables"].append((table, tuple(inspector.get_pk_constraint(table)["constrained_columns"])))
            for row in conn.exec_driver_sql(f"PRAGMA table_info('{table}')"):
                _cid, name, type_, notnull, default, pk = row
                described["columns"].append((table, name, type_, notnull, default, pk))
            for row in conn.exec_driver_sql(f"PRAGMA index_list('{table}')"):
                _seq, index, unique, origin, partial = row
                columns = tuple(r[2] for r in conn.exec_driver_sql(f"PRAGMA index_info('{index}')"))
                # Unique constraints are sqlite_autoindex_<table>_<n>, numbered by position: name them by columns.
                shown = index if origin == "c" else f"{origin}:{','.join(columns)}"
                described["indexes"].append((table, shown, unique, origin, partial, columns))
            for check in inspector.get_check_constraints(table):
                described["checks"].append((table, check["name"], " ".join(check["sqltext"].split())))
        rows = conn.execute(text("SELECT name, tbl_name, sql FROM sqlite_master WHERE type = 'trigger' ORDER BY name"))
        described["triggers"] = [(name, table, " ".join(sql.split())) for name, table, sql in rows]
    for rows in described.values():
        rows.sort()
    return described
