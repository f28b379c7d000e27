"""The manual queue: what automation refuses to decide goes here for a person, once.

``escalate`` is the one way in: it opens a ``manual_review`` row and raises
an alert for a (kind, subject), or, while that subject's review is still
open, updates the open one (reason, details, ``occurrences``,
``last_seen_at``) and raises nothing new. A conflicting answer seen again and
again is therefore one review and one alert, never a loop of them (docs/design.md
invariant 13). The UNIQUE ``open_key`` (``<kind>:<subject>`` while open, NULL
once resolved) holds that even against concurrent writers; ``resolve`` frees
the subject, and a later escalation opens a fresh review.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, select, update

from payments.escalation import alerts
from payments.infra.db import upsert
from payments.infra.schema import manual_review
from payments.states import ReviewStatus

log = logging.getLogger("paysync.review")


@dataclass(frozen=True)
class Escalation:
    """What ``escalate`` did."""

    review_id: int
    first: bool
    """True when it opened the review (and raised its alert); False when it updated the open one."""


def escalate(
    conn: Connection,
    *,
    kind: str,
    subject: str,
    reason: str,
    now: datetime,
    alert_key: str | None = None,
    severity: str = "warning",
    details: dict[str, Any] | None = None,
    payment_id: str | None = None,
    refund_id: str | None = None,
    callback_log_id: int | None = None,
) -> Escalation:
    """Hand ``subject`` to a person, in the caller's transaction: one open review and one alert per (kind, subject).

    ``subject`` names what it is about (``payment:<id>``, ``callback:<id>``,
    …); the alert's rule is ``kind`` and its key ``alert_key`` (default
    ``<kind>:<subject>``). The references (payment, refund, callback row) are
    those of the first escalation; ``reason`` and ``details`` are the latest.
    """
    open_key = f"{kind}:{subject}"[:191]
    text = json.dumps(details, sort_keys=True, default=str) if details else None
    t = manual_review
    upsert(
        conn,
        t,
        {
            "kind": kind,
            "subject": subject[:150],
            "open_key": open_key,
            "reason": reason[:500],
            "details": text,
            "payment_id": payment_id,
            "refund_id": refund_id,
            "callback_log_id": callback_log_id,
            "status": ReviewStatus.OPEN,
            "alert_key": (alert_key or open_key)[:191],
            "occurrences": 1,
            "created_at": now,
            "last_seen_at": now,
        },
        t.c.open_key,
        {"reason": reason[:500], "details": text, "occurrences": t.c.occurrences + 1, "last_seen_at": now},
    )
    # Our upsert holds the row's lock until commit: what we read is what we wrote.
    row = conn.execute(select(t.c.id, t.c.occurrences).where(t.c.open_key == open_key)).one()
    first = row.occurrences == 1
    if first:
        alerts.observe(
            conn,
            rule=kind,
            key=alert_key or open_key,
            message=reason,
            now=now,
            severity=severity,
            # The payment in the alert too: its notices group by payment, and link to it.
            details={
                "manual_review_id": row.id,
                **({"payment_id": payment_id} if payment_id else {}),
                **(details or {}),
            },
        )
        log.warning("manual review opened", extra={"kind": kind, "subject": subject, "manual_review_id": row.id})
    return Escalation(review_id=row.id, first=first)


def resolve(conn: Connection, review_id: int, *, resolution: str, resolved_by: str, now: datetime) -> bool:
    """Close an open review, freeing its subject for a later escalation, and resolve its alert; False if not open."""
    row = conn.execute(
        select(manual_review.c.kind, manual_review.c.subject, manual_review.c.alert_key).where(
            manual_review.c.id == review_id
        )
    ).first()
    changed = conn.execute(
        update(manual_review)
        .where(manual_review.c.id == review_id, manual_review.c.status == ReviewStatus.OPEN)
        .values(
            status=ReviewStatus.RESOLVED,
            open_key=None,
            resolution=resolution[:500],
            resolved_by=resolved_by[:64],
            resolved_at=now,
        )
    ).rowcount
    if changed == 1:
        # A person decided: the incident the review raised is over. Reviews from before alert_key existed
        # raised their alert under the review's own key (the default of ``escalate``).
        alerts.clear(conn, key=row.alert_key or f"{row.kind}:{row.subject}"[:191], now=now)
    return changed == 1
