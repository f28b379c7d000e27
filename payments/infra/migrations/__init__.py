"""Schema migrations: Alembic, configured in code (no alembic.ini), revisions in ``versions/``.

:func:`upgrade` brings any paysync database to the newest revision:

- an empty database gets every revision in order;
- a database made by ``init-db`` before migrations existed (paysync's tables,
  no ``alembic_version``) is compared with revision 0001 and stamped with it
  only if it matches; otherwise nothing is touched and :class:`SchemaMismatch`
  lists what differs;
- a database at an earlier revision gets the later ones;
- a database at the newest revision is left alone (two cheap queries);
- a database whose version table names a revision this code lacks, or
  whose tables are gone, is refused.

Revisions only go forward and never drop data; there is no downgrade.
MariaDB commits each DDL statement on its own, so a revision that fails
half-way (a trigger refused with error 1419 on a binlogged or Galera server, a
lost connection) would leave half its tables behind, and the next init-db
would refuse them. So on MariaDB/MySQL the revisions run one at a time and a
failed one is undone: the tables, columns, indexes and triggers it added
(nothing that existed before it, so no row is lost) are dropped, the version
table still names the last revision that completed, and running init-db again
starts that revision afresh. Error 1419 is reported as
:class:`SchemaPrerequisite`, naming ``log_bin_trust_function_creators``.
Two processes upgrading at once are serialised: on MariaDB/MySQL by
``GET_LOCK`` (named after the database), on SQLite by running the whole
upgrade in one ``BEGIN IMMEDIATE`` transaction. The second one then finds the
work done.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.operations import Operations
from alembic.runtime.environment import EnvironmentContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection, Engine, MetaData, inspect, text

from payments.errors import PaysyncError
from payments.infra.migrations.compare import VERSION_TABLE, differences

MIGRATIONS_DIR = Path(__file__).resolve().parent
FIRST_REVISION = "0001"
LOCK_TIMEOUT_SECONDS = 60
"""How long an init-db waits for another one (MariaDB) before giving up."""


class SchemaMismatch(PaysyncError):
    """The database is not in a state any revision describes; init-db changed nothing."""

    code = "schema_mismatch"
    permanent = True


class SchemaPrerequisite(PaysyncError):
    """The server refused part of a revision for a reason of its own configuration; the revision was undone."""

    code = "schema_prerequisite"
    permanent = True


TRIGGER_NEEDS_TRUST = 1419
"""ER_BINLOG_CREATE_ROUTINE_NEED_SUPER: CREATE TRIGGER with binary logging on (Galera) and no SUPER."""


class MigrationLockTimeout(PaysyncError):
    """Another init-db held the migration lock for longer than LOCK_TIMEOUT_SECONDS."""

    code = "migration_lock_timeout"


@dataclass(frozen=True)
class Upgrade:
    """What :func:`upgrade` did: the revision before (None: empty database) and after."""

    before: str | None
    after: str
    recognised_unversioned: bool
    """The database had paysync's tables and no version table, and matched revision 0001."""


@functools.cache
def script_directory() -> ScriptDirectory:
    """The revisions, read once per process."""
    return ScriptDirectory(str(MIGRATIONS_DIR))


def head_revision() -> str:
    """The newest revision; there must be exactly one (two heads: two branches added revisions)."""
    return script_directory().get_current_head()


