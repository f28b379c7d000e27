"""Job ``compensate_callbacks``: sweep callback rows the fast path did not finish.

Takes rows with status 0 or 2 that are older than the grace period and due
(``next_retry_at``), oldest first, in batches. A batch is claimed with
``SELECT … FOR UPDATE SKIP LOCKED`` and leased by pushing ``next_retry_at``
out, in one short transaction, so any number of compensators share the
backlog without taking the same row. The claimed rows are then processed
``ROWS_PER_TRANSACTION`` at a time by ``payments.inbound.processing.process_batch``,
as the consumer processes its micro-batches: the common chunk set-wise (a
few multi-row statements and one COMMIT for all its rows), any chunk with
something unusual in it row by row, a savepoint each, with retries and
give-ups recorded per row. Up to ``COMPENSATOR_CONCURRENCY`` chunks are
processed at once, each in its own thread, connection and transaction, so
one chunk's round trips and commit overlap another's Python.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from compensator.ratelimit import RateLimiter
from payments.inbound.callbacks import CallbackResult
from payments.inbound.hints import HintLimits
from payments.inbound.processing import claim_retries, process_batch
from payments.infra.db import is_sqlite, utcnow
from payments.infra.settings import Settings
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.callbacks")

ROWS_PER_TRANSACTION = 50
"""Claimed rows processed in one transaction (one ``process_batch``): fewer commits, short enough locks."""


def lease_seconds(settings: Settings) -> float:
    """How long to lease a batch: COMPENSATOR_LEASE_SECONDS, or long enough to work through it at the rate limit.

    A lease that ran out mid-batch would hand the batch's tail to another
    compensator while this one still means to process it.
    """
    return max(
        settings.compensator_lease_seconds, 2 * settings.compensator_batch_size / settings.compensator_rate_limit
    )


def run_once(runtime: Runtime, *, max_seconds: float | None = None) -> int:
    """Sweep until nothing is due (or ``max_seconds`` pass); return the number of rows processed."""
    settings = runtime.settings
    limiter = RateLimiter(settings.compensator_rate_limit)
    budget = max_seconds if max_seconds is not None else max(settings.effective_interval_seconds * 5, 30)
    started = time.monotonic()
    done = 0
    outcomes: dict[str, int] = {}
    # SQLite has one writer at a time (BEGIN IMMEDIATE): more threads would only queue on its lock.
    workers = 1 if is_sqlite(runtime.engine) else settings.compensator_concurrency
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sweep") if workers > 1 else None

    hints = HintLimits.from_settings(settings)

    def process(log_ids: list[int]) -> list[CallbackResult]:
        outcomes = process_batch(runtime.engine, runtime.providers, log_ids, runtime.callback_policy, hints=hints)
        return [outcome for _, outcome in outcomes if outcome is not None]

    try:
        while time.monotonic() - started < budget:
            ids = claim_retries(
                runtime.engine,
                utcnow(),
                settings.effective_grace_seconds,
                settings.compensator_batch_size,
                lease_seconds(settings),
            )
            if not ids:
                break
            results, stopped = _process_batch(ids, process, limiter, pool)
            for outcome in results:
                outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1
                if outcome not in (CallbackResult.SKIPPED, CallbackResult.MISSING):
                    done += 1
            if stopped or len(ids) < settings.compensator_batch_size:
                break
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    if done:
        log.info("swept %s callback rows", done, extra={"outcomes": outcomes})
    return done


def _process_batch(
    ids: list[int],
    process: Callable[[list[int]], list[CallbackResult]],
    limiter: RateLimiter,
    pool: ThreadPoolExecutor | None,
) -> tuple[list[CallbackResult], bool]:
    """Process claimed rows a chunk at a time, paced by ``limiter``; return the outcomes and whether to stop.

    A chunk whose processing raises means even its failures could not be
    recorded (database gone): the sweep stops, and that chunk and the rows not
    started keep their lease, so a later sweep takes them again.
    """
    chunks = [ids[i : i + ROWS_PER_TRANSACTION] for i in range(0, len(ids), ROWS_PER_TRANSACTION)]
    outcomes: list[CallbackResult] = []
    if pool is None:
        for chunk in chunks:
            _pace(limiter, len(chunk))
            try:
                outcomes.extend(process(chunk))
            except Exception as exc:  # noqa: BLE001 - database gone: the lease expires, a later sweep retries
                log.error("sweep stopped: cannot record callbacks %s.. (%s)", chunk[0], type(exc).__name__)
                return outcomes, True
        return outcomes, False
    futures = []
    for chunk in chunks:
        _pace(limiter, len(chunk))  # paced as it is handed out, so the rate limit holds whatever the concurrency
        futures.append((chunk, pool.submit(process, chunk)))
    stopped = False
    for chunk, future in futures:
        if stopped:
            future.cancel()
            continue
        try:
            outcomes.extend(future.result())
        except Exception as exc:  # noqa: BLE001 - database gone: the lease expires, a later sweep retries
            log.error("sweep stopped: cannot record callbacks %s.. (%s)", chunk[0], type(exc).__name__)
            stopped = True
    # Chunks already running when the sweep stopped finish on their own; they count in a later sweep's logs.
    return outcomes, stopped


def _pace(limiter: RateLimiter, rows: int) -> None:
    """One token per row of a chunk, taken before the chunk starts."""
    for _ in range(rows):
        limiter.acquire()
