"""Domain events for the merchant's own systems: what they look like and where each one has got to.

Every payment and refund state change writes a domain event (``PaymentSucceeded``,
``RefundFailed``, …) to the ``outbox`` in the same transaction as the change
(``transitions`` writes what ``status_change_event`` below returns). The
``publish_events`` compensator job delivers them to up to two destinations:

- ``amqp``: the RabbitMQ topic exchange ``EVENTS_EXCHANGE`` (routing key = event type);
- ``webhook``: ``MERCHANT_WEBHOOK_URL``, signed in the Standard Webhooks format.

Delivery state lives in its own small table, ``event_delivery``, one row per
(event, destination), rather than in more ``outbox`` columns: each destination
keeps its own attempt count, backoff and give-up, so a broker outage never
re-sends a webhook that already got its 2xx (and a failing merchant endpoint
never re-publishes to the broker), and adding a destination later means rows,
not columns. The ``outbox`` row stays the unit that is claimed: it is
``OutboxStatus.PENDING`` while any configured destination is pending, its
``next_attempt_at`` is the earliest pending destination's, and it becomes
``DONE`` once every configured destination has the event (``DEAD`` if one of
them gave up into the manual queue).

Destinations that are not configured are skipped. With none configured (the
embedded default: no broker, no webhook URL) rows are marked ``DONE`` without
delivery rows: nobody is listening, and keeping them pending would only grow a
backlog; switching a destination on later delivers new events, not history.
Every compensator must therefore run with the same destinations configured.

Delivery is at least once: a relay that dies after a 2xx but before its
commit sends that event again. Receivers dedupe on the event id.

Only the types in ``DOMAIN_EVENT_TYPES`` are taken; commands such as
``ChargeRequested`` and ``RefundRequested`` belong to ``relay_outbox``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, select, update

from payments.escalation import alerts
from payments.escalation.review import escalate
from payments.infra.backoff import RetryPolicy
from payments.infra.db import insert_ignore, is_sqlite
from payments.infra.schema import event_delivery
from payments.infra.schema import outbox as outbox_table
from payments.states import DeliveryStatus, OutboxStatus, PaymentStatus, StatusChange

log = logging.getLogger("paysync.events")

DOMAIN_EVENTS = {
    ("payment", PaymentStatus.SUCCEEDED): "PaymentSucceeded",
    ("payment", PaymentStatus.FAILED): "PaymentFailed",
    ("payment", PaymentStatus.UNKNOWN): "PaymentUnknown",
    ("refund", PaymentStatus.SUCCEEDED): "RefundSucceeded",
    ("refund", PaymentStatus.FAILED): "RefundFailed",
    ("refund", PaymentStatus.UNKNOWN): "RefundUnknown",
}
"""Domain events for the merchant's own systems, by (kind, new status); Pending has none."""

DOMAIN_EVENT_TYPES = frozenset(DOMAIN_EVENTS.values())
"""Outbox event types that are news for the merchant (every other type is a command for relay_outbox)."""

AMQP = "amqp"
"""Destination: the RabbitMQ topic exchange."""
WEBHOOK = "webhook"
"""Destination: the merchant's webhook URL."""


def status_change_event(
    change: StatusChange,
    now: datetime,
    *,
    order_no: str | None,
    provider_reference: str | None,
    failure_code: str | None,
) -> tuple[str, dict[str, Any]] | None:
    """The domain event (type, outbox payload) a status change announces (pure); None for Pending."""
    event_type = DOMAIN_EVENTS.get((change.kind, change.target))
    if event_type is None:
        return None
    return event_type, {
        "type": event_type,
        "payment_id": change.payment_id,
        "refund_id": change.reference if change.kind == "refund" else None,
        "order_no": order_no,
        "amount": change.amount_minor,
        "currency": change.currency,
        "status": change.target.value,
        "provider": change.provider,
        "provider_transaction_id": provider_reference,
        "failure_code": failure_code,
        "source": change.source,
        "occurred_at": now.isoformat() + "Z",
    }


