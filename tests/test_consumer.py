"""The consumer process (``python -m consumer``) against real RabbitMQ and MariaDB.

Whether a message was acknowledged is read from the broker after the
consumer stopped: an unacknowledged message goes back to the queue and shows
up as ready, an acknowledged one is gone.
"""

from __future__ import annotations

import base64
import json
import re
import signal
import threading
import time

import pytest
from sqlalchemy import select, text

from payments.inbound.callbacks import process_callback, store_callback
from payments.infra.schema import ledger_event, outbox, payment_callback_log
from payments.providers import build_providers
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import (
    Stack,
    callback_rows,
    db_url,
    delivery_message,
    effect_counts,
    payment_status,
    post,
    publish_deliveries,
    publish_ids,
    publish_raw,
    ready_count,
)
from tests.support import create_payment, make_settings, sandbox_event, signed, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.rabbitmq, pytest.mark.slow]


def _store(engine, payment_id: str) -> int:  # noqa: ANN001
    body, headers = signed(sandbox_event(payment_id))
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def _row(engine, log_id: int):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == log_id)).one()


def _stopped_after(proc, what: str = "messages") -> int:  # noqa: ANN001
    """How many messages (or the callbacks they carried) a stopped consumer says it acknowledged."""
    match = re.search(r"consumer stopped after (\d+) messages \((\d+) callbacks\)", proc.output())
    assert match, proc.output()[-2000:]
    return int(match.group(1 if what == "messages" else 2))


def _stack(tmp_path, mariadb, amqp_url, amqp_queue) -> Stack:  # noqa: ANN001
    return Stack(tmp_path, DATABASE_URL=db_url(mariadb), AMQP_URL=amqp_url, AMQP_QUEUE=amqp_queue)


def test_a_message_for_an_already_processed_row_is_acked_with_no_effect(mariadb, amqp_url, amqp_queue, tmp_path):
    providers = build_providers(make_settings())
    runtime = build_runtime(make_settings(database_url=db_url(mariadb)), engine=mariadb)
    done_payment = create_payment(mariadb)
    done_id = _store(mariadb, done_payment)
    process_callback(mariadb, providers, done_id, runtime.callback_policy)
    before = _row(mariadb, done_id)
    effects = effect_counts(mariadb)
    fresh_payment = create_payment(mariadb)
    fresh_id = _store(mariadb, fresh_payment)

    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        consumer = stack.start("consumer")
        # One queue, one consumer: in order.
        publish_deliveries(amqp_url, amqp_queue, mariadb, [done_id, done_id, fresh_id])
        wait_until(lambda: payment_status(mariadb, fresh_payment) == "Succeeded", timeout=20, message="fresh row")
        assert consumer.stop() == 0
    assert _stopped_after(consumer) == 3
    assert ready_count(amqp_url, amqp_queue) == 0, "every message must have been acknowledged"
    assert _row(mariadb, done_id) == before
    assert effect_counts(mariadb)["ledger_events"] == effects["ledger_events"] + 1


def test_an_unreadable_message_goes_to_the_dead_letter_queue(mariadb, amqp_url, amqp_queue, tmp_path):
    payment_id = create_payment(mariadb)
    _store(mariadb, payment_id)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        consumer = stack.start("consumer")
        good = delivery_message(callback_rows(mariadb)[0])
        forged = json.loads(good)
        forged["body"] = base64.b64encode(b'{"id": "evt_forged"}').decode()  # the digest no longer matches
        publish_raw(
            amqp_url,
            amqp_queue,
            [b"not json", b'{"log_id": "12"}', b"[1, 2]", b'{"log_id": -5}', json.dumps(forged).encode()],
        )
        publish_raw(amqp_url, amqp_queue, [good])
        wait_until(lambda: payment_status(mariadb, payment_id) == "Succeeded", timeout=20, message="good message")
        wait_until(lambda: ready_count(amqp_url, f"{amqp_queue}.dlq") == 5, timeout=10, message="dead letters")
        assert consumer.stop() == 0
    assert ready_count(amqp_url, amqp_queue) == 0
    assert "unreadable message sent to the dead-letter queue" in consumer.output()
    assert len(callback_rows(mariadb)) == 1, "a message that is not the delivery it claims restores nothing"


def test_a_message_of_the_earlier_format_is_still_processed_by_its_id(mariadb, amqp_url, amqp_queue, tmp_path):
    payment_id = create_payment(mariadb)
    log_id = _store(mariadb, payment_id)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        consumer = stack.start("consumer")
        publish_ids(amqp_url, amqp_queue, [log_id])  # {"log_id": N}, as queued before an upgrade
        wait_until(lambda: payment_status(mariadb, payment_id) == "Succeeded", timeout=20, message="applied")
        assert consumer.stop() == 0
    assert _stopped_after(consumer) == 1
    assert _row(mariadb, log_id).status == CallbackStatus.PROCESSED


