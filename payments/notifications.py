"""Delivery state of alert notifications: one row per (alert, channel, kind), so channels never wait on each other.

Lifecycle of one alert on one channel (``alert_notification`` rows)::

    alert fires ─▶ firing   pending ─▶ sent | gave_up        (once per incident)
                   resolved held                              (waits for the clear)
    each cooldown ─▶ repeat n pending ─▶ sent | gave_up       (only while firing, none in flight)
    alert clears ─▶ pending firing/repeat not in flight: cancelled (nobody needs to hear it now)
                    resolved held ─▶ pending ─▶ sent | gave_up  if that channel was told it fired,
                                 ─▶ cancelled                   if it never was

``plan`` makes those rows from the alert table (one planner at a time: a
named lock on MariaDB, the write lock on SQLite); ``claim`` leases due rows
with ``SELECT … FOR UPDATE SKIP LOCKED`` (``payments.db.claim_rows``) so any
number of notifiers share the work; the send happens outside any transaction;
``record_sent`` / ``record_failure`` write the outcome with an UPDATE guarded
by the lease, so a notifier whose lease ran out cannot overwrite the one that
took over. A failure backs off (``compute_backoff``, or the service's
Retry-After if longer); a permanent failure, or ALERT_NOTIFY_MAX_ATTEMPTS of
them, gives up and fires ``alert_channel_failing:<channel>``, which is routed
to every other channel (never to the failing one itself) and resolves when
that channel delivers again.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, func, or_, select, text, update
from sqlalchemy.exc import SQLAlchemyError

from payments import alerts, metrics
from payments.alert_rules import RuleSet
from payments.backoff import RetryPolicy
from payments.db import claim_rows, insert_ignore, is_sqlite
from payments.errors import NotificationFailed
from payments.notify import FIRING, REPEAT, RESOLVED, Notice
from payments.schema import alert, alert_notification
from payments.states import AlertStatus, NotificationStatus

log = logging.getLogger("paysync.notifications")

TOLD = (FIRING, REPEAT)
"""Kinds that tell people an alert fires."""

LEASE_SECONDS = 120
"""A claimed notification is invisible to other notifiers this long; a notifier that died gives it back then."""
CHANNEL_FAILING = "alert_channel_failing"
"""The rule of the alert raised when a notification gives up on a channel."""
PLAN_LOCK = "paysync.notify_alerts.plan"
"""Named database lock: one planner at a time across every compensator (see ``plan_lock_name``)."""
_CHUNK = 500

n = alert_notification


@dataclass(frozen=True)
class Claimed:
    """A notification this notifier holds the lease on, with the notice to send."""

    id: int
    channel: str
    kind: str
    attempts: int
    lease_until: datetime
    notice: Notice


def channel_failing_key(channel: str) -> str:
    """The dedupe key of the alert that says notifications to ``channel`` give up."""
    return f"{CHANNEL_FAILING}:{channel}"


# --- planning -----------------------------------------------------------------


def plan_lock_name(conn: Connection) -> str:
    """PLAN_LOCK for this database: GET_LOCK names are server-wide, and one server may hold several paysyncs."""
    return f"{PLAN_LOCK}:{conn.engine.url.database}"[:64]


@contextlib.contextmanager
def _plan_lock(engine: Engine) -> Iterator[Connection | None]:
    """A connection holding the planning lock, or None if another planner has it (MariaDB GET_LOCK)."""
    with engine.connect() as conn:
        if is_sqlite(engine):  # BEGIN IMMEDIATE already makes planners take turns
            yield conn
            return
        got = conn.execute(text("SELECT GET_LOCK(:name, 0)"), {"name": plan_lock_name(conn)}).scalar()
        conn.commit()
        if got != 1:
            yield None
            return
        try:
            yield conn
        finally:
            with contextlib.suppress(SQLAlchemyError):  # a dead connection took its lock with it
                conn.rollback()
                conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": plan_lock_name(conn)})
                conn.commit()


def _row(alert_id: int, channel: str, kind: str, seq: int, status: NotificationStatus, now: datetime) -> dict[str, Any]:
    return {
        "alert_id": alert_id,
        "channel": channel,
        "kind": kind,
        "seq": seq,
        "status": status,
        "attempts": 0,
        "next_attempt_at": now,
        "created_at": now,
        "updated_at": now,
    }


def _targets(rules: RuleSet, rule: str, details: str | None, configured: Collection[str]) -> list[str]:
    """The configured channels an alert of ``rule`` goes to (a failing channel is not told about itself)."""
    targets = [c for c in rules.route(rule).channels if c in configured]
    if rule == CHANNEL_FAILING:
        failing = (json.loads(details) if details else {}).get("channel")
        targets = [c for c in targets if c != failing]
    return targets


def plan(engine: Engine, rules: RuleSet, configured: Collection[str], now: datetime) -> int:
    """Create the notifications firing alerts need and settle those of cleared alerts; return rows made due.

    Returns 0 without doing anything if another notifier is planning.
    """
    with _plan_lock(engine) as conn:
        if conn is None:
            return 0
        with conn.begin():
            made = _plan_firing(conn, rules, configured, now)
            made += _plan_resolved(conn, now)
        return made


def _plan_firing(conn: Connection, rules: RuleSet, configured: Collection[str], now: datetime) -> int:
    firing = conn.execute(
        select(alert.c.id, alert.c.rule, alert.c.details).where(alert.c.status == AlertStatus.FIRING)
    ).all()
    made = 0
    for start in range(0, len(firing), _CHUNK):
        chunk = firing[start : start + _CHUNK]
        told = case((n.c.kind.in_(TOLD), 1), else_=0)
        state = {
            (r.alert_id, r.channel): r
            for r in conn.execute(
                select(
                    n.c.alert_id,
                    n.c.channel,
                    func.max(case((n.c.kind.in_(TOLD), n.c.seq))).label("last_seq"),
                    func.max(case((n.c.kind.in_(TOLD), n.c.created_at))).label("last_at"),
                    func.sum(
                        case((and_(n.c.kind.in_(TOLD), n.c.status == NotificationStatus.PENDING), 1), else_=0)
                    ).label("in_flight"),
                    func.sum(told).label("told"),
                )
                .where(n.c.alert_id.in_([a.id for a in chunk]))
                .group_by(n.c.alert_id, n.c.channel)
            )
        }
        new_rows = []
        for a in chunk:
            cooldown = rules.route(a.rule).cooldown_seconds
            for channel in _targets(rules, a.rule, a.details, configured):
                seen = state.get((a.id, channel))
                if seen is None or not seen.told:
                    new_rows.append(_row(a.id, channel, FIRING, 0, NotificationStatus.PENDING, now))
                    new_rows.append(_row(a.id, channel, RESOLVED, 0, NotificationStatus.HELD, now))
                elif cooldown and not seen.in_flight and seen.last_at <= now - timedelta(seconds=cooldown):
                    new_rows.append(
                        _row(a.id, channel, REPEAT, (seen.last_seq or 0) + 1, NotificationStatus.PENDING, now)
                    )
        for row in new_rows:
            # IGNORE: the unique key is what keeps "once per incident" true if two planners ever overlap.
            inserted = conn.execute(insert_ignore(n).values(**row)).rowcount
            made += inserted if row["status"] == NotificationStatus.PENDING else 0
    return made


def _plan_resolved(conn: Connection, now: datetime) -> int:
    held = conn.execute(
        select(n.c.id, n.c.alert_id, n.c.channel)
        .select_from(n.join(alert, alert.c.id == n.c.alert_id))
        .where(n.c.status == NotificationStatus.HELD, alert.c.status == AlertStatus.RESOLVED)
    ).all()
    made = 0
    for h in held:
        siblings = and_(n.c.alert_id == h.alert_id, n.c.channel == h.channel, n.c.kind.in_(TOLD))
        conn.execute(
            update(n)
            .where(
                siblings,
                n.c.status == NotificationStatus.PENDING,
                or_(n.c.lease_until.is_(None), n.c.lease_until <= now),
            )
            .values(
                status=NotificationStatus.CANCELLED,
                last_error="the alert resolved before this was sent",
                updated_at=now,
            )
        )
        in_flight, sent = conn.execute(
            select(
                func.coalesce(func.sum(case((n.c.status == NotificationStatus.PENDING, 1), else_=0)), 0),
                func.coalesce(func.sum(case((n.c.status == NotificationStatus.SENT, 1), else_=0)), 0),
            ).where(siblings)
        ).one()
        if in_flight:
            continue  # being sent right now: settle once its outcome is written
        settle = update(n).where(n.c.id == h.id, n.c.status == NotificationStatus.HELD)
        if sent:
            made += conn.execute(
                settle.values(status=NotificationStatus.PENDING, next_attempt_at=now, updated_at=now)
            ).rowcount
        else:
            conn.execute(
                settle.values(
                    status=NotificationStatus.CANCELLED,
                    last_error="this channel was never told it fired",
                    updated_at=now,
                )
            )
    return made


# --- claiming and recording ---------------------------------------------------


def _notice(row: Any) -> Notice:
    return Notice(
        kind=row.kind,
        rule=row.rule,
        severity=row.severity,
        message=row.message,
        key=row.dedupe_key,
        alert_id=row.alert_id,
        details=json.loads(row.details) if row.details else {},
        first_seen_at=row.first_seen_at,
        fired_at=row.fired_at,
        resolved_at=row.resolved_at,
        repeat=row.seq,
    )


def claim(engine: Engine, now: datetime, limit: int, channels: Collection[str]) -> list[Claimed]:
    """Lease up to ``limit`` due notifications for ``channels`` (the configured ones), oldest first."""
    if not channels:
        return []
    due = (
        select(n.c.id)
        .where(
            n.c.status == NotificationStatus.PENDING,
            n.c.next_attempt_at <= now,
            or_(n.c.lease_until.is_(None), n.c.lease_until <= now),
            n.c.channel.in_(list(channels)),
        )
        .order_by(n.c.next_attempt_at, n.c.id)
        .limit(limit)
    )
    lease_until = now + timedelta(seconds=LEASE_SECONDS)
    ids = [r.id for r in claim_rows(engine, due, n, n.c.lease_until, lease_until)]
    if not ids:
        return []
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                n.c.id,
                n.c.alert_id,
                n.c.channel,
                n.c.kind,
                n.c.seq,
                n.c.attempts,
                alert.c.rule,
                alert.c.severity,
                alert.c.message,
                alert.c.dedupe_key,
                alert.c.details,
                alert.c.first_seen_at,
                alert.c.fired_at,
                alert.c.resolved_at,
            )
            .select_from(n.join(alert, alert.c.id == n.c.alert_id))
            .where(n.c.id.in_(ids))
            .order_by(n.c.next_attempt_at, n.c.id)
        ).all()
    return [Claimed(r.id, r.channel, r.kind, r.attempts, lease_until, _notice(r)) for r in rows]


def _guard(item: Claimed) -> Any:
    return and_(n.c.id == item.id, n.c.status == NotificationStatus.PENDING, n.c.lease_until == item.lease_until)


def record_sent(engine: Engine, item: Claimed, now: datetime) -> bool:
    """Mark ``item`` sent, and resolve its channel's failing alert; False if our lease was lost meanwhile."""
    with engine.begin() as conn:
        done = conn.execute(
            update(n)
            .where(_guard(item))
            .values(status=NotificationStatus.SENT, sent_at=now, lease_until=None, updated_at=now)
        ).rowcount
        metrics.notification(item.channel, "sent")
        if alerts.clear(conn, key=channel_failing_key(item.channel), now=now):
            log.info("alert channel %s delivers again", item.channel)
    if not done:
        log.info("notification %s was taken over by another notifier after its lease ran out", item.id)
    return bool(done)


