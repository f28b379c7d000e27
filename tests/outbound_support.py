"""Helpers for tests of the relay and the query job: payments as the merchant API makes them, and what they left."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from payments.infra.db import utcnow
from payments.infra.schema import manual_review, outbox, payment, provider_call
from payments.outbound import protocol as outbound_protocol
from payments.outbound.charges import CreatePayment, create_payment
from payments.runtime import build_runtime
from payments.states import OutboxStatus
from tests.support import make_settings


def new_payment(rt, provider="sandbox", amount=1000, key=None):
    """A payment created through ``create_payment``, its ChargeRequested due now; return its payment_id."""
    key = key or f"key-{time.monotonic_ns()}"
    answer = create_payment(
        rt.engine,
        CreatePayment(f"order-{key}", amount, "CNY", provider, None),
        key,
        deadline_seconds=rt.settings.payment_deadline_seconds,
        lock_seconds=60,
    )
    return json.loads(answer.body)["payment_id"]


def row(rt, payment_id):
    """The payment row."""
    with rt.engine.connect() as conn:
        return conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()


def calls(rt, payment_id, operation=None):
    """The payment's provider_call rows, oldest first."""
    q = select(provider_call).where(provider_call.c.payment_id == payment_id).order_by(provider_call.c.id)
    if operation:
        q = q.where(provider_call.c.operation == operation)
    with rt.engine.connect() as conn:
        return conn.execute(q).mappings().all()


def domain_events(rt, payment_id):
    """Types of the payment's domain events in the outbox, oldest first."""
    with rt.engine.connect() as conn:
        return list(
            conn.execute(
                select(outbox.c.event_type)
                .where(outbox.c.aggregate_id == payment_id, outbox.c.event_type != "ChargeRequested")
                .order_by(outbox.c.id)
            ).scalars()
        )


def reviews(rt, payment_id):
    """Kinds of the payment's manual reviews."""
    with rt.engine.connect() as conn:
        return list(
            conn.execute(select(manual_review.c.kind).where(manual_review.c.payment_id == payment_id)).scalars()
        )


def make_due(rt, payment_id):
    """Skip the query backoff: the payment is due for a query now."""
    with rt.engine.begin() as conn:
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id)
            .values(next_query_at=utcnow(), updated_at=utcnow())
        )


def claim_for_query(engine, payment_id):
    """Make the payment due and claim it as the query job does; return the lease token query_payment needs."""
    with engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=utcnow()))
    claimed = {p: lease for p, _, lease, _ in outbound_protocol.claim_queries(engine, utcnow(), 100, 30, 3600)}
    return claimed[payment_id]


def push_query_out(engine, payment_id):
    """As right after a query: the payment's next one is an hour off (a hint is what may bring it forward)."""
    with engine.begin() as conn:
        later = utcnow() + timedelta(hours=1)
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=later))


def query_due_now(engine, payment_id) -> bool:
    """True when the payment's query is due (a hint brought it forward)."""
    with engine.connect() as conn:
        due = conn.execute(select(payment.c.next_query_at).where(payment.c.payment_id == payment_id)).scalar()
    return due is not None and due <= utcnow()


def expire_leases(rt):
    """Every pending outbox row is due now, as if its lease had run out."""
    with rt.engine.begin() as conn:
        conn.execute(update(outbox).where(outbox.c.status == OutboxStatus.PENDING).values(next_attempt_at=utcnow()))


@pytest.fixture
def runtime(mariadb, sandbox):
    """A runtime on the test MariaDB calling the real sandbox platform, with short timeouts and backoffs."""
    settings = make_settings(
        database_url=mariadb.url.render_as_string(hide_password=False),
        sandbox_api_url=sandbox.url,
        provider_timeout_seconds=0.3,
        query_base_seconds=0.05,
        query_max_seconds=0.2,
        query_pending_after_seconds=0.2,
        relay_max_seconds=10,
        sandbox_legacy_enabled=True,
    )
    return build_runtime(settings, mariadb)
