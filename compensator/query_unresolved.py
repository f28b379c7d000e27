"""Job ``query_unresolved``: ask the provider about payments and refunds we do not know the outcome of.

Takes payments that are Unknown, or Pending past QUERY_PENDING_AFTER_SECONDS,
whose ``next_query_at`` is due; claims them with ``FOR UPDATE SKIP LOCKED``
and a lease, and queries each by our business number
(``payments.outbound.protocol.query_payment``). Found → applied through the state
machine. Not found → sent again with the same idempotency key, if the
provider's capabilities make that safe. Still unresolved at the payment's
deadline → manual review and an alert. Backoff between queries is exponential
with jitter (QUERY_BASE_SECONDS … QUERY_MAX_SECONDS). While a provider's
circuit breaker is open, each run may still send BREAKER_QUERY_BUDGET queries
to it; their answers are the probes that close it. Refunds (Unknown, or
Pending past the same setting) are claimed once no payment is left due, and
queried by our refund number (``payments.outbound.protocol.query_refund``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from datetime import datetime

from compensator.relay_outbox import throttle
from compensator.workpool import drain
from payments.infra.db import utcnow
from payments.outbound import breaker
from payments.outbound.protocol import Context, Result, claim_queries, query_payment, query_refund
from payments.runtime import Runtime
from payments.states import BreakerState

log = logging.getLogger("paysync.compensator.query")


def run_once(runtime: Runtime, *, max_seconds: float | None = None) -> int:
    """Query every due payment once; return how many were handled."""
    settings = runtime.settings
    ctx = Context(runtime.engine, runtime.providers, settings)
    lease = settings.call_lease_seconds
    budget: Counter[str] = Counter()
    budget_lock = threading.Lock()

    def work(item: tuple[str, str, datetime, str]) -> Result:
        number, provider, lease_until, kind = item
        budget_ok = False
        if breaker.read(runtime.engine, provider).state == BreakerState.OPEN:
            with budget_lock:
                budget_ok = budget[provider] < settings.breaker_query_budget
                budget[provider] += 1
        throttle(provider, settings.provider_rate_limit)
        query = query_refund if kind == "refund" else query_payment
        return query(ctx, number, provider, lease_until, budget_ok=budget_ok)

    results = drain(
        lambda n: claim_queries(runtime.engine, utcnow(), n, lease, settings.query_pending_after_seconds),
        work,
        concurrency=settings.relay_concurrency,
        max_seconds=settings.relay_max_seconds if max_seconds is None else max_seconds,
        poll_seconds=0.05,
        name="query",
    )
    counts = Counter(r.value for r in results)
    handled = sum(n for r, n in counts.items() if r != Result.SKIPPED)
    if handled:
        log.info("queried %s unresolved payments and refunds", handled, extra={"results": dict(counts)})
    return handled
