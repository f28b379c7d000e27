"""What the consumer does with one message, with no pika inside (easy to test).

The message is ``{"log_id": N}``; the row it names is the truth. Any outcome
of processing (applied, duplicate, conflict, recorded for retry) is an ack:
the row now carries the state, and the compensator owns retries. Only a
message we cannot read goes to the dead-letter queue, and only a database we
cannot reach at all leaves the message for redelivery.
"""

from __future__ import annotations

import json
import logging
from enum import StrEnum

from payments.callbacks import CallbackResult, process_callback
from payments.runtime import Runtime

log = logging.getLogger("paysync.consumer")


class Action(StrEnum):
    """What to tell the broker."""

    ACK = "ack"
    DEAD_LETTER = "dead_letter"
    REQUEUE = "requeue"


def parse_message(body: bytes) -> int | None:
    """The log id in a message body, or None if it is not ``{"log_id": <positive int>}``."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        return None
    log_id = doc.get("log_id") if isinstance(doc, dict) else None
    if isinstance(log_id, int) and not isinstance(log_id, bool) and log_id > 0:
        return log_id
    return None


def handle(runtime: Runtime, body: bytes) -> tuple[Action, CallbackResult | None]:
    """Process one message; return what to tell the broker and what processing did."""
    log_id = parse_message(body)
    if log_id is None:
        log.warning("unreadable message sent to the dead-letter queue (%d bytes)", len(body))
        return Action.DEAD_LETTER, None
    try:
        outcome = process_callback(runtime.engine, runtime.providers, log_id, runtime.callback_policy)
    except Exception as exc:  # noqa: BLE001 - database unreachable: not even the failure could be recorded
        log.error("callback %s: database unavailable (%s); message left for redelivery", log_id, type(exc).__name__)
        return Action.REQUEUE, None
    return Action.ACK, outcome
