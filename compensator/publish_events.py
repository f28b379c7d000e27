"""Job ``publish_events``: deliver domain events from the outbox to the merchant's systems.

Claims due outbox rows whose type is a domain event (``payments.lifecycle.events.DOMAIN_EVENT_TYPES``;
``ChargeRequested``/``RefundRequested`` are left to ``relay_outbox``) with
``SELECT … FOR UPDATE SKIP LOCKED`` and a lease, then for each event and each
configured destination that still needs it:

- ``amqp`` (when ``AMQP_URL`` is set): publish to the ``EVENTS_EXCHANGE`` topic
  exchange with publisher confirms (``compensator/events_amqp.py``);
- ``webhook`` (when ``MERCHANT_WEBHOOK_URL`` is set): POST it signed in the
  Standard Webhooks format (``compensator/events_webhook.py``);

and records the outcome per destination in one transaction
(``payments.lifecycle.events.record``): delivered, backed off, or given up into the
manual queue with an alert. See ``payments/lifecycle/events.py`` for the delivery-state
model and the choices behind it.

Delivery happens outside any transaction (slow I/O never holds row locks);
the lease keeps other relays off the rows meanwhile. A pass stops taking new
events from its batch well before the lease could expire and gives the rest
back, so two relays never hold the same row in the steady state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import requests

from compensator.events_amqp import CONNECT_TIMEOUT_SECONDS, BrokerUnavailable, EventPublisher, MessageRefused
from compensator.events_webhook import post_event
from payments.escalation import evaluators as alert_evaluators
from payments.infra import failpoints
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.settings import Settings
from payments.lifecycle import events
from payments.lifecycle.events import AMQP, WEBHOOK, Attempt, ClaimedEvent
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.events")

RECORD_CHUNK = 50
"""Delivery outcomes are committed together up to this many events …"""
RECORD_EVERY_SECONDS = 1.0
"""… or this often, whichever comes first: a crash re-sends at most that much (at least once, deduped by id)."""


def _record(runtime: Runtime, chunk: list, policy: RetryPolicy, dests: Sequence[str]) -> int:
    if chunk:
        deadline = runtime.settings.event_delivery_deadline_seconds
        events.record(runtime.engine, chunk, utcnow(), policy, deadline, dests)
    return len(chunk)


def destinations(settings: Settings) -> list[str]:
    """The destinations configured in ``settings``, in delivery order."""
    out = []
    if settings.has_broker:
        out.append(AMQP)
    if settings.merchant_webhook_url:
        out.append(WEBHOOK)
    return out


def delivery_policy(settings: Settings) -> RetryPolicy:
    """Retry timing for one destination of one event."""
    return RetryPolicy(
        max_retries=settings.event_delivery_max_attempts,
        base_seconds=settings.retry_base_seconds,
        max_seconds=settings.retry_max_seconds,
    )


class _Pass:
    """The connections and counters of one run (a publisher and an HTTP session, both closed at the end)."""

    def __init__(self, settings: Settings, dests: Sequence[str]) -> None:
        self.settings = settings
        self.publisher = EventPublisher(settings.amqp_url, settings.events_exchange) if AMQP in dests else None
        self.session = requests.Session() if WEBHOOK in dests else None
        self.broker_down: str | None = None
        self.outcomes: dict[str, list[int]] = {d: [0, 0] for d in dests}

    def deliver(self, ev: ClaimedEvent) -> list[Attempt]:
        """Try every destination that is due for ``ev``; never raises."""
        now = utcnow()
        due = [d for d in self.outcomes if ev.due(d, now)]
        try:
            body = ev.body()
        except Exception as exc:  # noqa: BLE001 - a row we cannot read backs off and, in the end, gives up
            return [Attempt(d, ok=False, error=f"unreadable payload: {type(exc).__name__}") for d in due]
        attempts = []
        for destination in due:
            if destination == AMQP:
                attempt = self._publish(ev, body)
            else:
                s = self.settings
                attempt = post_event(
                    self.session,
                    s.merchant_webhook_url,
                    s.merchant_webhook_secret[0],  # rotation: the first listed secret signs
                    ev.event_id,
                    body,
                    s.merchant_webhook_timeout_seconds,
                )
            self.outcomes[destination][0 if attempt.ok else 1] += 1
            attempts.append(attempt)
        return attempts

    def _publish(self, ev: ClaimedEvent, body: bytes) -> Attempt:
        if self.broker_down:
            # One failed connect per run is enough: the rest of the batch backs off without waiting on it.
            return Attempt(AMQP, ok=False, error=f"broker unavailable: {self.broker_down}")
        try:
            self.publisher.publish(ev.event_id, ev.event_type, body, ev.created_at)
        except MessageRefused:
            return Attempt(AMQP, ok=False, error="broker nacked the message")
        except BrokerUnavailable as exc:
            self.broker_down = str(exc)
            log.warning("events broker unavailable (%s); events stay in the outbox", exc)
            return Attempt(AMQP, ok=False, error=f"broker unavailable: {exc}")
        return Attempt(AMQP, ok=True)

    def close(self) -> None:
        """Close the broker connection and the HTTP session."""
        if self.publisher is not None:
            self.publisher.close()
        if self.session is not None:
            self.session.close()


def run_once(runtime: Runtime, *, max_seconds: float | None = None) -> int:
    """Deliver due domain events until none are due (or ``max_seconds`` pass); return how many rows were handled."""
    settings = runtime.settings
    engine = runtime.engine
    dests = destinations(settings)
    policy = delivery_policy(settings)
    batch_size = settings.compensator_batch_size
    budget = max_seconds if max_seconds is not None else 30.0
    # Stop starting deliveries while the slowest possible one could still end inside the lease.
    lease = settings.events_lease_seconds
    safe_seconds = lease - settings.merchant_webhook_timeout_seconds - CONNECT_TIMEOUT_SECONDS * 2 - 10
    started = time.monotonic()
    handled = 0
    run = _Pass(settings, dests)
    try:
        while time.monotonic() - started < budget:
            claimed, finished = events.claim(engine, utcnow(), batch_size, dests, lease)
            handled += finished
            if not claimed:
                if finished == batch_size:
                    continue
                break
            claimed_at = time.monotonic()
            chunk: list[tuple[ClaimedEvent, list[Attempt]]] = []
            chunk_started = 0.0
            for i, ev in enumerate(claimed):
                if time.monotonic() - claimed_at > safe_seconds or time.monotonic() - started > budget:
                    events.release(engine, claimed[i:], utcnow())
                    break
                if not chunk:
                    chunk_started = time.monotonic()
                chunk.append((ev, run.deliver(ev)))
                failpoints.hit("publish_events.after_deliver")
                if len(chunk) >= RECORD_CHUNK or time.monotonic() - chunk_started >= RECORD_EVERY_SECONDS:
                    handled += _record(runtime, chunk, policy, dests)
                    chunk = []
            handled += _record(runtime, chunk, policy, dests)
            if len(claimed) < batch_size:
                break
    finally:
        run.close()
    sustain = alert_evaluators.rules_for(settings).route("event_delivery_failing").sustain_seconds
    events.note_health(engine, {d: (ok, failed) for d, (ok, failed) in run.outcomes.items()}, utcnow(), sustain)
    if handled:
        log.info("handled %s domain events", handled, extra={"outcomes": run.outcomes})
    return handled
