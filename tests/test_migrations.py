"""Migrations: every revision in order gives what payments/infra/schema.py gives, and init-db upgrades any earlier
state.

If ``test_every_revision_in_order_gives_what_payments_schema_py_gives`` fails
after a change to payments/infra/schema.py, the change needs a migration: docs/operations/
schema-changes.md; ``python -m payments migration-diff`` drafts it.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from alembic.migration import MigrationContext
from alembic.operations import Operations
from sqlalchemy import (
    CheckConstraint,
    Column,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    inspect,
    text,
)

from payments.infra.db import init_db, make_engine
from payments.infra.migrations import (
    FIRST_REVISION,
    MIGRATIONS_DIR,
    VERSION_TABLE,
    SchemaMismatch,
    SchemaPrerequisite,
    current_revision,
    head_revision,
    migration_lock_name,
    script_directory,
    upgrade,
)
from payments.infra.migrations.compare import differences
from payments.infra.migrations.draft import draft_revision
from payments.infra.schema import APPEND_ONLY_TABLES, metadata, trigger_ddl
from tests.schema_describe import describe
from tests.support import ROOT, env_for

REVISIONS = [script.revision for script in reversed(list(script_directory().walk_revisions()))]
DATA = Path(__file__).parent / "data"
WRITE_A_MIGRATION = (
    "payments/infra/schema.py and payments/infra/migrations disagree: write a migration, a revision under "
    "payments/infra/migrations/versions (docs/operations/schema-changes.md; `python -m payments migration-diff` "
    "drafts one).\n"
)


@pytest.fixture
def scratch_mariadb(mariadb_engine):
    """Make empty MariaDB databases beside the test database; all dropped afterwards."""
    base = mariadb_engine.url.database
    made = []

    def make():
        name = f"{base}_mig{len(made)}"
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        engine = make_engine(mariadb_engine.url.set(database=name).render_as_string(hide_password=False))
        made.append((name, engine))
        return engine

    yield make
    for name, engine in made:
        engine.dispose()
        with mariadb_engine.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))


@pytest.fixture
def scratch_sqlite(tmp_path):
    """Make empty SQLite database files."""
    made = []

    def make():
        engine = make_engine(f"sqlite:///{tmp_path / f'scratch{len(made)}.db'}")
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.dispose()


@pytest.fixture(params=["sqlite", "mariadb"])
def scratch(request):
    """Make empty databases of one kind; each test that takes it runs on both."""
    return request.getfixturevalue(f"scratch_{request.param}")


def create_from_metadata(engine) -> None:
    """A fresh create straight from payments/infra/schema.py: what init-db did before migrations existed."""
    metadata.create_all(engine)
    with engine.begin() as conn:
        for statement in trigger_ddl(engine.dialect.name):
            conn.exec_driver_sql(statement)


def schema_differences(engine, schema: MetaData = metadata, triggers=trigger_ddl) -> list[str]:
    with engine.connect() as conn:
        return differences(
            conn, schema, triggers(engine.dialect.name), expected="payments/infra/schema.py", other_tables=True
        )


def version(engine) -> str | None:
    with engine.connect() as conn:
        return current_revision(conn)


def run_sql_file(engine, path: Path) -> None:
    """Run a DDL file: statements end with ';' at a line end (a trigger body has inner ';' mid-line)."""
    with engine.begin() as conn:
        for chunk in re.split(r";[ \t]*$", path.read_text(), flags=re.MULTILINE):
            lines = [line for line in chunk.splitlines() if line.strip() and not line.strip().startswith("--")]
            if lines:
                conn.exec_driver_sql("\n".join(lines))


def make_unversioned(engine) -> None:
    """The database init-db made before migrations existed, from the DDL frozen at that commit."""
    run_sql_file(
        engine, DATA / f"schema_before_migrations.{'sqlite' if engine.dialect.name == 'sqlite' else 'mysql'}.sql"
    )


CHECKED_VALUE = re.compile(r"[`\"]?(\w+)[`\"]?\s+IN\s*\(\s*'([^']*)'", re.IGNORECASE)


Stored = dict[str, tuple[list[str], list[tuple]]]
"""Per table: its column names and every row."""


def fill_every_table(engine) -> Stored:
    """Insert one row into every table, with values read off the live columns; return what is stored.

    A column under an ``IN ('a', …)`` check gets the first value it allows.
    """
    with engine.begin() as conn:
        inspector = inspect(conn)
        for table in sorted(set(inspector.get_table_names()) - {VERSION_TABLE}):
            allowed = {}
            for check in inspector.get_check_constraints(table):
                for column, value in CHECKED_VALUE.findall(check["sqltext"]):
                    allowed.setdefault(column, value)
            # Integer keys get 1 too: not every one autoincrements (ledger_seal.seq is the chain's own number).
            row = {
                column["name"]: allowed.get(column["name"], _value_for(column["type"]))
                for column in inspector.get_columns(table)
            }
            names = ", ".join(row)
            marks = ", ".join(f":{name}" for name in row)
            conn.execute(text(f"INSERT INTO {table} ({names}) VALUES ({marks})"), row)
    return stored_rows(engine)


SAMPLE_VALUES = {
    int: 1,
    str: "x",
    bytes: b"\x00body",
    dt.datetime: dt.datetime(2026, 1, 2, 3, 4, 5, 678901),
    dt.date: dt.date(2026, 1, 2),
}


def _value_for(type_) -> object:
    assert type_.python_type in SAMPLE_VALUES, f"fill_every_table: add a sample value for {type_!r}"
    return SAMPLE_VALUES[type_.python_type]


def stored_rows(engine, columns: dict[str, list[str]] | None = None) -> Stored:
    """Every row of every table (of the tables and columns in ``columns`` when given)."""
    out = {}
    with engine.connect() as conn:
        inspector = inspect(conn)
        tables = columns or {t: [c["name"] for c in inspector.get_columns(t)] for t in inspector.get_table_names()}
        for table, names in sorted(tables.items()):
            if table != VERSION_TABLE:
                rows = conn.execute(text(f"SELECT {', '.join(names)} FROM {table} ORDER BY 1"))
                out[table] = (names, [tuple(row) for row in rows])
    return out


def kept(engine, before: Stored) -> Stored:
    """The tables and columns of ``before``, as they are now."""
    return stored_rows(engine, {table: names for table, (names, _) in before.items()})


def test_revisions_are_one_numbered_line_written_out_in_full():
    files = sorted(p.name for p in (MIGRATIONS_DIR / "versions").glob("*.py"))
    assert files and files[0].startswith(f"{FIRST_REVISION}_")
    assert len(script_directory().get_heads()) == 1, "more than one head: two branches each added a revision"
    previous = None
    for number, (revision, filename) in enumerate(zip(REVISIONS, files, strict=True), start=1):
        assert re.fullmatch(r"\d{4}_[a-z0-9_]+\.py", filename), f"{filename}: name it NNNN_what_it_does.py"
        assert revision == f"{number:04d}" == filename[:4], f"{filename}: revision id must be its number"
        script = script_directory().get_revision(revision)
        assert script.down_revision == previous, f"{filename}: down_revision must be {previous!r}"
        source = Path(script.path).read_text()
        # A revision must keep doing what it did: nothing it runs may follow payments/infra/schema.py as it changes.
        assert "payments.infra.schema" not in source and "create_all" not in source, filename
        previous = revision


def test_every_revision_in_order_gives_what_payments_schema_py_gives(scratch):
    migrated, fresh = scratch(), scratch()
    for revision in REVISIONS:
        upgrade(migrated, revision)
        assert version(migrated) == revision
    create_from_metadata(fresh)

    found = schema_differences(migrated)
    assert not found, WRITE_A_MIGRATION + "\n".join(found)
    migrated_schema, fresh_schema = describe(migrated), describe(fresh)
    assert len(fresh_schema["tables"]) >= 13 and len(fresh_schema["triggers"]) == 2 * len(APPEND_ONLY_TABLES)
    for part in fresh_schema:
        assert migrated_schema[part] == fresh_schema[part], WRITE_A_MIGRATION + f"they differ in {part}"


def test_init_db_builds_an_empty_database_to_head_and_a_second_run_changes_nothing(scratch):
    engine = scratch()
    init_db(engine)
    assert version(engine) == head_revision()
    built = describe(engine)
    again = upgrade(engine)
    assert (again.before, again.after, again.recognised_unversioned) == (head_revision(), head_revision(), False)
    assert describe(engine) == built
    assert schema_differences(engine) == []


@pytest.fixture
def refuse_on_server(monkeypatch):
    """Make the server itself refuse the first DDL statement that contains a given text, with a given error.

    The statement is replaced by a SIGNAL of that MariaDB error number, so the real driver and the
    real server report it, exactly as a Galera node refuses CREATE TRIGGER with 1419.
    """
    from alembic.ddl.impl import DefaultImpl

    real_exec = DefaultImpl._exec
    armed = {}

    def arm(contains: str, errno: int) -> None:
        armed.update(contains=contains, errno=errno, hit=0)

    def _exec(self, construct, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        rendered = str(construct.compile(dialect=self.dialect)) if not isinstance(construct, str) else construct
        if armed and not armed["hit"] and armed["contains"] in rendered:
            armed["hit"] = 1
            signal_ = f"SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = {armed['errno']}, MESSAGE_TEXT = 'refused in a test'"
            return real_exec(self, text(signal_), *args, **kw)
        return real_exec(self, construct, *args, **kw)

    monkeypatch.setattr(DefaultImpl, "_exec", _exec)
    return arm


def test_a_first_init_db_refused_at_its_triggers_with_1419_names_the_setting_and_leaves_nothing(
    scratch_mariadb, refuse_on_server
):
    engine = scratch_mariadb()
    refuse_on_server("CREATE TRIGGER", 1419)
    with pytest.raises(SchemaPrerequisite, match="log_bin_trust_function_creators=1") as refused:
        init_db(engine)
    assert "table payment" in str(refused.value)  # the tables made before the trigger were dropped
    with engine.connect() as conn:
        assert inspect(conn).get_table_names() == []
        triggers = conn.execute(
            text("SELECT COUNT(*) FROM information_schema.triggers WHERE trigger_schema = DATABASE()")
        )
        assert triggers.scalar() == 0
    refuse_on_server("no statement has this", 1419)  # the setting fixed: the next init-db just works
    init_db(engine)
    assert version(engine) == head_revision()
    assert schema_differences(engine) == []


def test_a_later_revision_failing_half_way_is_undone_and_the_next_init_db_finishes_it(
    scratch_mariadb, refuse_on_server
):
    engine = scratch_mariadb()
    upgrade(engine, "0006")
    rows = fill_every_table(engine)
    # 0007 creates tables, then an index on an existing table, then triggers: refuse its first trigger.
    refuse_on_server("CREATE TRIGGER", 1205)
    with pytest.raises(SchemaPrerequisite, match="revision 0007 failed") as failed:
        init_db(engine)
    assert "table settlement_line" in str(failed.value)
    assert "index ledger_event.idx_ledger_event_type_time" in str(failed.value)
    assert version(engine) == "0006"
    assert kept(engine, rows) == rows
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) == set(rows) | {VERSION_TABLE}
    init_db(engine)
    assert version(engine) == head_revision()
    assert schema_differences(engine) == []
    assert kept(engine, rows) == rows


@pytest.mark.parametrize("revision", REVISIONS)
def test_init_db_upgrades_a_database_at_each_revision_and_keeps_its_rows(scratch, revision):
    engine = scratch()
    upgrade(engine, revision)
    before = fill_every_table(engine)
    assert all(len(rows) == 1 for _, rows in before.values())

    done = upgrade(engine)
    assert (done.before, done.after) == (revision, head_revision())
    assert schema_differences(engine) == []
    assert kept(engine, before) == before


def test_reviews_open_before_0004_count_as_seen_once_when_opened_and_hold_no_subject(scratch):
    engine = scratch()
    upgrade(engine, "0003")
    opened = dt.datetime(2026, 1, 2, 3, 4, 5, 678901)
    with engine.begin() as conn:
        for status in ("open", "resolved"):
            conn.execute(
                text(
                    "INSERT INTO manual_review (kind, payment_id, reason, status, created_at)"
                    " VALUES ('conflicting_report', 'pay_1', 'r', :status, :at)"
                ),
                {"status": status, "at": opened},
            )
    upgrade(engine)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT status, subject, open_key, occurrences, last_seen_at = created_at"
                " FROM manual_review ORDER BY id"
            )
        ).all()
    assert [tuple(r) for r in rows] == [("open", None, None, 1, 1), ("resolved", None, None, 1, 1)]
    assert schema_differences(engine) == []


def test_a_database_made_before_migrations_is_recognised_as_0001_and_upgraded(scratch):
    engine = scratch()
    make_unversioned(engine)
    before = fill_every_table(engine)

    done = upgrade(engine)
    assert (done.before, done.after, done.recognised_unversioned) == (None, head_revision(), True)
    assert version(engine) == head_revision()
    assert schema_differences(engine) == []
    assert kept(engine, before) == before


DAMAGE = {
    "a missing column": ("ALTER TABLE payment DROP COLUMN description", "column payment.description"),
    "a missing index": ("DROP INDEX idx_payment_order_no{on}", "idx_payment_order_no"),
    "a missing trigger": ("DROP TRIGGER ledger_entry_no_delete", "trigger ledger_entry_no_delete"),
    "a missing table": ("DROP TABLE alert", "table alert"),
    "a missing unique constraint": (
        "DROP INDEX uq_refund_provider_refund_id ON refund",
        "uq_refund_provider_refund_id",
    ),
    "another type": ("ALTER TABLE payment MODIFY currency VARCHAR(8) NOT NULL", "column payment.currency: type"),
    "another nullability": ("ALTER TABLE outbox MODIFY last_error VARCHAR(500) NOT NULL", "column outbox.last_error"),
}
MARIADB_ONLY = {"a missing unique constraint", "another type", "another nullability"}  # SQLite cannot ALTER these


@pytest.mark.parametrize("damage", DAMAGE)
def test_an_unversioned_database_unlike_0001_is_refused_and_left_as_it_was(scratch, damage):
    engine = scratch()
    if engine.dialect.name == "sqlite" and damage in MARIADB_ONLY:
        pytest.skip("SQLite cannot make this change in place")
    make_unversioned(engine)
    statement, named = DAMAGE[damage]
    with engine.begin() as conn:
        conn.exec_driver_sql(statement.format(on="" if engine.dialect.name == "sqlite" else " ON payment"))
    damaged = describe(engine)

    with pytest.raises(SchemaMismatch) as refused:
        init_db(engine)
    assert f"does not match revision {FIRST_REVISION}" in str(refused.value)
    assert named in str(refused.value)
    assert describe(engine) == damaged
    with engine.connect() as conn:
        assert not inspect(conn).has_table(VERSION_TABLE)


def test_a_database_at_a_revision_this_code_does_not_have_is_refused(scratch):
    engine = scratch()
    init_db(engine)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '9999'"))
    with pytest.raises(SchemaMismatch, match="revision 9999, which this code does not have"):
        init_db(engine)


def test_a_recorded_revision_without_its_tables_is_refused(scratch):
    engine = scratch()
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL PRIMARY KEY)"))
        conn.execute(text(f"INSERT INTO {VERSION_TABLE} VALUES ('{FIRST_REVISION}')"))
    with pytest.raises(SchemaMismatch, match=f"says revision {FIRST_REVISION} but paysync's tables are missing"):
        init_db(engine)


def test_init_db_waits_while_another_holds_the_migration_lock(scratch):
    engine = scratch()
    other = make_engine(engine.url.render_as_string(hide_password=False))
    holder = engine.connect()
    if engine.dialect.name == "sqlite":
        holder.begin()  # BEGIN IMMEDIATE: the write lock init-db's own transaction needs
    else:
        assert holder.execute(text("SELECT GET_LOCK(:n, 0)"), {"n": migration_lock_name(engine)}).scalar() == 1
    errors = []
    waiting = threading.Thread(target=lambda: _run_catching(errors, init_db, other))
    waiting.start()
    try:
        waiting.join(timeout=1.0)
        assert waiting.is_alive(), "init-db did not wait for the lock"
        assert not inspect(holder).has_table(VERSION_TABLE)
    finally:
        if engine.dialect.name == "sqlite":
            holder.rollback()
        else:
            holder.execute(text("SELECT RELEASE_LOCK(:n)"), {"n": migration_lock_name(engine)})
        holder.close()
    waiting.join(timeout=60)
    other.dispose()
    assert not waiting.is_alive() and errors == []
    assert version(engine) == head_revision()


def _run_catching(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_three_init_db_processes_at_once_build_the_schema_once(scratch):
    engine = scratch()
    url = engine.url.render_as_string(hide_password=False)
    env = env_for({"DATABASE_URL": url, "PAYSYNC_ENV": "development"})
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "payments", "init-db"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], outputs
    said = sorted(out.split(" in ")[0].split(" to ")[0] for out, _ in outputs)
    head = head_revision()
    assert said == [f"init-db: already at head {head}"] * 2 + [f"init-db: applied {FIRST_REVISION}..{head}"], outputs
    assert schema_differences(engine) == []


def test_init_db_command_refuses_a_mismatched_database_in_one_line(scratch_sqlite):
    engine = scratch_sqlite()
    make_unversioned(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER ledger_event_no_update")
    env = env_for({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "PAYSYNC_ENV": "development"})
    done = subprocess.run(
        [sys.executable, "-m", "payments", "init-db"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    # Development logs its one warning about the defaults first (a JSON line); the refusal is one line after it.
    lines = [line for line in done.stderr.strip().splitlines() if not line.startswith('{"ts"')]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("paysync: init-db: the database has paysync tables but no recorded revision")
    assert "trigger ledger_event_no_update: in revision 0001, not in the database" in lines[0]


def changed_schema() -> MetaData:
    """payments/infra/schema.py with one change of every kind a later revision might make."""
    schema = MetaData()
    for table in metadata.tables.values():
        table.to_metadata(schema)
    payment = schema.tables["payment"]
    payment.append_column(Column("settled_at_note", String(64), nullable=True, comment="new column"))
    payment.c.currency.type = String(8)
    schema.tables["outbox"].c.last_error.nullable = False
    Index("idx_payment_currency", payment.c.currency)
    payment.indexes.discard(next(i for i in payment.indexes if i.name == "idx_payment_order_no"))
    alert = schema.tables["alert"]
    alert.append_constraint(UniqueConstraint("dedupe_key", "first_seen_at", name="uq_alert_dedupe_first_seen"))
    alert.append_constraint(CheckConstraint("severity IN ('info', 'warning', 'critical')", name="ck_alert_severity"))
    Table(
        "payout_line",
        schema,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("day", String(10), nullable=False),
        comment="new table",
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mysql_collate="utf8mb4_bin",
    )
    return schema


def changed_triggers(dialect_name: str) -> list[str]:
    """The append-only triggers, one dropped, plus the same pair for the new payout_line table."""
    statements = [s for s in trigger_ddl(dialect_name) if "ledger_entry_no_update" not in s]
    return statements + [s.replace("ledger_event", "payout_line") for s in trigger_ddl(dialect_name)[:2]]


def test_the_comparison_names_every_kind_of_change(scratch):
    engine = scratch()
    init_db(engine)
    ours = "payments/infra/schema.py"
    assert schema_differences(engine, changed_schema(), changed_triggers) == [
        f"check ck_alert_severity on alert: in {ours}, not in the database",
        f"column outbox.last_error: NULL in the database, NOT NULL in {ours}",
        f"column payment.currency: type VARCHAR(3) in the database, VARCHAR(8) in {ours}",
        f"column payment.settled_at_note: in {ours}, not in the database",
        f"constraint uq_alert_dedupe_first_seen on alert (dedupe_key, first_seen_at): in {ours}, not in the database",
        f"index idx_payment_currency on payment (currency): in {ours}, not in the database",
        f"index idx_payment_order_no on payment (order_no): in the database, not in {ours}",
        f"table payout_line: in {ours}, not in the database",
        f"trigger ledger_entry_no_update: in the database, not in {ours}",
        f"trigger payout_line_no_delete: in {ours}, not in the database",
        f"trigger payout_line_no_update: in {ours}, not in the database",
    ]


def test_migration_diff_drafts_a_revision_that_closes_the_gap(scratch):
    engine = scratch()
    schema = changed_schema()
    draft = draft_revision(engine, "add payout lines", schema, changed_triggers)
    assert draft.filename == f"{int(head_revision()) + 1:04d}_add_payout_lines.py"
    assert f'down_revision = "{head_revision()}"' in draft.text
    assert draft.differences and all(line in draft.text for line in draft.differences)

    module: dict = {}
    exec(compile(draft.text, draft.filename, "exec"), module)  # noqa: S102 - the draft is what the lead would save
    with engine.begin() as conn:
        with Operations.context(MigrationContext.configure(conn)):
            module["upgrade"]()
    assert schema_differences(engine, schema, changed_triggers) == []


def test_migration_diff_command_says_when_the_head_matches_payments_schema_py():
    done = subprocess.run(
        [sys.executable, "-m", "payments", "migration-diff"],
        cwd=ROOT,
        env=env_for({"PAYSYNC_ENV": "development"}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no differences: the head revision matches payments/infra/schema.py" in done.stdout


def test_a_fresh_sqlite_init_db_stays_quick(scratch_sqlite):
    # The suite builds a SQLite schema for nearly every test; keep that cheap.
    engine = scratch_sqlite()
    init_db(engine)  # warm: revision files read, revision 0001 recorded
    timings = []
    for _ in range(5):
        fresh = scratch_sqlite()
        started = time.perf_counter()
        init_db(fresh)
        timings.append(time.perf_counter() - started)
    assert min(timings) < 0.5, timings
