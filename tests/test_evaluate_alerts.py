"""``evaluate_alerts``: the seed's backlog and failure-rate rules as ops/alert_rules.toml ships them, moved through
time with ``run_once(now=…)``."""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select, update

from compensator import evaluate_alerts
from payments.infra.db import make_engine, utcnow
from payments.infra.locks import named_lock
from payments.infra.schema import alert, payment_callback_log
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import db_url
from tests.support import make_settings


def _runtime(engine, **overrides):  # noqa: ANN001, ANN202
    return build_runtime(make_settings(database_url=db_url(engine), **overrides), engine=engine)


def _rows(engine, statuses: list[int], at: datetime, retry_count: int = 0) -> list[int]:  # noqa: ANN001
    """Callback rows with these statuses, received at ``at``."""
    with engine.begin() as conn:
        conn.execute(
            insert(payment_callback_log),
            [
                {
                    "provider": "sandbox",
                    "callback_data": b"{}",
                    "headers": "{}",
                    "status": status,
                    "retry_count": retry_count,
                    "next_retry_at": at,
                    "create_time": at,
                    "update_time": at,
                }
                for status in statuses
            ],
        )
        return list(conn.execute(select(payment_callback_log.c.id).order_by(payment_callback_log.c.id)).scalars())


def _alerts(engine, rule: str):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return list(conn.execute(select(alert).where(alert.c.rule == rule).order_by(alert.c.id)))


def _firing_lines(caplog) -> list[str]:  # noqa: ANN001
    return [r.getMessage() for r in caplog.records if r.name == "paysync.alerts" and "alert firing" in r.getMessage()]


def test_evaluate_alerts_no_ops_on_an_empty_database(engine):
    assert evaluate_alerts.run_once(_runtime(engine)) == 0
    assert _alerts(engine, evaluate_alerts.BACKLOG_KEY) == []


def test_a_backlog_over_100_fires_after_5_minutes_once_dedupes_and_resolves(engine, caplog):
    caplog.set_level(logging.INFO)
    runtime = _runtime(engine)
    t0 = utcnow()
    ids = _rows(
        engine, [CallbackStatus.PENDING] * 100 + [CallbackStatus.FAILED], t0
    )  # 101 waiting (1 % failed: no failure-rate alert)

    assert evaluate_alerts.run_once(runtime, now=t0) == 0
    (pending,) = _alerts(engine, "callback_backlog")
    assert (pending.status, pending.first_seen_at) == ("pending", t0)
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=299)) == 0
    assert _firing_lines(caplog) == []

    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=300)) == 1
    (firing,) = _alerts(engine, "callback_backlog")
    fired_at = t0 + timedelta(seconds=300)
    assert (firing.status, firing.fired_at, firing.notified_at) == ("firing", fired_at, fired_at)
    assert "101 callbacks waiting" in firing.message
    assert len(_firing_lines(caplog)) == 1

    # Still over the threshold: the same alert, not a new one, and channels are not told again.
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=400)) == 1
    assert [a.id for a in _alerts(engine, "callback_backlog")] == [firing.id]
    assert len(_firing_lines(caplog)) == 1

    # Cleared: resolved, kept as history; a later backlog opens a fresh alert with a fresh clock.
    with engine.begin() as conn:
        conn.execute(
            update(payment_callback_log)
            .where(payment_callback_log.c.id.in_(ids[:2]))
            .values(status=CallbackStatus.PROCESSED)
        )
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=500)) == 0
    (resolved,) = _alerts(engine, "callback_backlog")
    assert (resolved.status, resolved.open_key, resolved.resolved_at) == (
        "resolved",
        None,
        t0 + timedelta(seconds=500),
    )
    _rows(engine, [CallbackStatus.PENDING] * 5, t0 + timedelta(seconds=550))
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=600)) == 0
    history = _alerts(engine, "callback_backlog")
    assert [a.status for a in history] == ["resolved", "pending"]
    assert history[1].first_seen_at == t0 + timedelta(seconds=600)


