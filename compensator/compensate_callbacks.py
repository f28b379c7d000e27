"""Job ``compensate_callbacks``: sweep callback rows the fast path did not finish.

Takes rows with status 0 or 2 that are older than the grace period and due
(``next_retry_at``), oldest first, in batches. A batch is claimed with
``SELECT … FOR UPDATE SKIP LOCKED`` and leased by pushing ``next_retry_at``
out, in one short transaction, so any number of compensators share the
backlog without taking the same row; each row is then processed in its own
transaction by ``process_callback`` (which records retries and give-ups).
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from sqlalchemy import Engine, select, update

from compensator.ratelimit import RateLimiter
from payments.callbacks import Outcome, process_callback
from payments.db import is_sqlite, utcnow
from payments.runtime import Runtime
from payments.schema import CB_RETRYABLE, payment_callback_log

log = logging.getLogger("paysync.compensator.callbacks")

LEASE_SECONDS = 120
"""A claimed row is invisible to other sweeps this long; if we crash, it comes back after."""


def claim_batch(engine: Engine, now: datetime, grace_seconds: float, batch_size: int) -> list[int]:
    """Claim up to ``batch_size`` due rows for this sweep; return their ids, oldest first."""
    t = payment_callback_log
    query = (
        select(t.c.id)
        .where(
            t.c.status.in_(CB_RETRYABLE),
            t.c.next_retry_at <= now,
            t.c.create_time <= now - timedelta(seconds=grace_seconds),
        )
        .order_by(t.c.id)
        .limit(batch_size)
    )
    if not is_sqlite(engine):  # SQLite has one writer at a time; BEGIN IMMEDIATE already serialises us
        query = query.with_for_update(skip_locked=True)
    with engine.begin() as conn:
        ids = list(conn.execute(query).scalars())
        if ids:
            conn.execute(update(t).where(t.c.id.in_(ids)).values(next_retry_at=now + timedelta(seconds=LEASE_SECONDS)))
    return ids


def run_once(runtime: Runtime, *, max_seconds: float | None = None, limiter: RateLimiter | None = None) -> int:
    """Sweep until nothing is due (or ``max_seconds`` pass); return the number of rows processed."""
    settings = runtime.settings
    limiter = limiter or RateLimiter(settings.compensator_rate_limit)
    budget = max_seconds if max_seconds is not None else max(settings.effective_interval_seconds * 5, 30)
    started = time.monotonic()
    done = 0
    outcomes: dict[str, int] = {}
    while time.monotonic() - started < budget:
        ids = claim_batch(runtime.engine, utcnow(), settings.effective_grace_seconds, settings.compensator_batch_size)
        if not ids:
            break
        for log_id in ids:
            limiter.acquire()
            try:
                outcome = process_callback(runtime.engine, runtime.providers, log_id, runtime.callback_policy)
            except Exception as exc:  # noqa: BLE001 - database gone: the lease expires, a later sweep retries
                log.error("sweep stopped: cannot record callback %s (%s)", log_id, type(exc).__name__)
                return done
            outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1
            if outcome not in (Outcome.SKIPPED, Outcome.MISSING):
                done += 1
        if len(ids) < settings.compensator_batch_size:
            break
    if done:
        log.info("swept %s callback rows", done, extra={"outcomes": outcomes})
    return done
