"""The consume loop: prefetch, manual acknowledgement, reconnect with backoff, graceful stop.

The loop knows nothing of callbacks: for each message it calls a plain
handler ``(body) -> Action`` and tells the broker what the handler decided.
``ACK`` only once the handler returned (its transaction committed);
``DEAD_LETTER`` sends a message nobody can read to the dead-letter queue;
``REQUEUE`` (the handler could not even reach its database) waits a second,
so redeliveries do not spin, and gives the message back. Once ``stop`` is
called the message in hand is finished and acknowledged, every prefetched one
is handed back, and ``run`` returns.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
from collections.abc import Callable
from enum import StrEnum
from typing import Any

import pika.exceptions

from broker.connection import connect
from broker.topology import declare_callback_queue

log = logging.getLogger("paysync.broker.consume")

MAX_RECONNECT_SECONDS = 30.0
"""Cap on the wait between reconnection attempts (exponential, jittered)."""
REQUEUE_PAUSE_SECONDS = 1.0
"""How long a REQUEUE holds the message before giving it back (the handler's database is down)."""


class Action(StrEnum):
    """What to tell the broker about one message."""

    ACK = "ack"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"


class ConsumeLoop:
    """Consume ``queue`` with ``handler`` until ``stop`` is called (see module docstring)."""

    def __init__(
        self,
        url: str,
        queue: str,
        handler: Callable[[bytes], Action],
        *,
        prefetch: int,
        quorum: bool = False,
        timeout: float = 5.0,
    ) -> None:
        self.url = url
        self.queue = queue
        self.handler = handler
        self.prefetch = prefetch
        self.quorum = quorum
        self.timeout = timeout
        self.stopping = threading.Event()
        self.acked = 0

    def stop(self, *_args: object) -> None:
        """Finish the message in hand, hand back the rest, return from ``run`` (safe from a signal handler)."""
        self.stopping.set()

    def run(self) -> None:
        """Consume until stopped, reconnecting with backoff when the broker goes away."""
        delay = 0.5
        while not self.stopping.is_set():
            try:
                self._consume()
                delay = 0.5
            except (pika.exceptions.AMQPError, OSError) as exc:
                wait = random.uniform(delay / 2, delay)
                log.warning("broker unavailable (%s); reconnecting in %.1f s", type(exc).__name__, wait)
                self.stopping.wait(wait)
                delay = min(delay * 2, MAX_RECONNECT_SECONDS)

    def _consume(self) -> None:
        connection = connect(self.url, self.timeout)
        try:
            channel = connection.channel()
            declare_callback_queue(channel, self.queue, self.quorum)
            channel.basic_qos(prefetch_count=self.prefetch)
            channel.basic_consume(self.queue, self._on_message, auto_ack=False)
            log.info("consuming %s (prefetch %s)", self.queue, self.prefetch)
            while not self.stopping.is_set():
                connection.process_data_events(time_limit=0.5)
        finally:
            if connection.is_open:
                with contextlib.suppress(Exception):
                    connection.close()  # unacked prefetched messages go back to the queue

    def _on_message(self, channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        if self.stopping.is_set():
            # Stop requested: hand back what was prefetched instead of starting on it.
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
        action = self.handler(body)
        if action is Action.ACK:
            channel.basic_ack(method.delivery_tag)
            self.acked += 1
        elif action is Action.DEAD_LETTER:
            channel.basic_nack(method.delivery_tag, requeue=False)
        else:
            self.stopping.wait(REQUEUE_PAUSE_SECONDS)
            channel.basic_nack(method.delivery_tag, requeue=True)
