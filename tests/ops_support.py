"""Rows the ops console and ``compensator review`` work on, made the way paysync makes them."""

from __future__ import annotations

import hashlib
import uuid
from datetime import date

from sqlalchemy import insert, select

from payments.escalation.review import escalate
from payments.inbound.callbacks import process_callback, store_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import (
    manual_review,
    payment_callback_log,
    reconciliation_item,
    reconciliation_run,
    settlement_file,
    settlement_line,
)
from payments.providers import build_providers
from payments.states import CallbackStatus
from tests.support import make_settings, sandbox_event, signed

GIVE_UP_AT_ONCE = RetryPolicy(max_retries=1, base_seconds=0.01, max_seconds=0.01)
"""One failed attempt gives the row up (status 4)."""


def providers():
    """The adapters of the test settings (the sandbox, with the test secret)."""
    return build_providers(make_settings())


def given_up_callback(engine, payment_id: str, *, amount: int = 1000, event: dict | None = None) -> int:
    """A signed sandbox success for ``payment_id`` that gave up (its payment did not exist yet); return its id."""
    body, headers = signed(event or sandbox_event(payment_id, amount=amount))
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    outcome = process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE)
    assert outcome.value == "gave_up", outcome
    with engine.connect() as conn:
        status = conn.execute(select(payment_callback_log.c.status).where(payment_callback_log.c.id == log_id))
        assert status.scalar_one() == CallbackStatus.GAVE_UP
    return log_id


def review_for(engine, *, callback_log_id: int | None = None, payment_id: str | None = None) -> int:
    """The open review of a given-up callback, or the newest open one of a payment."""
    t = manual_review
    with engine.connect() as conn:
        query = select(t.c.id).where(t.c.status == "open").order_by(t.c.id.desc())
        if callback_log_id is not None:
            query = query.where(t.c.callback_log_id == callback_log_id)
        if payment_id is not None:
            query = query.where(t.c.payment_id == payment_id)
        return conn.execute(query).scalars().first()


def settled_review(
    engine,
    payment_id: str,
    *,
    line_status: str = "succeeded",
    amount: int = 1000,
    currency: str = "CNY",
    provider_reference: str | None = None,
    category: str = "status_mismatch",
) -> tuple[int, int]:
    """A reconciliation item for ``payment_id`` whose settlement line says ``line_status``, escalated.

    Returns (review id, item id)."""
    now = utcnow()
    provider_reference = provider_reference or f"ch_{uuid.uuid4().hex[:16]}"
    raw = f"{provider_reference},{payment_id},{amount},{currency},{line_status},sign=abc123secret"
    with engine.begin() as conn:
        file_id = conn.execute(
            insert(settlement_file).values(
                provider="sandbox",
                settlement_date=date.today(),
                format="sandbox_csv",
                source="file:test.csv",
                sha256=hashlib.sha256(raw.encode() + uuid.uuid4().bytes).hexdigest(),
                size_bytes=len(raw),
                line_count=1,
                status="imported",
                created_at=now,
                imported_at=now,
            )
        ).inserted_primary_key[0]
        conn.execute(
            insert(settlement_line).values(
                settlement_file_id=file_id,
                line_no=2,
                kind="charge",
                status=line_status,
                provider_reference=provider_reference,
                merchant_reference=payment_id,
                amount_minor=amount,
                currency=currency,
                occurred_at=now,
                raw=raw,
            )
        )
        run_id = conn.execute(
            insert(reconciliation_run).values(
                provider="sandbox",
                settlement_date=date.today(),
                settlement_file_id=file_id,
                started_by="manual",
                status="completed",
                line_count=1,
                new_lines=1,
                resolved=0,
                adjustments=0,
                reviews=1,
                started_at=now,
                finished_at=now,
            )
        ).inserted_primary_key[0]
        item_id = conn.execute(
            insert(reconciliation_item).values(
                run_id=run_id,
                category=category,
                kind="charge",
                settlement_file_id=file_id,
                line_no=2,
                payment_id=payment_id,
                provider_reference=provider_reference,
                merchant_reference=payment_id,
                currency=currency,
                provider_amount_minor=amount,
                local_amount_minor=amount,
                provider_status=line_status,
                action="review",
                created_at=now,
            )
        ).inserted_primary_key[0]
        escalation = escalate(
            conn,
            kind=f"reconciliation_{category}",
            subject=f"sandbox:charge:{payment_id}",
            reason=f"reconciliation sandbox: {category}",
            now=now,
            payment_id=payment_id,
            details={"reconciliation_item_id": item_id},
        )
        conn.execute(
            reconciliation_item.update()
            .where(reconciliation_item.c.id == item_id)
            .values(manual_review_id=escalation.review_id)
        )
    return escalation.review_id, int(item_id)
