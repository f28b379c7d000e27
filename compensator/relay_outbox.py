"""Job ``relay_outbox``: send ChargeRequested and RefundRequested outbox rows to their provider.

Claims due rows with ``SELECT … FOR UPDATE SKIP LOCKED`` and leases them by
pushing ``next_attempt_at`` past the wait for the rate limiter and one full
provider call (``Settings.call_lease_seconds``), in one short transaction, so
any number of compensators share the queue; a row whose worker dies comes
back when the lease runs out and is sent again with the same idempotency key.
The lease is also the worker's token: a worker that finds another's token on
the row when it prepares the call sends nothing. Each row is handled by ``payments.outbound.protocol.relay_charge``
or ``relay_refund``, by its event type (prepare, call, apply: see there). Up to RELAY_CONCURRENCY calls are in flight
at once (256: a slot is a thread asleep on its socket, so calls hanging until
PROVIDER_TIMEOUT_SECONDS hold cheap slots, not the queue), at most
RELAY_PROVIDER_CONCURRENCY of them to one provider, and at most
RELAY_DB_CONCURRENCY (8) of them in a database transaction at once (the
claim, a prepare, an apply): a unit waits for its turn holding no connection,
so 256 threads never crowd the pool and the interpreter lock with 256 open
transactions (which stretched every one of them, ran the pool dry and failed
units on its timeout, to wait out their lease). Each provider
is held to PROVIDER_RATE_LIMIT calls per second per process and guarded by
its breaker (``payments.outbound.breaker``, inside the relay). The compensator runs
the job in a thread of its own, one run after another (``run_forever``), not
on the scheduler; a run polls for due rows every POLL_SECONDS while it has
calls in flight, and an idle run polls on for RELAY_INTERVAL_SECONDS (200 ms
by default) before the next begins, which is what keeps creation-to-provider
latency low. Claims are batched (``workpool.drain``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import datetime

from compensator.ratelimit import RateLimiter
from compensator.workpool import drain
from payments.infra.db import utcnow
from payments.infra.group_commit import GroupCommit
from payments.outbound.charges import CHARGE_REQUESTED
from payments.outbound.protocol import Context, Result, claim_sends, relay_charge, relay_refund
from payments.outbound.refunds import REFUND_REQUESTED
from payments.outbound.relay_batch import PreparedCharge, apply_charges, prepare_charges, send_prepared
from payments.providers.base import QueryOutcome
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.relay")

_limiters: dict[tuple[str, float], tuple[RateLimiter, threading.Lock]] = {}
_limiters_lock = threading.Lock()
_slots: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_db_turns: dict[int, threading.BoundedSemaphore] = {}


def provider_slots(provider: str, size: int) -> threading.BoundedSemaphore:
    """This process's bound on calls in flight to ``provider`` (kept across runs, like the rate limiter)."""
    with _limiters_lock:
        key = (provider, size)
        if key not in _slots:
            _slots[key] = threading.BoundedSemaphore(size)
        return _slots[key]


def db_turns(size: int) -> threading.BoundedSemaphore:
    """This process's bound on relay units inside a database transaction at once (RELAY_DB_CONCURRENCY)."""
    with _limiters_lock:
        if size not in _db_turns:
            _db_turns[size] = threading.BoundedSemaphore(size)
        return _db_turns[size]


def throttle(provider: str, rate: float) -> None:
    """Wait for this process's token bucket for ``provider`` (kept across runs, so the rate holds over time)."""
    with _limiters_lock:
        key = (provider, rate)
        if key not in _limiters:
            _limiters[key] = (RateLimiter(rate), threading.Lock())
        limiter, lock = _limiters[key]
    with lock:  # RateLimiter is not thread-safe; callers queue here, which is the rate limit
        limiter.acquire()


RELAYS = {CHARGE_REQUESTED: relay_charge, REFUND_REQUESTED: relay_refund}
"""The outbox commands this job sends (``outbound_protocol.SENDS``, claimed by ``claim_sends``), and what sends each."""


