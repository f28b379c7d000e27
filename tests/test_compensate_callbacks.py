"""The callback sweep (``compensate_callbacks``): grace period, due times, give-up, and compensators in parallel."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select

from compensator import compensate_callbacks
from payments.inbound.callbacks import store_callback
from payments.infra.db import utcnow
from payments.infra.schema import (
    alert,
    ledger_entry,
    ledger_event,
    manual_review,
    payment,
    payment_callback_log,
    processed_event,
)
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import callback_rows, db_url, status_counts
from tests.support import ROOT, create_payment, env_for, make_settings, sandbox_event, signed, wait_until


def _runtime(engine, **overrides):  # noqa: ANN001, ANN202
    return build_runtime(make_settings(database_url=db_url(engine), **overrides), engine=engine)


def _store(engine, payment_id: str, **event) -> int:  # noqa: ANN001
    body, headers = signed(sandbox_event(payment_id, **event))
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def test_the_sweep_no_ops_on_an_empty_database(engine):
    assert compensate_callbacks.run_once(_runtime(engine)) == 0


def test_without_a_broker_the_sweep_takes_fresh_rows_at_once(engine):
    payment_id = create_payment(engine)
    _store(engine, payment_id)
    assert compensate_callbacks.run_once(_runtime(engine, compensator_grace_seconds=60)) == 1
    assert status_counts(engine) == {CallbackStatus.PROCESSED: 1}


def test_with_a_broker_the_sweep_leaves_rows_younger_than_the_grace_period_to_the_consumer(engine):
    an_hour_ago = utcnow() - timedelta(hours=1)
    old_body, old_headers = signed(sandbox_event(create_payment(engine)), timestamp=int(time.time()) - 3600)
    store_callback(
        engine, provider="sandbox", body=old_body, headers=old_headers, remote_addr="127.0.0.1", now=an_hour_ago
    )
    fresh_id = _store(engine, create_payment(engine))
    # The broker URL is never dialled by the sweep; it only tells it that a consumer exists.
    runtime = _runtime(engine, amqp_url="amqp://guest:guest@127.0.0.1:1/%2F", compensator_grace_seconds=60)
    assert compensate_callbacks.run_once(runtime) == 1, "only the row the consumer left alone for an hour"
    assert {r.id: r.status for r in callback_rows(engine)} == {
        fresh_id - 1: CallbackStatus.PROCESSED,
        fresh_id: CallbackStatus.PENDING,
    }


def test_the_sweep_waits_for_next_retry_at_and_gives_up_after_max_retries(engine):
    # Backoff long enough that no machine is slow enough to reach it by itself; the test moves next_retry_at
    # into the past instead of sleeping, so "not due yet" is checked, not raced.
    runtime = _runtime(engine, compensator_max_retries=4, retry_base_seconds=60, retry_max_seconds=120)
    log_id = _store(engine, f"pay_{uuid.uuid4().hex[:20]}")  # an order that never commits
    assert compensate_callbacks.run_once(runtime) == 1
    (row,) = callback_rows(engine)
    assert (row.status, row.retry_count) == (CallbackStatus.FAILED, 1)
    sweeps = 1
    while callback_rows(engine)[0].status != CallbackStatus.GAVE_UP:
        assert callback_rows(engine)[0].next_retry_at > utcnow() + timedelta(seconds=20), "backed off"
        assert compensate_callbacks.run_once(runtime) == 0, "not due yet: next_retry_at is in the future"
        with engine.begin() as conn:
            conn.execute(
                payment_callback_log.update()
                .where(payment_callback_log.c.id == log_id)
                .values(next_retry_at=utcnow() - timedelta(seconds=1))
            )
        sweeps += compensate_callbacks.run_once(runtime)
        assert sweeps <= 4
    (row,) = callback_rows(engine)
    assert (sweeps, row.retry_count, row.status) == (4, 4, CallbackStatus.GAVE_UP)
    with engine.connect() as conn:
        assert conn.execute(select(manual_review.c.kind, manual_review.c.callback_log_id)).all() == [
            ("callback_gave_up", log_id)
        ]
        assert conn.execute(select(alert.c.rule, alert.c.status)).all() == [("callback_gave_up", "firing")]
    assert compensate_callbacks.run_once(runtime) == 0


def _backlog(engine, n: int) -> None:  # noqa: ANN001
    """``n`` pending payments, each with one signed success callback stored a minute ago, in bulk."""
    now = utcnow()
    past = now - timedelta(minutes=1)
    payments, callbacks = [], []
    for i in range(n):
        payment_id = f"pay_bulk{uuid.uuid4().hex[:16]}"
        amount = 100 + i
        body, headers = signed(sandbox_event(payment_id, amount=amount))
        payments.append(
            {
                "payment_id": payment_id,
                "order_no": f"order-{i}",
                "amount_minor": amount,
                "currency": "CNY",
                "provider": "sandbox",
                "status": "Pending",
                "idempotency_key": f"key-{payment_id}",
                "created_at": past,
                "updated_at": past,
            }
        )
        callbacks.append(
            {
                "provider": "sandbox",
                "callback_data": body,
                "headers": json.dumps(headers),
                "remote_addr": "127.0.0.1",
                "order_no": payment_id,
                "status": CallbackStatus.PENDING,
                "retry_count": 0,
                "next_retry_at": past,
                "create_time": past,
                "update_time": past,
            }
        )
    with engine.begin() as conn:
        conn.execute(insert(payment), payments)
        conn.execute(insert(payment_callback_log), callbacks)


def _claims_waiting(conn) -> int:  # noqa: ANN001
    """Sessions of this database whose statement now is a claim on payment_callback_log (waiting for its lock)."""
    return conn.exec_driver_sql(
        "SELECT COUNT(*) FROM information_schema.processlist"
        " WHERE db = DATABASE() AND id <> CONNECTION_ID()"
        " AND info LIKE '%%FROM payment_callback_log%%' AND info LIKE '%%SKIP LOCKED%%'"
    ).scalar()


@pytest.mark.mariadb
@pytest.mark.slow
def test_two_compensators_over_a_2000_row_backlog_process_every_row_exactly_once(mariadb):
    _backlog(mariadb, 2000)
    env = env_for(
        {
            "DATABASE_URL": db_url(mariadb),
            "AMQP_URL": "",
            "COMPENSATOR_GRACE_SECONDS": "0",
            "COMPENSATOR_BATCH_SIZE": "50",
            "COMPENSATOR_RATE_LIMIT": "100000",
            "LOG_LEVEL": "INFO",
        }
    )
    command = ["python", "-m", "compensator", "compensate", "--once"]
    started = time.perf_counter()
    # However late one process starts, both begin on the backlog together: the table is locked until both
    # are seen waiting on it with their first claim, so each first claim takes its own 50 rows.
    with mariadb.connect() as lock, mariadb.connect() as watch:
        lock.exec_driver_sql("LOCK TABLES payment_callback_log WRITE")
        procs = [
            subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        try:
            wait_until(
                lambda: _claims_waiting(watch) == 2 or any(p.poll() is not None for p in procs),
                timeout=120,
                interval=0.1,
                message="both compensators waiting on the locked table with their first claim",
            )
        finally:
            lock.exec_driver_sql("UNLOCK TABLES")
        outputs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.perf_counter() - started
    assert [p.returncode for p in procs] == [0, 0], outputs

    counts = [int(out.strip().rsplit(":", 1)[1]) for out, _ in outputs]
    assert sum(counts) == 2000 and min(counts) > 0, f"both compensators must share the backlog: {counts}"
    for _, err in outputs:
        swept = [json.loads(line) for line in err.splitlines() if '"swept ' in line]
        assert len(swept) == 1, err[-2000:]
        # A row taken twice would show up as "skipped" in the second taker's outcomes.
        assert set(swept[0]["outcomes"]) == {"applied"}, swept[0]["outcomes"]

    with mariadb.connect() as conn:
        assert status_counts(mariadb) == {CallbackStatus.PROCESSED: 2000}
        t = payment_callback_log
        assert conn.execute(select(func.count()).where(t.c.retry_count > 0)).scalar() == 0
        assert conn.execute(select(func.count()).where(t.c.result.not_like("applied:%"))).scalar() == 0
        assert conn.execute(select(func.count()).select_from(processed_event)).scalar() == 2000
        assert conn.execute(select(func.count()).select_from(ledger_event)).scalar() == 2000
        assert conn.execute(select(func.count(func.distinct(ledger_event.c.payment_id)))).scalar() == 2000
        assert conn.execute(select(func.count()).where(payment.c.status != "Succeeded")).scalar() == 0
        assert conn.execute(select(func.sum(ledger_entry.c.amount_minor))).scalar() == 0
    print(
        f"\n[two compensators] 2000 rows in {elapsed:.2f} s ({2000 / elapsed:.0f} rows/s incl. start-up), "
        f"split {counts}"
    )


def test_a_rate_limited_sweep_stays_under_its_rate(engine):
    ids = [create_payment(engine) for _ in range(6)]
    for payment_id in ids:
        _store(engine, payment_id)
    runtime = _runtime(engine)
    runtime = replace(runtime, settings=replace(runtime.settings, compensator_rate_limit=10.0))
    started = time.perf_counter()
    assert compensate_callbacks.run_once(runtime) == 6
    # burst of 1 token at 10/s: the 5 rows after the first wait ~0.1 s each
    assert time.perf_counter() - started >= 0.45


def test_a_batch_lease_outlasts_working_through_the_batch_at_the_rate_limit():
    from compensator.compensate_callbacks import lease_seconds

    settings = make_settings(compensator_batch_size=100)
    assert lease_seconds(replace(settings, compensator_rate_limit=1000)) == settings.compensator_lease_seconds == 120
    assert lease_seconds(replace(settings, compensator_rate_limit=0.5)) >= 100 / 0.5  # 200 s must not outlive 120 s
