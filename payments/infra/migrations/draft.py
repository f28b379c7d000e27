"""``python -m payments migration-diff``: what the newest revision lacks, and a draft of the next revision.

A database at the head revision (a throwaway SQLite file, or a scratch
database given by URL) is compared with payments/infra/schema.py. Alembic renders
the table, column, index and unique-constraint changes as ``op`` calls; check
constraints and the ledger's triggers, which Alembic does not compare, are
rendered here. The draft is a starting point to read and adjust, not a
finished revision: see docs/operations/schema-changes.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from alembic.autogenerate import produce_migrations, render_python_code
from alembic.migration import MigrationContext
from sqlalchemy import CheckConstraint, Connection, Engine, MetaData, inspect

from payments.infra.migrations import head_revision, upgrade
from payments.infra.migrations.compare import database_triggers, differences, parse_trigger
from payments.infra.schema import metadata, trigger_ddl

SCHEMA = "payments/infra/schema.py"


@dataclass(frozen=True)
class Draft:
    """The differences between the head revision and payments/infra/schema.py, and a revision that would remove them."""

    differences: list[str]
    revision: str
    filename: str
    text: str


def draft_revision(
    engine: Engine,
    message: str,
    schema: MetaData = metadata,
    triggers: Callable[[str], list[str]] = trigger_ddl,
) -> Draft:
    """Upgrade ``engine``'s database to head, compare it with payments/infra/schema.py and draft the next revision.

    ``schema`` and ``triggers`` (CREATE TRIGGER statements for a dialect name) stand in for payments/infra/schema.py.
    """
    upgrade(engine)
    head = head_revision()
    revision = f"{int(head) + 1:04d}" if head.isdigit() else "NNNN"
    slug = re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_") or "change"
    with engine.connect() as conn:
        found = differences(conn, schema, triggers(conn.dialect.name), expected=SCHEMA, other_tables=True)
        body = _alembic_ops(conn, schema) + _check_ops(conn, schema) + _trigger_ops(conn, triggers)
    listed = "\n".join(f"- {line}" for line in found)
    code = "\n".join(body) if body else "    pass"
    imports = "import sqlalchemy as sa\nfrom alembic import op\n"
    if "mysql." in code:
        imports += "from sqlalchemy.dialects import mysql\n"
    text = f'''"""{message[:1].upper() + message[1:]}.

Drafted by `python -m payments migration-diff` (on {engine.dialect.name}) from:
{listed}

Revision ID: {revision}
Revises: {head}
"""

from __future__ import annotations

{imports}
revision = "{revision}"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade() -> None:
{code}


def downgrade() -> None:
    raise NotImplementedError("paysync migrations are forward-only: restore a backup to go back")
'''
    return Draft(found, revision, f"{revision}_{slug}.py", text)


def _alembic_ops(conn: Connection, schema: MetaData) -> list[str]:
    context = MigrationContext.configure(conn, opts={"compare_type": True, "render_as_batch": True})
    script = produce_migrations(context, schema)
    if script.upgrade_ops.is_empty():
        return []
    rendered = render_python_code(script.upgrade_ops, render_as_batch=True, migration_context=context)
    return [line for line in rendered.splitlines() if line.strip() and not line.strip().startswith("# ###")]


def _check_ops(conn: Connection, schema: MetaData) -> list[str]:
    inspector = inspect(conn)
    existing = set(inspector.get_table_names())
    lines = []
    for table in schema.tables.values():
        if table.name not in existing:
            continue  # created with its checks by the create_table above
        wanted = {c.name: c for c in table.constraints if isinstance(c, CheckConstraint) and c.name}
        present = {c["name"] for c in inspector.get_check_constraints(table.name) if c.get("name")}
        changes = [
            f"        batch_op.create_check_constraint({name!r}, {str(wanted[name].sqltext)!r})"
            for name in sorted(wanted.keys() - present)
        ] + [f"        batch_op.drop_constraint({name!r}, type_='check')" for name in sorted(present - wanted.keys())]
        if changes:
            lines += [f"    with op.batch_alter_table({table.name!r}) as batch_op:", *changes]
    return lines


def _trigger_ops(conn: Connection, triggers: Callable[[str], list[str]]) -> list[str]:
    # Which triggers change is decided on this database; both dialects' statements are rendered for them.
    present = database_triggers(conn)
    wanted = dict(filter(None, map(parse_trigger, triggers(conn.dialect.name))))
    drop = sorted(name for name in present if present[name] != wanted.get(name))
    create = sorted(name for name in wanted if wanted[name] != present.get(name))
    if not drop and not create:
        return []
    lines = []
    for branch, dialect in (('    if op.get_context().dialect.name == "sqlite":', "sqlite"), ("    else:", "mysql")):
        by_name = {parse_trigger(s)[0]: s for s in triggers(dialect) if parse_trigger(s)}
        lines.append(branch)
        lines += [f"        op.execute({f'DROP TRIGGER IF EXISTS {name}'!r})" for name in drop]
        lines += [f"        op.execute({by_name[name]!r})" for name in create]
    return lines
