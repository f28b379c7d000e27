"""A person's hand on an alert or a review: acknowledge, silence (until a time) and assign.

Shared by the ops console (``gateway/ops``) and ``python -m compensator
alerts ack|silence|assign`` (and ``review ack|silence|assign``). Each action
is one transaction: a guarded UPDATE of the alert (``WHERE open_key IS NOT
NULL``: only an open alert) and of the review it belongs to, and the
``ops_action`` row that records who, why and what (the append-only log).

What the notifier does with them (``payments/escalation/notifications.py``):

- **ack**: no more firing or reminder notices for this incident (those not
  sent yet are cancelled); the resolved notice still goes out;
- **silence**: nothing at all about the alert is sent until
  ``silenced_until``; a silence of 0 minutes lifts it;
- **assign**: who is on it; shown in the console and the CLI, no effect on
  notices.

An alert and its review are one thing to a person: acting on either acts on
both (the review's ``alert_key`` is the alert's ``dedupe_key``).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, select, update

from payments.infra.db import utcnow
from payments.infra.schema import alert, alert_notification, manual_review
from payments.ops.actions import Actor, OpsRefused, Outcome, _iso, _json, _row, actions, clean_actor, clean_note, record
from payments.states import ReviewStatus

ALERT_ACTIONS = ("ack", "silence", "assign")
"""What a person may do to an open alert or review."""
MAX_SILENCE_MINUTES = 7 * 24 * 60
"""A silence ends within a week: a forgotten one must not hide an incident for ever."""


def _open_alert(conn: Connection, alert_id: int) -> dict[str, Any]:
    row = conn.execute(select(alert).where(alert.c.id == alert_id).with_for_update()).mappings().first()
    if row is None:
        raise OpsRefused(f"no alert {alert_id}")
    if row["open_key"] is None:
        raise OpsRefused(f"alert {alert_id} is resolved: there is nothing to act on")
    return dict(row)


def _review_of(conn: Connection, row: dict[str, Any]) -> dict[str, Any] | None:
    """The open review that raised this alert, if any."""
    review_id = (_json(row["details"]) or {}).get("manual_review_id") if row["details"] else None
    query = select(manual_review).where(manual_review.c.status == ReviewStatus.OPEN)
    query = query.where(
        manual_review.c.id == review_id
        if isinstance(review_id, int)
        else manual_review.c.alert_key == row["dedupe_key"]
    )
    found = conn.execute(query.with_for_update()).mappings().first()
    return dict(found) if found else None


def _alert_of_review(conn: Connection, review_id: int) -> int:
    row = conn.execute(select(manual_review).where(manual_review.c.id == review_id)).mappings().first()
    if row is None:
        raise OpsRefused(f"no manual review {review_id}")
    if row["status"] != ReviewStatus.OPEN:
        raise OpsRefused(f"review {review_id} is resolved")
    key = row["alert_key"] or f"{row['kind']}:{row['subject']}"[:191]
    alert_id = conn.execute(select(alert.c.id).where(alert.c.open_key == key)).scalar()
    if alert_id is None:
        raise OpsRefused(f"review {review_id} has no open alert to act on")
    return int(alert_id)


def _change(action: str, row: dict[str, Any], actor: Actor, now: datetime, minutes: int | None, assignee: str | None):  # noqa: ANN202
    """(values to set, outcome text, details) for ``action``; OpsRefused if it makes no sense now."""
    if action == "ack":
        if row["acked_at"] is not None:
            raise OpsRefused(
                f"alert {row['id']} was acknowledged already by {row['acked_by']} at {_iso(row['acked_at'])}"
            )
        return {"acked_at": now, "acked_by": actor.name}, f"acknowledged by {actor.name}: no more reminders", {}
    if action == "silence":
        if minutes is None or not 0 <= minutes <= MAX_SILENCE_MINUTES:
            raise OpsRefused(f"a silence is 0 (lift it) to {MAX_SILENCE_MINUTES} minutes")
        if minutes == 0:
            if row["silenced_until"] is None or row["silenced_until"] <= now:
                raise OpsRefused(f"alert {row['id']} is not silenced")
            return {"silenced_until": None}, "silence lifted", {"was_until": _iso(row["silenced_until"])}
        until = now + timedelta(minutes=minutes)
        outcome = f"silenced until {_iso(until)} ({minutes} min): no notice before then"
        return {"silenced_until": until}, outcome, {"silenced_until": _iso(until), "minutes": minutes}
    if action == "assign":
        who = clean_actor(assignee or "")
        if row["assignee"] == who:
            raise OpsRefused(f"alert {row['id']} is assigned to {who} already")
        return {"assignee": who}, f"assigned to {who}", {"assignee": who, "was": row["assignee"]}
    raise OpsRefused(f"action must be one of {', '.join(ALERT_ACTIONS)}")


def act(
    engine: Engine,
    action: str,
    *,
    actor: Actor,
    note: str,
    alert_id: int | None = None,
    review_id: int | None = None,
    minutes: int | None = None,
    assignee: str | None = None,
    now: datetime | None = None,
) -> Outcome:
    """Ack, silence or assign an open alert (or the alert of an open review, and the review with it)."""
    reason = clean_note(note)
    now = now or utcnow()
    with engine.begin() as conn:
        if alert_id is None:
            if review_id is None:
                raise OpsRefused("name an alert or a review")
            alert_id = _alert_of_review(conn, review_id)
        row = _open_alert(conn, alert_id)
        values, outcome, details = _change(action, row, actor, now, minutes, assignee)
        changed = conn.execute(
            update(alert).where(alert.c.id == alert_id, alert.c.open_key.is_not(None)).values(**values)
        ).rowcount
        if changed != 1:  # cannot happen under the row lock; a refusal rather than a log row that lies
            raise OpsRefused(f"alert {alert_id} changed meanwhile")
        review = _review_of(conn, row)
        if review is not None:
            conn.execute(
                update(manual_review)
                .where(manual_review.c.id == review["id"], manual_review.c.status == ReviewStatus.OPEN)
                .values(**values)
            )
        subject = f"review:{review['id']}" if review_id is not None and review else f"alert:{alert_id}"
        action_id = record(
            conn,
            action=action,
            actor=actor,
            subject=subject,
            reason=reason,
            outcome=outcome,
            now=now,
            alert_id=alert_id,
            manual_review_id=review["id"] if review else None,
            payment_id=(review or {}).get("payment_id") or (_json(row["details"]) or {}).get("payment_id"),
            details={"rule": row["rule"], "key": row["dedupe_key"], **details},
        )
    return Outcome(action, subject, outcome, action_id, {"alert_id": alert_id, **details})


def alert_of_review(conn: Connection, review: dict[str, Any]) -> dict[str, Any] | None:
    """The alert a review raised (the open one, else its latest), with its deliveries, for the review's page."""
    key = review.get("alert_key") or f"{review['kind']}:{review['subject']}"[:191]
    alert_id = conn.execute(
        select(alert.c.id).where(alert.c.dedupe_key == key).order_by(alert.c.id.desc()).limit(1)
    ).scalar()
    return alert_detail(conn, int(alert_id)) if alert_id is not None else None


