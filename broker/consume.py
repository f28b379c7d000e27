"""The consume loop: prefetch, manual acknowledgement, reconnect with backoff, graceful stop.

The loop knows nothing of callbacks: for each message it calls a plain
handler ``(body) -> Action`` and tells the broker what the handler decided.
``ACK`` only once the handler returned (its transaction committed);
``DEAD_LETTER`` sends a message nobody can read to the dead-letter queue;
``REQUEUE`` (the handler could not even reach its database) waits a second,
so redeliveries do not spin, and gives the message back. Once ``stop`` is
called the message in hand is finished and acknowledged, every prefetched one
is handed back, and ``run`` returns.

With a ``batch_handler``, every message that arrived while the previous batch
was being handled (at most ``batch_size``) is handed over at once, as a list;
when all of them are ``ACK`` one multiple ack answers the lot. The batch is
as large as the backlog makes it: a lone message is handled at once, alone.
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

from broker.connection import Nodes, connect, where
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
        batch_handler: Callable[[list[bytes]], list[Action]] | None = None,
        batch_size: int = 1,
    ) -> None:
        self.url = url
        self.nodes = Nodes(url)
        self.queue = queue
        self.handler = handler
        self.batch_handler = batch_handler if batch_size > 1 else None
        self.batch_size = batch_size
        self._batch: list[tuple[int, bytes]] = []
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
                # Lost (or never reached) this node: the next attempt starts at the next one of a cluster.
                lost = where(self.nodes.current())
                self.nodes.advance()
                wait = random.uniform(delay / 2, delay) if len(self.nodes) == 1 or delay > 0.5 else 0.0
                log.warning("broker at %s unavailable (%s); reconnecting in %.1f s", lost, type(exc).__name__, wait)
                self.stopping.wait(wait)
                delay = min(delay * 2, MAX_RECONNECT_SECONDS)

    def _consume(self) -> None:
        connection = connect(self.url, self.timeout, self.nodes)
        try:
            channel = connection.channel()
            declare_callback_queue(channel, self.queue, self.quorum)
            channel.basic_qos(prefetch_count=self.prefetch)
            channel.basic_consume(self.queue, self._on_message, auto_ack=False)
            log.info("consuming %s (prefetch %s)", self.queue, self.prefetch)
            while not self.stopping.is_set():
                connection.process_data_events(time_limit=0.5)
                while self._batch and not self.stopping.is_set():
                    self._handle_batch(channel)
                    # Take what arrived meanwhile (returns at once when nothing did).
                    connection.process_data_events(time_limit=0)
        finally:
            self._batch = []  # not acknowledged: the broker hands them out again
            if connection.is_open:
                with contextlib.suppress(Exception):
                    connection.close()  # unacked prefetched messages go back to the queue

    def _on_message(self, channel: Any, method: Any, _properties: Any, body: bytes) -> None:
        if self.stopping.is_set():
            # Stop requested: hand back what was prefetched instead of starting on it.
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
        if self.batch_handler is not None:
            self._batch.append((method.delivery_tag, body))  # handled when this dispatch round is over
            return
        self._answer(channel, method.delivery_tag, self.handler(body))

    def _handle_batch(self, channel: Any) -> None:
        batch, self._batch = self._batch[: self.batch_size], self._batch[self.batch_size :]
        actions = self.batch_handler([body for _, body in batch])
        if all(action is Action.ACK for action in actions):
            # Tags grow in delivery order and everything before this batch is answered: one ack for all.
            channel.basic_ack(batch[-1][0], multiple=True)
            self.acked += len(batch)
            return
        if Action.REQUEUE in actions:
            self.stopping.wait(REQUEUE_PAUSE_SECONDS)  # once for the batch, not once a message
        for (tag, _), action in zip(batch, actions, strict=True):
            self._answer(channel, tag, action, pause=False)

    def _answer(self, channel: Any, tag: int, action: Action, pause: bool = True) -> None:
        if action is Action.ACK:
            channel.basic_ack(tag)
            self.acked += 1
        elif action is Action.DEAD_LETTER:
            channel.basic_nack(tag, requeue=False)
        else:
            if pause:
                self.stopping.wait(REQUEUE_PAUSE_SECONDS)
            channel.basic_nack(tag, requeue=True)
