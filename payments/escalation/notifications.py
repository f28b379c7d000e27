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
with ``SELECT … FOR UPDATE SKIP LOCKED`` (``payments.infra.db.claim_rows``) so any
number of notifiers share the work; the send happens outside any transaction;
``record_sent`` / ``record_failure`` write the outcome with an UPDATE guarded
by the lease, so a notifier whose lease ran out cannot overwrite the one that
took over. A failure backs off (``compute_backoff``, or the service's
Retry-After if longer); a permanent failure, or ALERT_NOTIFY_MAX_ATTEMPTS of
them, gives up and fires ``alert_channel_failing:<channel>``, which is routed
to every other channel (never to the failing one itself) and resolves when
that channel delivers again.

One cause pages once. Firing and reminder notices of alerts that share a
group key (``group_key``) on one channel go out as one notice: the key is
``group:<name>`` for rules with the same ``group`` in the rules file (e.g.
past_deadline and the unresolved_payment reviews it leads to), else
``payment:<id>`` for alerts about one payment. The first notice of a group
waits the rule's ``group_wait_seconds``; a notice of the same group planned
while it is still unsent joins it (``grouped_into``: it is never sent by
itself, and takes the carrier's outcome), and the carrier lists it.

A person's hand on an alert (``payments/ops/actions.py``): an acknowledged
alert gets no more firing or reminder notices (those not yet sent are
cancelled); a silenced one sends nothing until ``silenced_until`` passes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, func, or_, select, text, update
from sqlalchemy.exc import SQLAlchemyError

from payments.errors import NotificationFailed
from payments.escalation import alerts
from payments.escalation.notify import FIRING, REPEAT, RESOLVED, Member, Notice
from payments.escalation.rules import RuleSet
from payments.infra import metrics
from payments.infra.backoff import RetryPolicy
from payments.infra.db import claim_rows, insert_ignore, is_sqlite
from payments.infra.schema import alert, alert_notification
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
_PAYMENT_IN_KEY = re.compile(r"(?:^|:)payment:([A-Za-z0-9_-]{1,40})")
_SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}

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
    riders: tuple[int, ...] = ()
    """Notifications carried by this one (grouped_into), which take its outcome."""


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


def group_key(rules: RuleSet, rule: str, key: str, details: str | None) -> str | None:
    """Which cause an alert's notices belong to: its rule's group, else the payment it is about; None: its own."""
    group = rules.route(rule).group
    if group:
        return f"group:{group}"[:191]
    payment_id = (json.loads(details) if details else {}).get("payment_id")
    if not payment_id:
        found = _PAYMENT_IN_KEY.search(key)
        payment_id = found.group(1) if found else None
    return f"payment:{payment_id}"[:191] if payment_id else None


def _carrier(conn: Connection, channel: str, key: str, now: datetime) -> Any:
    """The unsent notice of group ``key`` on ``channel`` that another may still join (not being sent right now)."""
    return conn.execute(
        select(n.c.id, n.c.next_attempt_at)
        .where(
            n.c.channel == channel,
            n.c.group_key == key,
            n.c.grouped_into.is_(None),
            n.c.kind.in_(TOLD),
            n.c.status == NotificationStatus.PENDING,
            or_(n.c.lease_until.is_(None), n.c.lease_until <= now),
        )
        .order_by(n.c.id)
        .limit(1)
    ).first()


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
    _cancel_acknowledged(conn, now)
    firing = conn.execute(
        select(alert.c.id, alert.c.rule, alert.c.details, alert.c.dedupe_key, alert.c.severity)
        .where(
            alert.c.status == AlertStatus.FIRING,
            alert.c.acked_at.is_(None),  # a person has it: no more firing or reminder notices
            or_(alert.c.silenced_until.is_(None), alert.c.silenced_until <= now),
        )
        .order_by(alert.c.id)
    ).all()
    # The most severe first, so the notice that carries a group is its most severe alert.
    firing.sort(key=lambda a: (_SEVERITY_RANK.get(a.severity, 3), a.id))
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
            route = rules.route(a.rule)
            cooldown = route.cooldown_seconds
            key = group_key(rules, a.rule, a.dedupe_key, a.details)
            for channel in _targets(rules, a.rule, a.details, configured):
                seen = state.get((a.id, channel))
                if seen is None or not seen.told:
                    told = _row(a.id, channel, FIRING, 0, NotificationStatus.PENDING, now)
                    new_rows.append((told, key, route.group_wait_seconds))
                    new_rows.append((_row(a.id, channel, RESOLVED, 0, NotificationStatus.HELD, now), None, 0))
                elif cooldown and not seen.in_flight and seen.last_at <= now - timedelta(seconds=cooldown):
                    told = _row(a.id, channel, REPEAT, (seen.last_seq or 0) + 1, NotificationStatus.PENDING, now)
                    new_rows.append((told, key, route.group_wait_seconds))
        for row, key, wait in new_rows:
            if key is not None:
                carrier = _carrier(conn, row["channel"], key, now)
                row["group_key"] = key
                if carrier is not None:  # the cause already has an unsent notice on this channel: ride on it
                    row["grouped_into"], row["next_attempt_at"] = carrier.id, carrier.next_attempt_at
                else:  # the first of its cause: wait a little for the rest of it
                    row["next_attempt_at"] = now + timedelta(seconds=wait)
            # IGNORE: the unique key is what keeps "once per incident" true if two planners ever overlap.
            inserted = conn.execute(insert_ignore(n).values(**row)).rowcount
            made += inserted if row["status"] == NotificationStatus.PENDING and "grouped_into" not in row else 0
    return made