def list_alerts(conn: Connection, *, open_only: bool = True, limit: int = 100) -> list[dict[str, Any]]:
    """Alerts, newest first (open ones only by default), with who has them."""
    query = select(alert).order_by(alert.c.id.desc()).limit(limit)
    if open_only:
        query = query.where(alert.c.open_key.is_not(None))
    return [{**_row(r), "details": _json(r["details"])} for r in conn.execute(query).mappings()]


def alert_detail(conn: Connection, alert_id: int, now: datetime | None = None) -> dict[str, Any] | None:
    """One alert: its row, where each notification went and whether the channel took it, and the actions on it."""
    row = conn.execute(select(alert).where(alert.c.id == alert_id)).mappings().first()
    if row is None:
        return None
    n = alert_notification
    deliveries = [
        _row(r)
        for r in conn.execute(
            select(
                n.c.id,
                n.c.channel,
                n.c.kind,
                n.c.seq,
                n.c.status,
                n.c.attempts,
                n.c.last_error,
                n.c.sent_at,
                n.c.next_attempt_at,
                n.c.grouped_into,
                n.c.created_at,
            )
            .where(n.c.alert_id == alert_id)
            .order_by(n.c.channel, n.c.id)
        ).mappings()
    ]
    details = _json(row["details"]) or {}
    now = now or utcnow()
    silenced = row["silenced_until"] is not None and row["silenced_until"] > now
    return {
        **_row(row),
        "details": details,
        "open": row["open_key"] is not None,
        "silenced": silenced,
        "manual_review_id": details.get("manual_review_id") if isinstance(details, dict) else None,
        "payment_id": details.get("payment_id") if isinstance(details, dict) else None,
        "deliveries": deliveries,
        "actions": actions(conn, alert_id=alert_id),
    }


def describe(item: dict[str, Any]) -> str:
    """The text form of ``alerts show``."""
    out = [f"alert {item['id']}: {item['rule']} ({item['severity']}, {item['status']})", f"  {item['message']}"]
    out.append(f"  key      {item['dedupe_key']}")
    out.append(f"  fired    {item['fired_at'] or '-'}   resolved {item['resolved_at'] or '-'}")
    out.append(
        f"  acked    {item['acked_at'] or '-'} {('by ' + item['acked_by']) if item['acked_by'] else ''}".rstrip()
    )
    out.append(f"  silenced {item['silenced_until'] if item['silenced'] else '-'}   assignee {item['assignee'] or '-'}")
    out.append("  deliveries:")
    for d in item["deliveries"] or [{"channel": "none", "kind": "", "status": "", "attempts": 0}]:
        line = f"    {d['channel']:<10} {d['kind']:<8} {d['status']:<9} attempts {d['attempts']}"
        if d.get("sent_at"):
            line += f"  sent {d['sent_at']}"
        if d.get("grouped_into"):
            line += f"  (in notice {d['grouped_into']})"
        if d.get("last_error"):
            line += f"  last error: {d['last_error']}"
        out.append(line)
    for a in item["actions"]:
        out.append(f"  {a['created_at']}  {a['action']:<8} {a['actor']}: {a['outcome']} ({a['reason']})")
    return "\n".join(out)
