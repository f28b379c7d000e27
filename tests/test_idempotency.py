"""payments.outbound.idempotency.run against real MariaDB: one transaction per request, and a key in use is never worked
twice.

The key is claimed in the transaction that does the work: a second request
with the same key waits for the first to commit and gets its answer; a
first request whose work fails leaves nothing behind, and the second then
does the work itself.
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import event, func, select

from payments.infra.schema import idempotency_request
from payments.outbound import idempotency
from payments.outbound.idempotency import Answer, IdempotencyConflict, Stored

pytestmark = pytest.mark.mariadb


def run(engine, work, key="key-1", digest="d1", then=None):
    return idempotency.run(engine, scope="payments", key=key, digest=digest, lock_seconds=30, work=work, then=then)


def keys(engine) -> list[tuple[str, str]]:
    with engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(select(idempotency_request.c.idempotency_key, idempotency_request.c.status))
        ]


def test_a_request_claims_works_and_stores_its_answer_in_one_transaction(mariadb):
    commits = []

    def on_commit(conn):
        commits.append(1)

    event.listen(mariadb, "commit", on_commit)
    try:
        answer = run(mariadb, lambda conn: Stored(201, '{"n":1}', "pay_1"))
    finally:
        event.remove(mariadb, "commit", on_commit)
    assert answer == Answer(201, '{"n":1}')
    assert len(commits) == 1
    assert keys(mariadb) == [("key-1", "done")]
    assert run(mariadb, lambda conn: pytest.fail("worked twice")) == Answer(201, '{"n":1}', replayed=True)


def test_the_same_key_while_the_first_is_in_its_transaction_waits_and_gets_the_first_answer(mariadb):
    inside, release = threading.Event(), threading.Event()
    worked = []

    def slow(conn):
        worked.append("first")
        inside.set()
        release.wait(5)
        return Stored(201, '{"first":true}', "pay_1")

    first = threading.Thread(target=run, args=(mariadb, slow))
    first.start()
    assert inside.wait(5)
    answers = []
    second = threading.Thread(target=lambda: answers.append(run(mariadb, lambda conn: worked.append("second"))))
    second.start()
    time.sleep(0.3)
    assert answers == [], "the second request waits while the first holds the key"
    release.set()
    first.join(5)
    second.join(5)
    assert answers == [Answer(201, '{"first":true}', replayed=True)]
    assert worked == ["first"]


def test_a_first_request_whose_work_fails_leaves_the_key_free_for_the_one_waiting(mariadb):
    inside, release = threading.Event(), threading.Event()

    def failing(conn):
        conn.execute(idempotency_request.update().values(updated_at=func.now()))  # writes something, rolled back
        inside.set()
        release.wait(5)
        raise IdempotencyConflict("this refund is more than is left", "amount_exceeds_refundable", 422)

    errors = []

    def first_request():
        try:
            run(mariadb, failing)
        except IdempotencyConflict as exc:
            errors.append(exc.code)

    first = threading.Thread(target=first_request)
    first.start()
    assert inside.wait(5)
    answers = []
    second = threading.Thread(target=lambda: answers.append(run(mariadb, lambda conn: Stored(201, "{}", "pay_2"))))
    second.start()
    time.sleep(0.2)
    release.set()
    first.join(5)
    second.join(5)
    assert errors == ["amount_exceeds_refundable"]
    assert answers == [Answer(201, "{}")], "the second request did the work itself"
    assert keys(mariadb) == [("key-1", "done")]


def test_the_same_key_with_another_request_is_422_and_writes_nothing(mariadb):
    run(mariadb, lambda conn: Stored(201, "{}", "pay_1"))
    with pytest.raises(IdempotencyConflict) as refused:
        run(mariadb, lambda conn: pytest.fail("worked"), digest="another")
    assert refused.value.http_status == 422
    assert keys(mariadb) == [("key-1", "done")]


def test_with_then_the_key_stays_in_flight_until_the_final_answer_is_stored(mariadb):
    during = []

    def then(stored):
        with pytest.raises(IdempotencyConflict) as busy:
            run(mariadb, lambda conn: pytest.fail("worked twice"))
        during.append(busy.value.http_status)
        return Stored(201, '{"final":true}', stored.payment_id)

    answer = run(mariadb, lambda conn: Stored(201, '{"work":true}', "pay_1"), then=then)
    assert answer == Answer(201, '{"final":true}')
    assert during == [409]
    assert run(mariadb, lambda conn: pytest.fail("worked")) == Answer(201, '{"final":true}', replayed=True)