def test_sigterm_finishes_the_message_in_hand_and_hands_back_the_rest(mariadb, amqp_url, amqp_queue, tmp_path):
    held_payment, next_payment = create_payment(mariadb), create_payment(mariadb)
    held_id, next_id = _store(mariadb, held_payment), _store(mariadb, next_payment)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack, mariadb.connect() as blocker:
        # Hold the first row's lock so the consumer is caught in the middle of processing it.
        blocker.execute(select(payment_callback_log.c.id).where(payment_callback_log.c.id == held_id).with_for_update())
        consumer = stack.start("consumer")
        publish_deliveries(amqp_url, amqp_queue, mariadb, [held_id, next_id])
        with mariadb.connect() as peek:
            wait_until(
                lambda: peek.execute(
                    # Only this database's transactions: the server is shared with other test runs.
                    text(
                        "SELECT COUNT(*) FROM information_schema.INNODB_TRX t"
                        " JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id"
                        " WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()"
                    )
                ).scalar(),
                timeout=20,
                interval=0.25,  # InnoDB refreshes INNODB_TRX only when it was not read in the last 0.1 s
                message="consumer waiting on the held row",
            )
        consumer.signal(signal.SIGTERM)
        time.sleep(0.3)  # give a wrong implementation the chance to exit early
        assert consumer.popen.poll() is None, "the consumer must not exit with a message in hand"
        blocker.rollback()  # release: the message in hand completes
        assert consumer.popen.wait(15) == 0

    assert _row(mariadb, held_id).status == CallbackStatus.PROCESSED
    assert payment_status(mariadb, held_payment) == "Succeeded"
    assert _row(mariadb, next_id).status == CallbackStatus.PENDING, "nothing new may start after SIGTERM"
    assert _stopped_after(consumer) == 1
    assert ready_count(amqp_url, amqp_queue) == 1, "the finished message is acked, the other one handed back"


def test_a_consumer_killed_after_commit_before_ack_gets_a_redelivery_with_no_second_effect(
    mariadb, amqp_url, amqp_queue, tmp_path
):
    payment_id = create_payment(mariadb)
    log_id = _store(mariadb, payment_id)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        doomed = stack.start("consumer", "consumer-doomed", FAILPOINTS="consumer.after_commit")
        publish_deliveries(amqp_url, amqp_queue, mariadb, [log_id])
        assert doomed.popen.wait(20) == -signal.SIGKILL
        assert "failpoint consumer.after_commit: SIGKILL" in doomed.output()
        committed = _row(mariadb, log_id)
        assert committed.status == CallbackStatus.PROCESSED and payment_status(mariadb, payment_id) == "Succeeded"
        assert ready_count(amqp_url, amqp_queue) == 1, "the unacked message must come back"

        clean = stack.start("consumer", "consumer-clean")
        wait_until(lambda: "consuming" in clean.output(), timeout=20, message="clean consumer up")
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == 0, timeout=20, message="redelivery taken")
        assert clean.stop() == 0
    assert _stopped_after(clean) == 1
    assert ready_count(amqp_url, amqp_queue) == 0, "the redelivery was acknowledged"
    assert _row(mariadb, log_id) == committed, "the redelivery had no effect"
    assert effect_counts(mariadb, payment_id) == {"ledger_events": 1, "processed_events": 1}


def test_the_same_event_delivered_20_times_at_once_changes_state_once(mariadb, amqp_url, amqp_queue, tmp_path):
    payment_id = create_payment(mariadb)
    body, headers = signed(sandbox_event(payment_id))
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=3)
        consumers = [stack.start("consumer", f"consumer-{i}") for i in range(2)]
        for c in consumers:
            wait_until(lambda c=c: "consuming" in c.output(), timeout=20, message="consumer up")
        barrier = threading.Barrier(20)
        answers: list[int] = []

        def deliver() -> None:
            barrier.wait()
            answers.append(post(port, body, headers).status_code)

        threads = [threading.Thread(target=deliver) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert answers == [200] * 20
        wait_until(
            lambda: [r.status for r in callback_rows(mariadb)] == [CallbackStatus.PROCESSED] * 20,
            timeout=30,
            message="all 20 rows processed",
        )
        for c in consumers:
            assert c.stop() == 0
    acked = [_stopped_after(c, "callbacks") for c in consumers]
    assert sum(acked) == 20 and min(acked) > 0, f"both consumers must have taken part: {acked}"
    results = [r.result.split(":")[0] for r in callback_rows(mariadb)]
    assert sorted(results) == ["applied"] + ["duplicate"] * 19
    assert all(r.retry_count == 0 for r in callback_rows(mariadb))
    assert payment_status(mariadb, payment_id) == "Succeeded"
    assert effect_counts(mariadb, payment_id) == {"ledger_events": 1, "processed_events": 1}
    with mariadb.connect() as conn:
        assert conn.execute(select(ledger_event.c.event_type)).scalars().all() == ["PaymentConfirmed"]
        assert conn.execute(select(outbox.c.event_type)).scalars().all() == ["PaymentSucceeded"]
