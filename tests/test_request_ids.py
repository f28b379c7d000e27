"""A request id travels from the gateway through the message to the consumer and the compensator log lines."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import delete, select

from compensator import compensate_callbacks
from consumer.handler import handle
from gateway import create_app
from payments.inbound.delivery import decode_message, encode_message, sign_document
from payments.infra.logs import _REQUEST_ID, REQUEST_ID, sane_request_id, scrub, setup_logging
from payments.infra.schema import payment_callback_log
from payments.runtime import build_runtime
from tests.stack import db_url, delivery_message
from tests.support import BROKER_KEY, create_payment, make_settings, sandbox_event, signed


@pytest.fixture
def json_logs():
    """Every process's JSON logging, into a buffer; the global logging state restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogRecordFactory())
    setup_logging("DEBUG", "test")
    buffer = io.StringIO()
    root.handlers[0].stream = buffer
    yield buffer
    root.handlers[:], _, factory = saved
    root.setLevel(saved[1])
    logging.setLogRecordFactory(factory)


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("raw", "kept"),
    [
        ("req-1", True),
        ("0af7651916cd43dd8448eb211c80319c", True),
        ("trace.id:42_a", True),
        ("a" * 64, True),
        ("a" * 65, False),
        ("", False),
        ("has space", False),
        ('quote"d', False),
        ("line\nbreak", False),
        ("-leading-dash", False),
        ("4111111111111111", False),  # a card number is not let into the logs as an "id"
        (None, False),
        (42, False),
    ],
)
def test_only_sane_request_ids_are_accepted(raw, kept):
    assert sane_request_id(raw) == (raw if kept else None)


@given(st.text(max_size=80))
def test_an_accepted_request_id_is_always_plain_and_unscrubbed(raw):
    got = sane_request_id(raw)
    assert got is None or (got == raw and _REQUEST_ID.fullmatch(raw) and scrub(raw) == raw)


def test_log_lines_carry_the_bound_request_id(json_logs):
    log = logging.getLogger("paysync.test")
    log.info("before")
    token = REQUEST_ID.set("req-42")
    try:
        log.info("during")
    finally:
        REQUEST_ID.reset(token)
    log.info("after")
    got = {line["msg"]: line.get("request_id") for line in lines(json_logs)}
    assert got == {"before": None, "during": "req-42", "after": None}


def test_the_gateway_answers_with_the_request_id_and_stores_it_with_the_callback(engine, settings):
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event(create_payment(engine)))
    response = client.post("/callbacks/sandbox", data=body, headers={**headers, "X-Request-Id": "edge-7f3a"})
    assert response.status_code == 200 and response.headers["X-Request-Id"] == "edge-7f3a"
    for bad in ("x" * 65, "two words", "4111 1111 1111 1111"):
        body, headers = signed(sandbox_event(create_payment(engine)))
        response = client.post("/callbacks/sandbox", data=body, headers={**headers, "X-Request-Id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", response.headers["X-Request-Id"]), bad
    assert re.fullmatch(r"[0-9a-f]{32}", client.get("/healthz").headers["X-Request-Id"])
    with engine.connect() as conn:
        stored = list(conn.execute(select(payment_callback_log.c.request_id).order_by(payment_callback_log.c.id)))
    assert stored[0].request_id == "edge-7f3a"
    assert all(re.fullmatch(r"[0-9a-f]{32}", r.request_id) for r in stored[1:])


def test_the_message_carries_the_request_id_and_old_messages_still_read():
    args = (7, "sandbox", __import__("datetime").datetime(2026, 1, 2, 3, 4, 5), b"{}", {})
    keys = (BROKER_KEY,)
    assert decode_message(encode_message(*args, None, "req-9", key=BROKER_KEY), 1024, keys=keys).request_id == "req-9"
    # Published before it was carried:
    assert decode_message(encode_message(*args, key=BROKER_KEY), 1024, keys=keys).request_id is None
    doc = json.loads(encode_message(*args, key=BROKER_KEY))
    del doc["sig"]
    doc["request_id"] = "not sane at all"
    assert decode_message(sign_document(doc, BROKER_KEY), 1024, keys=keys).request_id is None  # read, the id dropped
    assert decode_message(sign_document({"log_id": 7}, BROKER_KEY), 1024, keys=keys) == 7


def test_the_compensators_lines_about_a_callback_name_the_request_that_stored_it(engine, settings, json_logs):
    # Received before its payment exists: processing fails and the sweep retries it, logging as it goes.
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event("pay_not_yet_created"))
    assert client.post("/callbacks/sandbox", data=body, headers={**headers, "X-Request-Id": "req-sweep"}).status_code
    json_logs.truncate(0)
    json_logs.seek(0)
    runtime = build_runtime(make_settings(database_url=db_url(engine), compensator_grace_seconds=0), engine=engine)
    with engine.begin() as conn:  # due now
        conn.execute(payment_callback_log.update().values(next_retry_at=payment_callback_log.c.create_time))
    compensate_callbacks.run_once(runtime, max_seconds=5)
    about = [line for line in lines(json_logs) if "not processed" in line["msg"]]
    assert about and all(line["request_id"] == "req-sweep" for line in about)
    # ... and the sweep's own summary, after the callback, is not attributed to it.
    summary = [line for line in lines(json_logs) if line["msg"].startswith("swept")]
    assert summary and all("request_id" not in line for line in summary)


@pytest.mark.mariadb
def test_the_consumer_restores_a_lost_row_with_its_request_id_and_logs_it(mariadb, json_logs):
    settings = make_settings(database_url=db_url(mariadb))
    client = create_app(settings, engine=mariadb).test_client()
    body, headers = signed(sandbox_event(create_payment(mariadb)))
    client.post("/callbacks/sandbox", data=body, headers={**headers, "X-Request-Id": "req-lost"})
    with mariadb.begin() as conn:
        (row,) = conn.execute(select(payment_callback_log))
        conn.execute(delete(payment_callback_log))  # the database lost it (a failover); the message did not
    message = json.loads(delivery_message(row))
    del message["sig"]
    message["request_id"] = row.request_id
    json_logs.truncate(0)
    json_logs.seek(0)

    handle(build_runtime(settings, engine=mariadb), sign_document(message, BROKER_KEY))

    restored = [line for line in lines(json_logs) if "restored from its message" in line["msg"]]
    assert restored and restored[0]["request_id"] == "req-lost"
    with mariadb.connect() as conn:
        (again,) = conn.execute(select(payment_callback_log))
    assert again.request_id == "req-lost" and again.status == 1


@pytest.mark.mariadb
def test_the_gateway_puts_the_request_id_in_the_broker_message(mariadb, amqp_url, amqp_queue):
    from tests.stack import amqp_channel
    from tests.support import wait_until

    settings = make_settings(database_url=db_url(mariadb), amqp_url=amqp_url, amqp_queue=amqp_queue)
    app = create_app(settings, engine=mariadb)
    body, headers = signed(sandbox_event(create_payment(mariadb)))
    app.test_client().post("/callbacks/sandbox", data=body, headers={**headers, "X-Request-Id": "req-amqp"})
    assert app.extensions["paysync"]["publisher"].flush(10)
    conn, channel = amqp_channel(amqp_url)
    try:
        got = wait_until(lambda: channel.basic_get(amqp_queue, auto_ack=True)[2], timeout=10, message="the message")
    finally:
        conn.close()
        app.extensions["paysync"]["publisher"].close()
    assert decode_message(got, settings.callback_max_body_bytes, keys=(BROKER_KEY,)).request_id == "req-amqp"
