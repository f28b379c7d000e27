"""Catching up on Stripe events that never arrived as webhooks, applied like webhooks (job ``catch_up``).

Stripe keeps events for 30 days (``GET /v1/events``). Each run lists the
event types paysync applies created since the newest one the last run saw
(``provider_cursor`` stripe/events), less an overlap, up to a minute ago
(younger events are left to their webhook, which is normally in flight). Every
event not yet received (no applied ``processed_event``, no stored delivery of
it other than a rejected one) is stored as a delivery with source ``api``
(``payments.inbound.callbacks.store_callback``) and processed at once by
``process_callback``: the same store-then-process path, dedupe and state
machine as a webhook. Such a row needs no signature: it was written by this
job from Stripe's authenticated answer (``Provider.parse_fetched``); a rejected
webhook of the same event (a key problem, say) is exactly what this repairs.
A genuine event that is not ours (another integration's PaymentIntent) is
not stored. The cursor moves only after a complete listing, so a run that
breaks off is repeated, and repeats are deduplicated.

Unlike the gateway, this job publishes no delivery message (``payments.inbound.delivery``):
the backup of what it stores is Stripe itself. Nothing was acknowledged to
anyone, the event stays listable for 30 days, and the cursor is committed after
the rows it covers, so a database that lost those rows (a failover to a replica
that missed the last transactions, a restore from backup) lost the cursor's
advance too, and the next run fetches and stores the events again. A message
would also have to mark its row as needing no signature (``source`` api), a
trust the broker's copies of webhooks do not need.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from sqlalchemy import Engine, exists, or_, select

from payments.errors import EventIgnored, MalformedCallback
from payments.inbound.callbacks import process_callback, store_callback
from payments.inbound.context import Context
from payments.infra.cursors import advance_cursor, read_cursor
from payments.infra.schema import SOURCE_API, payment_callback_log, processed_event
from payments.providers.base import Provider, ProviderUnavailable
from payments.states import CallbackStatus

log = logging.getLogger("paysync.compensator.catch_up")  # the job's lines keep their name

PROVIDER = "stripe"
CURSOR = "events"
OVERLAP_SECONDS = 300
"""Each listing starts this long before the newest event seen: events are not committed in created order."""
SETTLE_SECONDS = 60
"""Events younger than this are left to their webhook."""
INITIAL_LOOKBACK_SECONDS = 3 * 86400
"""The first run looks this far back: as long as Stripe keeps retrying a webhook."""
RETENTION_SECONDS = 30 * 86400 - 3600
"""Stripe lists events up to 30 days old; never ask for more."""


def catch_up(runtime: Context, *, now: float | None = None) -> int:
    """List recent Stripe events and feed the missed ones into the pipeline; return how many were fed."""
    provider = runtime.providers.get(PROVIDER)
    if provider is None or not hasattr(provider, "list_events"):
        return 0
    now = time.time() if now is None else now
    cursor = read_cursor(runtime.engine, PROVIDER, CURSOR)
    since = now - INITIAL_LOOKBACK_SECONDS if cursor is None else cursor - OVERLAP_SECONDS
    since = max(since, now - RETENTION_SECONDS)
    until = now - SETTLE_SECONDS
    if since >= until:
        return 0
    fed = 0
    newest = cursor
    try:
        for event in provider.list_events(int(since), int(until), runtime.settings.provider_timeout_seconds):
            created = event.get("created")
            if isinstance(created, int) and not isinstance(created, bool):
                newest = created if newest is None else max(newest, created)
            fed += _feed(runtime, provider, event)
    except ProviderUnavailable as exc:
        log.warning("catch_up stopped, the cursor stays where it was: %s", exc)
        return fed
    if newest is not None:
        advance_cursor(runtime.engine, PROVIDER, CURSOR, newest)
    if fed:
        log.info("catch_up fed %s missed Stripe events", fed)
    return fed


def _feed(runtime: Context, provider: Provider, event: dict[str, Any]) -> bool:
    """Store and process one listed event unless it was received already or is not ours; True if it was fed."""
    event_id = event.get("id")
    if not isinstance(event_id, str) or _received(runtime.engine, event_id):
        return False
    body = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
    try:
        provider.parse_fetched(body)
    except EventIgnored:
        return False  # genuine and not ours (another integration's object): nothing to store
    except MalformedCallback:
        pass  # stored all the same: processing rejects it with the reason, for a person to see
    log_id = store_callback(
        runtime.engine,
        provider=PROVIDER,
        body=body,
        headers={},
        remote_addr=None,
        index=provider.peek_callback(body),
        source=SOURCE_API,
    )
    process_callback(runtime.engine, runtime.providers, log_id, runtime.callback_policy)
    return True


def _received(engine: Engine, event_id: str) -> bool:
    """True when the event was applied, or a delivery of it is stored and not rejected (it is or was processed)."""
    t = payment_callback_log
    with engine.connect() as conn:
        return bool(
            conn.execute(
                select(
                    or_(
                        exists().where(
                            processed_event.c.provider == PROVIDER, processed_event.c.provider_event_id == event_id
                        ),
                        exists().where(
                            t.c.provider == PROVIDER,
                            t.c.provider_event_id == event_id,
                            t.c.status != CallbackStatus.REJECTED,
                        ),
                    )
                )
            ).scalar()
        )
