"""What the consumer does with one message, with no pika inside (easy to test).

The message is the delivery itself (``payments.delivery``); the row it names
is the truth, and when the database lost that row the message restores it.
Any outcome of processing (applied, duplicate, conflict, recorded for retry)
is an ack: the row now carries the state, and the compensator owns retries.
Only a message we cannot read, or one paysync did not sign (``ForgedMessage``:
no valid BROKER_MESSAGE_SECRET signature), goes to the dead-letter queue; a
forged one also raises the alert ``broker_message_forged``. Only a database we
cannot reach at all leaves the message for redelivery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from broker.consume import Action
from payments import alerts, metrics
from payments.callbacks import CallbackResult, process_callback
from payments.db import utcnow
from payments.delivery import (
    Delivery,
    ForgedMessage,
    UnreadableMessage,
    decode_messages,
    process_batch,
    process_delivery,
)
from payments.logs import REQUEST_ID
from payments.runtime import Runtime

log = logging.getLogger("paysync.consumer")


class Answer(NamedTuple):
    """What to tell the broker about one message, what processing did, and how many callbacks it carried."""

    action: Action
    outcome: CallbackResult | None
    callbacks: int = 1


def handle(runtime: Runtime, body: bytes) -> Answer:
    """Process one message; return what to tell the broker and what processing did."""
    answer = _handle(runtime, body)
    metrics.consumer_message(answer.action.value)
    return answer


FORGED_ALERT_RULE = "broker_message_forged"
"""The alert raised (one open alert, seen again at each forgery) when a message without paysync's signature arrives."""


def _decode(runtime: Runtime, body: bytes) -> list[Delivery | int] | None:
    """The message's deliveries, or None: it was dead-lettered (logged, and alerted if forged)."""
    settings = runtime.settings
    try:
        return decode_messages(body, settings.callback_max_body_bytes, keys=settings.broker_message_secret)
    except ForgedMessage as exc:
        log.error("forged message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
        _alert_forged(runtime, str(exc), len(body))
    except UnreadableMessage as exc:
        log.warning("unreadable message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
    return None


def _alert_forged(runtime: Runtime, reason: str, size: int) -> None:
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
        log.error("forged message alert not recorded (%s)", type(exc).__name__)


def _handle(runtime: Runtime, body: bytes) -> Answer:
    messages = _decode(runtime, body)
    if messages is None:
        return Answer(Action.DEAD_LETTER, None, 0)
    if len(messages) > 1:  # several deliveries in one message: one transaction for them, as for a batch
        answers = _handle_batch(runtime, [body], None, decoded=[messages])
        return answers[0]
    message = messages[0]
    log_id = message if isinstance(message, int) else message.log_id
    # The gateway request's id, for this consumer's own lines (processing binds the row's, the same one).
    token = REQUEST_ID.set(None if isinstance(message, int) else message.request_id)
    try:
        if isinstance(message, int):
            outcome = process_callback(runtime.engine, runtime.providers, message, runtime.callback_policy)
        else:
            _, outcome = process_delivery(runtime.engine, runtime.providers, message, runtime.callback_policy)
    except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failure could be recorded
        log.error("callback %s: database unavailable (%s); message left for redelivery", log_id, type(exc).__name__)
        return Answer(Action.REQUEUE, None)
    finally:
        REQUEST_ID.reset(token)
    return Answer(Action.ACK, outcome)


def handle_batch(runtime: Runtime, bodies: list[bytes], stop: Callable[[], bool] | None = None) -> list[Answer]:
    """``handle`` for several messages at once: the readable ones are processed in one transaction.

    Once ``stop()`` is true no further message is started; those are REQUEUE (handed back).
    """
    answers = _handle_batch(runtime, bodies, stop)
    for answer in answers:
        metrics.consumer_message(answer.action.value)
    return answers


def _handle_batch(
    runtime: Runtime,
    bodies: list[bytes],
    stop: Callable[[], bool] | None,
    decoded: list[list[Delivery | int]] | None = None,
) -> list[Answer]:
    """Every readable message's deliveries, CONSUMER_BATCH_SIZE at a time, a transaction each.

    A message is ACK once all its deliveries were processed; REQUEUE when one
    was not (stop, or the database unreachable): its redelivery finds the
    others done. The outcome shown for a message is its last delivery's.
    """
    answers = [Answer(Action.ACK, None, 0)] * len(bodies)
    deliveries: list[tuple[int, Delivery | int]] = []  # (index of its message, delivery)
    for i, body in enumerate(bodies):
        messages = decoded[i] if decoded is not None else _decode(runtime, body)
        if messages is None:
            answers[i] = Answer(Action.DEAD_LETTER, None, 0)
            continue
        deliveries.extend((i, message) for message in messages)
    size = max(runtime.settings.consumer_batch_size, 1)
    outcomes: list[CallbackResult | None] = [None] * len(deliveries)
    for start in range(0, len(deliveries), size):
        chunk = deliveries[start : start + size]
        try:
            done = process_batch(
                runtime.engine, runtime.providers, [m for _, m in chunk], runtime.callback_policy, stop=stop
            )
        except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failures could be recorded
            log.error("batch of %s: database unavailable (%s); left for redelivery", len(chunk), type(exc).__name__)
            break
        for offset, (_log_id, outcome) in enumerate(done):
            outcomes[start + offset] = outcome
        if stop is not None and stop():
            break
    for (i, _), outcome in zip(deliveries, outcomes, strict=True):
        requeue = outcome is None or answers[i].action is Action.REQUEUE
        answers[i] = Answer(
            Action.REQUEUE if requeue else Action.ACK, None if requeue else outcome, answers[i].callbacks + 1
        )
    return answers
