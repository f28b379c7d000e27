"""Batched publishing: several callbacks in one broker message, each still a full backup of its delivery.

The format (hypothesis), the gateway's publisher against a real RabbitMQ
(linger, batch_max, batch_bytes, every callback confirmed exactly once), and
the consumer's handler on real MariaDB (each delivery of a batch message gets
what a message of its own would; a message is acknowledged only when all of
its deliveries were processed). The end-to-end restore of batched messages is
in test_restore.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import delete

from broker.consume import Action
from broker.publisher import PACKING_BYTES, CallbackPublisher
from consumer.handler import handle, handle_batch
from payments.inbound.callbacks import CallbackResult, store_callback
from payments.inbound.delivery import (
    UnreadableMessage,
    decode_message,
    decode_messages,
    encode_batch,
    encode_message,
    max_message_bytes,
    sign_document,
)
from payments.infra.db import utcnow
from payments.infra.schema import payment_callback_log
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import callback_rows, delivery_message, effect_counts, payment_status, queued_callbacks
from tests.support import BROKER_KEY, create_payment, make_settings, sandbox_event, signed

MAX_BODY = 256 * 1024
KEYS = (BROKER_KEY,)

deliveries = st.lists(
    st.tuples(st.integers(min_value=1, max_value=2**53), st.binary(max_size=300), st.text(max_size=40)),
    min_size=1,
    max_size=12,
)


@given(deliveries)
def test_a_batch_decodes_to_exactly_the_deliveries_packed_in_it_in_order(items):
    at = utcnow()
    messages = [encode_message(i, "sandbox", at, body, {"X-Note": note}, key=BROKER_KEY) for i, body, note in items]
    got = decode_messages(encode_batch(messages), MAX_BODY, keys=KEYS)
    assert got == [decode_message(m, MAX_BODY, keys=KEYS) for m in messages]
    assert [d.log_id for d in got] == [i for i, _, _ in items]


def test_a_lone_message_is_sent_as_it_is_and_both_readers_agree():
    message = encode_message(7, "sandbox", utcnow(), b'{"id":"evt_1"}', {}, key=BROKER_KEY)
    assert encode_batch([message]) == message
    assert decode_messages(message, MAX_BODY, keys=KEYS) == [decode_message(message, MAX_BODY, keys=KEYS)]
    assert decode_messages(sign_document({"log_id": 42}, BROKER_KEY), MAX_BODY, keys=KEYS) == [42]  # the earlier format


def _batch(*entries: object, signed: bool = True) -> bytes:
    """A batch of ``entries``, each signed (but the last when not ``signed``), as a gateway with a bug might pack."""
    parts = [sign_document(e, BROKER_KEY) if isinstance(e, dict) else json.dumps(e).encode() for e in entries]
    if not signed:
        parts[-1] = json.dumps(entries[-1]).encode()
    return encode_batch(parts)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"deliveries": []}', "non-empty list"),
        (b'{"deliveries": {"log_id": 1}}', "non-empty list"),
        (_batch({"log_id": 1}, {"log_id": 0}), "an entry of a batch of 2: log_id"),
        (_batch({"log_id": 1}, 5), "an entry of a batch of 2: not a JSON object"),
        (_batch({"log_id": 1}, {"log_id": 2}, signed=False), "an entry of a batch of 2: message is not signed"),
    ],
)
def test_a_batch_with_anything_wrong_in_it_is_unreadable_as_a_whole(raw, reason):
    with pytest.raises(UnreadableMessage, match=reason):
        decode_messages(raw, MAX_BODY, keys=KEYS)


def test_a_batch_packed_up_to_the_publishers_bound_is_still_readable():
    bound = max_message_bytes(1000) - PACKING_BYTES
    one = encode_message(1, "sandbox", utcnow(), b"x" * 200, {}, key=BROKER_KEY)
    count = bound // (len(one) + 1)
    packed = encode_batch([one] * count)
    assert len(packed) <= max_message_bytes(1000)
    assert len(decode_messages(packed, 1000, keys=KEYS)) == count


# --- the gateway's publisher, real RabbitMQ -----------------------------------------------------------


def _message(log_id: int, size: int = 50) -> bytes:
    return encode_message(log_id, "sandbox", utcnow(), b"b" * size, {}, key=BROKER_KEY)


@pytest.mark.rabbitmq
def test_callbacks_within_the_linger_share_messages_of_at_most_batch_max_and_each_is_confirmed_once(
    amqp_url, amqp_queue
):
    publisher = CallbackPublisher(amqp_url, amqp_queue, linger=0.3, pack=encode_batch, batch_max=8)
    try:
        assert publisher.publish(1, _message(1)) and publisher.flush(10)  # connected, queue declared
        for log_id in range(2, 32):
            assert publisher.publish(log_id, _message(log_id))
        assert publisher.flush(10)
    finally:
        publisher.close()
    assert (publisher.stats.published, publisher.stats.confirmed, publisher.stats.failed) == (31, 31, 0)
    messages, callbacks = queued_callbacks(amqp_url, amqp_queue)
    assert callbacks == 31
    assert messages == 1 + 4, "the first alone, then 30 within one linger: 8 + 8 + 8 + 6"


@pytest.mark.rabbitmq
def test_a_batch_never_grows_past_batch_bytes(amqp_url, amqp_queue):
    bound = 3 * (len(_message(1, 400)) + 1) + PACKING_BYTES
    publisher = CallbackPublisher(amqp_url, amqp_queue, linger=0.3, pack=encode_batch, batch_max=100, batch_bytes=bound)
    try:
        for log_id in range(1, 11):
            publisher.publish(log_id, _message(log_id, 400))
        assert publisher.flush(10)
    finally:
        publisher.close()
    messages, callbacks = queued_callbacks(amqp_url, amqp_queue)
    assert callbacks == 10 and messages >= 4, "at most three of these fit under the bound"


@pytest.mark.rabbitmq
def test_without_a_packer_every_callback_is_a_message_of_its_own(amqp_url, amqp_queue):
    publisher = CallbackPublisher(amqp_url, amqp_queue, linger=0.2, batch_max=50)
    try:
        for log_id in range(1, 11):
            publisher.publish(log_id, _message(log_id))
        assert publisher.flush(10)
    finally:
        publisher.close()
    assert queued_callbacks(amqp_url, amqp_queue) == (10, 10)


# --- the consumer's handler, real MariaDB -------------------------------------------------------------


def _stored(engine) -> tuple[str, int]:
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id))
    return payment_id, store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="10.0.0.1")


def _batch_of(engine, log_ids: list[int]) -> bytes:
    rows = {r.id: r for r in callback_rows(engine)}
    return encode_batch([delivery_message(rows[i]) for i in log_ids])


@pytest.mark.mariadb
def test_every_delivery_of_a_batch_message_is_applied_and_the_message_acked_once(mariadb):
    runtime = build_runtime(make_settings(), engine=mariadb)
    stored = [_stored(mariadb) for _ in range(5)]
    batch = _batch_of(mariadb, [log_id for _, log_id in stored])

    answer = handle(runtime, batch)

    assert (answer.action, answer.callbacks) == (Action.ACK, 5)
    assert all(payment_status(mariadb, p) == "Succeeded" for p, _ in stored)
    assert {r.status for r in callback_rows(mariadb)} == {CallbackStatus.PROCESSED}
    effects = effect_counts(mariadb)
    again = handle(runtime, batch)  # a redelivery: every row found processed already, nothing changes
    assert (again.action, again.outcome, again.callbacks) == (Action.ACK, CallbackResult.SKIPPED, 5)
    assert effect_counts(mariadb) == effects == {"ledger_events": 5, "processed_events": 5}


@pytest.mark.mariadb
def test_lost_rows_of_a_batch_message_are_restored_and_its_neighbours_processed_in_place(mariadb):
    runtime = build_runtime(make_settings(), engine=mariadb)
    stored = [_stored(mariadb) for _ in range(4)]
    batch = _batch_of(mariadb, [log_id for _, log_id in stored])
    lost = [stored[1][1], stored[3][1]]
    with mariadb.begin() as conn:
        conn.execute(delete(payment_callback_log).where(payment_callback_log.c.id.in_(lost)))

    [answer] = handle_batch(runtime, [batch])

    assert (answer.action, answer.callbacks) == (Action.ACK, 4)
    assert all(payment_status(mariadb, p) == "Succeeded" for p, _ in stored)
    rows = callback_rows(mariadb)
    assert len(rows) == 4 and {r.status for r in rows} == {CallbackStatus.PROCESSED}
    assert sum(1 for r in rows if (r.result or "").startswith("applied")) == 4
    assert sorted(r.id for r in rows if r.id not in lost)[:2] == sorted([stored[0][1], stored[2][1]])


@pytest.mark.mariadb
def test_messages_are_answered_one_each_whatever_they_carry(mariadb):
    runtime = build_runtime(make_settings(consumer_batch_size=2), engine=mariadb)
    stored = [_stored(mariadb) for _ in range(4)]
    three = _batch_of(mariadb, [log_id for _, log_id in stored[:3]])
    single = _batch_of(mariadb, [stored[3][1]])
    corrupt = json.dumps({"deliveries": [json.loads(single), {"log_id": -1}]}).encode()

    answers = handle_batch(runtime, [three, corrupt, single])

    # Three deliveries in chunks of CONSUMER_BATCH_SIZE=2 are one message: acknowledged once, for three.
    assert [(a.action, a.callbacks) for a in answers] == [(Action.ACK, 3), (Action.DEAD_LETTER, 0), (Action.ACK, 1)]
    assert all(payment_status(mariadb, p) == "Succeeded" for p, _ in stored)


@pytest.mark.mariadb
def test_a_stop_in_the_middle_hands_back_every_message_not_wholly_processed(mariadb):
    runtime = build_runtime(make_settings(consumer_batch_size=2), engine=mariadb)
    stored = [_stored(mariadb) for _ in range(5)]
    first = _batch_of(mariadb, [log_id for _, log_id in stored[:3]])  # chunks [a, b] [c, ...]
    second = _batch_of(mariadb, [log_id for _, log_id in stored[3:]])
    calls = []

    def stop() -> bool:  # asked before the first chunk (no), then after it (yes)
        calls.append(1)
        return len(calls) > 1

    answers = handle_batch(runtime, [first, second], stop=stop)

    assert [a.action for a in answers] == [Action.REQUEUE, Action.REQUEUE]
    statuses = [payment_status(mariadb, p) for p, _ in stored]
    assert statuses == ["Succeeded", "Succeeded", "Pending", "Pending", "Pending"], "the rest handed back untouched"
    # The redelivery of the first finds two done and does the third.
    [again] = handle_batch(runtime, [first])
    assert (again.action, again.callbacks) == (Action.ACK, 3)
    assert payment_status(mariadb, stored[2][0]) == "Succeeded"
