"""A dead database or a dead broker, made with a cuttable TCP proxy in front of the real servers.

The shared MariaDB and RabbitMQ are never stopped: the gateway (and consumer)
reach them through ``tests.support.TcpProxy``, and ``cut()`` makes the path
behave like a stopped server (connections dropped, new ones refused).
"""

from __future__ import annotations

import time

import pytest

from payments.states import CallbackStatus
from tests.stack import (
    Stack,
    callback_rows,
    db_url,
    effect_counts,
    median_ms,
    payment_status,
    post,
    url_via,
    worker_pids,
)
from tests.support import create_payment, sandbox_event, signed, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.slow]


def test_database_unreachable_answers_503_stores_nothing_and_the_same_delivery_is_accepted_after(mariadb, tmp_path):
    with Stack(tmp_path) as stack:
        proxy = stack.proxy(db_url(mariadb))
        # One worker, so every request below lands on the same process and the same connection pool;
        # no inline processing, so the stored row is seen exactly as the gateway stored it.
        web, port = stack.start_web(
            workers=1, DATABASE_URL=url_via(db_url(mariadb), proxy.port), CALLBACK_PROCESS_INLINE="false"
        )
        assert post(port, *signed(sandbox_event(create_payment(mariadb)))).status_code == 200
        workers_before = worker_pids(web.popen.pid)

        payment_id = create_payment(mariadb)
        body, headers = signed(sandbox_event(payment_id))
        proxy.cut()
        started = time.perf_counter()
        answer = post(port, body, headers)
        elapsed = time.perf_counter() - started
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "storage_unavailable"
        assert answer.headers["Retry-After"]
        assert elapsed < 5, f"a dead database must turn into a quick 503, took {elapsed:.1f} s"
        ready = post_get(port, "/readyz")
        assert ready.status_code == 503 and ready.json()["database"] == "unreachable"
        assert len(callback_rows(mariadb)) == 1  # nothing of the refused delivery

        proxy.restore()
        answer = post(port, body, headers)  # the provider retries the very same delivery
        assert answer.status_code == 200, answer.text
        rows = callback_rows(mariadb)
        assert len(rows) == 2
        assert bytes(rows[-1].callback_data) == body and rows[-1].status == CallbackStatus.PENDING

        # Kill the worker's pooled connection behind its back; the next request must still succeed on the
        # first try (no ping before use: the dead connection fails once and the INSERT runs on a fresh one).
        proxy.cut()
        proxy.restore()
        second = signed(sandbox_event(create_payment(mariadb)))
        assert post(port, *second).status_code == 200
        assert worker_pids(web.popen.pid) == workers_before, "the gunicorn worker must survive the outage"
        assert web.popen.poll() is None
        print(f"\n[db outage] 503 answered in {elapsed * 1000:.0f} ms while the database was cut")


def post_get(port: int, path: str):  # noqa: ANN201
    import requests

    return requests.get(f"http://127.0.0.1:{port}{path}", timeout=10)


@pytest.mark.rabbitmq
def test_broker_down_callbacks_are_acknowledged_and_swept_and_the_consumer_resumes(
    mariadb, amqp_url, amqp_queue, tmp_path
):
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), AMQP_QUEUE=amqp_queue) as stack:
        proxy = stack.proxy(amqp_url)
        via = url_via(amqp_url, proxy.port)
        web, port = stack.start_web(workers=1, AMQP_URL=via)
        consumer = stack.start("consumer", AMQP_URL=via)
        wait_until(lambda: "consuming" in consumer.output(), timeout=20, message="consumer connected")

        # Broker up: the fast path alone applies the callback (no compensator runs in this test but the one below).
        first = create_payment(mariadb)
        assert post(port, *signed(sandbox_event(first))).status_code == 200
        wait_until(lambda: payment_status(mariadb, first) == "Succeeded", timeout=15, message="consumer applies")

        # Broker cut: every delivery is still acknowledged, quickly.
        proxy.cut()
        during = [create_payment(mariadb) for _ in range(8)]
        latencies = []
        for payment_id in during:
            started = time.perf_counter()
            assert post(port, *signed(sandbox_event(payment_id))).status_code == 200
            latencies.append(time.perf_counter() - started)
        assert max(latencies) < 1.0, f"ack latency must stay bounded with the broker cut: {latencies}"
        assert all(payment_status(mariadb, p) == "Pending" for p in during)
        assert sum(r.status == CallbackStatus.PENDING for r in callback_rows(mariadb)) == len(during)

        # The compensator alone converges them (the broker is still cut for it too).
        sweep = stack.run("-m", "compensator", "compensate", "--once", AMQP_URL=via, COMPENSATOR_GRACE_SECONDS="0")
        assert sweep.returncode == 0, sweep.stderr
        assert sweep.stdout.strip() == f"compensate_callbacks: {len(during)}"
        assert all(payment_status(mariadb, p) == "Succeeded" for p in during)

        # Broker back: the consumer reconnects by itself and the fast path works again.
        proxy.restore()
        wait_until(lambda: consumer.output().count("consuming") >= 2, timeout=40, message="consumer reconnects")
        resumed = None
        for _ in range(10):  # the gateway's publisher may still be backing off for a moment: those rows wait
            payment_id = create_payment(mariadb)
            assert post(port, *signed(sandbox_event(payment_id))).status_code == 200
            try:
                wait_until(lambda p=payment_id: payment_status(mariadb, p) == "Succeeded", timeout=3)
                resumed = payment_id
                break
            except AssertionError:
                continue
        assert resumed, "the consumer never resumed after the broker came back"
        after = [create_payment(mariadb) for _ in range(3)]
        for payment_id in after:
            assert post(port, *signed(sandbox_event(payment_id))).status_code == 200
        wait_until(
            lambda: all(payment_status(mariadb, p) == "Succeeded" for p in after), timeout=10, message="fast path"
        )
        assert consumer.popen.poll() is None and web.popen.poll() is None

        # Whatever the publisher dropped while backing off is the sweep's, and nothing is applied twice.
        stack.run("-m", "compensator", "compensate", "--once", COMPENSATOR_GRACE_SECONDS="0")
        assert {r.status for r in callback_rows(mariadb)} == {CallbackStatus.PROCESSED}
        rows = len(callback_rows(mariadb))
        assert effect_counts(mariadb) == {"ledger_events": rows, "processed_events": rows}
        print(
            f"\n[broker outage] ack latency with the broker cut: median {median_ms(latencies):.1f} ms, "
            f"max {max(latencies) * 1000:.1f} ms"
        )
