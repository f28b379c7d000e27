"""docs/design.md section 4, inbound side: one test (or more) per invariant, each able to fail if it is broken.

Invariants 5 and 6 (Unknown is never Failed; one business number and key per
payment) belong to the outbound path and are tested there.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import DBAPIError

from broker.publisher import CallbackPublisher
from compensator.ratelimit import RateLimiter
from gateway import create_app
from payments.inbound.callbacks import CallbackResult, process_callback, store_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.db import make_engine, utcnow
from payments.infra.schema import alert, ledger_entry, ledger_event, manual_review, payment, payment_callback_log
from payments.money import ledger
from payments.providers import build_providers
from payments.states import CallbackStatus
from tests.stack import Stack, callback_rows, db_url, effect_counts, post, ready_count, url_via
from tests.support import SECRET, TcpProxy, create_payment, make_settings, sandbox_event, signed, wait_until

PROVIDERS = build_providers(make_settings())


def _client(engine, publisher=None):  # noqa: ANN001, ANN202
    # Not processed inline: these tests look at each row exactly as the gateway stored it.
    settings = make_settings(database_url=db_url(engine), callback_process_inline=False)
    return create_app(settings, engine=engine, publisher=publisher).test_client()


def _store(engine, event, **sign) -> int:  # noqa: ANN001
    body, headers = signed(event, **sign)
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def _payment_row(engine, payment_id: str):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return conn.execute(select(payment).where(payment.c.payment_id == payment_id)).one()


# --- 1. acknowledge only after commit ------------------------------------------------------------------------


@pytest.mark.mariadb
@pytest.mark.rabbitmq
def test_inv1_with_the_database_cut_the_answer_is_503_and_nothing_is_stored_or_published(mariadb, amqp_url, amqp_queue):
    proxy = TcpProxy("127.0.0.1", mariadb.url.port or 3306)
    proxied = make_engine(url_via(db_url(mariadb), proxy.port))
    publisher = CallbackPublisher(amqp_url, amqp_queue, timeout=0.5)
    try:
        client = _client(proxied, publisher)
        body, headers = signed(sandbox_event(create_payment(mariadb)))
        proxy.cut()
        answer = client.post("/callbacks/sandbox", data=body, headers=headers)
        assert answer.status_code == 503
        assert answer.get_json()["error"]["code"] == "storage_unavailable"
        assert publisher.flush(5)
        assert ready_count(amqp_url, amqp_queue) == 0, "nothing may be published for an uncommitted row"
        assert callback_rows(mariadb) == []

        proxy.restore()
        assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
        assert publisher.flush(5)
        # Same gateway, same publisher, database back: stored and published, so the 0 above meant something.
        assert len(callback_rows(mariadb)) == 1
        wait_until(lambda: ready_count(amqp_url, amqp_queue) == 1, timeout=5, message="published")
    finally:
        publisher.close()
        proxied.dispose()
        proxy.close()


def test_inv1_every_acknowledged_delivery_is_already_committed(engine):
    client = _client(engine)
    other = make_engine(db_url(engine))  # another pool: sees only committed rows
    try:
        for _ in range(10):
            body, headers = signed(sandbox_event(create_payment(engine)))
            assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
            with other.connect() as conn:
                stored = conn.execute(select(func.count()).where(payment_callback_log.c.callback_data == body)).scalar()
            assert stored == 1
    finally:
        other.dispose()


# --- 2. no callback is lost ----------------------------------------------------------------------------------


def test_inv2_every_delivery_that_reached_the_gateway_is_kept_byte_for_byte(engine):
    client = _client(engine)
    payment_id = create_payment(engine)
    float_event = sandbox_event(payment_id)
    float_event["data"]["amount"] = 10.5
    good_body, good_headers = signed(sandbox_event(payment_id))
    deliveries = [
        (good_body, good_headers),
        (good_body, good_headers),  # a provider retry of the same delivery is kept too
        signed(sandbox_event(payment_id), secret="whsec_wrong"),
        (json.dumps(sandbox_event(payment_id)).encode(), {}),
        signed(sandbox_event(payment_id), timestamp=int(time.time()) - 3600),
        (good_body.replace(b"1000", b"1001"), good_headers),
        signed(b"\xff\xfe not even utf-8"),
        signed(b""),
        signed(b"[]"),
        signed(float_event),
        signed(sandbox_event(f"pay_{uuid.uuid4().hex[:20]}")),  # unknown payment: stored, retried later
    ]
    for body, headers in deliveries:
        client.post("/callbacks/sandbox", data=body, headers=headers)
    rows = callback_rows(engine)
    assert [bytes(r.callback_data) for r in rows] == [body for body, _ in deliveries]
    assert all(r.status in (CallbackStatus.PENDING, CallbackStatus.REJECTED) for r in rows)


def test_inv2_a_forged_row_left_pending_is_rejected_by_processing_not_retried_forever(engine):
    # If the gateway could not mark a bad signature as rejected, the row stays 0 and the sweep rejects it.
    log_id = _store(engine, sandbox_event(create_payment(engine)), secret="whsec_wrong")
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.REJECTED
    (row,) = callback_rows(engine)
    assert (row.status, row.retry_count) == (CallbackStatus.REJECTED, 0)
    assert row.result.startswith("rejected: invalid_signature")


# --- 3. idempotent processing --------------------------------------------------------------------------------


@pytest.mark.mariadb
def test_inv3_concurrent_workers_on_duplicate_rows_and_on_one_row_apply_the_effect_once(mariadb):
    payment_id = create_payment(mariadb)
    event = sandbox_event(payment_id)
    ids = [_store(mariadb, event) for _ in range(8)]
    work = ids + ids[:4]  # 8 duplicate deliveries, 4 of them also processed twice at the same moment
    barrier = threading.Barrier(len(work))
    outcomes: list[CallbackResult] = []

    def worker(log_id: int) -> None:
        barrier.wait()
        outcomes.append(process_callback(mariadb, PROVIDERS, log_id, RetryPolicy()))

    threads = [threading.Thread(target=worker, args=(i,)) for i in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == sorted(
        [CallbackResult.APPLIED] + [CallbackResult.DUPLICATE] * 7 + [CallbackResult.SKIPPED] * 4
    )
    assert effect_counts(mariadb, payment_id) == {"ledger_events": 1, "processed_events": 1}
    assert {r.status for r in callback_rows(mariadb)} == {CallbackStatus.PROCESSED}


def test_inv3_a_replay_under_a_new_event_id_does_not_apply_twice(engine):
    payment_id = create_payment(engine)
    first = _store(engine, sandbox_event(payment_id, provider_transaction_id="ch_same"))
    replay = _store(engine, sandbox_event(payment_id, provider_transaction_id="ch_same"))
    assert process_callback(engine, PROVIDERS, first, RetryPolicy()) == CallbackResult.APPLIED
    assert process_callback(engine, PROVIDERS, replay, RetryPolicy()) == CallbackResult.NOOP
    assert effect_counts(engine, payment_id)["ledger_events"] == 1


# --- 4. guarded updates; terminal states are never overwritten ------------------------------------------------


@pytest.mark.parametrize("terminal", ["Succeeded", "Failed"])
@pytest.mark.parametrize("event_type", ["charge.succeeded", "charge.failed"])
def test_inv4_no_report_overwrites_a_terminal_payment(engine, terminal, event_type):
    payment_id = create_payment(engine, status=terminal)
    before = _payment_row(engine, payment_id)
    log_id = _store(engine, sandbox_event(payment_id, event_type=event_type))
    outcome = process_callback(engine, PROVIDERS, log_id, RetryPolicy())
    assert _payment_row(engine, payment_id) == before
    contradicts = (terminal == "Succeeded") != (event_type == "charge.succeeded")
    assert outcome == (CallbackResult.CONFLICT if contradicts else CallbackResult.NOOP)
    with engine.connect() as conn:
        reviews = conn.execute(select(func.count()).select_from(manual_review)).scalar()
        alerts_open = conn.execute(select(func.count()).where(alert.c.rule == "conflicting_report")).scalar()
    assert (reviews, alerts_open) == ((1, 1) if contradicts else (0, 0))


@pytest.mark.mariadb
def test_inv4_a_status_committed_while_processing_waits_is_seen_and_not_overwritten(mariadb):
    payment_id = create_payment(mariadb)
    log_id = _store(mariadb, sandbox_event(payment_id))
    outcome: list[CallbackResult] = []
    with mariadb.connect() as other:
        other.execute(select(payment.c.id).where(payment.c.payment_id == payment_id).with_for_update())
        worker = threading.Thread(
            target=lambda: outcome.append(process_callback(mariadb, PROVIDERS, log_id, RetryPolicy()))
        )
        worker.start()
        with mariadb.connect() as peek:
            wait_until(
                lambda: peek.execute(
                    text("SELECT COUNT(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'")
                ).scalar(),
                timeout=10,
                interval=0.25,
                message="processing waits on the payment row",
            )
        # Another path (a query, an outbound call) decides first: the payment failed.
        other.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id, payment.c.status == "Pending")
            .values(status="Failed")
        )
        other.commit()
        worker.join(30)
    assert outcome == [CallbackResult.CONFLICT]
    assert _payment_row(mariadb, payment_id).status == "Failed"
    assert effect_counts(mariadb, payment_id)["ledger_events"] == 0


# --- 7. money is integers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("amount", [1000.0, 10.5, "1000", True, 0, -1000, None, 1e3])
def test_inv7_an_amount_that_is_not_a_positive_integer_is_rejected_as_malformed(engine, amount):
    client = _client(engine)
    payment_id = create_payment(engine)
    event = sandbox_event(payment_id)
    event["data"]["amount"] = amount
    body, headers = signed(event)
    answer = client.post("/callbacks/sandbox", data=body, headers=headers)
    assert answer.status_code == 400
    assert answer.get_json()["error"]["code"] == "malformed_callback"
    (row,) = callback_rows(engine)
    assert row.status == CallbackStatus.REJECTED
    assert _payment_row(engine, payment_id).status == "Pending"


def test_inv7_the_ledger_refuses_float_amounts(engine):
    with pytest.raises(ledger.UnbalancedEntries), engine.begin() as conn:
        ledger.append(
            conn,
            event_type="PaymentConfirmed",
            dedupe_key="float-test",
            amount_minor=10,
            currency="CNY",
            source_type="test",
            source_id=None,
            now=utcnow(),
            entries=[("a", 10.5), ("b", -10.5)],
        )
    assert effect_counts(engine)["ledger_events"] == 0


@pytest.mark.mariadb
def test_inv7_every_money_column_is_an_integer_type(mariadb):
    with mariadb.connect() as conn:
        types = conn.execute(
            text(
                "SELECT TABLE_NAME, COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS "
                "WHERE TABLE_SCHEMA = DATABASE() AND (COLUMN_NAME LIKE '%amount%' OR COLUMN_NAME LIKE '%fee%')"
            )
        ).all()
    assert types, "expected amount columns"
    assert {data_type for _, _, data_type in types} == {"bigint"}, types


# --- 8. the ledger is append-only and balanced -----------------------------------------------------------------


def _ledger_snapshot(engine):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return (
            conn.execute(select(ledger_event).order_by(ledger_event.c.id)).all(),
            conn.execute(select(ledger_entry).order_by(ledger_entry.c.id)).all(),
        )


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE ledger_event SET amount_minor = amount_minor + 1",
        "DELETE FROM ledger_event",
        "UPDATE ledger_entry SET amount_minor = 0",
        "DELETE FROM ledger_entry",
    ],
)
def test_inv8_the_database_refuses_to_update_or_delete_ledger_rows(engine, statement):
    for event_type in ("charge.succeeded", "charge.failed"):
        process_callback(
            engine,
            PROVIDERS,
            _store(engine, sandbox_event(create_payment(engine), event_type=event_type)),
            RetryPolicy(),
        )
    before = _ledger_snapshot(engine)
    assert len(before[0]) == 2 and len(before[1]) == 2
    with pytest.raises(DBAPIError, match="append-only"), engine.begin() as conn:
        conn.execute(text(statement))
    assert _ledger_snapshot(engine) == before


def test_inv8_every_ledger_event_balances_to_zero(engine):
    for i in range(5):
        event_type = "charge.failed" if i == 2 else "charge.succeeded"
        payment_id = create_payment(engine, amount=100 * (i + 1))
        log_id = _store(engine, sandbox_event(payment_id, amount=100 * (i + 1), event_type=event_type))
        assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.APPLIED
    with engine.connect() as conn:
        sums = conn.execute(
            select(ledger_entry.c.ledger_event_id, func.sum(ledger_entry.c.amount_minor)).group_by(
                ledger_entry.c.ledger_event_id
            )
        ).all()
    assert len(sums) == 4 and all(total == 0 for _, total in sums)
    with pytest.raises(ledger.UnbalancedEntries), engine.begin() as conn:
        ledger.append(
            conn,
            event_type="PaymentConfirmed",
            dedupe_key="unbalanced",
            amount_minor=10,
            currency="CNY",
            source_type="test",
            source_id=None,
            now=utcnow(),
            entries=[("a", 10), ("b", -9)],
        )


# --- 9. logs never hold secrets, signatures or card numbers -----------------------------------------------------

CARD = "4111111111111111"
CARD_SPACED = "4242 4242 4242 4242"


@pytest.mark.mariadb
@pytest.mark.rabbitmq
@pytest.mark.slow
def test_inv9_process_logs_never_contain_the_secret_a_signature_or_a_card_number(
    mariadb, amqp_url, amqp_queue, tmp_path
):
    fast_retries = {
        "COMPENSATOR_GRACE_SECONDS": "0",
        "COMPENSATOR_INTERVAL_SECONDS": "0.2",
        "COMPENSATOR_MAX_RETRIES": "2",
        "RETRY_BASE_SECONDS": "0.05",
        "RETRY_MAX_SECONDS": "0.1",
        "LOG_LEVEL": "DEBUG",
    }
    with Stack(
        tmp_path, DATABASE_URL=db_url(mariadb), AMQP_URL=amqp_url, AMQP_QUEUE=amqp_queue, **fast_retries
    ) as stack:
        _, port = stack.start_web(workers=2)
        stack.start("consumer")
        stack.start("compensator")
        good = create_payment(mariadb)
        failed = create_payment(mariadb, status="Failed")
        unknown_card = CARD  # a card number where our payment id should be: never found, retried, given up
        bodies = [
            signed(sandbox_event(good, description=f"card {CARD} / {CARD_SPACED}", card_number=CARD)),
            signed(sandbox_event(failed, card=CARD_SPACED)),  # conflicting report: manual review
            signed(sandbox_event(unknown_card, pan=CARD)),
            signed(sandbox_event(good, note=CARD), secret="whsec_wrong"),
            signed(sandbox_event(good, pan=CARD), timestamp=int(time.time()) - 900),
            signed(f'{{"id": "evt_x", "pan": "{CARD}", '.encode()),
            signed(sandbox_event(good, amount=10.5, pan=CARD)),
        ]
        signatures = [headers["Sandbox-Signature"] for _, headers in bodies]
        for body, headers in bodies:
            post(port, body, headers)
        wait_until(
            lambda: CallbackStatus.GAVE_UP in {r.status for r in callback_rows(mariadb)},
            timeout=30,
            message="the give-up",
        )
        wait_until(lambda: "gave up after" in stack.output(), timeout=30, message="the give-up line")
        output = stack.output()

    for expected in ("gave up after", "conflicting report", "rejected: invalid_signature", "not processed"):
        assert expected in output, f"the run was meant to log {expected!r}"
    assert SECRET not in output
    for signature in signatures:
        assert signature not in output
        assert signature.split("v1=")[1] not in output
    # Also across any spacing or dashes a formatter might put between the digits.
    digits_only = re.sub(r"(?<=\d)[ -](?=\d)", "", output)
    for card in (CARD, CARD_SPACED.replace(" ", "")):
        assert card not in digits_only, "a card number from a callback body reached the logs"


# --- 10. backoff with jitter, rate limits, give-up to the manual queue with an alert --------------------------------


def test_inv10_failed_callbacks_back_off_exponentially_with_jitter_then_give_up_with_review_and_alert(engine):
    policy = RetryPolicy(max_retries=5, base_seconds=1.0, max_seconds=60.0)
    now = datetime(2030, 6, 1)
    crowd = [_store(engine, sandbox_event(f"pay_{uuid.uuid4().hex[:20]}")) for _ in range(10)]
    for attempt in range(1, policy.max_retries):
        for log_id in crowd:
            assert process_callback(engine, PROVIDERS, log_id, policy, now=now) == CallbackResult.RETRY
        delays = [(r.next_retry_at - now).total_seconds() for r in callback_rows(engine)]
        ceiling = policy.base_seconds * 2 ** (attempt - 1)
        assert all(ceiling / 2 <= d <= ceiling for d in delays), (attempt, delays)
        assert len(set(delays)) > 1, "jitter: a crowd must not retry in lockstep"
        now += timedelta(seconds=ceiling)
    for log_id in crowd:
        assert process_callback(engine, PROVIDERS, log_id, policy, now=now) == CallbackResult.GAVE_UP
    assert {r.status for r in callback_rows(engine)} == {CallbackStatus.GAVE_UP}
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).where(manual_review.c.kind == "callback_gave_up")).scalar() == 10
        assert conn.execute(select(func.count()).where(alert.c.rule == "callback_gave_up")).scalar() == 10


def test_inv10_the_sweep_rate_limiter_bounds_rows_per_second():
    clock = [0.0]
    limiter = RateLimiter(5.0, clock=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s))
    for _ in range(21):
        limiter.acquire()
    assert clock[0] == pytest.approx(4.0, abs=0.01)  # 1 token of burst, then 5 per second
