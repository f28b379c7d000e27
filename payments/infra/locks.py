"""Named database locks (``GET_LOCK``) for jobs that must run once at a time across every compensator.

A named lock belongs to one database session, so the caller holds one
connection for as long as it wants the lock and does its work on others. A
session that dies takes its lock with it, so a killed compensator never
leaves the job locked. SQLite has no named locks; the embedded database is
one machine whose writers already queue on ``BEGIN IMMEDIATE``, and the jobs
that take these locks stay correct without them (their effects are keyed
UNIQUE), so on SQLite the lock is always granted.

``GET_LOCK`` names are server-wide while a server may hold several paysync
databases (a test database beside a bench one, two deployments): the lock
taken is ``lock_name(engine, name)``, the name with the database's appended,
so one paysync never waits for another's job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError

MAX_NAME_LENGTH = 64
"""MariaDB and MySQL refuse longer lock names."""


def lock_name(engine: Engine, name: str) -> str:
    """The server-wide ``GET_LOCK`` name of the lock ``name`` in this engine's database."""
    return f"{name}:{engine.url.database}"[:MAX_NAME_LENGTH]


@contextlib.contextmanager
def named_lock(engine: Engine, name: str, wait_seconds: float = 0) -> Iterator[bool]:
    """Hold lock ``name`` of this database for the ``with`` block; yields False (holding nothing) if another has it."""
    if engine.dialect.name == "sqlite":
        yield True
        return
    name = lock_name(engine, name)
    with engine.connect() as conn:
        got = conn.execute(text("SELECT GET_LOCK(:name, :wait)"), {"name": name, "wait": int(wait_seconds)}).scalar()
        conn.commit()
        if got != 1:
            yield False
            return
        try:
            yield True
        finally:
            # A connection that died took its lock with it, and must not hide the error that killed it.
            with contextlib.suppress(SQLAlchemyError):
                conn.rollback()
                conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": name})
                conn.commit()
