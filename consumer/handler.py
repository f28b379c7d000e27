"""What the consumer does with its messages, with no pika inside: one call into the core each.

``payments.inbound.processing`` processes the deliveries a message carries
(restoring a row the database lost from the message) and says what to tell
the broker: ACK for any outcome of processing, DEAD_LETTER for a message we
cannot read or paysync did not sign (a forged one also raises the alert
``broker_message_forged``), REQUEUE only when the database could not be
reached at all. Here that answer becomes the broker's ``Action``, and is
counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from broker.consume import Action
from payments.inbound.processing import CallbackResult, Consumed, consume_message, consume_messages
from payments.infra import metrics
from payments.runtime import Runtime


class Answer(NamedTuple):
    """What to tell the broker about one message, what processing did, and how many callbacks it carried."""

    action: Action
    outcome: CallbackResult | None
    callbacks: int = 1


def handle(runtime: Runtime, body: bytes) -> Answer:
    """Process one message; return what to tell the broker and what processing did."""
    return _counted(consume_message(runtime, body))


def handle_batch(runtime: Runtime, bodies: list[bytes], stop: Callable[[], bool] | None = None) -> list[Answer]:
    """``handle`` for several messages at once: the readable ones are processed in one transaction.

    Once ``stop()`` is true no further message is started; those are REQUEUE (handed back).
    """
    return [_counted(consumed) for consumed in consume_messages(runtime, bodies, stop)]


def _counted(consumed: Consumed) -> Answer:
    answer = Answer(Action(consumed.disposition.value), consumed.outcome, consumed.callbacks)
    metrics.consumer_message(answer.action.value)
    return answer
