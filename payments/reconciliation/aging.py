"""Where payments stand across the three records (callback log, local status, settlement files), by age.

``python -m compensator aging`` prints, for each of

- ``callback_not_applied``: callbacks received but not applied (status 0
  pending, 2 failed and retrying, 4 gave up; rejected ones are not counted:
  they were not genuine), by when they arrived;
- ``succeeded_not_settled``: payments Succeeded locally that no current
  settlement file names yet, by when they were confirmed;
- ``settled_not_succeeded``: charges a current settlement file shows as
  settled that are not Succeeded locally (or not ours at all), by when the
  provider made them;
- ``refunds_pending``: refunds Created, Pending or Unknown, by when they were
  requested;

how many there are, and how much money by currency, in the age buckets
under 1 hour, under 1 day, under 3 days, and older. The last two look back
WINDOW_DAYS days (confirmations and settlement days), so payments from before
reconciliation began do not crowd the report; the others have no window.
The counting happens in the database, a GROUP BY per category.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, exists, func, literal, select

from payments.infra.db import utcnow
from payments.infra.schema import ledger_event, payment, payment_callback_log, refund, settlement_file, settlement_line
from payments.providers.settlement import SUCCEEDED
from payments.reconciliation.reconcile import current_files
from payments.states import CallbackStatus, PaymentStatus

AGE_LIMITS = (("<1h", 3600), ("<1d", 86400), ("<3d", 3 * 86400))
"""The age buckets (label, younger than so many seconds), then "older": the console, this report and the
Unknown-payments gauge of /metrics (Grafana) use the same ones."""
BUCKETS = (*(label for label, _ in AGE_LIMITS), "older")
CATEGORIES = ("callback_not_applied", "succeeded_not_settled", "settled_not_succeeded", "refunds_pending")
WINDOW_DAYS = 31
"""How far back succeeded_not_settled and settled_not_succeeded look."""


def _bucket(column: Any, now: datetime) -> Any:
    return case(
        *((column >= now - timedelta(seconds=limit), literal(label)) for label, limit in AGE_LIMITS),
        else_=literal("older"),
    )


def _current_lines() -> Any:
    return settlement_line.join(
        settlement_file,
        and_(settlement_file.c.id == settlement_line.c.settlement_file_id, settlement_file.c.superseded_at.is_(None)),
    )


def aging(engine: Engine, now: datetime | None = None, window_days: int = WINDOW_DAYS) -> dict[str, Any]:
    """The report as a dict: category -> bucket -> {count, amounts by currency}."""
    now = now or utcnow()
    since = now - timedelta(days=window_days)
    report: dict[str, Any] = {c: {b: {"count": 0, "amounts": {}} for b in BUCKETS} for c in CATEGORIES}
    with engine.connect() as conn:
        for category, rows in (
            ("callback_not_applied", _callbacks(conn, now)),
            ("succeeded_not_settled", _succeeded_not_settled(conn, now, since)),
            ("settled_not_succeeded", _settled_not_succeeded(conn, now, since)),
            ("refunds_pending", _refunds_pending(conn, now)),
        ):
            for bucket, currency, count, amount in rows:
                entry = report[category][bucket]
                entry["count"] += int(count)
                if currency is not None:
                    entry["amounts"][currency] = entry["amounts"].get(currency, 0) + int(amount or 0)
    return {"generated_at": now.isoformat() + "Z", "window_days": window_days, "categories": report}


def _callbacks(conn: Connection, now: datetime) -> list[Any]:
    t = payment_callback_log
    bucket = _bucket(t.c.create_time, now).label("bucket")
    query = (
        select(bucket, literal(None).label("currency"), func.count(), literal(0))
        .where(t.c.status.in_((CallbackStatus.PENDING, CallbackStatus.FAILED, CallbackStatus.GAVE_UP)))
        .group_by(bucket)
    )
    return list(conn.execute(query))


def _succeeded_not_settled(conn: Connection, now: datetime, since: datetime) -> list[Any]:
    e, p, line = ledger_event, payment, settlement_line
    days = (now.date() - since.date()).days
    files = current_files(conn, None, now.date(), days + 1)  # constants: one covering-index probe per payment
    by_ref = exists(
        select(literal(1)).where(
            line.c.provider_reference == p.c.provider_transaction_id,
            line.c.kind == "charge",
            line.c.settlement_file_id.in_(files),
        )
    )
    by_ours = exists(
        select(literal(1)).where(
            line.c.merchant_reference == p.c.payment_id, line.c.kind == "charge", line.c.settlement_file_id.in_(files)
        )
    )
    bucket = _bucket(e.c.created_at, now).label("bucket")
    query = (
        select(bucket, p.c.currency, func.count(), func.sum(p.c.amount_minor))
        .select_from(e.join(p, p.c.payment_id == e.c.payment_id))
        .where(
            e.c.event_type == "PaymentConfirmed",
            e.c.created_at >= since,
            p.c.status == PaymentStatus.SUCCEEDED.value,
            ~by_ref,
            ~by_ours,
        )
        .group_by(bucket, p.c.currency)
    )
    return list(conn.execute(query))


def _settled_not_succeeded(conn: Connection, now: datetime, since: datetime) -> list[Any]:
    line, p = settlement_line, payment
    succeeded = p.c.status == PaymentStatus.SUCCEEDED.value
    ours_by_ref = exists(select(literal(1)).where(p.c.provider_transaction_id == line.c.provider_reference, succeeded))
    ours_by_number = exists(select(literal(1)).where(p.c.payment_id == line.c.merchant_reference, succeeded))
    when = func.coalesce(line.c.occurred_at, settlement_file.c.imported_at, settlement_file.c.created_at)
    bucket = _bucket(when, now).label("bucket")
    query = (
        select(bucket, line.c.currency, func.count(), func.sum(line.c.amount_minor))
        .select_from(_current_lines())
        .where(
            settlement_file.c.settlement_date >= since.date(),
            line.c.kind == "charge",
            line.c.status == SUCCEEDED,
            ~ours_by_ref,
            ~ours_by_number,
        )
        .group_by(bucket, line.c.currency)
    )
    return list(conn.execute(query))


def _refunds_pending(conn: Connection, now: datetime) -> list[Any]:
    r = refund
    bucket = _bucket(r.c.created_at, now).label("bucket")
    unresolved = (PaymentStatus.CREATED.value, PaymentStatus.PENDING.value, PaymentStatus.UNKNOWN.value)
    query = (
        select(bucket, r.c.currency, func.count(), func.sum(r.c.amount_minor))
        .where(r.c.status.in_(unresolved))
        .group_by(bucket, r.c.currency)
    )
    return list(conn.execute(query))


def describe(report: dict[str, Any]) -> str:
    """The text table of ``aging``: counts per bucket, then the money."""
    out = [f"aging at {report['generated_at']} (settlement look-back {report['window_days']} days)"]
    out.append(f"  {'':<24}" + "".join(f"{b:>9}" for b in BUCKETS))
    for category, buckets in report["categories"].items():
        out.append(f"  {category:<24}" + "".join(f"{buckets[b]['count']:>9}" for b in BUCKETS))
        for bucket in BUCKETS:
            amounts = buckets[bucket]["amounts"]
            if amounts:
                money = ", ".join(f"{c} {v}" for c, v in sorted(amounts.items()))
                out.append(f"  {'':<24}{bucket:>9}: {money}")
    return "\n".join(out)
