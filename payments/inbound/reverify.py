"""Re-verifying rejected callbacks after a key fix (``python -m compensator reverify --provider P``).

A delivery rejected at the gateway (status 3: bad signature, say, because the
provider rotated its key before we listed the new one) is kept byte for byte
with the headers that verify it. Once the settings list the right key, this
re-verifies each status-3 row of the provider against today's keys, at the
time it was received (so a stale timestamp stays stale), and sends those that
now verify on: status 0, the change recorded in ``result``, for the consumer
or the sweep to process like any new delivery. Rows that still fail are left
as they are. Safe to run again, and beside the running processes: each row
moves in its own transaction with a guarded UPDATE.

A row refused for its source (``source_not_allowed``), or stored from an
address today's ``<PROVIDER>_SOURCE_CIDRS`` does not hold, stays refused
whatever its signature: the allow-list is there for the day a key leaks, so a
good signature must not be what lets such a row in. Nothing is lost by it:
the refusal was a hint (``payments.inbound.hints``), and the payment it names
converges by querying the provider.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update

from payments.errors import CallbackRejected, ConfigError
from payments.inbound.callbacks import refused_for_source, verify_callback
from payments.inbound.context import Context
from payments.infra.db import utcnow
from payments.infra.schema import SOURCE_WEBHOOK, payment_callback_log
from payments.infra.sources import source_allowed
from payments.states import CallbackStatus

log = logging.getLogger("paysync.compensator.reverify")  # the command's lines keep their name

BATCH = 500
"""Rows read per query."""


@dataclass
class Reverified:
    """What one run looked at and what it sent on."""

    checked: int = 0
    accepted: int = 0
    source_refused: int = 0
    """Rows left refused for their source, not verified at all."""


def reverify(runtime: Context, provider: str, since: datetime | None = None, now: datetime | None = None) -> Reverified:
    """Re-verify ``provider``'s status-3 rows received at or after ``since``; move those that verify to status 0."""
    adapter = runtime.providers.get(provider)
    if adapter is None:
        raise ConfigError(f"provider {provider[:32]!r} is not enabled by the settings: nothing can verify its rows")
    allowed = getattr(runtime.settings, f"{provider}_source_cidrs", ())
    t = payment_callback_log
    result = Reverified()
    last_id = 0
    while True:
        query = (
            select(t.c.id, t.c.callback_data, t.c.headers, t.c.create_time, t.c.result, t.c.remote_addr, t.c.source)
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
            if _refused_for_source(row, allowed):
                result.source_refused += 1
                continue
            if _reverify(runtime, adapter, row, now or utcnow()):
                result.accepted += 1


def _refused_for_source(row, allowed: tuple[str, ...]) -> bool:  # noqa: ANN001
    """True for a row the gateway refused for its source, or one from outside today's allow-list."""
    if refused_for_source(row.result):
        return True
    # Only what the gateway received has a source to check; what a job fetched from the provider has none.
    return row.source == SOURCE_WEBHOOK and not source_allowed(row.remote_addr, allowed)


def _reverify(runtime: Context, adapter, row, now: datetime) -> bool:  # noqa: ANN001
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
