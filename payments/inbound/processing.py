"""Processing stored callbacks: the consumer's messages, the sweep's and the gateway's batches, and restores.

``process_delivery`` is what the consumer does with one delivery
(``payments.inbound.delivery`` is its message format):

- the row ``log_id`` exists and holds this delivery (same body digest and
  receipt time): process it (``callbacks.process_callback``);
- the row is missing, or holds another delivery (the AUTO_INCREMENT id was
  handed out again after the loss): store the delivery again from the message
  (``restore_callback``) and process that row. A redelivered message finds the
  row it restored before (same provider, event id or receipt time, and digest)
  instead of storing a second copy, and the inbox (``processed_event``) keeps
  the business effect to one, whichever copy gets there first.

``process_batch`` does the same for several messages in ONE transaction and
one COMMIT (and the consumer one multiple ack). The common batch, every
message a fresh report that moves its payment on, is written set-wise
(``callbacks.process_locked_batch``: a few multi-row statements whatever its
size); any batch with something unusual in it (a rejected or duplicate
event, a conflict, a missing payment, a failure) goes message by message
instead, a savepoint each, so a message that fails rolls back only its own
work.

``consume_message`` and ``consume_messages`` are the consumer's whole job, with
no pika inside (``consumer.handler`` maps their answers to the broker's). Any
outcome of processing (applied, duplicate, conflict, recorded for retry) is
an ack: the row now carries the state, and the compensator owns retries. Only
a message we cannot read, or one paysync did not sign (``ForgedMessage``: no
valid BROKER_MESSAGE_SECRET signature), goes to the dead-letter queue; a
forged one also raises the alert ``broker_message_forged``. Only a database
we cannot reach at all leaves the message for redelivery.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, NamedTuple

from sqlalchemy import Engine, insert, select

from payments.escalation import alerts
from payments.inbound.callbacks import (
    CallbackResult,
    lock_rows,
    process_callback,
    process_locked,
    process_locked_batch,
    record_failure,
)
from payments.inbound.context import Context
from payments.inbound.delivery import Delivery, ForgedMessage, UnreadableMessage, body_digest, decode_messages
from payments.inbound.hints import HintLimits
from payments.infra import metrics
from payments.infra.backoff import RetryPolicy
from payments.infra.db import claim_rows, utcnow
from payments.infra.logs import REQUEST_ID
from payments.infra.schema import SOURCE_WEBHOOK, payment_callback_log
from payments.providers.base import Provider
from payments.states import CALLBACK_RETRYABLE, CallbackStatus

log = logging.getLogger("paysync.delivery")  # the lines keep the name they had before processing moved here
consumer_log = logging.getLogger("paysync.consumer")

RESTORE_CANDIDATES = 100
"""Rows sharing the delivery's event id (or receipt time) compared against it when looking for an earlier copy."""


def _earlier_copy(conn: Any, delivery: Delivery, event_id: str | None) -> int | None:
    """The id of a row already holding exactly this delivery (restored by an earlier attempt), or None."""
    t = payment_callback_log
    if event_id:
        where = (t.c.provider == delivery.provider, t.c.provider_event_id == event_id)
    else:
        where = (t.c.provider == delivery.provider, t.c.create_time == delivery.received_at)
    rows = conn.execute(
        select(t.c.id, t.c.create_time, t.c.callback_data).where(*where).order_by(t.c.id).limit(RESTORE_CANDIDATES)
    )
    for row in rows:
        if row.create_time == delivery.received_at and body_digest(bytes(row.callback_data)) == delivery.body_sha256:
            return row.id
    return None


def restore_callback(engine: Engine, providers: Mapping[str, Provider], delivery: Delivery) -> int:
    """Store ``delivery`` again (status 0, its original receipt time) unless a row already holds it; return the id."""
    provider = providers.get(delivery.provider)
    index = provider.peek_callback(delivery.body) if provider is not None else {}
    now = utcnow()
    with engine.begin() as conn:
        existing = _earlier_copy(conn, delivery, index.get("provider_event_id"))
        if existing is not None:
            return existing
        result = conn.execute(
            insert(payment_callback_log).values(
                provider=delivery.provider,
                callback_data=delivery.body,
                headers=json.dumps(delivery.headers, sort_keys=True, ensure_ascii=False),
                remote_addr=(delivery.remote_addr or "")[:64] or None,
                source=SOURCE_WEBHOOK,  # only the gateway publishes messages: every one is a webhook delivery
                order_no=index.get("order_no"),
                payment_order_no=index.get("payment_order_no"),
                provider_event_id=index.get("provider_event_id"),
                event_type=index.get("event_type"),
                status=CallbackStatus.PENDING,
                result=f"restored from the broker's copy of callback {delivery.log_id}",
                retry_count=0,
                next_retry_at=now,
                create_time=delivery.received_at,
                update_time=now,
                request_id=delivery.request_id,
            )
        )
        log_id = int(result.inserted_primary_key[0])
    log.warning(
        "callback %s was not in the database: restored from its message as callback %s",
        delivery.log_id,
        log_id,
        extra={"provider": delivery.provider, "provider_event_id": index.get("provider_event_id")},
    )
    return log_id


