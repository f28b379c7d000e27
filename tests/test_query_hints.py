"""An unverified notification is a hint, never a fact; source checks refuse deliveries from elsewhere.

Against MariaDB and the real sandbox platform: a refused notification that
names a Pending payment (or refund) brings its query forward (never its state), within a
per-payment and a per-provider rate limit, and query_unresolved then applies
the platform's answer. Source checks: the client behind TRUSTED_PROXIES is the
rightmost untrusted X-Forwarded-For hop, and a delivery from outside the
provider's networks is stored, refused like a bad signature, and hinted.
The per-provider versions (Alipay, WeChat Pay, Stripe) are in their gateway tests.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from compensator import compensate_callbacks, query_unresolved, relay_outbox
from gateway import create_app
from payments.inbound.callbacks import store_callback
from payments.infra.db import utcnow
from payments.infra.schema import payment, payment_callback_log, query_hint, refund
from payments.infra.sources import client_address
from payments.outbound.refunds import create_refund
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.outbound_support import new_payment, row, runtime  # noqa: F401
from tests.support import create_payment, sandbox_event, signed

STRANGER = "whsec_not_ours_" + "s" * 20
FAR = timedelta(hours=1)


def forge(client, payment_id, **headers):  # noqa: ANN001, ANN003, ANN201
    """POST a sandbox notification for ``payment_id`` signed with a key we do not hold; the answer."""
    body, signed_headers = signed(sandbox_event(payment_id), secret=STRANGER)
    return client.post("/callbacks/sandbox", data=body, headers={**signed_headers, **headers})


def last_callback(rt):  # noqa: ANN001, ANN201
    with rt.engine.connect() as conn:
        return conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id.desc())).first()


def push_query_out(rt, payment_id):  # noqa: ANN001, ANN201
    """As after a query: the next one is far off; return that time."""
    later = utcnow() + FAR
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=later))
    return later


def hinted_now(rt, payment_id) -> bool:  # noqa: ANN001
    return row(rt, payment_id)["next_query_at"] <= utcnow()


def with_settings(rt, **changes):  # noqa: ANN001, ANN003, ANN201
    return build_runtime(replace(rt.settings, **changes), rt.engine)


# --------------------------------------------------------------------------------------------- hints


def test_an_unverified_notification_triggers_a_query_not_a_state_change(runtime, sandbox):
    sandbox.faults(processing_rate=1.0, processing_seconds=0.2)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    push_query_out(runtime, payment_id)
    assert row(runtime, payment_id)["status"] == "Pending"
    client = create_app(runtime.settings, engine=runtime.engine).test_client()

    # The forged body says charge.succeeded; it is refused, changes nothing, and only moves the query.
    assert forge(client, payment_id).status_code == 401
    cb = last_callback(runtime)
    assert (cb.status, cb.order_no) == (CallbackStatus.REJECTED, payment_id)
    compensate_callbacks.run_once(runtime)
    p = row(runtime, payment_id)
    assert p["status"] == "Pending" and hinted_now(runtime, payment_id)

    # The platform's own answer settles it (the charge finished meanwhile).
    time.sleep(0.3)
    assert query_unresolved.run_once(runtime) >= 1
    p = row(runtime, payment_id)
    assert p["status"] == "Succeeded" and p["status_source"].startswith("query:")


def test_a_forged_failure_for_a_paid_payment_is_settled_by_the_truth_not_the_forgery(runtime, sandbox):
    sandbox.faults(processing_rate=1.0, processing_seconds=0.1)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    client = create_app(runtime.settings, engine=runtime.engine).test_client()
    body, headers = signed(sandbox_event(payment_id, event_type="charge.failed", failure_code="x"), secret=STRANGER)
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    time.sleep(0.2)
    query_unresolved.run_once(runtime)
    assert row(runtime, payment_id)["status"] == "Succeeded"


def test_the_hint_rate_limit_holds_per_payment(runtime):
    payment_id = create_payment(runtime.engine, provider="sandbox")
    client = create_app(runtime.settings, engine=runtime.engine).test_client()
    forge(client, payment_id)
    assert hinted_now(runtime, payment_id)

    later = push_query_out(runtime, payment_id)
    for _ in range(3):  # a flood of forgeries for one payment: no more queries
        assert forge(client, payment_id).status_code == 401
    assert row(runtime, payment_id)["next_query_at"] == later

    # Past HINT_QUERY_INTERVAL_SECONDS the next one counts again.
    with runtime.engine.begin() as conn:
        conn.execute(update(query_hint).values(hinted_at=utcnow() - timedelta(seconds=61)))
    forge(client, payment_id)
    assert hinted_now(runtime, payment_id)


def test_the_hint_rate_limit_holds_per_provider(runtime):
    rt = with_settings(runtime, hint_queries_per_minute=2)
    client = create_app(rt.settings, engine=rt.engine).test_client()
    ids = [create_payment(rt.engine, provider="sandbox") for _ in range(3)]
    for payment_id in ids:
        push_query_out(rt, payment_id)
        assert forge(client, payment_id).status_code == 401
    assert [hinted_now(rt, p) for p in ids] == [True, True, False]
    # Hints for another provider are counted apart.
    legacy = create_payment(rt.engine, provider="sandbox_legacy")
    push_query_out(rt, legacy)
    forge(client, legacy)
    assert not hinted_now(rt, legacy), "sandbox_legacy cannot be queried by our number: nothing to bring forward"


def test_hints_are_off_with_a_zero_limit_and_ignore_settled_and_unknown_payments(runtime):
    client = create_app(runtime.settings, engine=runtime.engine).test_client()
    settled = create_payment(runtime.engine, status="Succeeded")
    push_query_out(runtime, settled)
    forge(client, settled)
    forge(client, "pay_nobody_knows")
    assert row(runtime, settled)["next_query_at"] > utcnow()
    with runtime.engine.connect() as conn:
        assert conn.execute(select(query_hint)).all() == []

    off = with_settings(runtime, hint_queries_per_minute=0)
    pending = create_payment(off.engine)
    push_query_out(off, pending)
    forge(create_app(off.settings, engine=off.engine).test_client(), pending)
    assert not hinted_now(off, pending)


def test_an_unverified_refund_notification_brings_that_refunds_query_forward_within_the_limits(runtime):
    payment_id = create_payment(runtime.engine, status="Succeeded", provider_transaction_id="ch_hint_refund")
    answer = create_refund(runtime.engine, payment_id, 300, None, "rk-hint", deadline_seconds=3600, lock_seconds=60)
    refund_id = json.loads(answer.body)["refund_id"]
    later = utcnow() + FAR
    with runtime.engine.begin() as conn:  # as after a refund call whose answer was lost: Unknown, queried later
        conn.execute(
            update(refund).where(refund.c.refund_id == refund_id).values(status="Unknown", next_query_at=later)
        )
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=later))
    client = create_app(runtime.settings, engine=runtime.engine).test_client()
    event = sandbox_event(payment_id, event_type="refund.succeeded", amount=300, merchant_refund_id=refund_id)
    body, headers = signed(event, secret=STRANGER)
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    assert last_callback(runtime).order_no == refund_id
    with runtime.engine.connect() as conn:
        r = conn.execute(select(refund).where(refund.c.refund_id == refund_id)).mappings().one()
        hinted = conn.execute(select(query_hint.c.payment_id)).scalars().all()
    # The refund's query is due now, its state untouched; the payment (Succeeded) is left alone.
    assert r["status"] == "Unknown" and r["next_query_at"] <= utcnow() and hinted == [refund_id]
    assert row(runtime, payment_id)["next_query_at"] == later

    # The per-refund limit holds like a payment's, and a settled refund is never hinted.
    with runtime.engine.begin() as conn:
        conn.execute(update(refund).where(refund.c.refund_id == refund_id).values(next_query_at=later))
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    with runtime.engine.begin() as conn:
        assert conn.execute(select(refund.c.next_query_at).where(refund.c.refund_id == refund_id)).scalar() == later
        conn.execute(update(query_hint).values(hinted_at=utcnow() - timedelta(seconds=61)))
        conn.execute(update(refund).where(refund.c.refund_id == refund_id).values(status="Succeeded"))
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    with runtime.engine.connect() as conn:
        assert conn.execute(select(refund.c.next_query_at).where(refund.c.refund_id == refund_id)).scalar() == later


def test_a_row_left_pending_and_rejected_by_the_sweep_is_a_hint_too(runtime):
    payment_id = create_payment(runtime.engine)
    push_query_out(runtime, payment_id)
    body, headers = signed(sandbox_event(payment_id), secret=STRANGER)
    # Stored by a gateway that died before it could verify: the sweep rejects it, and hints.
    store_callback(runtime.engine, provider="sandbox", body=body, headers=headers, remote_addr=None,
                   index={"order_no": payment_id})  # fmt: skip
    compensate_callbacks.run_once(runtime)
    assert last_callback(runtime).status == CallbackStatus.REJECTED
    assert row(runtime, payment_id)["status"] == "Pending" and hinted_now(runtime, payment_id)


# --------------------------------------------------------------------------------------------- sources

TRUSTED = ("10.0.0.0/8",)


@pytest.mark.parametrize(
    ("peer", "forwarded", "client"),
    [
        ("198.51.100.7", "203.0.113.9", "198.51.100.7"),  # not our proxy: its header is not believed
        ("10.0.0.2", "203.0.113.9", "203.0.113.9"),
        ("10.0.0.2", "203.0.113.9, 198.51.100.7", "198.51.100.7"),  # the client wrote the left part itself
        ("10.0.0.2", "203.0.113.9, 198.51.100.7, 10.0.0.5", "198.51.100.7"),  # two of our proxies
        ("10.0.0.2", "10.0.0.9, 10.0.0.5", "10.0.0.9"),
        ("10.0.0.2", "", "10.0.0.2"),
        ("10.0.0.2", "garbage, 10.0.0.5", "garbage"),  # unreadable: lies in no allowed network
        ("::ffff:10.0.0.2", "203.0.113.9", "203.0.113.9"),
    ],
)
def test_the_client_is_the_rightmost_hop_our_proxies_did_not_write(peer, forwarded, client):
    assert client_address(peer, forwarded, TRUSTED) == client


def sourced(rt):  # noqa: ANN001, ANN201
    settings = replace(rt.settings, sandbox_source_cidrs=("203.0.113.0/24",), trusted_proxies=TRUSTED)
    return build_runtime(settings, rt.engine)


def genuine(client, payment_id, peer, forwarded=None):  # noqa: ANN001, ANN201
    body, headers = signed(sandbox_event(payment_id))
    if forwarded:
        headers["X-Forwarded-For"] = forwarded
    return client.post("/callbacks/sandbox", data=body, headers=headers, environ_base={"REMOTE_ADDR": peer})


def test_a_delivery_from_an_allowed_network_through_our_proxy_is_applied_and_stores_the_client(runtime):
    rt = sourced(runtime)
    client = create_app(rt.settings, engine=rt.engine).test_client()
    payment_id = create_payment(rt.engine)
    assert genuine(client, payment_id, "10.0.0.2", "203.0.113.9").status_code == 200
    cb = last_callback(rt)
    assert cb.remote_addr == "203.0.113.9" and cb.status in (CallbackStatus.PENDING, CallbackStatus.PROCESSED)
    compensate_callbacks.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"


@pytest.mark.parametrize(
    ("peer", "forwarded", "stored"),
    [
        ("127.0.0.1", None, "127.0.0.1"),
        ("198.51.100.7", "203.0.113.9", "198.51.100.7"),  # claims an allowed address, not through our proxy
        ("10.0.0.2", "203.0.113.9, 198.51.100.7", "198.51.100.7"),
    ],
)
def test_a_genuine_delivery_from_elsewhere_is_stored_refused_and_only_hints(runtime, peer, forwarded, stored):
    rt = sourced(runtime)
    client = create_app(rt.settings, engine=rt.engine).test_client()
    payment_id = create_payment(rt.engine)
    push_query_out(rt, payment_id)
    answer = genuine(client, payment_id, peer, forwarded)
    assert answer.status_code == 403 and "source_not_allowed" in answer.get_data(as_text=True)
    cb = last_callback(rt)
    assert (cb.status, cb.remote_addr) == (CallbackStatus.REJECTED, stored)
    assert cb.result.startswith("rejected: source_not_allowed")
    compensate_callbacks.run_once(rt)  # a refused row is never processed, however genuine its signature
    p = row(rt, payment_id)
    assert p["status"] == "Pending" and hinted_now(rt, payment_id)
