"""Domain events to the RabbitMQ topic exchange (``EVENTS_EXCHANGE``, default ``paysync.events``).

What a message looks like is decided here; how it gets to the broker is
``broker.events``. Every message: routing key = event type, ``message_id`` =
event id, ``type`` = event type, ``timestamp`` = when the event was written,
body = the event envelope, persistent, confirmed by the broker before
``publish`` returns (so "published" in ``event_delivery`` means the broker has
it). A consumer binds its durable queue before it relies on the events:
messages for types nobody is bound to are dropped by RabbitMQ.
"""

from __future__ import annotations

from datetime import datetime

from broker.events import CONNECT_TIMEOUT_SECONDS, BrokerUnavailable, EventsPublisher, MessageRefused

__all__ = ["CONNECT_TIMEOUT_SECONDS", "BrokerUnavailable", "EventPublisher", "MessageRefused"]


class EventPublisher:
    """One run's publisher of domain events (opened on the first event, closed at the end of the run)."""

    def __init__(self, amqp_url: str, exchange: str) -> None:
        self._publisher = EventsPublisher(amqp_url, exchange)

    def publish(self, event_id: str, event_type: str, body: bytes, created_at: datetime) -> None:
        """Publish one event and wait for the confirm; raises MessageRefused (nack) or BrokerUnavailable."""
        timestamp = int((created_at - datetime(1970, 1, 1)).total_seconds())
        self._publisher.publish(event_type, body, message_id=event_id, message_type=event_type, timestamp=timestamp)

    def close(self) -> None:
        """Close the connection, if any."""
        self._publisher.close()
