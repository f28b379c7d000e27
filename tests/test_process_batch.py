"""process_batch (the consumer's micro-batches): one transaction, a savepoint per message, every effect kept."""

from __future__ import annotations

from sqlalchemy import func, select

from payments.backoff import RetryPolicy
from payments.callbacks import CallbackResult, process_callback, store_callback
from payments.delivery import process_batch
from payments.providers import build_providers
from payments.schema import ledger_event, outbox, payment, payment_callback_log, processed_event
from payments.states import CallbackStatus
from tests.support import create_payment, make_settings, sandbox_event, signed


def _stored(engine, event) -> int:
    body, headers = signed(event)
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def _count(engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table).where(*where)).scalar()


def test_a_failing_message_rolls_back_only_itself_and_the_rest_of_the_batch_commits(engine):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=1000 + n) for n in range(3)]
    good = [_stored(engine, sandbox_event(p, amount=1000 + n)) for n, p in enumerate(paid)]
    # No such payment (yet): the message fails, is recorded for a retry, and must not undo its neighbours.
    orphan = _stored(engine, sandbox_event("pay_01NOSUCHPAYMENT0000000000", amount=5))
    twice = create_payment(engine, amount=900)
    duplicate_event = sandbox_event(twice, amount=900)  # one event delivered twice: two rows, one effect
    first_copy, second_copy = _stored(engine, duplicate_event), _stored(engine, duplicate_event)

    messages = [good[0], orphan, good[1], good[1], first_copy, second_copy, good[2], 987654321]
    outcomes = process_batch(engine, providers, messages, RetryPolicy())

    assert [o for _, o in outcomes] == [
        CallbackResult.APPLIED,
        CallbackResult.RETRY,
        CallbackResult.APPLIED,
        CallbackResult.SKIPPED,  # the same row twice in one batch: read once, applied once
        CallbackResult.APPLIED,
        CallbackResult.DUPLICATE,
        CallbackResult.APPLIED,
        CallbackResult.MISSING,
    ]
    with engine.connect() as conn:
        statuses = dict(conn.execute(select(payment_callback_log.c.id, payment_callback_log.c.status)).tuples().all())
        orphan_row = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == orphan)).one()
        ours = payment.c.payment_id.in_([*paid, twice])
        paid_status = conn.execute(select(payment.c.status).where(ours)).scalars().all()
    assert {statuses[i] for i in (*good, first_copy, second_copy)} == {CallbackStatus.PROCESSED}
    assert statuses[orphan] == CallbackStatus.FAILED and orphan_row.retry_count == 1
    assert paid_status == ["Succeeded"] * 4
    # Exactly one of each effect per applied payment: the savepoint took back everything the orphan wrote.
    assert _count(engine, ledger_event, ledger_event.c.event_type == "PaymentConfirmed") == 4
    assert _count(engine, outbox, outbox.c.event_type == "PaymentSucceeded") == 4
    assert _count(engine, processed_event) == 4

    # The batch left nothing half-done: processing any row again is a no-op.
    for log_id in good:
        assert process_callback(engine, providers, log_id, RetryPolicy()) == CallbackResult.SKIPPED


def test_stop_finishes_the_message_in_hand_and_leaves_the_rest_untouched(engine):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=700) for _ in range(3)]
    ids = [_stored(engine, sandbox_event(p, amount=700)) for p in paid]
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 1  # stop asked as soon as the first message is done

    outcomes = process_batch(engine, providers, ids, RetryPolicy(), stop=stop)
    assert [o for _, o in outcomes] == [CallbackResult.APPLIED, None, None]
    assert _count(engine, payment_callback_log, payment_callback_log.c.status == CallbackStatus.PENDING) == 2
    assert _count(engine, payment, payment.c.status == "Succeeded") == 1
