"""``python -m consumer``: consume ``payment_callbacks`` and process each row it names.

Manual ack only after the transaction commits; prefetch from settings;
reconnect with backoff when the broker goes away; SIGTERM finishes the
message in hand, then exits. With no broker configured it stays up and says
so (honcho stops every process when one exits) while the compensator sweeps.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import sys
import threading

import pika
import pika.exceptions

from consumer.handler import Action, handle
from consumer.topology import declare
from payments import failpoints
from payments.runtime import Runtime, build_runtime
from payments.settings import start_process

log = logging.getLogger("paysync.consumer")

MAX_RECONNECT_SECONDS = 30.0


class Consumer:
    """The pika loop around ``consumer.handler.handle``."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.stopping = threading.Event()
        self.processed = 0

    def stop(self, *_args: object) -> None:
        """Ask the loop to finish the message in hand and exit."""
        self.stopping.set()

    def run(self) -> None:
        """Consume until stopped, reconnecting with backoff."""
        settings = self.runtime.settings
        if not settings.has_broker:
            log.info("no broker configured (AMQP_URL is empty): idle; the compensator processes callbacks")
            self.stopping.wait()
            return
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
        settings = self.runtime.settings
        params = pika.URLParameters(settings.amqp_url)
        params.heartbeat = 30
        params.connection_attempts = 1
        params.socket_timeout = 5
        connection = pika.BlockingConnection(params)
        try:
            channel = connection.channel()
            declare(channel, settings.amqp_queue, settings.amqp_quorum_queue)
            channel.basic_qos(prefetch_count=settings.consumer_prefetch)
            channel.basic_consume(settings.amqp_queue, self._on_message, auto_ack=False)
            log.info("consuming %s (prefetch %s)", settings.amqp_queue, settings.consumer_prefetch)
            while not self.stopping.is_set():
                connection.process_data_events(time_limit=0.5)
        finally:
            if connection.is_open:
                with contextlib.suppress(Exception):
                    connection.close()  # unacked prefetched messages go back to the queue

    def _on_message(self, channel, method, _properties, body: bytes) -> None:  # noqa: ANN001
        if self.stopping.is_set():
            # Stop requested: hand back what was prefetched instead of starting on it.
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
        action, _outcome = handle(self.runtime, body)
        if action is Action.ACK:
            failpoints.hit("consumer.after_commit")
            channel.basic_ack(method.delivery_tag)
            self.processed += 1
        elif action is Action.DEAD_LETTER:
            channel.basic_nack(method.delivery_tag, requeue=False)
        else:
            self.stopping.wait(1.0)  # the database is down: don't spin on redeliveries
            channel.basic_nack(method.delivery_tag, requeue=True)


def main() -> int:
    """Entry point."""
    settings = start_process("consumer")
    consumer = Consumer(build_runtime(settings))
    signal.signal(signal.SIGTERM, consumer.stop)
    signal.signal(signal.SIGINT, consumer.stop)
    consumer.run()
    log.info("consumer stopped after %s messages", consumer.processed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
