"""What operators watch, read straight from the database so every process and host agrees.

``snapshot`` is cheap enough to run on every Prometheus scrape: a handful of
``COUNT … GROUP BY status`` queries on indexed columns. The gateway renders
it as ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, func, select

from payments.schema import (
    alert,
    manual_review,
    outbox,
    payment,
    payment_callback_log,
    provider_breaker,
    refund,
)
from payments.states import CALLBACK_RETRYABLE, BreakerState, OutboxStatus, ReviewStatus


@dataclass
class Snapshot:
    """Counts by state of everything that can pile up or go wrong."""

    callbacks_by_status: dict[int, int] = field(default_factory=dict)
    oldest_waiting_callback_seconds: float = 0.0
    payments_by_status: dict[str, int] = field(default_factory=dict)
    refunds_by_status: dict[str, int] = field(default_factory=dict)
    outbox_pending_by_type: dict[str, int] = field(default_factory=dict)
    manual_review_open: int = 0
    alerts_by_status: dict[str, int] = field(default_factory=dict)
    open_breakers: list[str] = field(default_factory=list)


def _grouped(conn: Connection, column, where=None) -> dict:  # noqa: ANN001
    query = select(column, func.count()).group_by(column)
    if where is not None:
        query = query.where(where)
    return {key: count for key, count in conn.execute(query)}


def snapshot(conn: Connection, now: datetime) -> Snapshot:
    """Read the current counts."""
    t = payment_callback_log
    oldest = conn.execute(select(func.min(t.c.create_time)).where(t.c.status.in_(CALLBACK_RETRYABLE))).scalar()
    return Snapshot(
        callbacks_by_status=_grouped(conn, t.c.status),
        oldest_waiting_callback_seconds=(now - oldest).total_seconds() if oldest else 0.0,
        payments_by_status=_grouped(conn, payment.c.status),
        refunds_by_status=_grouped(conn, refund.c.status),
        outbox_pending_by_type=_grouped(conn, outbox.c.event_type, outbox.c.status == OutboxStatus.PENDING),
        manual_review_open=conn.execute(
            select(func.count()).select_from(manual_review).where(manual_review.c.status == ReviewStatus.OPEN)
        ).scalar_one(),
        alerts_by_status=_grouped(conn, alert.c.status, alert.c.open_key.is_not(None)),
        open_breakers=list(
            conn.execute(
                select(provider_breaker.c.provider).where(provider_breaker.c.state == BreakerState.OPEN)
            ).scalars()
        ),
    )