def record_failure(
    engine: Engine,
    item: Claimed,
    error: NotificationFailed,
    policy: RetryPolicy,
    now: datetime,
    severity: str = "critical",
) -> NotificationStatus:
    """Count a failed attempt: back off, or give up (and fire ``alert_channel_failing``); return the new status."""
    attempts = item.attempts + 1
    reason = str(error)[:500]
    with engine.begin() as conn:
        if error.permanent or policy.exhausted(attempts):
            done = conn.execute(
                update(n)
                .where(_guard(item))
                .values(
                    status=NotificationStatus.GAVE_UP,
                    attempts=attempts,
                    last_error=reason,
                    lease_until=None,
                    updated_at=now,
                )
            ).rowcount
            if done:
                alerts.observe(
                    conn,
                    rule=CHANNEL_FAILING,
                    key=channel_failing_key(item.channel),
                    message=f"notifications to {item.channel} give up: {reason}",
                    now=now,
                    severity=severity,
                    details={"channel": item.channel, "notification_id": item.id, "attempts": attempts},
                )
            status = NotificationStatus.GAVE_UP
        else:
            delay = max(policy.delay(attempts), error.retry_after or 0.0)
            done = conn.execute(
                update(n)
                .where(_guard(item))
                .values(
                    attempts=attempts,
                    last_error=reason,
                    next_attempt_at=now + timedelta(seconds=delay),
                    lease_until=None,
                    updated_at=now,
                )
            ).rowcount
            status = NotificationStatus.PENDING
    metrics.notification(item.channel, "gave_up" if status is NotificationStatus.GAVE_UP else "failed")
    if not done:
        log.info("notification %s was taken over by another notifier after its lease ran out", item.id)
    return status


def release(engine: Engine, items: Collection[Claimed], next_attempt_at: datetime, now: datetime) -> None:
    """Give claimed notifications back unsent (no attempt counted), due again at ``next_attempt_at``."""
    if not items:
        return
    with engine.begin() as conn:
        for item in items:
            conn.execute(
                update(n).where(_guard(item)).values(lease_until=None, next_attempt_at=next_attempt_at, updated_at=now)
            )


def counts(conn: Connection) -> dict[tuple[str, str], int]:
    """(channel, status) -> notifications, for an operator's view."""
    rows = conn.execute(select(n.c.channel, n.c.status, func.count()).group_by(n.c.channel, n.c.status)).all()
    return {(channel, status): count for channel, status, count in rows}
