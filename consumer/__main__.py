"""``python -m consumer``: consume ``payment_callbacks`` and process each delivery a message carries.

The loop is ``broker.consume`` (prefetch from settings, manual ack only after
the transaction commits, reconnect with backoff, SIGTERM finishes the message
in hand, then exits); what a message means is ``consumer.handler``. With no
broker configured it stays up and says so (honcho stops every process when
one exits) while the compensator sweeps.
"""

from __future__ import annotations

import logging
import signal
import sys

from broker.consume import Action, ConsumeLoop
from consumer.handler import Answer, handle, handle_batch
from payments.infra import failpoints, metrics
from payments.runtime import Runtime, build_runtime, start_process

log = logging.getLogger("paysync.consumer")


class Consumer:
    """``consumer.handler.handle`` inside the broker's consume loop."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        settings = runtime.settings
        self.loop = ConsumeLoop(
            settings.amqp_url,
            settings.amqp_queue,
            self._handle,
            prefetch=settings.consumer_prefetch,
            quorum=settings.amqp_quorum_queue,
            batch_handler=self._handle_batch,
            batch_size=settings.consumer_batch_size,
        )
        self.callbacks = 0
        """Callbacks in the messages acknowledged so far (a message may carry several)."""

    @property
    def processed(self) -> int:
        """Messages acknowledged so far."""
        return self.loop.acked

    def stop(self, *_args: object) -> None:
        """Finish the message in hand and exit."""
        self.loop.stop()

    def _handle(self, body: bytes) -> Action:
        return self._answered([handle(self.runtime, body)])[0]

    def _handle_batch(self, bodies: list[bytes]) -> list[Action]:
        return self._answered(handle_batch(self.runtime, bodies, stop=self.loop.stopping.is_set))

    def _answered(self, answers: list[Answer]) -> list[Action]:
        acked = [answer for answer in answers if answer.action is Action.ACK]
        if acked:
            failpoints.hit("consumer.after_commit")  # committed, not yet acknowledged
            self.callbacks += sum(answer.callbacks for answer in acked)
        return [answer.action for answer in answers]

    def run(self) -> None:
        """Consume until stopped."""
        if not self.runtime.settings.has_broker:
            log.info("no broker configured (AMQP_URL is empty): idle; the compensator processes callbacks")
            self.loop.stopping.wait()
            return
        self.loop.run()


def main() -> int:
    """Entry point."""
    settings = start_process("consumer")
    metrics.serve_for(settings, settings.consumer_metrics_port, "consumer")
    consumer = Consumer(build_runtime(settings))
    signal.signal(signal.SIGTERM, consumer.stop)
    signal.signal(signal.SIGINT, consumer.stop)
    consumer.run()
    log.info("consumer stopped after %s messages (%s callbacks)", consumer.processed, consumer.callbacks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
