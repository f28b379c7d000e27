"""Publishing callback messages to RabbitMQ without ever making a callback wait on the broker.

The database row is the truth and the message the fast path (and a backup
copy of the delivery), so the request thread just drops the message into a
bounded in-process queue and returns.
One background thread per worker process owns the pika connection (pika is
not thread-safe): it publishes persistent messages and tracks publisher
confirms asynchronously (pika's ``SelectConnection``), so many messages are in
flight at once and the broker confirms them in batches (``multiple``). On the
2-core development machine a blocking publish-and-wait-for-confirm per message
cost about 0.2 ms of CPU in the worker and 0.4 ms in RabbitMQ; published with
asynchronous confirms, 15 and 40 µs in a tight loop; at ingest rates, each
message woke the I/O thread and RabbitMQ on its own, and RabbitMQ spent about
0.2 ms of CPU per message. So the first callback after a quiet spell wakes the
I/O thread to publish ``linger`` seconds later (PUBLISH_LINGER_SECONDS), and
everything queued by then leaves in as few messages as ``batch_max`` deliveries
and ``batch_bytes`` allow (``pack``: ``payments.inbound.delivery.encode_batch``): one wake-up,
one message and one confirm for many callbacks. The callback's answer never
waits for any of it. If the broker is down, messages are
dropped and counted, and the connection is re-established, with backoff, on a later
callback: the compensator's sweep finds those rows after its grace period.

On a cluster (several node URLs in AMQP_URL) a lost connection moves the
publisher to the next node at once, and the messages that were not yet
confirmed go with it, to be published there. A message the broker refuses
(a nack: a quorum queue with no leader while one is elected, a queue over
its length limit) is published again after a short, growing pause. Either way
a message is retried for at most ``retry_seconds`` (RETRY_SECONDS) from its
first failure and then left to the sweep, so a node loss or a leader election
costs the fast path a few seconds, not the sweep's grace period. A callback
counts as published only when the broker confirmed it.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection

from broker.connection import Nodes, parameters, where
from broker.topology import declare_callback_queue

log = logging.getLogger("paysync.publisher")

PACKING_BYTES = 64
"""Room ``pack`` may add around the bodies of a batch (the envelope), counted against batch_bytes."""

RETRY_SECONDS = 15.0
"""How long after its first nack or lost connection a message is still published again (then: the sweep).

A quorum queue's leader election took about 11 s when its node was SIGKILLed (issue 24)."""
RETRY_FIRST_PAUSE_SECONDS = 0.2
"""Pause before publishing a nacked message again; it doubles up to RETRY_MAX_PAUSE_SECONDS (jittered)."""
RETRY_MAX_PAUSE_SECONDS = 2.0
"""Longest pause between two attempts at a nacked message."""

Message = tuple[int, bytes]
"""(log id, body) of one callback delivery."""

_OUR_CLOSE = (pika.exceptions.ConnectionClosedByClient, pika.exceptions.ChannelClosedByClient)


@dataclass
class PublisherStats:
    """This worker's counters, reported in the body of /readyz."""

    published: int = 0
    confirmed: int = 0
    failed: int = 0
    dropped: int = 0
    reconnects: int = 0
    retried: int = 0
    """Messages published again after a nack or a lost connection (each time)."""
    node: str | None = None
    """host:port of the node of the current (or last) connection."""
    last_error: str | None = None


