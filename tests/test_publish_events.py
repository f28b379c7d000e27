"""publish_events: domain events from the outbox to RabbitMQ and to the merchant's signed webhook.

Real MariaDB (and SQLite), real RabbitMQ, and a real HTTP receiver thread that
verifies every Standard Webhooks signature and can be told to fail.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pika
import pytest
from sqlalchemy import func, select, update

from compensator import publish_events
from payments.inbound.callbacks import process_callback, store_callback
from payments.infra import webhook_signing
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import alert, event_delivery, manual_review
from payments.infra.schema import outbox as outbox_table
from payments.lifecycle import events, outbox
from payments.providers import build_providers
from payments.runtime import build_runtime
from payments.states import DeliveryStatus, OutboxStatus
from tests.support import ROOT, TcpProxy, create_payment, env_for, free_port, make_settings, sandbox_event, signed

WEBHOOK_SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


class Receiver:
    """The merchant's order service: a real HTTP server that verifies signatures and answers as told.

    ``answer(event_id, nth)`` gives the status for the nth (1-based) request
    carrying that event id; default 200. Every request is recorded.
    """

    def __init__(self, answer=None, delay: float = 0.0, retry_after: str | None = None) -> None:
        self.answer = answer or (lambda event_id, nth: 200)
        self.delay = delay
        self.retry_after = retry_after
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    event_id = webhook_signing.verify(WEBHOOK_SECRET, body, dict(self.headers.items()))
                    verified = True
                except Exception:
                    event_id, verified = self.headers.get("webhook-id"), False
                with receiver.lock:
                    nth = 1 + sum(1 for r in receiver.requests if r["event_id"] == event_id)
                    status = receiver.answer(event_id, nth) if verified else 401
                    receiver.requests.append(
                        {
                            "event_id": event_id,
                            "verified": verified,
                            "status": status,
                            "at": time.monotonic(),
                            "headers": dict(self.headers.items()),
                            "body": body,
                        }
                    )
                if receiver.delay:
                    time.sleep(receiver.delay)
                self.send_response(status)
                if receiver.retry_after and status >= 400:
                    self.send_header("Retry-After", receiver.retry_after)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/paysync"

    def delivered(self) -> Counter:
        """event id -> number of 2xx answers given for it."""
        with self.lock:
            return Counter(r["event_id"] for r in self.requests if 200 <= r["status"] < 300)

    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def exchange(amqp_url):
    """A topic exchange of this test's own (not the real paysync.events), deleted afterwards."""
    name = f"test_events_{uuid.uuid4().hex[:10]}"
    yield name
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    conn.channel().exchange_delete(name)
    conn.close()


def bind_queue(amqp_url: str, exchange: str, queue: str, binding: str = "#") -> None:
    """Declare the exchange as the relay does, and a queue of the test's own bound to it."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    ch.exchange_declare(exchange=exchange, exchange_type="topic", durable=True)
    ch.queue_declare(queue=queue, durable=True)
    ch.queue_bind(queue=queue, exchange=exchange, routing_key=binding)
    conn.close()


def drain(amqp_url: str, queue: str) -> list[tuple]:
    """Every message now in ``queue`` as (method, properties, body), acknowledged."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    out = []
    while True:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            break
        out.append((method, props, body))
    conn.close()
    return out


def runtime_for(engine, **overrides):
    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False), **overrides)
    return build_runtime(settings, engine=engine)


def webhook_settings(receiver: Receiver, **more) -> dict:
    return {"merchant_webhook_url": receiver.url, "merchant_webhook_secret": (WEBHOOK_SECRET,), **more}


def add_event(engine, event_type: str = "PaymentSucceeded", payment_id: str | None = None, now=None) -> str:
    """An outbox row exactly as transitions.apply_decision writes one."""
    payment_id = payment_id or f"pay_{uuid.uuid4().hex[:20]}"
    now = now or utcnow()
    with engine.begin() as conn:
        return outbox.enqueue(
            conn,
            event_type=event_type,
            aggregate_id=payment_id,
            now=now,
            payload={
                "type": event_type,
                "payment_id": payment_id,
                "refund_id": None,
                "order_no": f"order-{payment_id[-6:]}",
                "amount": 1000,
                "currency": "CNY",
                "status": "Succeeded",
                "provider": "sandbox",
                "provider_transaction_id": "ch_123",
                "failure_code": None,
                "source": "callback:1",
                "occurred_at": now.isoformat() + "Z",
            },
        )


