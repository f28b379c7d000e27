"""Job ``evaluate_alerts``: the original design's two rules, plus telling the channels.

- ``callback_backlog``: more than ALERT_BACKLOG_THRESHOLD rows with status 0/2,
  continuously for ALERT_BACKLOG_SECONDS.
- ``callback_failure_rate``: more than ALERT_FAILURE_RATE of the callbacks
  received in the last ALERT_FAILURE_WINDOW_SECONDS failed (rejected, retried
  or given up), once there are at least ALERT_FAILURE_MIN_SAMPLE of them.
Give-ups and conflicting reports fire their own alerts where they happen.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import Connection, case, func, or_, select

from payments import alerts
from payments.db import utcnow
from payments.locks import lock_name, named_lock
from payments.runtime import Runtime
from payments.schema import payment_callback_log
from payments.states import CALLBACK_RETRYABLE, AlertStatus, CallbackStatus

log = logging.getLogger("paysync.compensator.alerts")

BACKLOG_KEY = "callback_backlog"
FAILURE_RATE_KEY = "callback_failure_rate"


def backlog(conn: Connection) -> int:
    """Rows waiting to be processed (status 0 or 2)."""
    t = payment_callback_log
    return conn.execute(select(func.count()).select_from(t).where(t.c.status.in_(CALLBACK_RETRYABLE))).scalar_one()


def failure_counts(conn: Connection, since: datetime) -> tuple[int, int]:
    """(failed, total) callbacks received since ``since``."""
    t = payment_callback_log
    failed = or_(
        t.c.status.in_((CallbackStatus.FAILED, CallbackStatus.REJECTED, CallbackStatus.GAVE_UP)), t.c.retry_count > 0
    )
    row = conn.execute(
        select(func.count(), func.coalesce(func.sum(case((failed, 1), else_=0)), 0)).where(t.c.create_time >= since)
    ).one()
    return int(row[1]), int(row[0])


LOCK_NAME = "paysync.evaluate_alerts"
"""Named database lock (``payments.locks``): one evaluation at a time across every compensator."""


def run_once(runtime: Runtime, *, now: datetime | None = None) -> int:
    """Evaluate every rule and deliver new alerts; return how many alerts are firing (0 if another evaluator runs).

    Evaluators on several compensators would otherwise race on the same alert
    rows (INSERT IGNORE then UPDATE of one open key), which InnoDB answers with
    deadlocks; evaluating twice at once gains nothing, so the second one skips.
    """
    with named_lock(runtime.engine, LOCK_NAME) as locked:
        if not locked:
            log.debug("another evaluator holds %s; skipping this run", lock_name(runtime.engine, LOCK_NAME))
            return 0
        with runtime.engine.connect() as conn:
            return _evaluate(conn, runtime, now or utcnow())


def _evaluate(conn: Connection, runtime: Runtime, now: datetime) -> int:
    s = runtime.settings
    firing = 0
    with conn.begin():
        waiting = backlog(conn)
        if waiting > s.alert_backlog_threshold:
            status = alerts.observe(
                conn,
                rule=BACKLOG_KEY,
                key=BACKLOG_KEY,
                message=f"{waiting} callbacks waiting (threshold {s.alert_backlog_threshold})",
                now=now,
                sustain_seconds=s.alert_backlog_seconds,
                details={"backlog": waiting},
            )
            firing += status == AlertStatus.FIRING
        elif alerts.clear(conn, key=BACKLOG_KEY, now=now):
            log.info("callback backlog alert resolved (%s waiting)", waiting)

        failed, total = failure_counts(conn, now - timedelta(seconds=s.alert_failure_window_seconds))
        rate = failed / total if total else 0.0
        if total >= s.alert_failure_min_sample and rate > s.alert_failure_rate:
            status = alerts.observe(
                conn,
                rule=FAILURE_RATE_KEY,
                key=FAILURE_RATE_KEY,
                message=f"{rate:.1%} of {total} callbacks failed in the last {s.alert_failure_window_seconds} s",
                now=now,
                details={"failed": failed, "total": total, "rate": round(rate, 4)},
            )
            firing += status == AlertStatus.FIRING
        elif alerts.clear(conn, key=FAILURE_RATE_KEY, now=now):
            log.info("callback failure-rate alert resolved (%.1f%%)", rate * 100)
    with conn.begin():
        alerts.deliver(conn, now)
    return firing
