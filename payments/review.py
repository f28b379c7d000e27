"""The manual queue: what automation refuses to decide goes here for a person."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, insert

from payments.schema import manual_review
from payments.states import ReviewStatus


def open_review(
    conn: Connection,
    *,
    kind: str,
    reason: str,
    now: datetime,
    payment_id: str | None = None,
    refund_id: str | None = None,
    callback_log_id: int | None = None,
    details: dict[str, Any] | None = None,
) -> int:
    """Open a manual_review row in the caller's transaction; return its id."""
    result = conn.execute(
        insert(manual_review).values(
            kind=kind,
            reason=reason[:500],
            payment_id=payment_id,
            refund_id=refund_id,
            callback_log_id=callback_log_id,
            details=json.dumps(details, sort_keys=True, default=str) if details else None,
            status=ReviewStatus.OPEN,
            created_at=now,
        )
    )
    return result.inserted_primary_key[0]