POLL_SECONDS = 0.05
"""While a run is on, due rows are looked for at least this often (``compensator.workpool.drain``)."""


def run_forever(runtime: Runtime, stop: threading.Event) -> None:
    """The compensator's relay: ``run_once`` back to back until ``stop`` is set, each run polling for due rows.

    Not an APScheduler job: a run that polls on for most of its interval (so a
    row committed between runs waits for a poll, POLL_SECONDS, not for the next
    run) ends just after that interval, so the scheduler found the last run
    still going at every other tick and logged "maximum number of running
    instances reached" for it twice a second, burying the warnings that
    matter. Back to back, there is no tick to miss and no gap between runs. A
    run that raises is logged and the next starts RELAY_INTERVAL_SECONDS later.
    """
    interval = runtime.settings.relay_interval_seconds
    while not stop.is_set():
        try:
            run_once(runtime, linger_seconds=interval)
        except Exception:  # noqa: BLE001 - the relay must live on, like a scheduled job
            log.exception("job relay_outbox failed")
            stop.wait(interval)


APPLY_GROUP_MAX = 100
"""At most this many call outcomes are applied in one transaction (``payments.infra.group_commit``)."""


def run_once(runtime: Runtime, *, max_seconds: float | None = None, linger_seconds: float = 0.0) -> int:
    """Relay until nothing is due and nothing is in flight; return the number of rows handled."""
    settings = runtime.settings
    ctx = Context(runtime.engine, runtime.providers, settings)
    lease = settings.call_lease_seconds
    turns = db_turns(settings.relay_db_concurrency)

    def turn() -> threading.BoundedSemaphore:
        return turns

    def apply_group(units: Sequence[tuple[PreparedCharge, QueryOutcome]]) -> list[Result | None]:
        with turns:
            return apply_charges(ctx, units)

    group: GroupCommit[tuple[PreparedCharge, QueryOutcome], Result | None] = GroupCommit(apply_group, APPLY_GROUP_MAX)

    def work(item: PreparedCharge | tuple[int, str, datetime, str]) -> Result:
        provider = item.provider.name if isinstance(item, PreparedCharge) else item[1]
        # A row waiting here keeps its lease, which may run out: a prepared charge re-checks (and renews) it just
        # before its send (relay_batch._fence), any other row's prepare re-checks its token, so one whose lease
        # ran out meanwhile (another compensator took it over) sends nothing.
        with provider_slots(provider, settings.relay_provider_concurrency):
            throttle(provider, settings.provider_rate_limit)
            if isinstance(item, PreparedCharge):
                return send_prepared(ctx, item, group, turn)
            outbox_id, _, lease_until, event_type = item
            return RELAYS[event_type](ctx, outbox_id, provider, lease_until, turn)

    def claim(n: int) -> list[PreparedCharge | tuple[int, str, datetime, str]]:
        with turns:
            rows = claim_sends(runtime.engine, utcnow(), n, lease)
            charges = [(r[0], r[1], r[2]) for r in rows if r[3] == CHARGE_REQUESTED]
            prepared, others = prepare_charges(ctx, charges) if charges else ([], [])
        rest = set(others)
        return [*prepared, *(r for r in rows if r[3] != CHARGE_REQUESTED or r[0] in rest)]

    results = drain(
        claim,
        work,
        concurrency=settings.relay_concurrency,
        max_seconds=settings.relay_max_seconds if max_seconds is None else max_seconds,
        poll_seconds=min(settings.relay_interval_seconds, POLL_SECONDS),
        name="relay",
        linger_seconds=linger_seconds,
    )
    counts = Counter(r.value for r in results)
    handled = sum(n for r, n in counts.items() if r != Result.SKIPPED)
    if handled:
        log.info(
            "relayed %s charge and refund requests",
            handled,
            extra={"results": dict(counts), "apply_groups": group.groups, "applied_in_groups": group.units},
        )
    return handled