def envelope(event_id: str, event_type: str, payload: str, created_at: datetime) -> bytes:
    """The JSON body both destinations receive: ``{"id", "type", "timestamp", "data"}``, compact and sorted.

    The shape follows the Standard Webhooks payload recommendation; ``data``
    is the outbox payload (payment_id, refund_id, order_no, amount, currency,
    status, provider, provider_transaction_id, failure_code, source, occurred_at).
    """
    data = json.loads(payload)
    data.pop("type", None)  # it is the envelope's
    body = {"id": event_id, "type": event_type, "timestamp": created_at.isoformat() + "Z", "data": data}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


@dataclass
class Delivery:
    """One destination's state for one claimed event."""

    status: DeliveryStatus = DeliveryStatus.PENDING
    attempts: int = 0
    next_attempt_at: datetime | None = None


@dataclass
class ClaimedEvent:
    """An outbox row this relay holds a lease on, with its per-destination state."""

    outbox_id: int
    event_id: str
    event_type: str
    aggregate_id: str
    payload: str
    created_at: datetime
    lease_until: datetime
    deliveries: dict[str, Delivery] = field(default_factory=dict)

    def due(self, destination: str, now: datetime) -> bool:
        """True when ``destination`` still needs this event and its backoff has passed."""
        d = self.deliveries.get(destination)
        return (
            d is not None
            and d.status == DeliveryStatus.PENDING
            and (d.next_attempt_at is None or d.next_attempt_at <= now)
        )

    def body(self) -> bytes:
        """The envelope sent to every destination."""
        return envelope(self.event_id, self.event_type, self.payload, self.created_at)


@dataclass(frozen=True)
class Attempt:
    """The result of one delivery attempt to one destination."""

    destination: str
    ok: bool
    error: str | None = None
    http_status: int | None = None
    permanent: bool = False
    """The destination refused for good (HTTP 410 Gone): give up now, do not retry."""
    retry_after: float | None = None
    """Seconds the destination asked us to wait (Retry-After), if any."""


def claim(
    engine: Engine, now: datetime, batch_size: int, destinations: Sequence[str], lease_seconds: float
) -> tuple[list[ClaimedEvent], int]:
    """Claim up to ``batch_size`` due domain-event rows; return (leased events, rows finished at once).

    ``SELECT … FOR UPDATE SKIP LOCKED`` plus a lease (``next_attempt_at``
    pushed out to a value that is also this claim's token), in one short
    transaction, so concurrent relays never hold the same row. With no
    destination configured the rows are marked done here and nothing is leased.
    """
    t = outbox_table
    query = (
        select(t.c.id, t.c.event_id, t.c.event_type, t.c.aggregate_id, t.c.payload, t.c.created_at)
        .where(
            t.c.status == OutboxStatus.PENDING,
            t.c.event_type.in_(sorted(DOMAIN_EVENT_TYPES)),
            t.c.next_attempt_at <= now,
        )
        .order_by(t.c.id)
        .limit(batch_size)
    )
    if not is_sqlite(engine):  # SQLite has one writer at a time; BEGIN IMMEDIATE already serialises us
        query = query.with_for_update(skip_locked=True)
    lease_until = now + timedelta(seconds=lease_seconds)
    with engine.begin() as conn:
        rows = conn.execute(query).all()
        if not rows:
            return [], 0
        ids = [r.id for r in rows]
        if not destinations:
            conn.execute(update(t).where(t.c.id.in_(ids)).values(status=OutboxStatus.DONE, updated_at=now))
            return [], len(ids)
        conn.execute(update(t).where(t.c.id.in_(ids)).values(next_attempt_at=lease_until, updated_at=now))
        event_ids = [r.event_id for r in rows]
        fresh = [
            {
                "event_id": r.event_id,
                "destination": destination,
                "status": DeliveryStatus.PENDING,
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
                "updated_at": now,
            }
            for r in rows
            for destination in destinations
        ]
        conn.execute(insert_ignore(event_delivery), fresh)  # rows of earlier passes stay as they are
        states: dict[str, dict[str, Delivery]] = {}
        for d in conn.execute(
            select(
                event_delivery.c.event_id,
                event_delivery.c.destination,
                event_delivery.c.status,
                event_delivery.c.attempts,
                event_delivery.c.next_attempt_at,
            ).where(event_delivery.c.event_id.in_(event_ids))
        ):
            states.setdefault(d.event_id, {})[d.destination] = Delivery(d.status, d.attempts, d.next_attempt_at)
    claimed = [
        ClaimedEvent(
            outbox_id=r.id,
            event_id=r.event_id,
            event_type=r.event_type,
            aggregate_id=r.aggregate_id,
            payload=r.payload,
            created_at=r.created_at,
            lease_until=lease_until,
            deliveries={k: v for k, v in states.get(r.event_id, {}).items() if k in destinations},
        )
        for r in rows
    ]
    return claimed, 0


