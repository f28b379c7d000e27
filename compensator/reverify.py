"""``python -m compensator reverify --provider P [--since ISO-TIME]``: re-verify rejected callbacks after a key fix.

A delivery rejected at the gateway (status 3: bad signature, say, because the
provider rotated its key before we listed the new one) is kept byte for byte
with the headers that verify it. Once the settings list the right key, this
re-verifies each status-3 row of the provider against today's keys, at the
time it was received (so a stale timestamp stays stale), and sends those that
now verify on: status 0, the change recorded in ``result``, for the consumer
or the sweep to process like any new delivery. Rows that still fail are left
as they are. Safe to run again, and beside the running processes: each row
moves in its own transaction with a guarded UPDATE.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from payments.callbacks import verify_callback
from payments.db import utcnow
from payments.errors import CallbackRejected, ConfigError
from payments.runtime import Runtime
from payments.schema import payment_callback_log
from payments.states import CallbackStatus

log = logging.getLogger("paysync.compensator.reverify")

BATCH = 500
"""Rows read per query."""


@dataclass
class Result:
    """What one run looked at and what it sent on."""

    checked: int = 0
    accepted: int = 0


def run(runtime: Runtime, provider: str, since: datetime | None = None, now: datetime | None = None) -> Result:
    """Re-verify ``provider``'s status-3 rows received at or after ``since``; move those that verify to status 0."""
    adapter = runtime.providers.get(provider)
    if adapter is None:
        raise ConfigError(f"provider {provider[:32]!r} is not enabled by the settings: nothing can verify its rows")
    t = payment_callback_log
    result = Result()
    last_id = 0
    while True:
        query = (
            select(t.c.id, t.c.callback_data, t.c.headers, t.c.create_time, t.c.result)
            .where(t.c.provider == provider, t.c.status == CallbackStatus.REJECTED, t.c.id > last_id)
            .order_by(t.c.id)
            .limit(BATCH)
        )
        if since is not None:
            query = query.where(t.c.create_time >= since)
        with runtime.engine.connect() as conn:
            rows = conn.execute(query).all()
        if not rows:
            return result
        for row in rows:
            last_id = row.id
            result.checked += 1
            if _reverify(runtime, adapter, row, now or utcnow()):
                result.accepted += 1


def _reverify(runtime: Runtime, adapter, row, now: datetime) -> bool:  # noqa: ANN001
    received = (row.create_time - datetime(1970, 1, 1)).total_seconds()
    try:
        verify_callback(adapter, bytes(row.callback_data), json.loads(row.headers), now=received)
    except CallbackRejected:
        return False
    was = (row.result or "rejected").removeprefix("rejected: ")
    t = payment_callback_log
    with runtime.engine.begin() as conn:
        moved = conn.execute(
            update(t)
            .where(t.c.id == row.id, t.c.status == CallbackStatus.REJECTED)
            .values(
                status=CallbackStatus.PENDING,
                result=f"reverified at {now.isoformat()}Z against today's keys; was rejected: {was}"[:500],
                retry_count=0,
                next_retry_at=now,
                update_time=now,
            )
        ).rowcount
    if moved:
        log.info("callback %s verifies against today's keys: sent on (status 0)", row.id)
    return bool(moved)
