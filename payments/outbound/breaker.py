"""A circuit breaker per provider, kept in the database so every compensator process agrees.

Closed: calls flow. After BREAKER_FAILURE_THRESHOLD consecutive Unknowns
(timeouts, resets, 5xx, 429, garbage) the breaker opens: calls to that
provider pause as a whole until ``retry_at``, an alert fires, and outbox rows
are pushed out to ``retry_at`` instead of piling retries on a sick provider.
At ``retry_at`` exactly one caller (across all processes: a guarded UPDATE
takes the slot) sends a probe. A probe that gets any real answer closes the
breaker and clears the alert; a failed probe reopens it with a longer,
jittered pause. Queries keep a small budget while open (see query_unresolved)
and their answers count as probes too.

Why a table and not process memory: with several compensators, a per-process
breaker would let each of them hammer the provider with its own threshold's
worth of calls, and one process's probe could not close the others'.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import Engine, select, update

from payments.escalation import alerts
from payments.infra.backoff import compute_backoff
from payments.infra.db import insert_ignore
from payments.infra.schema import provider_breaker
from payments.infra.settings import Settings
from payments.states import BreakerState

log = logging.getLogger("paysync.breaker")

Turn = Callable[[], AbstractContextManager[object]]
"""A wait for a turn at the database: the relay bounds how many of its threads hold a connection at once."""


class Admission(StrEnum):
    """What a caller may do now."""

    ALLOW = "allow"
    PROBE = "probe"
    """The breaker is open and this caller holds the one probe slot."""
    DENY = "deny"


@dataclass(frozen=True)
class Snapshot:
    """The breaker row as last read."""

    state: BreakerState = BreakerState.CLOSED
    consecutive_failures: int = 0
    open_count: int = 0
    retry_at: datetime | None = None


alert_key = alerts.breaker_alert_key
"""The alert's dedupe key for one provider's open breaker (kept in alerts, where the evaluator reads it too)."""


CACHE_SECONDS = 0.2
"""A process re-reads a breaker row at most this often: one SELECT per provider per 200 ms, not per call."""

_cache: dict[tuple[int, str], tuple[float, Snapshot]] = {}
_cache_lock = threading.Lock()


def read(engine: Engine, provider: str, turn: Turn = nullcontext) -> Snapshot:
    """The breaker's current state (closed when there is no row yet), at most CACHE_SECONDS old.

    A cache miss reads the row within ``turn()``; a hit touches no connection and waits for no turn.
    """
    key = (id(engine), provider)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None and time.monotonic() - cached[0] < CACHE_SECONDS:
        return cached[1]
    with turn(), engine.connect() as conn:
        row = conn.execute(select(provider_breaker).where(provider_breaker.c.provider == provider)).first()
    snapshot = Snapshot()
    if row is not None:
        snapshot = Snapshot(row.state, row.consecutive_failures, row.open_count, row.retry_at)
    with _cache_lock:
        _cache[key] = (time.monotonic(), snapshot)
    return snapshot


def _forget(engine: Engine, provider: str) -> None:
    with _cache_lock:
        _cache.pop((id(engine), provider), None)


def clear_cache() -> None:
    """Forget every cached breaker row: after the table was emptied behind this process's back (tests do)."""
    with _cache_lock:
        _cache.clear()


@dataclass(frozen=True)
class Gate:
    """One caller's admission, and the breaker row it was decided on."""

    admission: Admission = Admission.ALLOW
    snapshot: Snapshot = Snapshot()
    probe_until: datetime | None = None
    """While PROBE: when the slot expires on its own; also the slot's token for ``release``."""

    @property
    def probe(self) -> bool:
        """True when this caller holds the probe slot: its call's result decides the breaker."""
        return self.admission == Admission.PROBE


def admit(engine: Engine, provider: str, now: datetime, probe_seconds: float) -> Gate:
    """ALLOW when closed; when open, PROBE for the one caller that takes the slot at ``retry_at``, else DENY.

    A caller that takes the slot and then makes no call must ``release`` it,
    or the breaker stays open until the slot expires (``probe_seconds``).
    """
    snapshot = read(engine, provider)
    if snapshot.state == BreakerState.CLOSED:
        return Gate(Admission.ALLOW, snapshot)
    if snapshot.retry_at is not None and now < snapshot.retry_at:
        return Gate(Admission.DENY, snapshot)
    probe_until = now + timedelta(seconds=probe_seconds)
    with engine.begin() as conn:
        taken = conn.execute(
            update(provider_breaker)
            .where(
                provider_breaker.c.provider == provider,
                provider_breaker.c.state == BreakerState.OPEN,
                provider_breaker.c.retry_at <= now,
            )
            .values(retry_at=probe_until, updated_at=now)
        ).rowcount
    _forget(engine, provider)
    if not taken:  # … another process took the probe slot first, or a probe already closed the breaker
        # Whoever took the slot holds it until about probe_until: that is when to look again.
        return Gate(Admission.DENY, replace(snapshot, retry_at=probe_until))
    return Gate(Admission.PROBE, snapshot, probe_until)


