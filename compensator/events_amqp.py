"""Publishing domain events to the RabbitMQ topic exchange (``EVENTS_EXCHANGE``, default ``paysync.events``).

pika lives here, outside ``payments/``. One publisher is used for one
``publish_events`` run: it connects on the first event that needs the broker,
declares the exchange (topic, durable), turns on publisher confirms, and is
closed at the end of the run, so no idle connection has to be kept alive
between runs and no pika object is shared between threads.

Every message: routing key = event type, ``delivery_mode=2`` (persistent),
``message_id`` = event id, ``type`` = event type, ``content_type``
``application/json``, body = the event envelope. ``basic_publish`` returns only
once the broker has confirmed the message (an exception otherwise), so
"published" in ``event_delivery`` means the broker has it. Not ``mandatory``:
a topic exchange with no queue bound for a type drops those messages by
design; a consumer binds its durable queue before it relies on the events.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime

import pika
import pika.exceptions

log = logging.getLogger("paysync.compensator.events_amqp")

CONNECT_TIMEOUT_SECONDS = 5.0
"""Upper bound on connecting (socket, AMQP handshake); a down broker fails one run quickly."""


class BrokerUnavailable(Exception):
    """The connection or channel failed: every further publish in this run would fail the same way."""


class EventPublisher:
    """Publishes events with confirms over one lazily opened connection (see module docstring)."""

    def __init__(self, amqp_url: str, exchange: str, *, timeout: float = CONNECT_TIMEOUT_SECONDS) -> None:
        self._url = amqp_url
        self._exchange = exchange
        self._timeout = timeout
        self._connection: pika.BlockingConnection | None = None
        self._channel = None

    def _connect(self) -> None:
        params = pika.URLParameters(self._url)
        params.socket_timeout = self._timeout
        params.stack_timeout = self._timeout
        params.blocked_connection_timeout = self._timeout
        params.connection_attempts = 1
        params.heartbeat = 60
        connection = pika.BlockingConnection(params)
        try:
            channel = connection.channel()
            channel.exchange_declare(exchange=self._exchange, exchange_type="topic", durable=True)
            channel.confirm_delivery()
        except Exception:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        self._connection, self._channel = connection, channel

    def publish(self, event_id: str, event_type: str, body: bytes, created_at: datetime) -> None:
        """Publish one event and wait for the broker's confirm.

        Raises ``pika.exceptions.NackError`` if the broker refused this message
        (worth retrying later, the connection stays), ``BrokerUnavailable`` for
        anything that breaks the connection (it is closed; the caller should
        not try again in this run).
        """
        properties = pika.BasicProperties(
            delivery_mode=2,
            content_type="application/json",
            message_id=event_id,
            type=event_type,
            timestamp=int((created_at - datetime(1970, 1, 1)).total_seconds()),
            app_id="paysync",
        )
        try:
            if self._channel is None:
                self._connect()
            self._channel.basic_publish(self._exchange, event_type, body, properties)
        except pika.exceptions.NackError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other broker trouble ends this run's use of it
            self.close()
            raise BrokerUnavailable(type(exc).__name__) from exc

    def close(self) -> None:
        """Close the connection, if any (safe to call twice)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()