def process_delivery(
    engine: Engine,
    providers: dict[str, Provider],
    delivery: Delivery,
    policy: RetryPolicy,
    hints: HintLimits | None = None,
) -> tuple[int, CallbackResult]:
    """Process the row holding ``delivery``, restoring it first if the database lost it; return (row id, outcome)."""
    expect = (delivery.body_sha256, delivery.received_at)
    log_id = delivery.log_id
    outcome = process_callback(engine, providers, log_id, policy, expect=expect, hints=hints)
    if outcome is CallbackResult.MISSING:  # lost, or its id handed out again: the message stores it again
        log_id = restore_callback(engine, providers, delivery)
        outcome = process_callback(engine, providers, log_id, policy, expect=expect, hints=hints)
    return log_id, outcome


def process_batch(
    engine: Engine,
    providers: dict[str, Provider],
    messages: list[Delivery | int],
    policy: RetryPolicy,
    stop: Callable[[], bool] | None = None,
    hints: HintLimits | None = None,
) -> list[tuple[int, CallbackResult | None]]:
    """Process ``messages`` in one transaction, set-wise or a savepoint each; return (row id, outcome) per message.

    Once ``stop()`` is true no further message is started: those not started
    have the outcome None (hand them back), and the finished ones commit.

    Each message gets exactly what ``process_delivery`` gives it: a failure
    rolls back to its savepoint and is recorded (retry count, backoff) after
    the batch committed, in its own transaction; a missing row is restored and
    processed on its own. If the transaction itself is lost (a deadlock rolls
    back all of it, the connection dies), every message is processed again
    one by one. Raises only when even that cannot reach the database.
    """
    now = utcnow()
    outcomes: list[CallbackResult | None] = [None] * len(messages)
    failures: dict[int, Exception] = {}
    try:
        with engine.begin() as conn:
            locked = lock_rows(conn, sorted({_target(m)[0] for m in messages}))
            request_ids = {log_id: row.request_id for log_id, row in locked.items() if row.request_id}
            # The whole batch at once when it is the common case; else a savepoint per message.
            done = None if stop is not None and stop() else _set_wise(conn, providers, messages, now, locked)
            if done is not None:
                outcomes = done
            else:
                _message_by_message(conn, providers, messages, now, locked, hints, stop, outcomes, failures)
    except Exception as exc:  # noqa: BLE001 - the batch as a whole is gone: nothing of it committed
        log.info("batch of %s rolled back (%s); processing its messages one by one", len(messages), type(exc).__name__)
        return [_one(engine, providers, message, policy, hints) for message in messages]
    results = []
    for i, message in enumerate(messages):
        log_id, _ = _target(message)
        outcome = outcomes[i]
        if outcome is None and i not in failures:
            pass  # not started (stop): handed back
        elif i in failures:
            # Its lines name the gateway request that stored the row, as process_callback's do.
            token = REQUEST_ID.set(request_ids.get(log_id, REQUEST_ID.get()))
            try:
                outcome = record_failure(engine, log_id, failures[i], policy, now)
            finally:
                REQUEST_ID.reset(token)
            metrics.callback_processed(outcome)
        elif outcome is CallbackResult.MISSING and isinstance(message, Delivery):
            log_id, outcome = process_delivery(engine, providers, message, policy, hints)  # counted by process_callback
        else:
            metrics.callback_processed(outcome)
        results.append((log_id, outcome))
    return results


