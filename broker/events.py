"""Publishing domain events to a topic exchange, each confirmed by the broker before ``publish`` returns.

One publisher serves one run of the caller: it connects on the first message,
declares the exchange (topic, durable), turns on publisher confirms, and is
closed at the end of the run, so no idle connection has to be kept alive
between runs and no pika object is shared between threads. Messages are
persistent (``delivery_mode=2``) and not ``mandatory``: a topic exchange with
no queue bound for a routing key drops those messages by design.
"""

from __future__ import annotations

import contextlib
import logging

import pika
import pika.exceptions

from broker.connection import STACK_FACTOR, Nodes, connect
from broker.topology import declare_events_exchange

log = logging.getLogger("paysync.broker.events")

CONNECT_TIMEOUT_SECONDS = 5.0
"""Upper bound on connecting (TCP, handshake, channel); a down broker fails one run quickly."""


class BrokerUnavailable(Exception):
    """The connection or channel failed: every further publish in this run would fail the same way."""


class MessageRefused(Exception):
    """The broker refused (nacked) this one message; the connection stays usable."""


class EventsPublisher:
    """Publishes with confirms over one lazily opened connection (see module docstring)."""

    def __init__(self, amqp_url: str, exchange: str, *, connect_timeout: float = CONNECT_TIMEOUT_SECONDS) -> None:
        self._url = amqp_url
        self._nodes = Nodes(amqp_url)  # a cluster's nodes: a run that loses one starts the next at another
        self._exchange = exchange
        self._timeout = connect_timeout / STACK_FACTOR  # the socket timeout whose bring-up bound is connect_timeout
        self._connection: pika.BlockingConnection | None = None
        self._channel = None

    def _connect(self) -> None:
        connection = connect(self._url, self._timeout, self._nodes)
        try:
            channel = connection.channel()
            declare_events_exchange(channel, self._exchange)
            channel.confirm_delivery()
        except Exception:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        self._connection, self._channel = connection, channel

    def publish(self, routing_key: str, body: bytes, *, message_id: str, message_type: str, timestamp: int) -> None:
        """Publish one persistent JSON message and wait for the broker's confirm.

        Raises ``MessageRefused`` if the broker nacked it (worth retrying
        later; the connection stays), ``BrokerUnavailable`` for anything that
        breaks the connection (it is closed; the caller should not try again
        in this run).
        """
        properties = pika.BasicProperties(
            delivery_mode=2,
            content_type="application/json",
            message_id=message_id,
            type=message_type,
            timestamp=timestamp,
            app_id="paysync",
        )
        try:
            if self._channel is None:
                self._connect()
            self._channel.basic_publish(self._exchange, routing_key, body, properties)
        except pika.exceptions.NackError:
            raise MessageRefused(message_id) from None
        except Exception as exc:  # noqa: BLE001 - any other broker trouble ends this run's use of it
            self.close()
            self._nodes.advance()
            raise BrokerUnavailable(type(exc).__name__) from exc

    def close(self) -> None:
        """Close the connection, if any (safe to call twice)."""
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()