def release(engine: Engine, provider: str, gate: Gate, now: datetime) -> None:
    """Give an unused probe slot back at once (the caller made no call), so the next caller may probe."""
    if not gate.probe:
        return
    with engine.begin() as conn:
        conn.execute(
            update(provider_breaker)
            .where(
                provider_breaker.c.provider == provider,
                provider_breaker.c.state == BreakerState.OPEN,
                provider_breaker.c.retry_at == gate.probe_until,  # still our slot
            )
            .values(retry_at=now, updated_at=now)
        )
    _forget(engine, provider)


def record(
    engine: Engine,
    provider: str,
    *,
    healthy: bool,
    probe: bool,
    snapshot: Snapshot,
    settings: Settings,
    now: datetime,
    turn: Turn = nullcontext,
) -> None:
    """Count one call's result. Writes nothing for a healthy call while nothing is wrong (the common case).

    What it does write, it writes within ``turn()``.
    """
    if healthy and snapshot.state == BreakerState.CLOSED and snapshot.consecutive_failures == 0:
        return
    with turn():
        _record(engine, provider, healthy=healthy, probe=probe, snapshot=snapshot, settings=settings, now=now)


def record_call(
    engine: Engine,
    provider: str,
    gate: Gate,
    *,
    healthy: bool,
    settings: Settings,
    now: datetime,
    turn: Turn = nullcontext,
) -> None:
    """Count the result of a call ``gate`` let through (``record``, with the gate's probe and snapshot)."""
    record(
        engine,
        provider,
        healthy=healthy,
        probe=gate.probe,
        snapshot=gate.snapshot,
        settings=settings,
        now=now,
        turn=turn,
    )


def _record(
    engine: Engine, provider: str, *, healthy: bool, probe: bool, snapshot: Snapshot, settings: Settings, now: datetime
) -> None:
    if healthy:
        _forget(engine, provider)
        with engine.begin() as conn:
            closed = conn.execute(
                update(provider_breaker)
                .where(provider_breaker.c.provider == provider)
                .values(state=BreakerState.CLOSED, consecutive_failures=0, open_count=0, retry_at=None, updated_at=now)
            ).rowcount
            if snapshot.state == BreakerState.OPEN and closed:
                alerts.clear(conn, key=alert_key(provider), now=now)
                log.warning("circuit breaker for %s closed: a probe got an answer", provider)
        return
    _forget(engine, provider)
    # Its own transaction: an INSERT IGNORE that meets the existing row holds a shared lock on it, and two
    # callers each holding one while asking for FOR UPDATE below would deadlock (and lose their counts).
    with engine.begin() as conn:
        conn.execute(
            insert_ignore(provider_breaker).values(
                provider=provider, state=BreakerState.CLOSED, consecutive_failures=0, open_count=0, updated_at=now
            )
        )
    with engine.begin() as conn:
        row = conn.execute(
            select(provider_breaker).where(provider_breaker.c.provider == provider).with_for_update()
        ).first()
        failures = row.consecutive_failures + 1
        values: dict = {"consecutive_failures": failures, "updated_at": now}
        opens = None
        if row.state == BreakerState.CLOSED and failures >= settings.breaker_failure_threshold:
            opens = 1
            values.update(state=BreakerState.OPEN, opened_at=now)
        elif row.state == BreakerState.OPEN and probe:
            opens = row.open_count + 1
        if opens is not None:
            pause = compute_backoff(opens, settings.breaker_open_seconds, settings.breaker_max_open_seconds)
            values.update(open_count=opens, retry_at=now + timedelta(seconds=pause))
            alerts.observe(
                conn,
                rule="provider_circuit_open",
                key=alert_key(provider),
                message=f"provider {provider} circuit open after {failures} failed calls; next probe in {pause:.1f} s",
                now=now,
                severity="critical",
                details={"provider": provider, "consecutive_failures": failures, "open_count": opens},
            )
            log.warning("circuit breaker for %s open (%s failures), probe in %.1f s", provider, failures, pause)
        conn.execute(update(provider_breaker).where(provider_breaker.c.provider == provider).values(**values))