def _message_by_message(
    conn: Any,
    providers: dict[str, Provider],
    messages: list[Delivery | int],
    now: datetime,
    locked: Mapping[int, Any],
    hints: HintLimits | None,
    stop: Callable[[], bool] | None,
    outcomes: list[CallbackResult | None],
    failures: dict[int, Exception],
) -> None:
    """``process_locked`` for each message under its own savepoint; fills ``outcomes`` and ``failures``."""
    seen: set[tuple[int, tuple[str, datetime] | None]] = set()
    for i, message in enumerate(messages):
        if i and stop is not None and stop():
            break
        log_id, expect = _target(message)
        if (log_id, expect) in seen:
            # A redelivery in the same batch: the row was read once, before the first copy changed it.
            # (Another delivery naming the same id, after a loss, is compared with the row as usual.)
            outcomes[i] = CallbackResult.SKIPPED
            continue
        seen.add((log_id, expect))
        # One name, set again for each message (MySQL and SQLite both allow it) and never released:
        # COMMIT releases them all, and a RELEASE per message would be one more round trip.
        conn.exec_driver_sql("SAVEPOINT paysync_message")
        # process_locked binds the row's request id for its log lines; each message gets its own.
        token = REQUEST_ID.set(REQUEST_ID.get())
        try:
            outcomes[i] = process_locked(conn, providers, log_id, now, expect, hints, locked=locked)
        except Exception as exc:  # noqa: BLE001 - recorded on the row by process_batch, as process_callback does
            # Raises if the server already rolled everything back (a deadlock): the batch is redone.
            conn.exec_driver_sql("ROLLBACK TO SAVEPOINT paysync_message")
            failures[i] = exc
        finally:
            REQUEST_ID.reset(token)


def _set_wise(
    conn: Any, providers: dict[str, Provider], messages: list[Delivery | int], now: datetime, locked: Mapping[int, Any]
) -> list[CallbackResult | None] | None:
    """Every message's outcome from ``process_locked_batch``, or None: the batch goes message by message."""
    firsts: dict[tuple[int, tuple[str, datetime] | None], int] = {}
    for i, message in enumerate(messages):
        firsts.setdefault(_target(message), i)
    done = process_locked_batch(conn, providers, list(firsts), now, locked)
    if done is None:
        return None
    outcomes: list[CallbackResult | None] = [CallbackResult.SKIPPED] * len(messages)  # redeliveries in the batch
    for i, outcome in zip(firsts.values(), done, strict=True):
        outcomes[i] = outcome
    return outcomes


def _target(message: Delivery | int) -> tuple[int, tuple[str, datetime] | None]:
    if isinstance(message, int):
        return message, None
    return message.log_id, (message.body_sha256, message.received_at)


def _one(
    engine: Engine,
    providers: dict[str, Provider],
    message: Delivery | int,
    policy: RetryPolicy,
    hints: HintLimits | None = None,
) -> tuple[int, CallbackResult]:
    if isinstance(message, int):
        return message, process_callback(engine, providers, message, policy, hints=hints)
    return process_delivery(engine, providers, message, policy, hints)


def claim_retries(engine: Engine, now: datetime, grace_seconds: float, batch_size: int, lease: float) -> list[int]:
    """The sweep's claim: up to ``batch_size`` due callbacks, leased ``lease`` seconds; their ids, oldest first."""
    t = payment_callback_log
    query = (
        select(t.c.id)
        .where(
            t.c.status.in_(CALLBACK_RETRYABLE),
            t.c.next_retry_at <= now,
            t.c.create_time <= now - timedelta(seconds=grace_seconds),
        )
        .order_by(t.c.id)
        .limit(batch_size)
    )
    rows = claim_rows(engine, query, t, t.c.next_retry_at, now + timedelta(seconds=lease))
    return [r.id for r in rows]


# --- the consumer: messages in, what to tell the broker out ---------------------------------------------------


class Disposition(StrEnum):
    """What the broker should do with a message (``broker.consume.Action`` by value)."""

    ACK = "ack"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"


class Consumed(NamedTuple):
    """What to tell the broker about one message, what processing did, and how many callbacks it carried."""

    disposition: Disposition
    outcome: CallbackResult | None
    callbacks: int = 1


FORGED_ALERT_RULE = "broker_message_forged"
"""The alert raised (one open alert, seen again at each forgery) when a message without paysync's signature arrives."""