def current_revision(conn: Connection) -> str | None:
    """The revision recorded in the database, or None when it has none."""
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, target: str = "head") -> Upgrade:
    """Bring the database to the newest revision (see the module docstring); safe to run again and concurrently.

    ``target`` stops at an earlier revision instead (tests build each earlier state that way).
    """
    head = head_revision() if target == "head" else target
    with _migration_lock(engine) as conn:
        before = current_revision(conn)
        if before is not None and not _paysync_tables(conn):
            raise SchemaMismatch(
                f"{VERSION_TABLE} says revision {before} but paysync's tables are missing: restore them, "
                f"or drop {VERSION_TABLE} to build the schema afresh"
            )
        if before == head:
            return Upgrade(before, head, recognised_unversioned=False)
        if before is not None and not _known(before):
            raise SchemaMismatch(
                f"the database is at revision {before}, which this code does not have (newer code's database?)"
            )
        unversioned = before is None and bool(_paysync_tables(conn))
        if unversioned:
            problems = differences_from_revision(conn, FIRST_REVISION)
            if problems:
                raise SchemaMismatch(
                    f"the database has paysync tables but no recorded revision ({VERSION_TABLE}), and does not "
                    f"match revision {FIRST_REVISION}, so init-db changed nothing. Bring it to revision "
                    f"{FIRST_REVISION} by hand (or, if it is an interrupted first init-db holding no data, drop "
                    "those tables) and run again. Differences: " + "; ".join(problems)
                )
        if conn.in_transaction() and conn.dialect.name != "sqlite":
            conn.commit()  # let Alembic commit each revision on its own (see env.py)
        script = script_directory()
        if unversioned:
            _run_env(conn, lambda rev, _context: script._stamp_revs((FIRST_REVISION,), rev), FIRST_REVISION)
        if conn.dialect.name == "sqlite":
            _run_env(conn, lambda rev, _context: script._upgrade_revs(target, rev), target)
        else:
            for revision in _revisions_between(current_revision(conn), head):
                _upgrade_one_or_undo(conn, revision)
        return Upgrade(before, head, recognised_unversioned=unversioned)


def _revisions_between(before: str | None, head: str) -> list[str]:
    """The revisions after ``before`` up to ``head``, oldest first."""
    walked = script_directory().iterate_revisions(head, before or "base")
    return [script.revision for script in reversed(list(walked))]


def _upgrade_one_or_undo(conn: Connection, revision: str) -> None:
    """Run one revision; if it fails, drop what it added (MariaDB DDL cannot be rolled back) and re-raise."""
    script = script_directory()
    before = _objects(conn)
    try:
        _run_env(conn, lambda rev, _context: script._upgrade_revs(revision, rev), revision)
    except Exception as exc:
        conn.rollback()
        undone = _undo(conn, before)
        code = _mysql_error_code(exc)
        if code == TRIGGER_NEEDS_TRUST:
            raise SchemaPrerequisite(
                f"revision {revision} creates triggers, and this server refuses them (error 1419: binary logging "
                "is on, as on every Galera node, and the user lacks SUPER). Set log_bin_trust_function_creators=1 "
                "in the server's configuration (deploy/galera/paysync.cnf does) or run init-db as a user with "
                f"SUPER, then run init-db again. The half-done revision was undone ({undone})."
            ) from exc
        raise SchemaPrerequisite(
            f"revision {revision} failed ({type(exc).__name__}: {str(exc)[:200]}); what it had done was undone "
            f"({undone}), so init-db can run again once the cause is fixed"
        ) from exc


