"""Alembic's environment: runs the revisions on the connection ``payments.infra.migrations`` hands over.

There is no alembic.ini and no URL here: ``payments.infra.migrations.upgrade`` opens
the connection (holding the migration lock) and passes it in
``config.attributes["connection"]``.
"""

from __future__ import annotations

from alembic import context

from payments.infra.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError("run migrations with `python -m payments init-db`, not the alembic command")

context.configure(
    connection=connection,
    target_metadata=metadata,
    # MariaDB commits every DDL statement itself, so record each revision as soon as it is done:
    # a failure in a later one then leaves the version table true. SQLite runs the whole upgrade
    # in the caller's one transaction instead (all or nothing).
    transaction_per_migration=connection.dialect.name != "sqlite",
    # SQLite can only ALTER a table by copying it; batch_alter_table does that there and plain ALTERs elsewhere.
    render_as_batch=True,
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
