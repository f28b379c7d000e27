"""Leases and fencing of the relay and the query job: a claimed row is one worker's, and only that worker sends.

The lease on a claimed row covers the wait for the rate limiter as well as
the call; a worker whose lease ran out and was taken by another finds out in
its prepare step (the lease is its token) and sends nothing.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

from sqlalchemy import update

from compensator import relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import outbox, payment
from payments.outbound import protocol as outbound_protocol
from payments.outbound.protocol import Context, Result, query_payment, relay_charge
from payments.providers.base import Capabilities, Dedupe, Succeeded, Unknown
from payments.runtime import build_runtime
from tests.fake_provider import FakeProvider
from tests.outbound_support import calls, make_due, new_payment, row
from tests.support import make_settings


def runtime_with(engine, provider, **overrides):
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=0.3,
        query_base_seconds=30,
        query_max_seconds=60,
        relay_max_seconds=20,
        **overrides,
    )
    rt = build_runtime(settings, engine)
    return replace(rt, providers={**rt.providers, provider.name: provider})


def keyed(**scripts) -> FakeProvider:
    return FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), **scripts)


def test_a_relay_worker_whose_lease_was_taken_by_another_sends_nothing(mariadb):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    ctx = Context(rt.engine, rt.providers, rt.settings)
    [(outbox_id, provider, first_lease, _)] = outbound_protocol.claim_sends(rt.engine, utcnow(), 10, 30)
    with rt.engine.begin() as conn:  # the first worker stalls; its lease runs out …
        conn.execute(update(outbox).where(outbox.c.id == outbox_id).values(next_attempt_at=utcnow()))
    [(_, _, second_lease, _)] = outbound_protocol.claim_sends(
        rt.engine, utcnow(), 10, 30
    )  # … and another worker claims it

    assert relay_charge(ctx, outbox_id, provider, first_lease) == Result.SKIPPED
    assert fake.charges == [] and calls(rt, payment_id) == [], "the stale worker neither sent nor recorded a call"
    assert relay_charge(ctx, outbox_id, provider, second_lease) == Result.APPLIED
    assert len(fake.charges) == 1 and row(rt, payment_id)["status"] == "Succeeded"


def test_a_query_worker_whose_lease_was_taken_by_another_sends_nothing(mariadb):
    fake = keyed(charges=[Unknown("timeout")], queries=[Succeeded("ch_1")])
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    make_due(rt, payment_id)
    ctx = Context(rt.engine, rt.providers, rt.settings)
    [(_, provider, first_lease, _)] = outbound_protocol.claim_queries(rt.engine, utcnow(), 10, 30, 60)
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=utcnow()))
    [(_, _, second_lease, _)] = outbound_protocol.claim_queries(rt.engine, utcnow(), 10, 30, 60)

    assert query_payment(ctx, payment_id, provider, first_lease) == Result.SKIPPED
    assert fake.queries == [] and calls(rt, payment_id, "query") == []
    assert query_payment(ctx, payment_id, provider, second_lease) == Result.APPLIED
    assert len(fake.queries) == 1 and row(rt, payment_id)["status"] == "Succeeded"


def test_a_claimed_rows_lease_outlasts_its_wait_for_the_rate_limiter(mariadb):
    # 5 rows claimed at once at 1 call per second: the last one waits ~4 s, longer than a call's own lease.
    # Calls are slow: a worker that took over an expired row would send while the first one's call is out.
    fake = keyed(on_charge=lambda request, key: time.sleep(3))
    rt = runtime_with(mariadb, fake, provider_rate_limit=1.0, relay_concurrency=5)
    # Another compensator process, with its own rate limiter (a per-process token bucket per provider and rate).
    other = replace(rt, settings=replace(rt.settings, provider_rate_limit=1.0001))
    ids = [new_payment(rt, provider="fake") for _ in range(5)]
    first = threading.Thread(target=relay_outbox.run_once, args=(rt,))
    started = time.monotonic()
    first.start()
    time.sleep(max(0.0, started + rt.settings.provider_timeout_seconds * 2 + 3.2 - time.monotonic()))
    relay_outbox.run_once(other)  # after a call-only lease would have run out, while the first is still busy
    first.join(30)
    sent = Counter(request.payment_id for request, _ in fake.charges)
    assert sent == Counter(dict.fromkeys(ids, 1)), "every payment sent once, by the worker that claimed it"
    assert {row(rt, pid)["status"] for pid in ids} == {"Succeeded"}


def test_a_prepared_charge_whose_lease_ran_out_waiting_for_a_slot_is_not_sent_by_a_second_relay(engine):
    """Two relays and a slow provider slot: one send per idempotency key (the grouped path's fence)."""
    from compensator.relay_outbox import provider_slots
    from tests.support import wait_until

    fake = keyed()
    # Two compensators: each its own bound on calls to the provider (one slot here, two there) and its own pool.
    first = runtime_with(engine, fake, relay_concurrency=1, relay_provider_concurrency=1, provider_rate_limit=1e5)
    second = runtime_with(engine, fake, relay_concurrency=2, relay_provider_concurrency=2, provider_rate_limit=1e5)
    payment_id = new_payment(first, provider="fake")
    slot = provider_slots("fake", 1)
    slot.acquire()  # the first relay's only slot is held by a call that hangs
    try:
        relay = threading.Thread(target=relay_outbox.run_once, args=(first,))
        relay.start()
        wait_until(lambda: len(calls(first, payment_id)) == 1, message="the first relay prepared the charge")
        with first.engine.begin() as conn:  # … and waits for the slot until its lease runs out
            conn.execute(update(outbox).where(outbox.c.aggregate_id == payment_id).values(next_attempt_at=utcnow()))
        assert relay_outbox.run_once(second) == 1, "the second relay claims the row and sends it"
        assert row(first, payment_id)["status"] == "Succeeded"
    finally:
        slot.release()
    relay.join(10)
    assert not relay.is_alive()

    keys = Counter(key for _, key in fake.charges)
    assert list(keys.values()) == [1], f"one send per idempotency key, got {keys}"
    first_call, second_call = calls(first, payment_id)
    assert (first_call["outcome"], first_call["error_code"]) == ("Failed", "not_sent_lease_lost"), "never sent"
    assert second_call["outcome"] == "Succeeded"
