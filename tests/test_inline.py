"""Inline processing: the gateway applies a callback before it answers, within CALLBACK_INLINE_BUDGET_SECONDS.

The answer depends only on the raw row's commit: a failure or an overrun
leaves the row at status 0 or 2 for the consumer and the sweep.
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select

from gateway import create_app
from payments.infra.db import make_engine
from payments.infra.schema import payment
from payments.infra.settings import load_settings
from payments.states import CallbackStatus
from tests.stack import Stack, callback_rows, db_url, payment_status, post
from tests.support import create_payment, make_settings, sandbox_event, signed, wait_until


def _client(engine, **settings):  # noqa: ANN001, ANN202
    return create_app(make_settings(database_url=db_url(engine), **settings), engine=engine).test_client()


def test_inline_is_on_without_a_broker_and_off_with_one_unless_told():
    assert load_settings({}).process_inline is True
    assert load_settings({"AMQP_URL": "amqp://mq/%2F"}).process_inline is False
    assert load_settings({"AMQP_URL": "amqp://mq/%2F", "CALLBACK_PROCESS_INLINE": "true"}).process_inline is True
    assert load_settings({"CALLBACK_PROCESS_INLINE": "false"}).process_inline is False
    assert load_settings({"CALLBACK_PROCESS_INLINE": ""}).process_inline is True
    assert load_settings({}).callback_inline_budget_seconds == 2.0


def test_with_inline_processing_the_payment_is_succeeded_when_the_provider_gets_its_answer(engine):
    client = _client(engine)
    for _ in range(5):
        payment_id = create_payment(engine)
        body, headers = signed(sandbox_event(payment_id))
        assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
        assert payment_status(engine, payment_id) == "Succeeded"
    assert [r.status for r in callback_rows(engine)] == [CallbackStatus.PROCESSED] * 5


def test_without_inline_processing_the_row_waits_for_the_consumer_or_sweep(engine):
    client = _client(engine, callback_process_inline=False)
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id))
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
    assert payment_status(engine, payment_id) == "Pending"
    assert [r.status for r in callback_rows(engine)] == [CallbackStatus.PENDING]


def test_a_failed_inline_attempt_is_recorded_for_retry_and_the_answer_is_still_200(engine):
    client = _client(engine)
    body, headers = signed(sandbox_event("pay_not_created_yet"))  # the payment may commit later
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
    (row,) = callback_rows(engine)
    assert row.status == CallbackStatus.FAILED and row.retry_count == 1 and row.result.startswith("target_not_found")


def test_a_rejected_callback_is_not_processed_inline(engine):
    client = _client(engine)
    body, headers = signed(sandbox_event(create_payment(engine)), secret="whsec_wrong")
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    (row,) = callback_rows(engine)
    assert row.status == 3 and row.retry_count == 0


@pytest.mark.mariadb
def test_an_inline_overrun_answers_within_the_budget_and_leaves_the_row_for_the_sweep(mariadb):
    client = _client(mariadb, callback_inline_budget_seconds=0.3)
    payment_id = create_payment(mariadb)
    body, headers = signed(sandbox_event(payment_id))
    with mariadb.connect() as blocker:
        # Someone else holds the payment row: processing waits on its lock, the provider must not.
        blocker.execute(select(payment.c.id).where(payment.c.payment_id == payment_id).with_for_update())
        started = time.monotonic()
        answer = client.post("/callbacks/sandbox", data=body, headers=headers)
        elapsed = time.monotonic() - started
        assert answer.status_code == 200
        assert elapsed < 0.3 + 2.0, f"answered after {elapsed:.2f} s"
        (row,) = callback_rows(mariadb)
        assert row.status == CallbackStatus.PENDING, "left at 0 for the consumer and the sweep"
        # Every inline thread may be held up the same way: further callbacks skip inline processing at once.
        for _ in range(3):
            other = signed(sandbox_event(payment_id))
            started = time.monotonic()
            assert client.post("/callbacks/sandbox", data=other[0], headers=other[1]).status_code == 200
            assert time.monotonic() - started < 0.3 + 2.0
        blocker.rollback()
    # The overrun carried on in the background and finished once the lock was released.
    wait_until(lambda: payment_status(mariadb, payment_id) == "Succeeded", timeout=20, message="applied afterwards")


@pytest.mark.slow
def test_in_embedded_mode_every_payment_is_succeeded_before_its_callback_is_answered(tmp_path):
    url = f"sqlite:///{tmp_path / 'paysync.db'}"
    with Stack(tmp_path, DATABASE_URL=url, CALLBACK_INLINE_BUDGET_SECONDS="10") as stack:
        assert stack.run("-m", "payments", "init-db").returncode == 0
        # Web alone, as `make run` starts it but with no consumer or compensator: only the gateway can apply.
        _, port = stack.start_web(workers=2)
        engine = make_engine(url)
        payments = [create_payment(engine) for _ in range(20)]
        late: list[str] = []
        lock = threading.Lock()

        def deliver(batch: list[str]) -> None:
            for payment_id in batch:
                assert post(port, *signed(sandbox_event(payment_id))).status_code == 200
                if payment_status(engine, payment_id) != "Succeeded":
                    with lock:
                        late.append(payment_id)

        threads = [threading.Thread(target=deliver, args=(payments[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert late == [], "a payment was not Succeeded by the time its callback was answered"
        assert [r.status for r in callback_rows(engine)] == [CallbackStatus.PROCESSED] * 20
        engine.dispose()
        assert "database is locked" not in stack.output()


@pytest.mark.mariadb
def test_callbacks_that_arrive_together_are_processed_in_one_transaction_each_with_its_own_outcome(
    mariadb, monkeypatch
):
    import payments.inbound.processing
    from gateway.inline import InlineProcessor
    from payments.inbound.callbacks import CallbackResult, store_callback
    from payments.runtime import build_runtime

    # The budget is not under test here, the grouping is: a budget no loaded machine overruns.
    runtime = build_runtime(make_settings(database_url=db_url(mariadb), callback_inline_budget_seconds=60), mariadb)
    inline = InlineProcessor(runtime, threads=40)
    paid = [create_payment(mariadb, amount=700 + n) for n in range(30)]
    settled = create_payment(mariadb, status="Succeeded", provider_transaction_id="ch_settled", amount=900)

    def stored(event):
        body, headers = signed(event)
        return store_callback(mariadb, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")

    usual = [stored(sandbox_event(p, amount=700 + n)) for n, p in enumerate(paid)]
    noop = stored(sandbox_event(settled, amount=900, provider_transaction_id="ch_settled"))
    unknown = stored(sandbox_event("pay_01NOSUCHPAYMENT0000000000", amount=5))
    first_group = threading.Event()
    real = payments.inbound.processing.process_batch
    sizes: list[int] = []

    def slow_first(engine, providers, messages, *args, **kwargs):
        sizes.append(len(messages))
        if len(sizes) == 1:
            first_group.wait(5)  # the first callback is slow: the others arrive meanwhile
        return real(engine, providers, messages, *args, **kwargs)

    monkeypatch.setattr("gateway.inline.process_batch", slow_first)
    outcomes: dict[int, CallbackResult | None] = {}

    def process(log_id):
        outcomes[log_id] = inline.process(log_id)

    threads = [threading.Thread(target=process, args=(log_id,)) for log_id in [usual[0], *usual[1:], noop, unknown]]
    threads[0].start()
    wait_until(lambda: len(sizes) == 1, timeout=10, message="the first callback is being written")
    for t in threads[1:]:
        t.start()
    # Known, not slept on: every other callback waits in the group commit behind the first one's write.
    wait_until(lambda: len(inline._group._queue) == 31, timeout=10, message="31 callbacks waiting in the group")
    first_group.set()
    for t in threads:
        t.join(10)

    assert sizes[0] == 1 and len(sizes) <= 3 and sum(sizes) == 32, sizes
    assert [outcomes[i] for i in usual] == [CallbackResult.APPLIED] * 30
    assert (outcomes[noop], outcomes[unknown]) == (CallbackResult.NOOP, CallbackResult.RETRY)
    assert {payment_status(mariadb, p) for p in paid} == {"Succeeded"}
    rows = {r.id: r for r in callback_rows(mariadb)}
    assert {rows[i].status for i in [*usual, noop]} == {CallbackStatus.PROCESSED}
    assert (rows[unknown].status, rows[unknown].retry_count) == (CallbackStatus.FAILED, 1)
