"""Broker messages published by someone other than a gateway change nothing (docs/design.md invariant 16).

What the consumer used to take from a message on trust: a restored row's
receipt time (``received_at``, which the provider's timestamp tolerance is
checked against) and the row itself. So anyone able to publish to the
callback queue could re-date a captured, long-expired provider notification
and have it applied, or make the consumer store rows nobody sent. The real
gateway, consumer, MariaDB and RabbitMQ run here; the forged messages are
written by hand, as an attacker without BROKER_MESSAGE_SECRET would write
them, and published straight to the callback queue.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import select

from payments.errors import ConfigError
from payments.infra.schema import alert, ledger_event
from payments.infra.settings import load_settings
from payments.runtime import check_deployment
from tests.stack import Stack, amqp_channel, callback_rows, db_url, payment_status, post, publish_raw, ready_count
from tests.support import create_payment, sandbox_event, signed, wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.rabbitmq, pytest.mark.slow]

TOLERANCE = 300
"""CALLBACK_TOLERANCE_SECONDS' default: a notification signed longer ago than this is refused."""


PRODUCTION = {
    "PAYSYNC_ENV": "production",
    "MERCHANT_API_TOKEN": "mt_Q7vK2pX9rT4wZ8nB3cF6hJ1m",
    "OPS_TOKEN": "ops_L5sD8gY2kW7qE4tR9uA3zV6x",
    "AMQP_URL": "amqp://paysync:pw@mq:5672/%2F",
}


@pytest.mark.parametrize(
    ("secret", "why"),
    [
        ("dev-broker-message-secret", "development default"),
        ("k" * 23, "shorter than 24"),
        ("k" * 30 + ",short", "shorter"),
    ],
)
def test_production_with_a_broker_refuses_a_weak_message_key_naming_it(secret, why):
    with pytest.raises(ConfigError, match=f"BROKER_MESSAGE_SECRET is (a )?{why}") as refused:
        check_deployment(load_settings({**PRODUCTION, "BROKER_MESSAGE_SECRET": secret}))
    assert secret not in str(refused.value), "the setting is named, never its value"


@pytest.mark.parametrize("env", ["production", "development"])
def test_a_broker_without_a_message_key_is_refused_in_either_environment(env):
    with pytest.raises(ConfigError, match="BROKER_MESSAGE_SECRET is required when AMQP_URL is set"):
        check_deployment(load_settings({**PRODUCTION, "PAYSYNC_ENV": env, "BROKER_MESSAGE_SECRET": ""}))


def test_a_strong_message_key_and_a_rotation_list_of_them_are_accepted():
    new, old = "bm_N4fH8jK2lP6qS9tV3wX7yZ1c", "bm_O5gJ9kL3mQ7rT1uW4xY8zA2d"
    settings = load_settings({**PRODUCTION, "BROKER_MESSAGE_SECRET": f"{new},{old}"})
    assert check_deployment(settings) is None and settings.broker_message_secret == (new, old)
    assert load_settings({**PRODUCTION, "AMQP_URL": ""}).broker_message_secret == ()  # no broker: not needed


def _stack(tmp_path, mariadb, amqp_url, amqp_queue) -> Stack:  # noqa: ANN001
    return Stack(tmp_path, DATABASE_URL=db_url(mariadb), AMQP_URL=amqp_url, AMQP_QUEUE=amqp_queue)


def _genuine_message(port: int, amqp_url: str, queue: str, payment_id: str) -> bytes:
    """POST a valid notification to the gateway and take the message it published off the queue."""
    publish_raw(amqp_url, queue, [])  # declares the queue (paysync's topology) before anyone reads it
    body, headers = signed(sandbox_event(payment_id))
    assert post(port, body, headers).status_code == 200

    def take() -> bytes | None:
        conn, channel = amqp_channel(amqp_url)
        try:
            return channel.basic_get(queue, auto_ack=True)[2]
        finally:
            conn.close()

    return wait_until(take, timeout=15, message="the gateway's message")


def _hand_written(log_id: int, body: bytes, headers: dict[str, str], received_at: datetime, **extra: object) -> bytes:
    """A message in the delivery format, consistent in itself, as anyone who read the code could write it."""
    doc = {
        "log_id": log_id,
        "provider": "sandbox",
        "received_at": received_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "remote_addr": "203.0.113.9",
        "headers": headers,
        "body": base64.b64encode(body).decode(),
        "body_sha256": hashlib.sha256(body).hexdigest(),
        **extra,
    }
    return json.dumps(doc).encode()


def _rows(mariadb) -> list:  # noqa: ANN001
    return callback_rows(mariadb)


def _ledger(mariadb) -> list:  # noqa: ANN001
    with mariadb.connect() as conn:
        return list(conn.execute(select(ledger_event).order_by(ledger_event.c.id)))


def _forged_alerts(mariadb) -> list:  # noqa: ANN001
    with mariadb.connect() as conn:
        return list(conn.execute(select(alert).where(alert.c.rule == "broker_message_forged")))


def _drained(port: int, mariadb, marker: str) -> None:  # noqa: ANN001
    """Wait for a genuine notification published after the forged ones to apply.

    One queue, one consumer: messages are handled in order, so once the marker applied the forged ones
    before it were handled too.
    """
    body, headers = signed(sandbox_event(marker))
    assert post(port, body, headers).status_code == 200
    wait_until(lambda: payment_status(mariadb, marker) == "Succeeded", timeout=20, message="the marker")


