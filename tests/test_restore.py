"""Invariant 12 end to end: an acknowledged callback survives the database losing its row.

Real gunicorn gateway, real RabbitMQ, real MariaDB, real consumer. Callbacks
are acknowledged (so the messages, the deliveries themselves, sit in the
queue); then the database "fails over" to a state that lacks those rows:
deleted behind the application's back, and in the second case with the
AUTO_INCREMENT counter set back so the same ids go to other deliveries. The
consumer then starts: every delivery is back, byte for byte with its receipt
time, and applied exactly once. The first case packs the deliveries several
to a message (a long PUBLISH_LINGER_SECONDS), the second one to a message
(PUBLISH_BATCH_MAX=1): both formats restore.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import delete, func, select, text

from payments.infra.schema import ledger_event, payment_callback_log
from payments.states import CallbackStatus
from tests.stack import (
    Stack,
    callback_rows,
    db_url,
    delivery_message,
    effect_counts,
    payment_status,
    post,
    publish_raw,
    queued_callbacks,
    ready_count,
)
from tests.support import create_payment, sandbox_event, signed, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.rabbitmq, pytest.mark.slow]

N = 12


def _acknowledged(port: int, mariadb, count: int) -> tuple[list[str], list[bytes]]:  # noqa: ANN001
    """``count`` payments and their success callbacks, each answered 200 by the gateway."""
    payments, bodies = [], []
    for _ in range(count):
        payment_id = create_payment(mariadb)
        body, headers = signed(sandbox_event(payment_id))
        assert post(port, body, headers).status_code == 200
        payments.append(payment_id)
        bodies.append(body)
    return payments, bodies


def _lose_rows(mariadb, reuse_ids: bool = False) -> None:  # noqa: ANN001
    """The database loses every callback row (and, with ``reuse_ids``, forgets it ever handed out their ids)."""
    with mariadb.begin() as conn:
        conn.execute(delete(payment_callback_log))
        if reuse_ids:
            # Empty table: InnoDB sets the counter back to 1, so the next deliveries get the lost rows' ids.
            conn.execute(text("ALTER TABLE payment_callback_log AUTO_INCREMENT = 1"))


def _check_every_delivery_back_once(mariadb, payments: list[str], bodies: list[bytes], received: dict) -> None:  # noqa: ANN001
    rows = callback_rows(mariadb)
    assert sorted(bytes(r.callback_data) for r in rows) == sorted(bodies), "every delivery is back, once"
    results = [r.result for r in rows]
    assert all(r.status == CallbackStatus.PROCESSED and r.result.startswith("applied") for r in rows), results
    for r in rows:
        assert r.create_time == received[bytes(r.callback_data)], "restored with its original receipt time"
    assert all(payment_status(mariadb, p) == "Succeeded" for p in payments)
    assert effect_counts(mariadb) == {"ledger_events": len(payments), "processed_events": len(payments)}
    with mariadb.connect() as conn:
        confirmed = conn.execute(
            select(func.count()).where(ledger_event.c.event_type == "PaymentConfirmed")
        ).scalar_one()
    assert confirmed == len(payments), "one confirmation per payment"


def _stack(tmp_path, mariadb, amqp_url, amqp_queue) -> Stack:  # noqa: ANN001
    # No compensator: whatever comes back, comes back through the broker's copy.
    return Stack(tmp_path, DATABASE_URL=db_url(mariadb), AMQP_URL=amqp_url, AMQP_QUEUE=amqp_queue)


def test_acknowledged_callbacks_whose_rows_were_lost_are_restored_from_the_queue_and_applied_once(
    mariadb, amqp_url, amqp_queue, tmp_path
):
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=2, PUBLISH_LINGER_SECONDS="0.5")
        payments, bodies = _acknowledged(port, mariadb, N)
        wait_until(
            lambda: queued_callbacks(amqp_url, amqp_queue)[1] == N, timeout=20, message="every delivery published"
        )
        assert queued_callbacks(amqp_url, amqp_queue)[0] < N, "several deliveries share a message"
        lost = callback_rows(mariadb)
        received = {bytes(r.callback_data): r.create_time for r in lost}
        _lose_rows(mariadb)
        # Each message also comes twice (a redelivery after a lost ack): the copy is found, not stored again.
        publish_raw(amqp_url, amqp_queue, [delivery_message(r) for r in lost])

        consumer = stack.start("consumer")
        wait_until(
            lambda: all(payment_status(mariadb, p) == "Succeeded" for p in payments), timeout=30, message="applied"
        )
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == 0, timeout=20, message="queue drained")
        assert consumer.stop() == 0
    assert consumer.output().count("restored from its message") == N
    _check_every_delivery_back_once(mariadb, payments, bodies, received)
    assert ready_count(amqp_url, f"{amqp_queue}.dlq") == 0


def test_lost_rows_whose_ids_went_to_other_deliveries_are_restored_beside_them_and_all_applied_once(
    mariadb, amqp_url, amqp_queue, tmp_path
):
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=2, PUBLISH_BATCH_MAX="1")
        lost_payments, lost_bodies = _acknowledged(port, mariadb, N)
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == N, timeout=20, message="first deliveries published")
        lost_rows = callback_rows(mariadb)
        received = {bytes(r.callback_data): r.create_time for r in lost_rows}
        _lose_rows(mariadb, reuse_ids=True)

        later_payments, later_bodies = _acknowledged(port, mariadb, N)
        later_rows = callback_rows(mariadb)
        assert sorted(r.id for r in later_rows) == sorted(r.id for r in lost_rows), "the ids were handed out again"
        received.update({bytes(r.callback_data): r.create_time for r in later_rows})
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == 2 * N, timeout=20, message="all published")
        for message in [json.loads(delivery_message(r)) for r in lost_rows]:
            assert message["log_id"] in {r.id for r in later_rows}, "each lost delivery's message names a reused id"

        consumer = stack.start("consumer")
        everyone = lost_payments + later_payments
        wait_until(
            lambda: all(payment_status(mariadb, p) == "Succeeded" for p in everyone), timeout=30, message="applied"
        )
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == 0, timeout=20, message="queue drained")
        assert consumer.stop() == 0
    assert consumer.output().count("restored from its message") == N
    _check_every_delivery_back_once(mariadb, everyone, lost_bodies + later_bodies, received)