def test_a_backlog_that_dips_below_the_threshold_restarts_the_5_minute_clock(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    ids = _rows(engine, [CallbackStatus.PENDING] * 101, t0)
    evaluate_alerts.run_once(runtime, now=t0)
    with engine.begin() as conn:
        conn.execute(
            update(payment_callback_log)
            .where(payment_callback_log.c.id == ids[0])
            .values(status=CallbackStatus.PROCESSED)
        )
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=200))
    _rows(engine, [CallbackStatus.PENDING], t0)
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=250))
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=400)) == 0, "not 5 minutes continuously"
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=550)) == 1


@pytest.mark.parametrize(
    ("statuses", "fires"),
    [
        (
            [CallbackStatus.PROCESSED] * 37 + [CallbackStatus.REJECTED, CallbackStatus.FAILED, CallbackStatus.GAVE_UP],
            True,
        ),  # 7.5 %
        (
            [CallbackStatus.PROCESSED] * 38 + [CallbackStatus.REJECTED, CallbackStatus.FAILED],
            False,
        ),  # exactly 5 %: not above
        ([CallbackStatus.PROCESSED] * 10 + [CallbackStatus.REJECTED] * 9, False),  # 47 % but fewer than 20 callbacks
    ],
)
def test_the_failure_rate_rule_fires_above_5_percent_of_at_least_20_callbacks(engine, statuses, fires):
    runtime = _runtime(engine)
    t0 = utcnow()
    _rows(engine, statuses, t0)
    assert evaluate_alerts.run_once(runtime, now=t0) == int(fires)
    assert [a.status for a in _alerts(engine, "callback_failure_rate")] == (["firing"] if fires else [])


def test_a_row_that_needed_retries_counts_as_a_failure_even_once_processed(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    _rows(engine, [CallbackStatus.PROCESSED] * 37, t0)
    _rows(engine, [CallbackStatus.PROCESSED] * 3, t0, retry_count=2)
    assert evaluate_alerts.run_once(runtime, now=t0) == 1


def test_the_failure_rate_looks_at_the_last_10_minutes_only_and_resolves(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    _rows(engine, [CallbackStatus.PROCESSED] * 30 + [CallbackStatus.REJECTED] * 10, t0)
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=590)) == 1
    assert evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=601)) == 0
    assert [a.status for a in _alerts(engine, "callback_failure_rate")] == ["resolved"]


@pytest.mark.mariadb
def test_evaluators_running_at_once_neither_deadlock_nor_open_two_alerts(mariadb):
    runtime = _runtime(mariadb)
    t0 = utcnow()
    _rows(mariadb, [CallbackStatus.REJECTED] * 40 + [CallbackStatus.PENDING] * 101, t0)
    errors: list[BaseException] = []

    def evaluate(now: datetime, barrier: threading.Barrier) -> None:
        barrier.wait()
        try:
            evaluate_alerts.run_once(runtime, now=now)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    for round_ in range(6):  # several compensators' evaluate_alerts jobs firing at the same moment
        barrier = threading.Barrier(4)
        threads = [
            threading.Thread(target=evaluate, args=(t0 + timedelta(seconds=100 * round_), barrier)) for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    assert [a.status for a in _alerts(mariadb, "callback_failure_rate")] == ["firing"]
    assert [a.status for a in _alerts(mariadb, "callback_backlog")] == ["firing"]


@pytest.mark.mariadb
def test_an_evaluator_of_another_database_on_the_same_server_does_not_stop_ours(mariadb, tmp_path):
    from tests.conftest import _create_database

    rules = tmp_path / "rules.toml"
    rules.write_text("[rules.callback_backlog]\nthreshold = 100\nsustain_seconds = 0\n")

    other = make_engine(mariadb.url.set(database=f"{mariadb.url.database}_other").render_as_string(hide_password=False))
    try:
        other = _create_database(other)
        t0 = utcnow()
        _rows(mariadb, [CallbackStatus.PENDING] * 101, t0)
        with named_lock(other, evaluate_alerts.LOCK_NAME) as held:
            assert held, "the other database's evaluator is running"
            evaluate_alerts.run_once(_runtime(mariadb, alert_rules_file=str(rules)), now=t0)
        assert [a.status for a in _alerts(mariadb, "callback_backlog")] == ["firing"]
    finally:
        other.dispose()
