"""What the consumer does with one message, with no pika inside (easy to test).

The message is the delivery itself (``payments.delivery``); the row it names
is the truth, and when the database lost that row the message restores it.
Any outcome of processing (applied, duplicate, conflict, recorded for retry)
is an ack: the row now carries the state, and the compensator owns retries.
Only a message we cannot read goes to the dead-letter queue, and only a
database we cannot reach at all leaves the message for redelivery.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.consume import Action
from payments import metrics
from payments.callbacks import CallbackResult, process_callback
from payments.delivery import Delivery, UnreadableMessage, decode_message, process_batch, process_delivery
from payments.logs import REQUEST_ID
from payments.runtime import Runtime

log = logging.getLogger("paysync.consumer")


def handle(runtime: Runtime, body: bytes) -> tuple[Action, CallbackResult | None]:
    """Process one message; return what to tell the broker and what processing did."""
    action, outcome = _handle(runtime, body)
    metrics.consumer_message(action.value)
    return action, outcome


def _handle(runtime: Runtime, body: bytes) -> tuple[Action, CallbackResult | None]:
    try:
        message = decode_message(body, runtime.settings.callback_max_body_bytes)
    except UnreadableMessage as exc:
        log.warning("unreadable message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
        return Action.DEAD_LETTER, None
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
        return Action.REQUEUE, None
    finally:
        REQUEST_ID.reset(token)
    return Action.ACK, outcome


def handle_batch(
    runtime: Runtime, bodies: list[bytes], stop: Callable[[], bool] | None = None
) -> list[tuple[Action, CallbackResult | None]]:
    """``handle`` for several messages at once: the readable ones are processed in one transaction.

    Once ``stop()`` is true no further message is started; those are REQUEUE (handed back).
    """
    answers = _handle_batch(runtime, bodies, stop)
    for action, _outcome in answers:
        metrics.consumer_message(action.value)
    return answers


def _handle_batch(
    runtime: Runtime, bodies: list[bytes], stop: Callable[[], bool] | None
) -> list[tuple[Action, CallbackResult | None]]:
    answers: list[tuple[Action, CallbackResult | None]] = [(Action.ACK, None)] * len(bodies)
    readable: list[tuple[int, Delivery | int]] = []
    for i, body in enumerate(bodies):
        try:
            readable.append((i, decode_message(body, runtime.settings.callback_max_body_bytes)))
        except UnreadableMessage as exc:
            log.warning("unreadable message sent to the dead-letter queue (%d bytes): %s", len(body), exc)
            answers[i] = (Action.DEAD_LETTER, None)
    if not readable:
        return answers
    try:
        outcomes = process_batch(
            runtime.engine, runtime.providers, [m for _, m in readable], runtime.callback_policy, stop=stop
        )
    except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failures could be recorded
        log.error("batch of %s: database unavailable (%s); left for redelivery", len(readable), type(exc).__name__)
        for i, _ in readable:
            answers[i] = (Action.REQUEUE, None)
        return answers
    for (i, _), (_log_id, outcome) in zip(readable, outcomes, strict=True):
        answers[i] = (Action.REQUEUE, None) if outcome is None else (Action.ACK, outcome)
    return answers
