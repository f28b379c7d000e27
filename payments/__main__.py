"""``python -m payments``: ``init-db`` migrates the schema, ``schema-sql`` prints the MySQL DDL,
``migration-diff`` drafts the next migration, ``settings-reference`` writes docs/reference/settings.md."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile

from payments.errors import PaysyncError
from payments.infra.db import make_engine, schema_sql
from payments.runtime import start_process


def main(argv: list[str] | None = None) -> int:
    """Entry point for the payments command line."""
    parser = argparse.ArgumentParser(prog="python -m payments")
    sub = parser.add_subparsers(dest="command", required=True)
    init_db = sub.add_parser(
        "init-db", help="upgrade DATABASE_URL to the newest schema revision (creates it when empty)"
    )
    init_db.add_argument(
        "--verbose", action="store_true", help="show Alembic's own log lines (also shown under LOG_LEVEL=DEBUG)"
    )
    sub.add_parser("schema-sql", help="print the MySQL/MariaDB DDL (what schema.sql holds)")
    diff = sub.add_parser(
        "migration-diff",
        help="print what payments/infra/schema.py has that the newest revision lacks, as a draft revision file",
    )
    diff.add_argument(
        "--url",
        help="a scratch database to upgrade to head and compare (default: a throwaway SQLite file)",
    )
    diff.add_argument("-m", "--message", default="describe the change", help="the draft revision's title")
    reference = sub.add_parser(
        "settings-reference", help="write docs/reference/settings.md from the settings' field docs"
    )
    reference.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    if args.command == "settings-reference":
        return _settings_reference(check=args.check)
    if args.command == "schema-sql":
        sys.stdout.write(schema_sql())
        return 0
    if args.command == "migration-diff":
        return _migration_diff(args.url, args.message)
    settings = start_process("paysync")
    return _init_db(settings.database_url, verbose=args.verbose or settings.log_level == "DEBUG")


def _init_db(url: str, verbose: bool) -> int:
    # Alembic logs a dozen INFO lines per run (its plugins as it is imported, its context, one per revision);
    # the one line printed below says what happened. --verbose (or LOG_LEVEL=DEBUG) lets them through again.
    logging.getLogger("alembic").setLevel(logging.INFO if verbose else logging.WARNING)
    from payments.infra.migrations import script_directory, upgrade

    engine = make_engine(url)
    where = engine.url.render_as_string(hide_password=True)
    try:
        done = upgrade(engine)
    except PaysyncError as exc:
        print(f"paysync: init-db: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    if done.before == done.after:
        print(f"init-db: already at head {done.after} in {where}")
        return 0
    start = "base" if done.before is None or done.recognised_unversioned else done.before
    applied = [rev.revision for rev in script_directory().iterate_revisions(done.after, start)][::-1]
    if done.recognised_unversioned:
        applied = applied[1:]  # 0001 was stamped, not run: the tables were there
    span = applied[0] if len(applied) == 1 else f"{applied[0]}..{applied[-1]}"
    if done.recognised_unversioned:
        was = "made before migrations, recognised as revision 0001"
    else:
        was = "empty" if done.before is None else f"at revision {done.before}"
    print(f"init-db: applied {span} to {where} (was {was})")
    return 0


def _settings_reference(check: bool) -> int:
    from payments.infra import settings_reference

    path = settings_reference.REFERENCE_PATH
    if check:
        found = settings_reference.problems(path.read_text(encoding="utf-8") if path.exists() else "")
        for problem in found:
            print(f"{path.name}: {problem}", file=sys.stderr)
        if found:
            print(f"regenerate it: {settings_reference.REGENERATE}", file=sys.stderr)
        return 1 if found else 0
    count = settings_reference.write(path)
    shown = (
        path.relative_to(settings_reference.PROJECT_ROOT)
        if path.is_relative_to(settings_reference.PROJECT_ROOT)
        else path
    )
    print(f"settings-reference: wrote {count} settings to {shown}")
    return 0


def _migration_diff(url: str | None, message: str) -> int:
    from payments.infra.migrations.draft import draft_revision

    with tempfile.TemporaryDirectory(prefix="paysync-migration-diff-") as scratch:
        engine = make_engine(url or f"sqlite:///{scratch}/head.db")
        try:
            draft = draft_revision(engine, message)
        except PaysyncError as exc:
            print(f"paysync: migration-diff: {exc}", file=sys.stderr)
            return 2
        finally:
            engine.dispose()
    if not draft.differences:
        print(f"no differences: the head revision matches payments/infra/schema.py (compared on {engine.dialect.name})")
        return 0
    sys.stdout.write(draft.text)
    print(
        f"{len(draft.differences)} difference(s); read the draft, then save it as "
        f"payments/infra/migrations/versions/{draft.filename}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
