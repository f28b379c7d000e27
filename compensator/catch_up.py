"""Job ``catch_up``: fetch the Stripe events that never arrived as webhooks, and apply them like webhooks.

The work is ``payments.inbound.catch_up`` (what is listed, what is stored, when the cursor moves); this is
the job's schedule.
"""

from __future__ import annotations

from payments.inbound.catch_up import catch_up
from payments.runtime import Runtime

INTERVAL_SECONDS = 120.0
"""How often the job runs."""


def run_once(runtime: Runtime, *, now: float | None = None) -> int:
    """List recent Stripe events and feed the missed ones into the pipeline; return how many were fed."""
    return catch_up(runtime, now=now)
