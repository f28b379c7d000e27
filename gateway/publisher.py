"""Publishing ``{log_id}`` to RabbitMQ without ever making a callback wait on the broker.

The database row is the truth and the message only the fast path, so the
request thread just drops the id into a bounded in-process queue and returns.
One background thread per worker process owns the pika connection (pika is
not thread-safe), publishes persistent messages with publisher confirms, and
reconnects with backoff. If the broker is down, ids are dropped and counted:
the compensator's sweep finds those rows after its grace period.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import pika
import pika.exceptions

from consumer.topology import declare

log = logging.getLogger("paysync.publisher")


@dataclass
class PublisherStats:
    """Counters reported by /readyz and /metrics."""

    published: int = 0
    confirmed: int = 0
    failed: int = 0
    dropped: int = 0
    reconnects: int = 0
    last_error: str | None = None
    extra: dict[str, int] = field(default_factory=dict)


class CallbackPublisher:
    """Fire-and-forget publisher of callback log ids (see module docstring)."""

    def __init__(
        self,
        amqp_url: str,
        queue_name: str,
        *,
        quorum: bool = False,
        timeout: float = 0.5,
        max_pending: int = 10_000,
        max_backoff: float = 5.0,
    ) -> None:
        self._url = amqp_url
        self._queue_name = queue_name
        self._quorum = quorum
        self._timeout = timeout
        self._max_backoff = max_backoff
        self._pending: queue.Queue[int] = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._connected = False
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

    def publish(self, log_id: int) -> bool:
        """Queue ``log_id`` for publishing; never blocks. False if it was dropped."""
        if not self.enabled:
            return False
        self._ensure_thread()
        try:
            self._pending.put_nowait(log_id)
            return True
        except queue.Full:
            self.stats.dropped += 1
            return False

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything queued has been handed to the broker (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._pending.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Stop the background thread."""
        self._stopping.set()
        if self._thread:
            self._thread.join(timeout=self._timeout * 4 + 1)

    def _ensure_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="amqp-publisher", daemon=True)
                self._thread.start()

    def _connect(self) -> pika.BlockingConnection:
        params = pika.URLParameters(self._url)
        params.socket_timeout = self._timeout
        params.stack_timeout = self._timeout * 4
        params.blocked_connection_timeout = self._timeout * 4
        params.connection_attempts = 1
        params.heartbeat = 30
        connection = pika.BlockingConnection(params)
        channel = connection.channel()
        declare(channel, self._queue_name, self._quorum)
        channel.confirm_delivery()
        self._channel = channel
        return connection

    def _run(self) -> None:
        connection = None
        backoff = 0.1
        retry_at = 0.0
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        while not self._stopping.is_set():
            try:
                log_id = self._pending.get(timeout=1.0)
            except queue.Empty:
                if connection is not None:
                    try:
                        connection.process_data_events(0)  # heartbeats while idle
                    except Exception:  # noqa: BLE001
                        connection, self._connected = None, False
                continue
            try:
                if connection is None:
                    if time.monotonic() < retry_at:
                        # Broker recently unreachable: drop; the sweep will find the row.
                        self.stats.dropped += 1
                        continue
                    connection = self._connect()
                    self._connected = True
                    self.stats.reconnects += 1
                    backoff = 0.1
                body = json.dumps({"log_id": log_id}).encode()
                self._channel.basic_publish("", self._queue_name, body, props)
                self.stats.published += 1
                self.stats.confirmed += 1
            except Exception as exc:  # noqa: BLE001 - any broker trouble: count, drop, reconnect later
                self.stats.failed += 1
                self.stats.last_error = type(exc).__name__
                log.warning("publish of callback %s failed (%s); the sweep will pick it up", log_id, type(exc).__name__)
                with contextlib.suppress(Exception):
                    if connection is not None and connection.is_open:
                        connection.close()
                connection, self._connected = None, False
                retry_at = time.monotonic() + backoff
                backoff = min(backoff * 2, self._max_backoff)
            finally:
                self._pending.task_done()
        if connection is not None and connection.is_open:
            with contextlib.suppress(Exception):
                connection.close()
