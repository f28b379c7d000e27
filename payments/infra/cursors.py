"""Where a job reading a provider's API left off (``provider_cursor``): read it, move it forward.

A cursor only moves forward, so two compensators running the same job at once
can both advance it without one winding the other back.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Engine, select, update

from payments.infra.db import insert_ignore, utcnow
from payments.infra.schema import provider_cursor


def read_cursor(engine: Engine, provider: str, name: str) -> int | None:
    """The cursor's value (a whole number, e.g. a unix time), or None if the job never finished a run."""
    with engine.connect() as conn:
        value = conn.execute(
            select(provider_cursor.c.value).where(
                provider_cursor.c.provider == provider, provider_cursor.c.name == name
            )
        ).scalar()
    return int(value) if value is not None else None


def advance_cursor(engine: Engine, provider: str, name: str, value: int, now: datetime | None = None) -> int:
    """Set the cursor to ``value`` unless it is already further; return the value it now has."""
    now = now or utcnow()
    t = provider_cursor
    where = (t.c.provider == provider, t.c.name == name)
    with engine.begin() as conn:
        conn.execute(insert_ignore(t).values(provider=provider, name=name, value=str(value), updated_at=now))
        current = int(conn.execute(select(t.c.value).where(*where).with_for_update()).scalar_one())
        if value > current:
            conn.execute(update(t).where(*where).values(value=str(value), updated_at=now))
            return value
        return current