def release(engine: Engine, events: Iterable[ClaimedEvent], now: datetime) -> int:
    """Give back leased rows this relay will not get to, so another relay can take them at once."""
    released = 0
    with engine.begin() as conn:
        for ev in events:
            released += conn.execute(
                update(outbox_table)
                .where(
                    outbox_table.c.id == ev.outbox_id,
                    outbox_table.c.status == OutboxStatus.PENDING,
                    outbox_table.c.next_attempt_at == ev.lease_until,  # still ours
                )
                .values(next_attempt_at=now, updated_at=now)
            ).rowcount
    return released


def record(
    engine: Engine,
    passes: Sequence[tuple[ClaimedEvent, Sequence[Attempt]]],
    now: datetime,
    policy: RetryPolicy,
    deadline_seconds: float,
    destinations: Sequence[str],
) -> list[OutboxStatus]:
    """Record a chunk of delivery passes in ONE transaction; return the outbox status each event is left in.

    Delivered destinations are marked; failed ones back off (exponential with
    jitter, at least any Retry-After) or, past ``policy.max_retries`` failures,
    the deadline, or on a permanent refusal, give up into the manual queue with
    an alert. An outbox row then becomes DONE/DEAD when no configured
    destination is pending, else is rescheduled at the earliest pending one.

    One transaction per chunk rather than per event: a commit costs a log
    flush, and a relay that dies before it re-sends at most one chunk (the
    delivery is at least once either way). The common case, delivered
    everywhere, is a handful of set-wise UPDATEs whatever the chunk size.
    Outbox UPDATEs are guarded by the lease token; if the lease was lost (the
    pass took longer than EVENTS_LEASE_SECONDS) the delivery facts are still written
    and the row is left to whoever holds it now.
    """
    statuses: list[OutboxStatus] = []
    delivered: dict[tuple[str, int | None], list[str]] = {}
    finished: dict[datetime, list[int]] = {}
    with engine.begin() as conn:
        for ev, attempts in passes:
            deadline = ev.created_at + timedelta(seconds=deadline_seconds)
            for a in attempts:
                state = ev.deliveries[a.destination]
                if a.ok:
                    delivered.setdefault((a.destination, a.http_status), []).append(ev.event_id)
                    state.status = DeliveryStatus.DELIVERED
                    continue
                guard = (
                    event_delivery.c.event_id == ev.event_id,
                    event_delivery.c.destination == a.destination,
                    event_delivery.c.status == DeliveryStatus.PENDING,
                )
                failures = state.attempts + 1
                error = (a.error or "failed")[:480]
                values: dict[str, Any] = {
                    "attempts": failures,
                    "last_error": error,
                    "last_http_status": a.http_status,
                    "updated_at": now,
                }
                if a.permanent or policy.exhausted(failures) or now >= deadline:
                    if a.permanent:
                        why = "refused for good"
                    else:
                        why = "deadline passed" if now >= deadline else "retries exhausted"
                    values.update(
                        status=DeliveryStatus.GAVE_UP,
                        last_error=f"gave up ({why}) after {failures} attempts: {error}"[:500],
                    )
                    conn.execute(update(event_delivery).where(*guard).values(**values))
                    _give_up(conn, ev, a.destination, failures, why, error, now)
                    state.status, state.attempts = DeliveryStatus.GAVE_UP, failures
                    continue
                delay = policy.delay(failures)
                if a.retry_after:
                    delay = max(delay, min(a.retry_after, policy.max_seconds))
                state.attempts, state.next_attempt_at = failures, now + timedelta(seconds=delay)
                conn.execute(
                    update(event_delivery).where(*guard).values(next_attempt_at=state.next_attempt_at, **values)
                )

            configured = [s for d, s in ev.deliveries.items() if d in destinations]
            pending = [s for s in configured if s.status == DeliveryStatus.PENDING]
            errors = "; ".join(f"{a.destination}: {a.error}" for a in attempts if not a.ok)[:500] or None
            if not pending and not errors and all(s.status == DeliveryStatus.DELIVERED for s in configured):
                finished.setdefault(ev.lease_until, []).append(ev.outbox_id)
                statuses.append(OutboxStatus.DONE)
                continue
            if pending:
                status = OutboxStatus.PENDING
                row: dict[str, Any] = {"next_attempt_at": min(s.next_attempt_at or now for s in pending)}
            else:
                status = (
                    OutboxStatus.DEAD
                    if any(s.status == DeliveryStatus.GAVE_UP for s in configured)
                    else OutboxStatus.DONE
                )
                row = {"status": status}
            statuses.append(status)
            _update_leased(conn, [ev.outbox_id], ev.lease_until, last_error=errors, **row, now=now)

        for (destination, http_status), event_ids in delivered.items():
            conn.execute(
                update(event_delivery)
                .where(
                    event_delivery.c.event_id.in_(event_ids),
                    event_delivery.c.destination == destination,
                    event_delivery.c.status == DeliveryStatus.PENDING,
                )
                .values(
                    status=DeliveryStatus.DELIVERED,
                    delivered_at=now,
                    last_error=None,
                    last_http_status=http_status,
                    updated_at=now,
                )
            )
        for lease_until, ids in finished.items():
            _update_leased(conn, ids, lease_until, status=OutboxStatus.DONE, last_error=None, now=now)
    return statuses


