"""process_callback on both databases: the happy path and the ledger it leaves."""

from __future__ import annotations

from sqlalchemy import func, select

from payments.backoff import RetryPolicy
from payments.callbacks import Outcome, process_callback, store_callback
from payments.providers import build_providers
from payments.schema import ledger_entry, payment, payment_callback_log
from tests.support import create_payment, make_settings, sandbox_event, signed


def test_a_verified_success_callback_confirms_the_payment_once(engine):
    settings = make_settings()
    providers = build_providers(settings)
    payment_id = create_payment(engine, amount=1234)
    body, headers = signed(sandbox_event(payment_id, amount=1234))
    first = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    second = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")

    assert process_callback(engine, providers, first, RetryPolicy()) == Outcome.APPLIED
    assert process_callback(engine, providers, second, RetryPolicy()) == Outcome.DUPLICATE
    assert process_callback(engine, providers, first, RetryPolicy()) == Outcome.SKIPPED

    with engine.connect() as conn:
        assert conn.execute(select(payment.c.status).where(payment.c.payment_id == payment_id)).scalar() == "Succeeded"
        statuses = conn.execute(select(payment_callback_log.c.status).order_by(payment_callback_log.c.id)).scalars()
        assert list(statuses) == [1, 1]
        lines = conn.execute(select(func.count(), func.sum(ledger_entry.c.amount_minor))).one()
        assert tuple(lines) == (2, 0)
