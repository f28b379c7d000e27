"""The transactional outbox: work to send, written in the caller's transaction.

Two jobs claim due rows: ``relay_outbox`` takes the commands
(``ChargeRequested`` and ``RefundRequested``, sent to the provider by
``payments.outbound.protocol``) and
``publish_events`` the domain events (``payments.lifecycle.events``). Each marks a row
done in the same transaction as the effect of sending it, so a crash anywhere
means the row is simply claimed again.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, insert

from payments.infra.ids import new_id
from payments.infra.schema import outbox
from payments.states import OutboxStatus

_INSERT = insert(outbox)
"""Built once: every processed callback enqueues a domain event (values are execute-time parameters)."""


def enqueue(
    conn: Connection,
    *,
    event_type: str,
    aggregate_id: str,
    payload: dict[str, Any],
    now: datetime,
    delay_seconds: float = 0,
    event_id: str | None = None,
) -> str:
    """Add one outbox row in the caller's transaction; return its event id."""
    values = row(
        event_type=event_type,
        aggregate_id=aggregate_id,
        payload=payload,
        now=now,
        delay_seconds=delay_seconds,
        event_id=event_id,
    )
    conn.execute(_INSERT, values)
    return values["event_id"]


def enqueue_many(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Add several outbox rows (each made by ``row``) in one multi-row INSERT, in the caller's transaction."""
    if rows:
        conn.execute(_INSERT, rows)


def row(
    *,
    event_type: str,
    aggregate_id: str,
    payload: dict[str, Any],
    now: datetime,
    delay_seconds: float = 0,
    event_id: str | None = None,
) -> dict[str, Any]:
    """The outbox row ``enqueue`` writes (a new event id unless given)."""
    return {
        "event_id": event_id or new_id("evt"),
        "event_type": event_type,
        "aggregate_id": aggregate_id,
        "payload": json.dumps(payload, sort_keys=True, default=str),
        "status": OutboxStatus.PENDING,
        "attempts": 0,
        "next_attempt_at": now + timedelta(seconds=delay_seconds),
        "created_at": now,
        "updated_at": now,
    }