def _mysql_error_code(exc: BaseException) -> int | None:
    orig = getattr(exc, "orig", exc)
    args = getattr(orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


@dataclass(frozen=True)
class _Objects:
    """What a MariaDB schema holds, by name: enough to drop what a failed revision added."""

    tables: frozenset[str]
    columns: dict[str, frozenset[str]]
    indexes: dict[str, frozenset[str]]
    triggers: frozenset[str]


def _objects(conn: Connection) -> _Objects:
    inspector = inspect(conn)
    tables = inspector.get_table_names()
    columns = {t: frozenset(c["name"] for c in inspector.get_columns(t)) for t in tables}
    indexes = {t: frozenset(i["name"] for i in inspector.get_indexes(t) if i["name"]) for t in tables}
    rows = conn.execute(text("SELECT trigger_name FROM information_schema.triggers WHERE trigger_schema = DATABASE()"))
    triggers = frozenset(row[0] for row in rows)
    conn.rollback()
    return _Objects(frozenset(tables), columns, indexes, triggers)


def _undo(conn: Connection, before: _Objects) -> str:
    """Drop every trigger, table, column and index that is not in ``before``; say what was dropped."""
    now = _objects(conn)
    dropped: list[str] = []
    for trigger in sorted(now.triggers - before.triggers):
        conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS `{trigger}`")
        dropped.append(f"trigger {trigger}")
    new_tables = sorted(now.tables - before.tables)
    if new_tables:
        # The new tables may reference each other; they are all going, in any order.
        conn.exec_driver_sql("SET SESSION foreign_key_checks = 0")
        try:
            for table in new_tables:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS `{table}`")
                dropped.append(f"table {table}")
        finally:
            conn.exec_driver_sql("SET SESSION foreign_key_checks = 1")
    for table in sorted(now.tables & before.tables):
        for index in sorted(now.indexes[table] - before.indexes.get(table, frozenset())):
            conn.exec_driver_sql(f"ALTER TABLE `{table}` DROP INDEX `{index}`")
            dropped.append(f"index {table}.{index}")
        for column in sorted(now.columns[table] - before.columns.get(table, frozenset())):
            conn.exec_driver_sql(f"ALTER TABLE `{table}` DROP COLUMN `{column}`")
            dropped.append(f"column {table}.{column}")
    conn.commit()
    return ", ".join(dropped) or "nothing had been added"


def _run_env(conn: Connection, steps: Callable, destination: str) -> None:
    # What alembic.command.stamp/upgrade do, with the revisions read once per process instead of
    # once per call (the test suite builds a schema for nearly every test). env.py runs the steps.
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = conn
    script = script_directory()
    with EnvironmentContext(config, script, fn=steps, destination_rev=destination):
        script.run_env()


def _known(revision: str) -> bool:
    try:
        return script_directory().get_revision(revision) is not None
    except CommandError:
        return False


def _paysync_tables(conn: Connection) -> set[str]:
    first = revision_schema(FIRST_REVISION, conn.dialect.name)[0]
    return set(first.tables) & set(inspect(conn).get_table_names())


def differences_from_revision(conn: Connection, revision: str) -> list[str]:
    """How the database differs from what ``revision`` (one that only creates tables) creates."""
    tables, statements = revision_schema(revision, conn.dialect.name)
    return differences(conn, tables, statements, expected=f"revision {revision}", other_tables=False)


@functools.cache
def revision_schema(revision: str, dialect_name: str) -> tuple[MetaData, list[str]]:
    """The tables and SQL statements a creating revision runs, recorded without touching any database.

    The revision's ``upgrade()`` runs in Alembic's offline ("--sql") mode, which
    renders SQL to a throwaway buffer; the tables it creates and the statements
    it executes are collected on the way.
    """
    offline = {"as_sql": True, "output_buffer": io.StringIO()}
    context = MigrationContext.configure(dialect_name=dialect_name, opts=offline)
    tables, statements = MetaData(), []
    impl = context.impl  # this context's own object: wrapping its methods affects nothing else
    create_table, execute = impl.create_table, impl.execute

    def record_table(table, **kw):  # noqa: ANN001, ANN202
        table.to_metadata(tables)
        create_table(table, **kw)

    def record_statement(sql, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        statements.append(str(sql))
        execute(sql, *args, **kw)

    impl.create_table, impl.execute = record_table, record_statement
    with Operations.context(context):
        script_directory().get_revision(revision).module.upgrade()
    return tables, statements


def migration_lock_name(engine: Engine) -> str:
    """The MariaDB/MySQL ``GET_LOCK`` name: locks are server-wide, so it names the database."""
    return f"paysync.migrations.{engine.url.database}"[:64]


@contextmanager
def _migration_lock(engine: Engine) -> Iterator[Connection]:
    if engine.dialect.name == "sqlite":
        # The engine's "begin" hook issues BEGIN IMMEDIATE: the write lock is held from here to the commit.
        with engine.begin() as conn:
            yield conn
        return
    name = migration_lock_name(engine)
    with engine.connect() as conn:
        got = conn.execute(text("SELECT GET_LOCK(:name, :timeout)"), {"name": name, "timeout": LOCK_TIMEOUT_SECONDS})
        if got.scalar() != 1:
            raise MigrationLockTimeout(
                f"another init-db has held the migration lock {name!r} for {LOCK_TIMEOUT_SECONDS} s; is it stuck?"
            )
        conn.commit()
        try:
            yield conn
        finally:
            conn.rollback()
            conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": name})
            conn.commit()