def _cancel_acknowledged(conn: Connection, now: datetime) -> None:
    """Cancel the firing and reminder notices not yet sent of alerts a person acknowledged."""
    acked = select(alert.c.id).where(alert.c.acked_at.is_not(None), alert.c.status == AlertStatus.FIRING)
    cancelled = conn.execute(
        update(n)
        .where(
            n.c.alert_id.in_(acked),
            n.c.kind.in_(TOLD),
            n.c.status == NotificationStatus.PENDING,
            or_(n.c.lease_until.is_(None), n.c.lease_until <= now),
        )
        .values(status=NotificationStatus.CANCELLED, last_error="acknowledged: a person has it", updated_at=now)
    ).rowcount
    if cancelled:
        _ungroup_orphans(conn, now)


def _ungroup_orphans(conn: Connection, now: datetime) -> None:
    """Notices riding on a carrier that will never be sent now (cancelled) go out by themselves."""
    carrier = n.alias("carrier")
    riders = [
        r.id
        for r in conn.execute(
            select(n.c.id)
            .select_from(n.join(carrier, carrier.c.id == n.c.grouped_into))
            .where(n.c.status == NotificationStatus.PENDING, carrier.c.status == NotificationStatus.CANCELLED)
        )
    ]
    if riders:
        conn.execute(update(n).where(n.c.id.in_(riders)).values(grouped_into=None, next_attempt_at=now, updated_at=now))


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
    if held:
        _ungroup_orphans(conn, now)
    return made


# --- claiming and recording ---------------------------------------------------


def _notice(row: Any, members: tuple[Member, ...] = ()) -> Notice:
    return Notice(
        members=members,
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
            n.c.grouped_into.is_(None),  # a rider goes out inside its carrier
            # Silenced: nothing about the alert until the silence ends (a scalar subquery: SKIP LOCKED locks n only).
            n.c.alert_id.not_in(select(alert.c.id).where(alert.c.silenced_until > now).scalar_subquery()),
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
        riders = _riders(conn, ids)
    claimed = []
    for r in rows:
        mine = riders.get(r.id, [])
        notice = _notice(r, tuple(member for _, member in mine))
        claimed.append(Claimed(r.id, r.channel, r.kind, r.attempts, lease_until, notice, tuple(i for i, _ in mine)))
    return claimed


def _riders(conn: Connection, carrier_ids: list[int]) -> dict[int, list[tuple[int, Member]]]:
    """The riders of each carrier that still need telling: (notification id, the alert the carrier lists)."""
    found: dict[int, list[tuple[int, Member]]] = {}
    for r in conn.execute(
        select(
            n.c.id,
            n.c.grouped_into,
            alert.c.id.label("aid"),
            alert.c.rule,
            alert.c.severity,
            alert.c.message,
            alert.c.dedupe_key,
        )
        .select_from(n.join(alert, alert.c.id == n.c.alert_id))
        .where(n.c.grouped_into.in_(carrier_ids), n.c.status == NotificationStatus.PENDING)
        .order_by(n.c.id)
    ):
        member = Member(r.aid, r.rule, r.severity, r.message, r.dedupe_key)
        found.setdefault(r.grouped_into, []).append((r.id, member))
    return found


def _settle_riders(conn: Connection, item: Claimed, values: dict[str, Any]) -> None:
    """Riders take their carrier's outcome: told with it, or given up with it (by id: no scan, no gap locks)."""
    if item.riders:
        conn.execute(
            update(n)
            .where(n.c.id.in_(item.riders), n.c.grouped_into == item.id, n.c.status == NotificationStatus.PENDING)
            .values(lease_until=None, **values)
        )


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
        if done:
            _settle_riders(conn, item, {"status": NotificationStatus.SENT, "sent_at": now, "updated_at": now})
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
                _settle_riders(
                    conn,
                    item,
                    {
                        "status": NotificationStatus.GAVE_UP,
                        "last_error": f"carried by {item.id}: {reason}"[:500],
                        "updated_at": now,
                    },
                )
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