def outbox_rows(engine) -> dict[str, dict]:
    with engine.connect() as conn:
        return {r["event_id"]: dict(r) for r in conn.execute(select(outbox_table)).mappings()}


def deliveries(engine) -> dict[tuple[str, str], dict]:
    with engine.connect() as conn:
        return {(r["event_id"], r["destination"]): dict(r) for r in conn.execute(select(event_delivery)).mappings()}


def run_until(runtime, predicate, timeout: float = 20.0) -> None:
    """Call run_once until ``predicate()`` holds (retries become due as time passes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "relay did not get there in time"
        publish_events.run_once(runtime)
        time.sleep(0.02)


def all_finished(engine) -> bool:
    with engine.connect() as conn:
        return not conn.execute(
            select(func.count()).where(
                outbox_table.c.status == OutboxStatus.PENDING,
                outbox_table.c.event_type.in_(sorted(events.DOMAIN_EVENT_TYPES)),
            )
        ).scalar()


# --- both databases, webhook destination ---------------------------------------------------------


def test_it_no_ops_on_an_empty_database(engine, receiver):
    assert publish_events.run_once(runtime_for(engine, **webhook_settings(receiver))) == 0
    assert receiver.count() == 0


def test_every_status_change_but_pending_announces_a_relayed_domain_event_and_no_command_is_one():
    from payments.states import PaymentStatus, StatusChange

    announced = set()
    for kind in ("payment", "refund"):
        for target in PaymentStatus:
            change = StatusChange(
                kind=kind,
                reference="ref_1",
                payment_id="pay_1",
                provider="sandbox",
                amount_minor=100,
                currency="CNY",
                previous=PaymentStatus.PENDING,
                target=target,
                path=(target,),
                source="call:1",
            )
            event = events.status_change_event(
                change, utcnow(), order_no=None, provider_reference=None, failure_code=None
            )
            if target in (PaymentStatus.CREATED, PaymentStatus.PENDING):
                assert event is None
            else:
                announced.add(event[0])
                assert event[1]["status"] == target.value and event[1]["type"] == event[0]
    assert announced == events.DOMAIN_EVENT_TYPES and len(announced) == 6
    assert not {"ChargeRequested", "RefundRequested"} & events.DOMAIN_EVENT_TYPES


def test_an_event_is_posted_signed_in_the_standard_webhooks_format_and_marked_done(engine, receiver):
    event_id = add_event(engine, "PaymentSucceeded", payment_id="pay_01TESTWEBHOOK")
    before = int(time.time())

    assert publish_events.run_once(runtime_for(engine, **webhook_settings(receiver))) == 1

    [req] = receiver.requests
    assert req["verified"] and req["status"] == 200
    headers = {k.lower(): v for k, v in req["headers"].items()}
    assert headers["webhook-id"] == event_id
    assert before <= int(headers["webhook-timestamp"]) <= int(time.time())
    assert headers["webhook-signature"] == webhook_signing.sign(
        WEBHOOK_SECRET, event_id, int(headers["webhook-timestamp"]), req["body"]
    )
    assert headers["content-type"] == "application/json"
    body = json.loads(req["body"])
    assert body["id"] == event_id and body["type"] == "PaymentSucceeded"
    assert body["data"]["payment_id"] == "pay_01TESTWEBHOOK"
    assert body["data"]["amount"] == 1000 and body["data"]["currency"] == "CNY"
    assert outbox_rows(engine)[event_id]["status"] == OutboxStatus.DONE
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["status"] == DeliveryStatus.DELIVERED and d["attempts"] == 0 and d["last_http_status"] == 200

    assert publish_events.run_once(runtime_for(engine, **webhook_settings(receiver))) == 0
    assert receiver.count() == 1


def test_a_failing_endpoint_is_retried_with_growing_backoff_until_it_answers_2xx(engine):
    receiver = Receiver(answer=lambda event_id, nth: 500 if nth <= 3 else 204)
    try:
        runtime = runtime_for(engine, retry_base_seconds=0.2, retry_max_seconds=5.0, **webhook_settings(receiver))
        event_id = add_event(engine)
        run_until(runtime, lambda: receiver.delivered()[event_id] == 1)
        times = [r["at"] for r in receiver.requests]
        assert [r["status"] for r in receiver.requests] == [500, 500, 500, 204]
    finally:
        receiver.close()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Equal jitter: delay n is in [d/2, d] with d = 0.2 * 2**(n-1): at least 0.1, 0.2, 0.4 s.
    for gap, floor in zip(gaps, (0.1, 0.2, 0.4), strict=True):
        assert gap >= floor - 0.02, gaps
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["status"] == DeliveryStatus.DELIVERED and d["attempts"] == 3
    assert outbox_rows(engine)[event_id]["status"] == OutboxStatus.DONE


def test_an_endpoint_that_never_succeeds_gives_up_into_manual_review_with_an_alert(engine):
    receiver = Receiver(answer=lambda event_id, nth: 503)
    try:
        runtime = runtime_for(engine, event_delivery_max_attempts=3, **webhook_settings(receiver))
        event_id = add_event(engine, payment_id="pay_01GIVEUP")
        run_until(runtime, lambda: outbox_rows(engine)[event_id]["status"] != OutboxStatus.PENDING)
        assert receiver.count() == 3
        publish_events.run_once(runtime)
        assert receiver.count() == 3  # nothing more once given up
    finally:
        receiver.close()
    assert outbox_rows(engine)[event_id]["status"] == OutboxStatus.DEAD
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["status"] == DeliveryStatus.GAVE_UP and d["attempts"] == 3 and "retries exhausted" in d["last_error"]
    with engine.connect() as conn:
        [review] = conn.execute(select(manual_review)).mappings().all()
        alerts = conn.execute(select(alert).where(alert.c.open_key.is_not(None))).mappings().all()
    assert review["kind"] == "event_delivery_gave_up" and review["payment_id"] == "pay_01GIVEUP"
    assert event_id in review["details"]
    assert {a["rule"] for a in alerts} >= {"event_delivery_gave_up", "event_delivery_failing"}


def test_410_gone_gives_up_at_once(engine):
    receiver = Receiver(answer=lambda event_id, nth: 410)
    try:
        runtime = runtime_for(engine, **webhook_settings(receiver))
        event_id = add_event(engine)
        publish_events.run_once(runtime)
        time.sleep(0.1)
        publish_events.run_once(runtime)
        assert receiver.count() == 1
    finally:
        receiver.close()
    assert outbox_rows(engine)[event_id]["status"] == OutboxStatus.DEAD
    assert "refused for good" in deliveries(engine)[(event_id, "webhook")]["last_error"]


def test_an_event_past_its_deadline_gives_up_on_its_next_failure(engine):
    receiver = Receiver(answer=lambda event_id, nth: 500)
    try:
        runtime = runtime_for(engine, event_delivery_deadline_seconds=3600, **webhook_settings(receiver))
        event_id = add_event(engine, now=utcnow() - timedelta(hours=2))
        publish_events.run_once(runtime)
        assert receiver.count() == 1
    finally:
        receiver.close()
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["status"] == DeliveryStatus.GAVE_UP and "deadline passed" in d["last_error"]


def test_a_timeout_and_a_retry_after_count_as_a_failed_attempt_that_waits(engine):
    slow = Receiver(delay=1.0)
    try:
        runtime = runtime_for(engine, merchant_webhook_timeout_seconds=0.2, **webhook_settings(slow))
        event_id = add_event(engine)
        publish_events.run_once(runtime)
    finally:
        slow.close()
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["status"] == DeliveryStatus.PENDING and d["attempts"] == 1 and d["last_error"] == "webhook ReadTimeout"

    busy = Receiver(answer=lambda event_id, nth: 429, retry_after="30")
    try:
        with engine.begin() as conn:  # due again now
            conn.execute(update(event_delivery).values(next_attempt_at=utcnow()))
            conn.execute(update(outbox_table).values(next_attempt_at=utcnow()))
        publish_events.run_once(runtime_for(engine, retry_max_seconds=60, **webhook_settings(busy)))
    finally:
        busy.close()
    d = deliveries(engine)[(event_id, "webhook")]
    assert d["attempts"] == 2 and d["last_http_status"] == 429
    assert d["next_attempt_at"] - d["updated_at"] >= timedelta(seconds=29.9)  # Retry-After beats the backoff
    assert outbox_rows(engine)[event_id]["next_attempt_at"] == d["next_attempt_at"]


def test_charge_and_refund_requests_are_left_untouched(engine, receiver):
    with engine.begin() as conn:
        commands = [
            outbox.enqueue(conn, event_type=t, aggregate_id="pay_x", payload={"payment_id": "pay_x"}, now=utcnow())
            for t in ("ChargeRequested", "RefundRequested")
        ]
    event_id = add_event(engine)
    before = outbox_rows(engine)

    publish_events.run_once(runtime_for(engine, **webhook_settings(receiver)))

    after = outbox_rows(engine)
    for command in commands:
        assert after[command] == before[command]
    assert set(receiver.delivered()) == {event_id}
    assert {key[0] for key in deliveries(engine)} == {event_id}


def test_with_no_destination_configured_events_are_marked_done_not_left_to_pile_up(engine):
    ids = [add_event(engine) for _ in range(3)]
    assert publish_events.run_once(runtime_for(engine)) == 3
    rows = outbox_rows(engine)
    assert {rows[i]["status"] for i in ids} == {OutboxStatus.DONE}
    assert deliveries(engine) == {}


def test_a_processed_callback_reaches_the_merchant_as_a_signed_webhook(engine, receiver):
    settings = make_settings()
    payment_id = create_payment(engine, amount=4321)
    body, headers = signed(sandbox_event(payment_id, amount=4321))
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    process_callback(engine, build_providers(settings), log_id, RetryPolicy())

    publish_events.run_once(runtime_for(engine, **webhook_settings(receiver)))

    [req] = receiver.requests
    event = json.loads(req["body"])
    assert req["verified"]
    assert event["type"] == "PaymentSucceeded"
    assert event["data"]["payment_id"] == payment_id and event["data"]["amount"] == 4321
    assert event["data"]["status"] == "Succeeded"


def test_a_relay_killed_after_delivering_delivers_again_with_the_same_event_id(mariadb, receiver):
    event_id = add_event(mariadb)
    env = env_for(
        {
            "DATABASE_URL": mariadb.url.render_as_string(hide_password=False),
            "MERCHANT_WEBHOOK_URL": receiver.url,
            "MERCHANT_WEBHOOK_SECRET": WEBHOOK_SECRET,
            "FAILPOINTS": "publish_events.after_deliver",
        }
    )
    cmd = [sys.executable, "-m", "compensator", "publish_events", "--once"]
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert killed.returncode == -9
    assert receiver.delivered()[event_id] == 1
    assert outbox_rows(mariadb)[event_id]["status"] == OutboxStatus.PENDING  # delivered, not recorded

    with mariadb.begin() as conn:  # the lease runs out
        conn.execute(update(outbox_table).values(next_attempt_at=utcnow()))
    env["FAILPOINTS"] = ""
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert receiver.delivered()[event_id] == 2  # at least once: the receiver dedupes on webhook-id
    assert outbox_rows(mariadb)[event_id]["status"] == OutboxStatus.DONE


# --- RabbitMQ ------------------------------------------------------------------------------------


def test_events_are_published_to_the_topic_exchange_routed_by_type_persistent_with_ids(
    mariadb, amqp_url, amqp_queue, exchange
):
    refunds_queue = f"{amqp_queue}.refunds"
    bind_queue(amqp_url, exchange, amqp_queue, "#")
    bind_queue(amqp_url, exchange, refunds_queue, "RefundSucceeded")
    try:
        ids = {add_event(mariadb, t): t for t in ("PaymentSucceeded", "PaymentFailed", "RefundSucceeded")}
        runtime = runtime_for(mariadb, amqp_url=amqp_url, events_exchange=exchange)
        assert publish_events.run_once(runtime) == 3

        messages = drain(amqp_url, amqp_queue)
        refunds = drain(amqp_url, refunds_queue)
    finally:
        drain(amqp_url, refunds_queue)
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        conn.channel().queue_delete(refunds_queue)
        conn.close()
    assert sorted(p.message_id for _, p, _ in messages) == sorted(ids)
    for method, props, body in messages:
        event = json.loads(body)
        assert method.routing_key == ids[props.message_id] == props.type == event["type"]
        assert event["id"] == props.message_id
        assert props.delivery_mode == 2
        assert props.content_type == "application/json"
    assert [json.loads(b)["type"] for _, _, b in refunds] == ["RefundSucceeded"]
    assert {r["status"] for r in outbox_rows(mariadb).values()} == {OutboxStatus.DONE}
    assert {d["status"] for d in deliveries(mariadb).values()} == {DeliveryStatus.DELIVERED}


def test_a_broker_outage_loses_no_event_and_resends_no_webhook(mariadb, amqp_url, amqp_queue, exchange, receiver):
    bind_queue(amqp_url, exchange, amqp_queue)
    host, port = pika.URLParameters(amqp_url).host, pika.URLParameters(amqp_url).port
    proxy = TcpProxy(host, port)
    proxied = amqp_url.replace(f"@{host}:{port}", f"@127.0.0.1:{proxy.port}")
    assert proxied != amqp_url
    try:
        runtime = runtime_for(mariadb, amqp_url=proxied, events_exchange=exchange, **webhook_settings(receiver))
        proxy.cut()
        ids = [add_event(mariadb) for _ in range(5)]
        publish_events.run_once(runtime)
        assert receiver.delivered() == Counter(dict.fromkeys(ids, 1))
        pending = deliveries(mariadb)
        assert {pending[(i, "amqp")]["status"] for i in ids} == {DeliveryStatus.PENDING}
        assert {pending[(i, "webhook")]["status"] for i in ids} == {DeliveryStatus.DELIVERED}

        time.sleep(0.1)  # past the backoff: the broker is tried again, still down
        publish_events.run_once(runtime)
        assert {deliveries(mariadb)[(i, "amqp")]["attempts"] for i in ids} == {2}
        assert receiver.count() == 5

        proxy.restore()
        run_until(runtime, lambda: all_finished(mariadb))
    finally:
        proxy.close()
    assert receiver.count() == 5
    assert sorted(p.message_id for _, p, _ in drain(amqp_url, amqp_queue)) == sorted(ids)
    assert {r["status"] for r in outbox_rows(mariadb).values()} == {OutboxStatus.DONE}


def test_a_failing_webhook_does_not_republish_to_the_broker(mariadb, amqp_url, amqp_queue, exchange):
    bind_queue(amqp_url, exchange, amqp_queue)
    receiver = Receiver(answer=lambda event_id, nth: 500 if nth <= 2 else 200)
    try:
        runtime = runtime_for(mariadb, amqp_url=amqp_url, events_exchange=exchange, **webhook_settings(receiver))
        ids = [add_event(mariadb) for _ in range(4)]
        run_until(runtime, lambda: all_finished(mariadb))
        assert receiver.count() == 12 and receiver.delivered() == Counter(dict.fromkeys(ids, 1))
    finally:
        receiver.close()
    assert Counter(p.message_id for _, p, _ in drain(amqp_url, amqp_queue)) == Counter(dict.fromkeys(ids, 1))


def test_concurrent_relays_deliver_every_event_exactly_once(mariadb, amqp_url, amqp_queue, exchange, receiver):
    bind_queue(amqp_url, exchange, amqp_queue)
    ids = [add_event(mariadb, "PaymentSucceeded" if i % 2 else "RefundFailed") for i in range(300)]
    # Small batches so the four relays really interleave on the same rows.
    runtime = runtime_for(
        mariadb, amqp_url=amqp_url, events_exchange=exchange, compensator_batch_size=10, **webhook_settings(receiver)
    )
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    deadline = time.monotonic() + 90

    def relay():
        try:
            start.wait()
            while not all_finished(mariadb):
                assert time.monotonic() < deadline, "relays did not finish"
                publish_events.run_once(runtime)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=relay) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert receiver.delivered() == Counter(dict.fromkeys(ids, 1))
    assert receiver.count() == 300
    published = Counter(p.message_id for _, p, _ in drain(amqp_url, amqp_queue))
    assert published == Counter(dict.fromkeys(ids, 1))


def test_a_pass_out_of_time_gives_its_undelivered_rows_back_at_once(engine):
    slow = Receiver(delay=0.2)
    try:
        ids = [add_event(engine) for _ in range(6)]
        publish_events.run_once(runtime_for(engine, **webhook_settings(slow)), max_seconds=0.3)
        delivered = set(slow.delivered())
    finally:
        slow.close()
    assert 0 < len(delivered) < 6
    rows = outbox_rows(engine)
    now = utcnow()
    for event_id in ids:
        if event_id in delivered:
            assert rows[event_id]["status"] == OutboxStatus.DONE
        else:  # not leased for EVENTS_LEASE_SECONDS any more: another relay may take it now
            assert rows[event_id]["status"] == OutboxStatus.PENDING and rows[event_id]["next_attempt_at"] <= now


def give_up_at_once(engine, event_ids: list[str]) -> None:
    """Claim these events and record a permanent refusal (410) for each: every one gives up."""
    claimed, _ = events.claim(engine, utcnow(), len(event_ids), [events.WEBHOOK], 120)
    assert sorted(ev.event_id for ev in claimed) == sorted(event_ids)
    passes = [
        (ev, [events.Attempt(events.WEBHOOK, ok=False, error="gone", http_status=410, permanent=True)])
        for ev in claimed
    ]
    events.record(engine, passes, utcnow(), RetryPolicy(), 86400, [events.WEBHOOK])


def test_every_event_delivery_give_up_notifies_not_only_the_first_per_destination(engine):
    from payments.escalation import alerts as alert_rows

    told: list[dict] = []
    for _ in range(3):
        give_up_at_once(engine, [add_event(engine)])
        with engine.begin() as conn:
            alert_rows.deliver(conn, utcnow(), [told.append])
    assert [a["rule"] for a in told] == ["event_delivery_gave_up"] * 3
    assert len({a["details"]["event_id"] for a in told}) == 3
    with engine.connect() as conn:
        assert conn.execute(select(manual_review.c.kind)).scalars().all() == ["event_delivery_gave_up"] * 3


def test_compensators_recording_give_ups_at_once_do_not_deadlock_on_the_alert_row(mariadb):
    give_up_at_once(mariadb, [add_event(mariadb)])  # the first give-up's alert row exists from here on
    errors: list[BaseException] = []
    gone = events.Attempt(events.WEBHOOK, ok=False, error="gone", http_status=410, permanent=True)
    for _ in range(5):
        for _ in range(6):
            add_event(mariadb)
        # One event each, claimed one after the other (concurrent claims may skip each other's rows).
        claims = [events.claim(mariadb, utcnow(), 1, [events.WEBHOOK], 120)[0] for _ in range(6)]
        assert [len(c) for c in claims] == [1] * 6
        start = threading.Barrier(len(claims))

        def record(claimed, start=start):
            try:
                start.wait(10)
                events.record(mariadb, [(claimed[0], [gone])], utcnow(), RetryPolicy(), 86400, [events.WEBHOOK])
            except BaseException as exc:  # noqa: BLE001 - collected and asserted on below
                errors.append(exc)

        threads = [threading.Thread(target=record, args=(c,)) for c in claims]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == []
    assert {r["status"] for r in outbox_rows(mariadb).values()} == {OutboxStatus.DEAD}
    with mariadb.connect() as conn:
        assert conn.execute(select(func.count()).select_from(manual_review)).scalar() == 31
