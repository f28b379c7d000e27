"""Alerts as rows: at most one open alert per key, resolved when the condition clears.

An alert is ``pending`` while its condition has held for less than the rule's
sustain time, ``firing`` after, and ``resolved`` once the condition clears
(``open_key`` is then NULL, so a later occurrence opens a fresh row and the
old one stays as history). Channels are told about firing alerts by
``deliver`` after the transaction that fired them has committed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, case, select, update

from payments.infra.db import upsert
from payments.infra.schema import alert
from payments.states import AlertStatus

log = logging.getLogger("paysync.alerts")


def breaker_alert_key(provider: str) -> str:
    """The dedupe key of one provider's open-breaker alert: the breaker raises it, the evaluator keeps it true."""
    return f"provider_circuit_open:{provider}"


def _dumps(details: dict[str, Any] | None) -> str | None:
    return json.dumps(details, sort_keys=True, default=str) if details else None


def observe(
    conn: Connection,
    *,
    rule: str,
    key: str,
    message: str,
    now: datetime,
    sustain_seconds: float = 0,
    details: dict[str, Any] | None = None,
    severity: str = "warning",
) -> AlertStatus:
    """Record that the condition behind ``key`` holds now; return the alert's status.

    The alert fires once the condition has held for ``sustain_seconds``
    (0: at once). Safe against concurrent evaluators: the open key is UNIQUE,
    and one upsert takes the row's lock without a shared lock first.
    """
    status = AlertStatus.FIRING if sustain_seconds <= 0 else AlertStatus.PENDING
    fires = and_(
        alert.c.status == AlertStatus.PENDING, alert.c.first_seen_at <= now - timedelta(seconds=sustain_seconds)
    )
    upsert(
        conn,
        alert,
        {
            "rule": rule,
            "dedupe_key": key,
            "open_key": key,
            "severity": severity,
            "status": status,
            "message": message[:500],
            "details": _dumps(details),
            "first_seen_at": now,
            "last_seen_at": now,
            "fired_at": now if status == AlertStatus.FIRING else None,
        },
        alert.c.open_key,
        # fired_at before status: MySQL evaluates these left to right and must still see the old status.
        {
            "fired_at": case((fires, now), else_=alert.c.fired_at),
            "status": case((fires, AlertStatus.FIRING.value), else_=alert.c.status),
            "last_seen_at": now,
            "message": message[:500],
            "details": _dumps(details),
        },
    )
    return AlertStatus(conn.execute(select(alert.c.status).where(alert.c.open_key == key)).scalar_one())


def clear(conn: Connection, *, key: str, now: datetime) -> bool:
    """Resolve the open alert for ``key``, if any; return True if one was open."""
    result = conn.execute(
        update(alert)
        .where(alert.c.open_key == key)
        .values(status=AlertStatus.RESOLVED, open_key=None, resolved_at=now, last_seen_at=now)
    )
    return result.rowcount > 0


def deliver(conn: Connection, now: datetime, channels: list[Callable[[dict[str, Any]], None]] | None = None) -> int:
    """Tell every channel about firing alerts not told yet; return how many.

    The structured log line is the channel that always exists; more channels
    are callables taking the alert as a dict.
    """
    rows = (
        conn.execute(
            select(alert)
            .where(alert.c.status == AlertStatus.FIRING, alert.c.notified_at.is_(None))
            .order_by(alert.c.id)
            .with_for_update()
        )
        .mappings()
        .all()
    )
    for row in rows:
        payload = {k: (v.isoformat() + "Z" if isinstance(v, datetime) else v) for k, v in row.items()}
        payload["details"] = json.loads(row["details"]) if row["details"] else None
        log.warning("alert firing: %s", row["message"], extra={"alert": payload})
        for channel in channels or ():
            channel(payload)
        conn.execute(update(alert).where(alert.c.id == row["id"]).values(notified_at=now))
    return len(rows)
