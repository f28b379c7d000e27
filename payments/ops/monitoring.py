"""What operators watch, read straight from the database so every process and host agrees.

Two parts, so a scrape stays cheap when the tables hold millions of rows:

- ``live_counts``: what can pile up (callbacks waiting or failing, payments
  and refunds not final, outbox, reviews, alerts, breakers). Every count is a
  range on an index that starts with ``status``, index-only, over rows that
  are few unless something is wrong; read on every scrape.
- ``settled_counts``: the rows that only ever grow (processed, rejected and
  given-up callbacks; succeeded and failed payments and refunds). Counting
  them scans an index of millions of entries, so the gateway caches them for
  METRICS_SETTLED_CACHE_SECONDS.

The gateway renders the two as ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Connection, case, func, select

from payments.escalation.evaluators import unexplained_by_provider
from payments.infra.schema import (
    alert,
    manual_review,
    outbox,
    payment,
    payment_callback_log,
    provider_breaker,
    reconciliation_item,
    reconciliation_run,
    refund,
)
from payments.reconciliation.aging import AGE_LIMITS
from payments.states import (
    CALLBACK_RETRYABLE,
    BreakerState,
    CallbackStatus,
    OutboxStatus,
    PaymentStatus,
    ReconciliationRunStatus,
    ReviewStatus,
)


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
    outbox_oldest_pending_seconds: float = 0.0
    """Outbox lag: how long the oldest pending outbox row has waited."""
    unknown_by_age: dict[str, int] = field(default_factory=dict)
    """Unknown payments by age bucket (UNKNOWN_AGE_BUCKETS labels)."""
    unknown_oldest_seconds: float = 0.0
    reconciliation_items: dict[tuple[str, str], int] = field(default_factory=dict)
    """(provider, category) -> items of each provider's latest completed run (filled in from Settled)."""
    reconciliation_unexplained: dict[str, int] = field(default_factory=dict)
    """provider -> unexplained items of its latest run whose review is still open (filled in from Settled)."""
    past_deadline: dict[str, int] = field(default_factory=dict)
    """"payment" / "refund" -> not final after their deadline."""
    open_alerts_by_rule: dict[tuple[str, str], int] = field(default_factory=dict)
    """(rule, status) -> open (pending or firing) alerts."""


UNKNOWN_AGE_BUCKETS = AGE_LIMITS
"""Unknown payments are counted as younger than 1 hour, 1 day, 3 days, or older ("older"): the console's buckets."""


SETTLED_CALLBACK = (CallbackStatus.PROCESSED, CallbackStatus.REJECTED, CallbackStatus.GAVE_UP)
"""Callback statuses rows stay in (until retention or reverify): counted in ``settled_counts``."""
SETTLED_PAYMENT = (PaymentStatus.SUCCEEDED.value, PaymentStatus.FAILED.value)
"""Final payment and refund statuses: counted in ``settled_counts``."""
OPEN_PAYMENT = tuple(s.value for s in PaymentStatus if s.value not in SETTLED_PAYMENT)
"""The others (named, not NOT IN, so the count is an index range)."""


def _grouped(conn: Connection, column, where=None) -> dict:  # noqa: ANN001
    query = select(column, func.count()).group_by(column)
    if where is not None:
        query = query.where(where)
    return {key: count for key, count in conn.execute(query)}


def _unknown_ages(conn: Connection, now: datetime) -> tuple[dict[str, int], float]:
    """Unknown payments by age bucket, and the oldest one's age, in one range over the status index."""
    unknown = payment.c.status == PaymentStatus.UNKNOWN.value
    columns = [
        func.coalesce(func.sum(case((payment.c.created_at > now - timedelta(seconds=limit), 1), else_=0)), 0)
        for _, limit in UNKNOWN_AGE_BUCKETS
    ]
    row = conn.execute(select(func.count(), func.min(payment.c.created_at), *columns).where(unknown)).one()
    total, oldest, within = row[0], row[1], [int(v) for v in row[2:]]
    ages, below = {}, 0
    for (label, _), count in zip(UNKNOWN_AGE_BUCKETS, within, strict=True):
        ages[label] = count - below
        below = count
    ages["older"] = total - below
    return ages, (now - oldest).total_seconds() if oldest else 0.0


