"""``python -m payments init-db`` creates the schema; ``schema-sql`` prints the MySQL DDL."""

from __future__ import annotations

import argparse
import sys

from payments.db import init_db, make_engine, schema_sql
from payments.settings import start_process


def main(argv: list[str] | None = None) -> int:
    """Entry point for the payments command line."""
    parser = argparse.ArgumentParser(prog="python -m payments")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("init-db", help="create every missing table, index and trigger in DATABASE_URL")
    sub.add_parser("schema-sql", help="print the MySQL/MariaDB DDL (what schema.sql holds)")
    args = parser.parse_args(argv)
    if args.command == "schema-sql":
        sys.stdout.write(schema_sql())
        return 0
    settings = start_process("paysync")
    engine = make_engine(settings.database_url)
    init_db(engine)
    print(f"schema ready in {engine.url.render_as_string(hide_password=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