def _update_leased(conn: Any, ids: list[int], lease_until: datetime, *, now: datetime, **values: Any) -> None:
    """UPDATE outbox rows this relay still holds (lease token unchanged); count one more attempt."""
    t = outbox_table
    changed = conn.execute(
        update(t)
        .where(t.c.id.in_(ids), t.c.status == OutboxStatus.PENDING, t.c.next_attempt_at == lease_until)
        .values(attempts=t.c.attempts + 1, updated_at=now, **values)
    ).rowcount
    if changed != len(ids):
        log.warning(
            "%s of %s outbox rows: lease lost before recording; another relay holds them", len(ids) - changed, len(ids)
        )


def _give_up(conn: Any, ev: ClaimedEvent, destination: str, failures: int, why: str, error: str, now: datetime) -> None:
    data = json.loads(ev.payload)
    reason = f"event {ev.event_id} ({ev.event_type}) not delivered to {destination}: {why} after {failures} attempts"
    # Its own subject per event and destination: every give-up is news, and no two relays share an alert row.
    escalate(
        conn,
        kind="event_delivery_gave_up",
        subject=f"event:{ev.event_id}:{destination}",
        reason=reason,
        now=now,
        payment_id=data.get("payment_id"),
        refund_id=data.get("refund_id"),
        details={
            "event_id": ev.event_id,
            "event_type": ev.event_type,
            "destination": destination,
            "attempts": failures,
            "last_error": error,
        },
    )
    log.warning("event delivery gave up", extra={"event_id": ev.event_id, "destination": destination, "why": why})


def note_health(engine: Engine, outcomes: dict[str, tuple[int, int]], now: datetime, sustain_seconds: float) -> None:
    """Keep one ``event_delivery_failing:<destination>`` alert per destination in step with this run.

    ``outcomes`` maps destination -> (delivered, failed) in this run. Failures
    with no success open (then, after ``sustain_seconds``, fire) the alert; any
    success resolves it: the destination is reachable again.
    """
    if not outcomes:
        return
    with engine.begin() as conn:
        for destination, (ok, failed) in outcomes.items():
            key = f"event_delivery_failing:{destination}"
            if ok:
                if alerts.clear(conn, key=key, now=now):
                    log.info("event delivery to %s recovered", destination)
            elif failed:
                alerts.observe(
                    conn,
                    rule="event_delivery_failing",
                    key=key,
                    message=f"domain events cannot be delivered to {destination} ({failed} failed attempts)",
                    now=now,
                    sustain_seconds=sustain_seconds,
                    details={"failed": failed},
                )