def live_counts(conn: Connection, now: datetime) -> Snapshot:
    """What can pile up, by index ranges over the few rows not yet settled (no settled counts filled in)."""
    t = payment_callback_log
    oldest = conn.execute(select(func.min(t.c.create_time)).where(t.c.status.in_(CALLBACK_RETRYABLE))).scalar()
    outbox_oldest = conn.execute(
        select(func.min(outbox.c.created_at)).where(outbox.c.status == OutboxStatus.PENDING)
    ).scalar()
    unknown_by_age, unknown_oldest = _unknown_ages(conn, now)
    past_deadline = {
        name: conn.execute(
            select(func.count()).where(table.c.status.in_(OPEN_PAYMENT), table.c.deadline_at < now)
        ).scalar_one()
        for name, table in (("payment", payment), ("refund", refund))
    }
    open_alerts = conn.execute(
        select(alert.c.rule, alert.c.status, func.count())
        .where(alert.c.open_key.is_not(None))
        .group_by(alert.c.rule, alert.c.status)
    )
    return Snapshot(
        past_deadline=past_deadline,
        open_alerts_by_rule={(rule, status): count for rule, status, count in open_alerts},
        outbox_oldest_pending_seconds=(now - outbox_oldest).total_seconds() if outbox_oldest else 0.0,
        unknown_by_age=unknown_by_age,
        unknown_oldest_seconds=unknown_oldest,
        callbacks_by_status=_grouped(conn, t.c.status, t.c.status.in_(CALLBACK_RETRYABLE)),
        oldest_waiting_callback_seconds=(now - oldest).total_seconds() if oldest else 0.0,
        payments_by_status=_grouped(conn, payment.c.status, payment.c.status.in_(OPEN_PAYMENT)),
        refunds_by_status=_grouped(conn, refund.c.status, refund.c.status.in_(OPEN_PAYMENT)),
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


@dataclass
class Settled:
    """Counts of rows in their final statuses (large, slow to change: cached by the gateway)."""

    callbacks_by_status: dict[int, int] = field(default_factory=dict)
    payments_by_status: dict[str, int] = field(default_factory=dict)
    refunds_by_status: dict[str, int] = field(default_factory=dict)
    reconciliation_items: dict[tuple[str, str], int] = field(default_factory=dict)
    reconciliation_unexplained: dict[str, int] = field(default_factory=dict)
    """provider -> unexplained items of its latest run whose review is still open (``unexplained_by_provider``)."""


def latest_reconciliation(conn: Connection) -> dict[tuple[str, str], int]:
    """(provider, category) -> items of each provider's latest completed reconciliation run."""
    r, i = reconciliation_run, reconciliation_item
    latest = (
        select(func.max(r.c.id).label("run_id"), r.c.provider)
        .where(r.c.status == ReconciliationRunStatus.COMPLETED.value)
        .group_by(r.c.provider)
        .subquery()
    )
    rows = conn.execute(
        select(latest.c.provider, i.c.category, func.count())
        .select_from(latest.join(i, i.c.run_id == latest.c.run_id))
        .group_by(latest.c.provider, i.c.category)
    )
    return {(provider, category): count for provider, category, count in rows}


def settled_counts(conn: Connection) -> Settled:
    """Index-only counts of the settled rows: one range per status, over millions of entries in a busy system."""
    t = payment_callback_log
    return Settled(
        reconciliation_items=latest_reconciliation(conn),
        reconciliation_unexplained={p: count for p, (_, count) in unexplained_by_provider(conn).items()},
        callbacks_by_status=_grouped(conn, t.c.status, t.c.status.in_(SETTLED_CALLBACK)),
        payments_by_status=_grouped(conn, payment.c.status, payment.c.status.in_(SETTLED_PAYMENT)),
        refunds_by_status=_grouped(conn, refund.c.status, refund.c.status.in_(SETTLED_PAYMENT)),
    )


def combine(live: Snapshot, settled: Settled) -> Snapshot:
    """The live snapshot with the settled counts added in."""
    live.callbacks_by_status = {**settled.callbacks_by_status, **live.callbacks_by_status}
    live.payments_by_status = {**settled.payments_by_status, **live.payments_by_status}
    live.refunds_by_status = {**settled.refunds_by_status, **live.refunds_by_status}
    live.reconciliation_items = dict(settled.reconciliation_items)
    live.reconciliation_unexplained = dict(settled.reconciliation_unexplained)
    return live


def snapshot(conn: Connection, now: datetime) -> Snapshot:
    """Every count at once, uncached."""
    return combine(live_counts(conn, now), settled_counts(conn))
