"""Escalation: review.escalate (one review and one alert per kind and subject) and alerts.observe, concurrently too."""

from __future__ import annotations

import threading
from datetime import timedelta

from sqlalchemy import select

from payments.escalation import alerts, review
from payments.infra.db import utcnow
from payments.infra.schema import alert, manual_review
from payments.states import AlertStatus, ReviewStatus


def _reviews(engine):
    with engine.connect() as conn:
        return conn.execute(select(manual_review).order_by(manual_review.c.id)).mappings().all()


def _alerts(engine):
    with engine.connect() as conn:
        return conn.execute(select(alert).order_by(alert.c.id)).mappings().all()


def _escalate(conn, n: int, subject: str = "payment:pay_1", **more):
    return review.escalate(
        conn,
        kind="conflicting_report",
        subject=subject,
        reason=f"answer number {n} conflicts",
        now=utcnow(),
        severity="critical",
        payment_id="pay_1",
        details={"n": n},
        **more,
    )


def test_a_subject_escalated_again_updates_its_open_review_and_raises_no_second_alert(engine):
    told: list[dict] = []
    for n in range(1, 4):
        with engine.begin() as conn:
            done = _escalate(conn, n)
            alerts.deliver(conn, utcnow(), [told.append])
        assert done.first == (n == 1)
    (row,) = _reviews(engine)
    assert (row["kind"], row["subject"], row["status"], row["occurrences"]) == (
        "conflicting_report",
        "payment:pay_1",
        ReviewStatus.OPEN,
        3,
    )
    assert row["reason"] == "answer number 3 conflicts" and '"n": 3' in row["details"]
    assert row["last_seen_at"] >= row["created_at"]
    (fired,) = _alerts(engine)
    assert (fired["rule"], fired["dedupe_key"], fired["severity"]) == (
        "conflicting_report",
        "conflicting_report:payment:pay_1",
        "critical",
    )
    assert [t["rule"] for t in told] == ["conflicting_report"], "the channels are told once"


def test_another_subject_or_kind_gets_its_own_review(engine):
    with engine.begin() as conn:
        _escalate(conn, 1)
        _escalate(conn, 1, subject="payment:pay_2")
        review.escalate(conn, kind="unresolved_payment", subject="payment:pay_1", reason="late", now=utcnow())
    assert len(_reviews(engine)) == 3
    assert len(_alerts(engine)) == 3


def test_a_resolved_review_frees_its_subject_for_a_fresh_one(engine):
    with engine.begin() as conn:
        first = _escalate(conn, 1)
        assert review.resolve(conn, first.review_id, resolution="refunded by hand", resolved_by="ops", now=utcnow())
        assert not review.resolve(conn, first.review_id, resolution="again", resolved_by="ops", now=utcnow())
        second = _escalate(conn, 2)
    assert second.first and second.review_id != first.review_id
    old, new = _reviews(engine)
    assert (old["status"], old["open_key"], old["resolved_by"]) == (ReviewStatus.RESOLVED, None, "ops")
    assert (new["status"], new["occurrences"]) == (ReviewStatus.OPEN, 1)


def test_concurrent_escalations_of_one_subject_make_one_review_without_deadlocks(mariadb):
    errors: list[BaseException] = []
    with mariadb.begin() as conn:
        _escalate(conn, 0)  # the row exists: the case where INSERT IGNORE + UPDATE deadlocked
    start = threading.Barrier(8)

    def escalate(n: int) -> None:
        try:
            start.wait(10)
            with mariadb.begin() as conn:
                _escalate(conn, n)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=escalate, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    (row,) = _reviews(mariadb)
    assert row["occurrences"] == 9
    assert len(_alerts(mariadb)) == 1


def test_concurrent_observations_of_one_alert_key_do_not_deadlock(mariadb):
    errors: list[BaseException] = []
    t0 = utcnow()
    with mariadb.begin() as conn:
        alerts.observe(conn, rule="r", key="r:1", message="seen", now=t0, sustain_seconds=60)
    start = threading.Barrier(8)

    def observe(n: int) -> None:
        try:
            start.wait(10)
            with mariadb.begin() as conn:
                later = t0 + timedelta(seconds=n)
                alerts.observe(conn, rule="r", key="r:1", message=f"seen {n}", now=later, sustain_seconds=60)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    threads = [threading.Thread(target=observe, args=(n,)) for n in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    (row,) = _alerts(mariadb)
    assert row["status"] == AlertStatus.PENDING and row["first_seen_at"] == t0


def test_a_pending_alert_fires_once_its_condition_has_held_for_the_sustain_time(engine):
    t0 = utcnow().replace(microsecond=0)
    statuses = []
    for seconds in (0, 30, 60, 90):
        with engine.begin() as conn:
            statuses.append(
                alerts.observe(
                    conn, rule="r", key="r:1", message="m", now=t0 + timedelta(seconds=seconds), sustain_seconds=60
                )
            )
    assert statuses == [AlertStatus.PENDING, AlertStatus.PENDING, AlertStatus.FIRING, AlertStatus.FIRING]
    (row,) = _alerts(engine)
    assert row["fired_at"] == t0 + timedelta(seconds=60) and row["last_seen_at"] == t0 + timedelta(seconds=90)
