"""An unverified notification is a hint, never a fact: it may bring its payment's query forward.

A delivery that fails verification (a forgery, a garbled body, or a genuine
one signed with a key we do not hold yet) never changes a state. When it names
a payment we know (the unverified ``order_no`` that ``peek_callback`` indexed)
that is still Pending or Unknown at that platform, the payment's
``next_query_at`` is set to now, so ``query_unresolved`` asks the provider,
whose authenticated answer is what gets applied. A genuine notification with a
key problem therefore still converges, and a forged one costs at most a query.
A refund notification that names our refund id (WeChat Pay's REFUND.*,
Stripe's refund events, the sandbox's) does the same for that refund, under
the same limits (``query_hint`` keys it by the refund id).

Rate limits, so forged traffic cannot turn into query traffic (``query_hint``):
per payment, one hint every HINT_QUERY_INTERVAL_SECONDS; per provider, at
most HINT_QUERIES_PER_MINUTE hints in any sliding minute (0 turns hints off).
The per-provider count is read, then written, in the rejecting transaction:
two gateways racing may each take the last slot, which overshoots by at most
the number of gateway workers, never by the volume of forged traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from sqlalchemy import Connection, func, or_, select, update

from payments.infra.db import insert_ignore
from payments.infra.schema import payment, query_hint, refund
from payments.providers.base import Provider
from payments.states import PaymentStatus

log = logging.getLogger("paysync.hints")

_OPEN = (PaymentStatus.PENDING.value, PaymentStatus.UNKNOWN.value)


@dataclass(frozen=True)
class HintLimits:
    """How often unverified notifications may bring a query forward."""

    per_payment_seconds: float = 60.0
    """HINT_QUERY_INTERVAL_SECONDS."""
    per_provider_per_minute: int = 60
    """HINT_QUERIES_PER_MINUTE; 0: hints are off."""

    @classmethod
    def from_settings(cls, settings: object) -> HintLimits:
        """The limits a Settings object names."""
        return cls(
            per_payment_seconds=getattr(settings, "hint_query_interval_seconds", cls.per_payment_seconds),
            per_provider_per_minute=getattr(settings, "hint_queries_per_minute", cls.per_provider_per_minute),
        )


class Hint(StrEnum):
    """What one unverified notification did."""

    SCHEDULED = "scheduled"
    """The payment's query was brought forward to now."""
    NO_REFERENCE = "no_reference"
    UNKNOWN_PAYMENT = "unknown_payment"
    OTHER_PLATFORM = "other_platform"
    """The payment was made through an adapter of another platform (or none we can query)."""
    SETTLED = "settled"
    """Not Pending or Unknown: there is nothing a query could still settle."""
    PAYMENT_LIMITED = "payment_limited"
    PROVIDER_LIMITED = "provider_limited"


def hint_query(
    conn: Connection,
    providers: Mapping[str, Provider],
    platform: str,
    payment_id: str | None,
    now: datetime,
    limits: HintLimits,
    *,
    callback_log_id: int | None = None,
) -> Hint:
    """Bring the query of the payment (or refund) an unverified ``platform`` notification names forward, within
    the limits.

    Runs in the caller's transaction (the one that marks the delivery
    rejected). Never changes the payment's status.
    """
    if not payment_id:
        return Hint.NO_REFERENCE
    table, number = payment, payment.c.payment_id
    row = conn.execute(
        select(payment.c.id, payment.c.provider, payment.c.status).where(number == payment_id[:40])
    ).first()
    if row is None:
        # A refund notification names our refund id (the adapters' peek indexes it as order_no).
        table, number = refund, refund.c.refund_id
        row = conn.execute(
            select(refund.c.id, refund.c.provider, refund.c.status).where(number == payment_id[:40])
        ).first()
    if row is None:
        return Hint.UNKNOWN_PAYMENT
    adapter = providers.get(row.provider)
    if adapter is None or adapter.platform != platform or not adapter.capabilities.query_by_merchant_id:
        return Hint.OTHER_PLATFORM
    if row.status not in _OPEN:
        return Hint.SETTLED
    if limits.per_provider_per_minute <= 0:
        return Hint.PROVIDER_LIMITED
    recent = conn.execute(
        select(func.count())
        .select_from(query_hint)
        .where(query_hint.c.provider == row.provider, query_hint.c.hinted_at > now - timedelta(minutes=1))
    ).scalar()
    if recent >= limits.per_provider_per_minute:
        log.warning("unverified notification hint dropped: provider limit", extra={"provider": row.provider})
        return Hint.PROVIDER_LIMITED
    key = (query_hint.c.provider == row.provider, query_hint.c.payment_id == payment_id)
    last = conn.execute(select(query_hint.c.hinted_at).where(*key).with_for_update()).scalar()
    if last is None:
        values = {
            "provider": row.provider,
            "payment_id": payment_id,
            "hinted_at": now,
            "callback_log_id": callback_log_id,
        }
        if not conn.execute(insert_ignore(query_hint).values(**values)).rowcount:
            return Hint.PAYMENT_LIMITED  # another delivery's hint for this payment got there first
    elif last > now - timedelta(seconds=limits.per_payment_seconds):
        return Hint.PAYMENT_LIMITED
    else:
        conn.execute(update(query_hint).where(*key).values(hinted_at=now, callback_log_id=callback_log_id))
    # Only ever earlier: a query already due stays due; the status guard keeps a settled payment alone.
    conn.execute(
        update(table)
        .where(
            table.c.id == row.id,
            table.c.status.in_(_OPEN),
            or_(table.c.next_query_at.is_(None), table.c.next_query_at > now),
        )
        .values(next_query_at=now)
    )
    log.info(
        "unverified notification: query brought forward",
        extra={"provider": row.provider, number.name: payment_id, "callback_log_id": callback_log_id},
    )
    return Hint.SCHEDULED
