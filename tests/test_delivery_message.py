"""The callback message is the delivery itself: its format, and restoring a row the database lost.

Pure format checks (hypothesis) plus ``process_delivery`` on SQLite and
MariaDB. The full stack (gateway, broker, consumer) is in test_restore.py.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import delete, func, select, update

from payments.inbound.callbacks import CallbackResult, store_callback
from payments.inbound.delivery import (
    Delivery,
    UnreadableMessage,
    body_digest,
    decode_message,
    encode_message,
    max_message_bytes,
    message_signature,
    sign_document,
)
from payments.inbound.processing import process_delivery
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import payment_callback_log
from payments.providers import build_providers
from payments.states import CallbackStatus
from tests.stack import callback_rows, delivery_message, effect_counts, payment_status
from tests.support import BROKER_KEY, create_payment, make_settings, sandbox_event, signed

MAX_BODY = 256 * 1024
KEYS = (BROKER_KEY,)
PROVIDERS = build_providers(make_settings())
POLICY = RetryPolicy(max_retries=3, base_seconds=0.01, max_seconds=0.05)

times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1))
header_maps = st.dictionaries(st.text(min_size=1, max_size=20), st.text(max_size=200), max_size=4)


@given(
    log_id=st.integers(min_value=1, max_value=2**63 - 1),
    provider=st.text(min_size=1, max_size=32),
    received_at=times,
    body=st.binary(max_size=2000),
    headers=header_maps,
    remote_addr=st.one_of(st.none(), st.text(max_size=64)),
)
def test_a_message_decodes_to_exactly_the_delivery_it_was_made_from(
    log_id, provider, received_at, body, headers, remote_addr
):
    raw = encode_message(log_id, provider, received_at, body, headers, remote_addr, key=BROKER_KEY)
    assert decode_message(raw, MAX_BODY, keys=KEYS) == Delivery(
        log_id, provider, received_at, body, headers, remote_addr, body_digest(body)
    )


def test_a_message_carries_the_named_fields_with_the_body_in_base64():
    when = datetime(2024, 5, 1, 12, 0, 0, 123456)
    doc = json.loads(
        encode_message(7, "sandbox", when, b'{"id":"evt_1"}', {"Sandbox-Signature": "t=1,v1=ab"}, key=BROKER_KEY)
    )
    assert doc == {
        "log_id": 7,
        "provider": "sandbox",
        "received_at": "2024-05-01T12:00:00.123456Z",
        "remote_addr": None,
        "headers": {"Sandbox-Signature": "t=1,v1=ab"},
        "body": base64.b64encode(b'{"id":"evt_1"}').decode(),
        "body_sha256": body_digest(b'{"id":"evt_1"}'),
        "sig": message_signature(doc, BROKER_KEY),
    }


def test_the_largest_body_fits_the_message_bound_and_a_larger_one_is_refused():
    big = b"x" * MAX_BODY
    raw = encode_message(
        1, "sandbox", utcnow(), big, {"User-Agent": "\u00ff" * 8000, "Sandbox-Signature": "s" * 8000}, key=BROKER_KEY
    )
    assert len(raw) <= max_message_bytes(MAX_BODY)
    assert decode_message(raw, MAX_BODY, keys=KEYS).body == big
    with pytest.raises(UnreadableMessage, match="exceeds CALLBACK_MAX_BODY_BYTES"):
        decode_message(encode_message(1, "sandbox", utcnow(), big + b"x", {}, key=BROKER_KEY), MAX_BODY, keys=KEYS)
    with pytest.raises(UnreadableMessage, match="larger than any callback message"):
        decode_message(b" " * (max_message_bytes(MAX_BODY) + 1), MAX_BODY, keys=KEYS)


def test_the_earlier_format_is_still_read_as_a_log_id_when_signed():
    assert decode_message(sign_document({"log_id": 42}, BROKER_KEY), MAX_BODY, keys=KEYS) == 42


def _doc(**changes):
    """A message as a gateway with a bug would sign it: signed, and wrong in ``changes``."""
    doc = json.loads(encode_message(5, "sandbox", datetime(2024, 1, 1), b"{}", {}, key=BROKER_KEY))
    del doc["sig"]
    doc.update(changes)
    return sign_document(doc, BROKER_KEY)


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "not JSON"),
        (b"[1]", "not a JSON object"),
        (sign_document({"log_id": "5"}, BROKER_KEY), "log_id"),
        (sign_document({"log_id": True}, BROKER_KEY), "log_id"),
        (sign_document({"log_id": -1}, BROKER_KEY), "log_id"),
        (b"[" * 100_000, "not JSON"),
        (_doc(body_sha256=body_digest(b"[]")), "does not match"),
        (_doc(body="not base64!"), "base64"),
        (_doc(body=None), "base64"),
        (_doc(received_at="2024-01-01T00:00:00"), "received_at"),
        (_doc(received_at="yesterday Z"), "received_at"),
        (_doc(provider=""), "provider"),
        (_doc(provider="p" * 33), "provider"),
        (_doc(headers={"a": 1}), "headers"),
        (_doc(headers=["a"]), "headers"),
        (_doc(remote_addr=5), "remote_addr"),
    ],
)
def test_anything_else_is_unreadable_with_the_reason(raw, reason):
    with pytest.raises(UnreadableMessage, match=reason):
        decode_message(raw, MAX_BODY, keys=KEYS)


# --- processing a delivery, restoring what the database lost -------------------------------------------------


def _received(engine, payment_id: str) -> tuple[int, bytes]:
    """Store a delivery as the gateway does; return its row id and the message the gateway would publish."""
    return _received_as(engine, *signed(sandbox_event(payment_id)))


def _received_as(engine, body: bytes, headers: dict) -> tuple[int, bytes]:
    index = PROVIDERS["sandbox"].peek_callback(body)
    log_id = store_callback(
        engine, provider="sandbox", body=body, headers=headers, remote_addr="203.0.113.7", index=index
    )
    (row,) = [r for r in callback_rows(engine) if r.id == log_id]
    return log_id, delivery_message(row)


def _process(engine, raw: bytes) -> tuple[int, CallbackResult]:
    return process_delivery(engine, PROVIDERS, decode_message(raw, MAX_BODY, keys=KEYS), POLICY)


def _forget(engine, *log_ids: int) -> None:
    """What a failover to a replica that missed the last transactions does to those rows."""
    with engine.begin() as conn:
        conn.execute(delete(payment_callback_log).where(payment_callback_log.c.id.in_(log_ids)))


def test_a_delivery_whose_row_is_there_is_processed_in_place(engine):
    payment_id = create_payment(engine)
    log_id, raw = _received(engine, payment_id)
    assert _process(engine, raw) == (log_id, CallbackResult.APPLIED)
    assert _process(engine, raw) == (log_id, CallbackResult.SKIPPED)
    assert len(callback_rows(engine)) == 1
    assert payment_status(engine, payment_id) == "Succeeded"


def test_a_lost_row_is_stored_again_from_the_message_as_received_and_applied_once(engine):
    payment_id = create_payment(engine)
    log_id, raw = _received(engine, payment_id)
    (original,) = callback_rows(engine)
    _forget(engine, log_id)

    restored_id, outcome = _process(engine, raw)
    assert outcome is CallbackResult.APPLIED
    (row,) = callback_rows(engine)
    assert row.id == restored_id
    same = ("provider", "callback_data", "headers", "remote_addr", "order_no", "provider_event_id", "create_time")
    assert {k: getattr(row, k) for k in same} == {k: getattr(original, k) for k in same}
    assert row.status == CallbackStatus.PROCESSED
    # The message comes again (its ack was lost): it finds the copy it restored, stores nothing, applies nothing.
    assert _process(engine, raw) == (restored_id, CallbackResult.SKIPPED)
    assert len(callback_rows(engine)) == 1
    assert payment_status(engine, payment_id) == "Succeeded"
    assert effect_counts(engine, payment_id) == {"ledger_events": 1, "processed_events": 1}


def test_a_row_whose_id_now_holds_another_delivery_leaves_both_deliveries_applied_once(engine):
    first_payment, second_payment = create_payment(engine), create_payment(engine)
    log_id, first_raw = _received(engine, first_payment)
    _forget(engine, log_id)
    # The id is handed out again to the next delivery (an AUTO_INCREMENT counter after a failover).
    second_id, _ = _received(engine, second_payment)
    with engine.begin() as conn:
        conn.execute(update(payment_callback_log).where(payment_callback_log.c.id == second_id).values(id=log_id))
    (row,) = callback_rows(engine)
    second_raw = delivery_message(row)

    restored_id, outcome = _process(engine, first_raw)
    assert restored_id != log_id and outcome is CallbackResult.APPLIED
    assert _process(engine, second_raw) == (log_id, CallbackResult.APPLIED)
    bodies = sorted(bytes(r.callback_data) for r in callback_rows(engine))
    assert bodies == sorted(decode_message(raw, MAX_BODY, keys=KEYS).body for raw in (first_raw, second_raw))
    assert payment_status(engine, first_payment) == payment_status(engine, second_payment) == "Succeeded"
    assert effect_counts(engine)["processed_events"] == 2


def test_a_lost_row_whose_event_was_delivered_again_meanwhile_is_restored_but_applied_once(engine):
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id))
    log_id, raw = _received_as(engine, body, headers)
    _forget(engine, log_id)
    # The provider's retry of the same event (byte for byte) arrived after the failover and was applied.
    retry_id, retry_raw = _received_as(engine, body, headers)
    assert _process(engine, retry_raw) == (retry_id, CallbackResult.APPLIED)

    restored_id, outcome = _process(engine, raw)
    assert outcome is CallbackResult.DUPLICATE and restored_id not in (log_id, retry_id)
    assert len(callback_rows(engine)) == 2, "both deliveries are kept, as they were received"
    assert effect_counts(engine, payment_id) == {"ledger_events": 1, "processed_events": 1}


def test_a_restored_row_is_verified_against_its_original_receipt_time(engine):
    # Signed 200 s before it was received, processed long after: the tolerance is about the receipt.
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id), timestamp=1_700_000_000)
    received = datetime(2023, 11, 14, 22, 16, 40)  # 1_700_000_200 in UTC
    raw = encode_message(99, "sandbox", received, body, headers, key=BROKER_KEY)
    restored_id, outcome = _process(engine, raw)
    assert outcome is CallbackResult.APPLIED
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(payment_callback_log)).scalar() == 1
        assert (
            conn.execute(
                select(payment_callback_log.c.create_time).where(payment_callback_log.c.id == restored_id)
            ).scalar()
            == received
        )