class CallbackPublisher:
    """Fire-and-forget publisher of callback messages (see module docstring)."""

    def __init__(
        self,
        amqp_url: str,
        queue_name: str,
        *,
        quorum: bool = False,
        timeout: float = 0.5,
        max_pending: int = 10_000,
        max_backoff: float = 5.0,
        on_failure: Callable[[str, int], None] | None = None,
        linger: float = 0.0,
        pack: Callable[[list[bytes]], bytes] | None = None,
        batch_max: int = 1,
        batch_bytes: int = 1 << 20,
        retry_seconds: float = RETRY_SECONDS,
    ) -> None:
        self._url = amqp_url
        self._nodes = Nodes(amqp_url) if amqp_url else None
        self._retry_seconds = retry_seconds
        self._on_failure = on_failure  # (reason, count): the gateway counts failures in its metrics
        self._queue_name = queue_name
        self._quorum = quorum
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._max_unconfirmed = max_pending
        self._linger = linger
        # pack(bodies) -> one message for them all; without it, one message per body.
        self._pack = pack
        self._batch_max = max(batch_max, 1) if pack is not None else 1
        self._batch_bytes = batch_bytes
        self._pending: queue.Queue[tuple[int, bytes]] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._connected = False
        self._props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        # Owned by the I/O thread, except _conn and _wake_pending (see _wake).
        self._conn: SelectConnection | None = None
        self._channel: Any = None
        self._ready = False
        self._next_tag = 0
        self._unconfirmed: dict[int, list[Message]] = {}  # delivery tag -> its messages, in publishing order
        self._in_flight = 0  # messages in _unconfirmed and _nacked
        self._window_full = False  # _drain stopped at max_pending in flight: a confirm drains again
        # Taken from the queue, to publish as soon as the connection is ready: the message that started it,
        # and what a lost connection left unconfirmed (carried over to the next node).
        self._carried: list[Message] = []
        self._nacked: list[Message] = []  # refused by the broker, waiting for their next attempt
        self._give_up_at: dict[int, float] = {}  # log id -> when it stops being retried (set at its first failure)
        self._opened = False
        self._reported = False  # this connection's loss was logged (channel and connection both report it)
        self._wake_pending = False
        self.stats = PublisherStats()

    @property
    def enabled(self) -> bool:
        """False when no broker is configured."""
        return bool(self._url)

    @property
    def state(self) -> str:
        """'disabled', 'connected' or 'disconnected'."""
        if not self.enabled:
            return "disabled"
        return "connected" if self._connected else "disconnected"

    def publish(self, log_id: int, body: bytes) -> bool:
        """Queue the message ``body`` about callback ``log_id`` for publishing; never blocks. False if dropped."""
        if not self.enabled:
            return False
        self._ensure_thread()
        try:
            self._pending.put_nowait((log_id, body))
        except queue.Full:
            self.stats.dropped += 1
            return False
        self._wake()
        return True

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued is confirmed, refused or dropped (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pending.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop the background thread (closing the connection; unconfirmed messages count as failed)."""
        self._stopping.set()
        conn = self._conn
        if conn is not None:
            try:
                conn.ioloop.add_callback_threadsafe(self._close_connection)
            except Exception:  # noqa: BLE001 - the loop is already gone
                log.debug("publisher loop already stopped")
        if self._thread:
            self._thread.join(timeout=self._timeout * 4 + 1)

    # --- request threads -------------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="amqp-publisher", daemon=True)
                self._thread.start()

    def _wake(self) -> None:
        # One wake-up per burst: the I/O thread clears the flag, then takes everything queued, so an id
        # put before it cleared the flag is taken by that pass and one put after it asks for another.
        conn = self._conn
        if conn is None or self._wake_pending:
            return  # not connected: the thread's own loop takes the id (and connects, or drops it)
        self._wake_pending = True
        try:
            conn.ioloop.add_callback_threadsafe(self._drain_soon)
        except Exception:  # noqa: BLE001 - the loop just stopped; the thread's own loop takes the id
            self._wake_pending = False

    # --- the I/O thread --------------------------------------------------------------------------

    def _run(self) -> None:
        assert self._nodes is not None
        backoff = 0.1
        retry_at = 0.0
        failed_opens = 0  # in a row: after a whole round of the nodes, back off
        while not self._stopping.is_set():
            carried, self._carried = self._carried, []
            if carried:
                # A lost connection left these unconfirmed: take them to the next node now (or after the backoff).
                self._stopping.wait(max(0.0, retry_at - time.monotonic()))
            else:
                try:
                    carried = [self._pending.get(timeout=1.0)]
                except queue.Empty:
                    continue
                if time.monotonic() < retry_at:
                    # Every node recently unreachable: drop; the sweep will find the row.
                    self.stats.dropped += 1
                    self._pending.task_done()
                    continue
            opened = self._serve(carried)
            if self._stopping.is_set():
                break
            self._nodes.advance()  # lost or never opened: the next connection goes to the next node
            if opened:
                backoff, failed_opens, retry_at = 0.1, 0, 0.0
                continue
            failed_opens += 1
            if failed_opens % len(self._nodes) == 0:
                # No node answers: leave what is carried to the sweep (as with one node down), back off.
                self._fail(self._carried, "connection_lost")
                self._carried = []
                retry_at = time.monotonic() + backoff
                backoff = min(backoff * 2, self._max_backoff)
        self._fail(self._carried, "connection_lost")
        self._carried = []

    def _serve(self, carried: list[Message]) -> bool:
        """Connect, publish ``carried`` and whatever follows until the connection is lost; True if it opened."""
        assert self._nodes is not None
        self._ready = False
        self._opened = False
        self._reported = False
        self._next_tag = 0
        self._in_flight = 0
        self._carried = carried
        node = self._nodes.current()
        self.stats.node = where(node)
        try:
            conn = SelectConnection(
                parameters(node, self._timeout),
                on_open_callback=self._on_open,
                on_open_error_callback=self._on_open_error,
                on_close_callback=self._on_closed,
            )
            self._conn = conn
            conn.ioloop.start()  # returns when _on_open_error or _on_closed stops it
        except Exception as exc:  # noqa: BLE001 - any broker trouble: count, drop, reconnect later
            self._lost(exc)
        finally:
            self._conn = None  # first, so request threads stop scheduling wake-ups on this loop ...
            self._wake_pending = False  # ... then a stale flag cannot block the next connection's wake-ups
            self._connected = self._ready = False
            self._channel = None
        return self._opened

    def _on_open(self, conn: SelectConnection) -> None:
        self._opened = True
        conn.channel(on_open_callback=self._on_channel_open)

    def _on_channel_open(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        declare_callback_queue(channel, self._queue_name, self._quorum)
        # RPCs on a channel run in order, so when Confirm.SelectOk arrives the queues exist; no
        # message may be published before it, or its delivery tag would not be counted.
        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_ready)

    def _on_ready(self, _frame: Any) -> None:
        self._ready = True
        self._connected = True
        self.stats.reconnects += 1
        carried, self._carried = self._carried, []  # what started this connection, and what the last one left
        if len(carried) > 1:
            self.stats.retried += len(carried) - 1
            log.info(
                "publishing %s callbacks left unconfirmed by the last connection on %s",
                len(carried) - 1,
                self.stats.node,
            )
        if self._publish_all(carried):
            self._drain()

    def _drain_soon(self) -> None:
        """Woken by a request thread: drain after the linger, so what arrives meanwhile shares the message."""
        if self._linger > 0 and self._conn is not None:
            self._conn.ioloop.call_later(self._linger, self._drain)
        else:
            self._drain()

    def _drain(self) -> None:
        self._wake_pending = False
        if not self._ready:
            return  # _on_ready drains
        taken: list[Message] = []
        room = self._max_unconfirmed - self._in_flight
        while len(taken) < room:
            try:
                taken.append(self._pending.get_nowait())
            except queue.Empty:
                break
        self._window_full = len(taken) >= room
        self._publish_all(taken)

    def _publish_all(self, messages: list[Message]) -> bool:
        """Publish ``messages`` in batches; False if the connection failed (the rest is carried over with it)."""
        batches = self._batches(messages)
        for number, batch in enumerate(batches):
            if not self._publish(batch):
                rest = [message for later in batches[number + 1 :] for message in later]
                again, expired = self._split_by_deadline(rest, time.monotonic())
                self._carried.extend(again)
                self._fail(expired, "connection_lost")
                return False
        return True

    def _batches(self, messages: list[Message]) -> list[list[Message]]:
        """``messages`` in order, cut into runs of at most batch_max deliveries and batch_bytes bytes."""
        batches: list[list[Message]] = []
        batch: list[Message] = []
        size = PACKING_BYTES
        for message in messages:
            grown = size + len(message[1]) + 1  # and a separator
            if batch and (len(batch) >= self._batch_max or grown > self._batch_bytes):
                batches.append(batch)
                batch, size = [], PACKING_BYTES
            batch.append(message)
            size += len(message[1]) + 1
        if batch:
            batches.append(batch)
        return batches

    def _publish(self, batch: list[Message]) -> bool:
        """Publish ``batch`` as one message; False (the connection is being closed) if that failed."""
        try:
            body = batch[0][1] if self._pack is None or len(batch) == 1 else self._pack([b for _, b in batch])
            self._channel.basic_publish("", self._queue_name, body, self._props)
        except Exception as exc:  # noqa: BLE001
            self._carried.extend(batch)  # _lost decides: to the next node, or (past its retry time) the sweep
            self._lost(exc)
            self._close_connection()
            return False
        self._next_tag += 1
        self._unconfirmed[self._next_tag] = batch
        self._in_flight += len(batch)
        self.stats.published += len(batch)
        return True

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        if method.multiple:
            tags = []
            for tag in self._unconfirmed:  # ascending: publishing order
                if tag > method.delivery_tag:
                    break
                tags.append(tag)
        else:
            tags = [method.delivery_tag] if method.delivery_tag in self._unconfirmed else []
        refused: list[Message] = []
        for tag in tags:
            batch = self._unconfirmed.pop(tag)
            if not acked:
                refused.extend(batch)
                continue
            self._in_flight -= len(batch)
            self.stats.confirmed += len(batch)
            for log_id, _ in batch:
                self._give_up_at.pop(log_id, None)
                self._pending.task_done()
        if refused:
            self._refused(refused)
        if self._window_full:
            self._drain()  # the full in-flight window left ids waiting (and no wake-up is coming for them)

    def _refused(self, messages: list[Message]) -> None:
        """Nacked: publish again after a pause while within their retry time; past it, leave them to the sweep."""
        now = time.monotonic()
        again, expired = self._split_by_deadline(messages, now)
        self._in_flight -= len(expired)
        if expired:
            self._fail(expired, "nack")
            log.warning(
                "broker refused callbacks %s (nack) for %.0f s; the sweep will pick them up",
                [log_id for log_id, _ in expired[:10]],
                self._retry_seconds,
            )
        if not again:
            return
        first_failed = min(self._give_up_at[log_id] for log_id, _ in again) - self._retry_seconds
        pause = min(RETRY_MAX_PAUSE_SECONDS, max(RETRY_FIRST_PAUSE_SECONDS, (now - first_failed) / 2))
        if not self._nacked:
            log.info("broker refused %s callbacks (nack); publishing them again", len(again))
        self._nacked.extend(again)  # still counted in _in_flight: a lost connection carries them over
        self._conn.ioloop.call_later(random.uniform(pause / 2, pause), self._publish_nacked)

    def _publish_nacked(self) -> None:
        if not self._ready or not self._nacked:
            return  # the connection was lost meanwhile: _lost carried them over
        batch, self._nacked = self._nacked, []
        self._in_flight -= len(batch)  # _publish counts them again
        self.stats.retried += len(batch)
        self._publish_all(batch)

    def _split_by_deadline(self, messages: list[Message], now: float) -> tuple[list[Message], list[Message]]:
        """(those still within their retry time, those past it); a first failure starts the clock."""
        again: list[Message] = []
        expired: list[Message] = []
        for message in messages:
            deadline = self._give_up_at.setdefault(message[0], now + self._retry_seconds)
            (again if now < deadline and not self._stopping.is_set() else expired).append(message)
        return again, expired

    def _fail(self, messages: list[Message], reason: str) -> None:
        """Give up on ``messages``: count them failed; their rows are the sweep's."""
        if not messages:
            return
        for log_id, _ in messages:
            self._give_up_at.pop(log_id, None)
            self._pending.task_done()
        self._failed(reason, len(messages))

    def _on_channel_closed(self, _channel: Any, reason: Exception) -> None:
        self._lost(reason)
        self._close_connection()

    def _on_open_error(self, conn: SelectConnection, error: BaseException) -> None:
        self._lost(error)
        conn.ioloop.stop()

    def _on_closed(self, conn: SelectConnection, reason: BaseException) -> None:
        self._lost(reason)
        conn.ioloop.stop()

    def _failed(self, reason: str, count: int) -> None:
        self.stats.failed += count
        if self._on_failure is not None:
            try:
                self._on_failure(reason, count)
            except Exception:  # noqa: BLE001 - counting must never break publishing
                log.warning("publish failure hook raised", exc_info=True)

    def _close_connection(self) -> None:
        conn = self._conn
        if conn is not None and not (conn.is_closing or conn.is_closed):
            conn.close()

    def _lost(self, exc: BaseException) -> None:
        """The connection is gone: its unconfirmed messages go to the next node, or (past their time) the sweep."""
        unconfirmed = [message for batch in self._unconfirmed.values() for message in batch]
        messages = self._carried + unconfirmed + self._nacked
        self._unconfirmed.clear()
        self._nacked = []
        self._in_flight = 0
        self._window_full = False
        self._connected = self._ready = False
        again, expired = self._split_by_deadline(messages, time.monotonic())
        self._carried = again
        self._fail(expired, "connection_lost")
        # Our own close (shutdown, or after a failed publish already counted) is not news.
        if (messages or not self._reported) and not isinstance(exc, _OUR_CLOSE):
            self._reported = True
            self.stats.last_error = type(exc).__name__
            log.warning(
                "broker connection to %s lost (%s); %s unconfirmed callbacks go to the next node, %s to the sweep",
                self.stats.node,
                type(exc).__name__,
                len(again),
                len(expired),
            )