def _dead_letters(amqp_url: str, queue: str, expected: int) -> None:
    wait_until(lambda: ready_count(amqp_url, f"{queue}.dlq") >= expected, timeout=10, message="dead letters")
    assert ready_count(amqp_url, f"{queue}.dlq") == expected


def test_a_forged_body_is_dead_lettered_and_changes_nothing(mariadb, amqp_url, amqp_queue, tmp_path):
    target, other, marker = create_payment(mariadb), create_payment(mariadb), create_payment(mariadb)
    # A genuine notification for the target, captured on the wire an hour ago: long past the tolerance.
    signed_at = int(time.time()) - 12 * TOLERANCE
    stale_body, stale_headers = signed(sandbox_event(target), timestamp=signed_at)
    then = datetime.fromtimestamp(signed_at, UTC).replace(tzinfo=None)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=1)
        assert post(port, stale_body, stale_headers).status_code in (400, 401)  # the gateway refuses it
        genuine = json.loads(_genuine_message(port, amqp_url, amqp_queue, other))
        before_rows, before_ledger = _rows(mariadb), _ledger(mariadb)
        swapped = {  # the genuine message with the stale delivery put in, its signature (if any) kept
            **genuine,
            "body": base64.b64encode(stale_body).decode(),
            "body_sha256": hashlib.sha256(stale_body).hexdigest(),
            "headers": stale_headers,
            "received_at": then.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        }
        forged = [
            # Re-dated to when it was signed, so the provider's timestamp check would pass against it.
            _hand_written(10**9, stale_body, stale_headers, then),
            _hand_written(10**9 + 1, stale_body, stale_headers, then, sig="00" * 32),
            json.dumps(swapped).encode(),
        ]
        stack.start("consumer")
        publish_raw(amqp_url, amqp_queue, forged)
        _drained(port, mariadb, marker)
        assert payment_status(mariadb, target) == "Pending", "the re-dated stale notification was applied"
    assert _rows(mariadb)[: len(before_rows)] == before_rows, "no stored row changed"
    assert len(_rows(mariadb)) == len(before_rows) + 1, "only the marker's row is new: nothing restored"
    assert [r for r in _ledger(mariadb)[len(before_ledger) :] if r.payment_id != marker] == []
    _dead_letters(amqp_url, amqp_queue, len(forged))
    (raised,) = _forged_alerts(mariadb)
    assert raised.status == "firing" and raised.severity == "critical"


def test_a_forged_log_id_is_dead_lettered_and_changes_nothing(mariadb, amqp_url, amqp_queue, tmp_path):
    applied, waiting, marker = create_payment(mariadb), create_payment(mariadb), create_payment(mariadb)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=1)
        first = _genuine_message(port, amqp_url, amqp_queue, applied)
        _genuine_message(port, amqp_url, amqp_queue, waiting)  # its row waits, status 0, for the sweep
        _, waiting_row = callback_rows(mariadb)
        stack.start("consumer")
        publish_raw(amqp_url, amqp_queue, [first])
        wait_until(lambda: payment_status(mariadb, applied) == "Succeeded", timeout=20, message="the first")
        before_rows, before_ledger = _rows(mariadb), _ledger(mariadb)
        doc = json.loads(first)
        forged = [
            json.dumps({**doc, "log_id": waiting_row.id}).encode(),  # another row's id on a genuine delivery
            json.dumps({**doc, "log_id": 10**9}).encode(),  # an id nobody stored: would be "restored"
            json.dumps({"log_id": waiting_row.id}).encode(),  # the bare earlier format, unsigned
        ]
        publish_raw(amqp_url, amqp_queue, forged)
        _drained(port, mariadb, marker)
    assert payment_status(mariadb, waiting) == "Pending", "a row was processed on a forged message's word"
    assert _rows(mariadb)[: len(before_rows)] == before_rows, "no stored row changed"
    assert len(callback_rows(mariadb)) == len(before_rows) + 1, "only the marker's row is new"
    assert [r for r in _ledger(mariadb)[len(before_ledger) :] if r.payment_id != marker] == []
    assert callback_rows(mariadb)[1].status == 0 == waiting_row.status
    _dead_letters(amqp_url, amqp_queue, len(forged))
    assert len(_forged_alerts(mariadb)) == 1, "one open alert, seen again, not one per message"


def test_a_replayed_valid_message_is_acknowledged_and_changes_nothing(mariadb, amqp_url, amqp_queue, tmp_path):
    paid, marker = create_payment(mariadb), create_payment(mariadb)
    with _stack(tmp_path, mariadb, amqp_url, amqp_queue) as stack:
        _, port = stack.start_web(workers=1)
        message = _genuine_message(port, amqp_url, amqp_queue, paid)
        stack.start("consumer")
        publish_raw(amqp_url, amqp_queue, [message])
        wait_until(lambda: payment_status(mariadb, paid) == "Succeeded", timeout=20, message="applied once")
        before_rows, before_ledger = _rows(mariadb), _ledger(mariadb)
        publish_raw(amqp_url, amqp_queue, [message, message, message])
        _drained(port, mariadb, marker)
        _dead_letters(amqp_url, amqp_queue, 0)
    assert _rows(mariadb)[: len(before_rows)] == before_rows
    assert len(callback_rows(mariadb)) == len(before_rows) + 1, "only the marker's row is new"
    assert [r for r in _ledger(mariadb)[len(before_ledger) :] if r.payment_id != marker] == []
    assert _forged_alerts(mariadb) == []
    assert ready_count(amqp_url, amqp_queue) == 0, "a replay is acknowledged: it is genuine, and a no-op"
