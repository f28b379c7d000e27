"""When an unresolved payment is queried next: fast at first, backing off, never faster than its provider allows.

A payment left Unknown (a timeout, a dropped connection, a 5xx) or Pending is
settled by querying its provider. Most are settled by the first query, a
second or two after the fault; the ones still unresolved then are those the
fault is still on for, so each further query waits twice as long as the one
before, up to QUERY_MAX_SECONDS: the queries of a long outage stay few, and
the first one after it ends comes at most a cap later. With "equal jitter"
(as ``payments.infra.backoff``) a crowd of payments failed together does not come
back in lockstep.

Every unresolved payment of a provider shares that provider's rate limit
(PROVIDER_RATE_LIMIT, calls a second) with its charges and refunds. Queries
may use ``QUERY_SHARE`` of it: with ``backlog`` payments waiting on one
provider, each waits at least ``backlog / (QUERY_SHARE * rate_limit)``
between two queries, so together they never ask for more than that share.

``query_delay_seconds`` is the schedule itself, a pure function;
``query_delay`` reads it from the settings.
"""

from __future__ import annotations

import random

from payments.infra.settings import Settings

QUERY_SHARE = 0.5
"""Share of a provider's rate limit that queries of unresolved payments may use; the rest is for charges and refunds."""


def query_delay_seconds(
    attempt: int,
    *,
    base: float,
    cap: float,
    rate_limit: float,
    backlog: int = 1,
    jitter: float = 1.0,
    settles_in: float | None = None,
) -> float:
    """Seconds before query number ``attempt`` (1-based) of one payment.

    ``min(cap, base * 2**(attempt-1))`` with equal jitter (``jitter`` in [0, 1]
    picks the point in its upper half); no later than ``settles_in``, the
    seconds until a moment known to settle it (an unpaid QR order may be
    closed then); and at least ``backlog`` payments' share of the provider's
    ``rate_limit`` (calls a second), whichever of those asks.
    """
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    if not 0.0 <= jitter <= 1.0:
        raise ValueError("jitter is a fraction in [0, 1]")
    if base <= 0 or cap <= 0 or rate_limit <= 0 or backlog < 1:
        raise ValueError("base, cap and rate_limit are positive, backlog at least 1")
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 62))  # 2**62 keeps an absurd attempt count a finite float
    delay = ceiling / 2 * (1.0 + jitter)
    if settles_in is not None and settles_in >= 0:
        delay = min(delay, settles_in)
    return max(delay, backlog / (QUERY_SHARE * rate_limit))


def query_delay(
    settings: Settings,
    attempt: int,
    backlog: int = 1,
    rng: random.Random | None = None,
    settles_in: float | None = None,
) -> float:
    """Seconds before query number ``attempt`` (1-based) of a payment: the schedule with the settings' figures."""
    return query_delay_seconds(
        max(1, attempt),
        base=settings.query_base_seconds,
        cap=settings.query_max_seconds,
        rate_limit=settings.provider_rate_limit,
        backlog=backlog,
        jitter=(rng or random).random(),
        settles_in=settles_in,
    )
