"""The RabbitMQ topology paysync uses, declared the same way by every process that touches it.

``payment_callbacks`` (durable, optionally a quorum queue) dead-letters to
``payment_callbacks.dlq`` through the ``paysync.dlx`` exchange: messages that
cannot even be read go there instead of looping. Domain events go to a
durable topic exchange (``paysync.events``), routing key = event type.
"""

from __future__ import annotations

from typing import Any

DLX = "paysync.dlx"
"""Dead-letter exchange (direct)."""


def dead_letter_queue(queue: str) -> str:
    """Name of the dead-letter queue for ``queue``."""
    return f"{queue}.dlq"


def declare_callback_queue(channel: Any, queue: str, quorum: bool = False) -> None:
    """Declare the callback queue and its dead-letter queue on a pika channel (idempotent)."""
    channel.exchange_declare(exchange=DLX, exchange_type="direct", durable=True)
    dlq_args = {"x-queue-type": "quorum"} if quorum else None
    channel.queue_declare(queue=dead_letter_queue(queue), durable=True, arguments=dlq_args)
    channel.queue_bind(queue=dead_letter_queue(queue), exchange=DLX, routing_key=queue)
    args: dict[str, Any] = {"x-dead-letter-exchange": DLX, "x-dead-letter-routing-key": queue}
    if quorum:
        args["x-queue-type"] = "quorum"
    channel.queue_declare(queue=queue, durable=True, arguments=args)


def declare_events_exchange(channel: Any, exchange: str) -> None:
    """Declare the domain-event topic exchange (durable, idempotent)."""
    channel.exchange_declare(exchange=exchange, exchange_type="topic", durable=True)