def consume_message(runtime: Context, body: bytes) -> Consumed:
    """Process one message; return what to tell the broker and what processing did."""
    messages = _decode(runtime, body)
    if messages is None:
        return Consumed(Disposition.DEAD_LETTER, None, 0)
    if len(messages) > 1:  # several deliveries in one message: one transaction for them, as for a batch
        return consume_messages(runtime, [body], None, decoded=[messages])[0]
    message = messages[0]
    log_id = message if isinstance(message, int) else message.log_id
    # The gateway request's id, for this consumer's own lines (processing binds the row's, the same one).
    token = REQUEST_ID.set(None if isinstance(message, int) else message.request_id)
    try:
        _, outcome = _one(runtime.engine, runtime.providers, message, runtime.callback_policy)
    except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failure could be recorded
        consumer_log.error(
            "callback %s: database unavailable (%s); message left for redelivery", log_id, type(exc).__name__
        )
        return Consumed(Disposition.REQUEUE, None)
    finally:
        REQUEST_ID.reset(token)
    return Consumed(Disposition.ACK, outcome)


def consume_messages(
    runtime: Context,
    bodies: list[bytes],
    stop: Callable[[], bool] | None = None,
    decoded: list[list[Delivery | int]] | None = None,
) -> list[Consumed]:
    """Every readable message's deliveries, CONSUMER_BATCH_SIZE at a time, a transaction each.

    A message is ACK once all its deliveries were processed; REQUEUE when one
    was not (``stop()`` came true, or the database unreachable): its
    redelivery finds the others done. The outcome shown for a message is its
    last delivery's.
    """
    answers = [Consumed(Disposition.ACK, None, 0)] * len(bodies)
    deliveries: list[tuple[int, Delivery | int]] = []  # (index of its message, delivery)
    for i, body in enumerate(bodies):
        messages = decoded[i] if decoded is not None else _decode(runtime, body)
        if messages is None:
            answers[i] = Consumed(Disposition.DEAD_LETTER, None, 0)
            continue
        deliveries.extend((i, message) for message in messages)
    outcomes = _process_in_chunks(runtime, [m for _, m in deliveries], stop)
    for (i, _), outcome in zip(deliveries, outcomes, strict=True):
        requeue = outcome is None or answers[i].disposition is Disposition.REQUEUE
        answers[i] = Consumed(
            Disposition.REQUEUE if requeue else Disposition.ACK,
            None if requeue else outcome,
            answers[i].callbacks + 1,
        )
    return answers


def _process_in_chunks(
    runtime: Context, deliveries: list[Delivery | int], stop: Callable[[], bool] | None
) -> list[CallbackResult | None]:
    """``process_batch`` over CONSUMER_BATCH_SIZE deliveries at a time; None for each one not processed."""
    size = max(runtime.settings.consumer_batch_size, 1)
    outcomes: list[CallbackResult | None] = [None] * len(deliveries)
    for start in range(0, len(deliveries), size):
        chunk = deliveries[start : start + size]
        try:
            done = process_batch(runtime.engine, runtime.providers, chunk, runtime.callback_policy, stop=stop)
        except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failures could be recorded
            consumer_log.error(
                "batch of %s: database unavailable (%s); left for redelivery", len(chunk), type(exc).__name__
            )
            break
        for offset, (_log_id, outcome) in enumerate(done):
            outcomes[start + offset] = outcome
        if stop is not None and stop():
            break
    return outcomes


def _decode(runtime: Context, body: bytes) -> list[Delivery | int] | None:
    """The message's deliveries, or None: it goes to the dead-letter queue (logged, and alerted if forged)."""
    settings = runtime.settings
    try:
        return decode_messages(body, settings.callback_max_body_bytes, keys=settings.broker_message_secret)
    except ForgedMessage as exc:
        consumer_log.error("forged message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
        _alert_forged(runtime, str(exc), len(body))
    except UnreadableMessage as exc:
        consumer_log.warning("unreadable message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
    return None


def _alert_forged(runtime: Context, reason: str, size: int) -> None:
    # Someone with access to the broker published as if they were a gateway (or a gateway has a key the
    # consumers do not list): a person must look. The message itself stays in the dead-letter queue.
    try:
        with runtime.engine.begin() as conn:
            alerts.observe(
                conn,
                rule=FORGED_ALERT_RULE,
                key=FORGED_ALERT_RULE,
                message=f"a callback message without paysync's signature was dead-lettered: {reason}",
                now=utcnow(),
                severity="critical",
                details={"queue": runtime.settings.amqp_queue, "bytes": size, "reason": reason},
            )
    except Exception as exc:  # noqa: BLE001 - the dead-letter queue keeps the message; the log line says it
        consumer_log.error("forged message alert not recorded (%s)", type(exc).__name__)
