"""The relay's capacity under hanging calls: cheap slots, the per-provider cap, a bounded share of the database.

A call that hangs holds one of RELAY_CONCURRENCY slots (a thread asleep on
its socket) and none of the database: at most RELAY_DB_CONCURRENCY units are
in a transaction at once, and at most RELAY_PROVIDER_CONCURRENCY calls are out
to one provider, hanging or not. Claims are batched (``workpool.drain``) and an
idle scheduled run keeps polling until just before the next one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace

from sqlalchemy import event, select

from compensator import relay_outbox, workpool
from payments.infra.schema import payment, provider_breaker, provider_call
from payments.outbound import breaker
from payments.providers.base import Capabilities, Dedupe, Unknown
from payments.runtime import build_runtime
from tests.fake_provider import FakeProvider
from tests.outbound_support import new_payment
from tests.support import make_settings


class InFlight:
    """Counts what is in progress at once, and the most there ever were."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


def runtime_with(engine, provider, **overrides):
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=5,
        relay_max_seconds=20,
        **overrides,
    )
    rt = build_runtime(settings, engine)
    return replace(rt, providers={**rt.providers, provider.name: provider})


class WatchedTurns:
    """The relay's turns at the database (``relay_outbox.db_turns``), knowing which threads hold one now."""

    def __init__(self, size: int) -> None:
        self._turns = threading.BoundedSemaphore(size)
        self._held = threading.local()

    def __enter__(self) -> WatchedTurns:
        self._turns.acquire()
        self._held.depth = self.depth() + 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._held.depth -= 1
        self._turns.release()

    def depth(self) -> int:
        return getattr(self._held, "depth", 0)


def test_hanging_calls_hold_cheap_slots_within_the_provider_cap_and_the_rest_flow_past_them(mariadb, monkeypatch):
    quick_calls = 36
    calls_out = InFlight()
    hanging: list[str] = []
    quick: list[str] = []
    all_quick_sent = threading.Event()
    gave_up: list[str] = []
    lock = threading.Lock()

    def on_charge(request, key):
        # The first 4 calls to reach the provider hang until every other call has come and gone: the others
        # can only finish if the relay sends them past the hanging ones, through the 2 slots those leave.
        calls_out.enter()
        try:
            with lock:
                hangs = len(hanging) < 4
                (hanging if hangs else quick).append(request.payment_id)
                if len(quick) == quick_calls:
                    all_quick_sent.set()
            if hangs and not all_quick_sent.wait(30):
                gave_up.append(request.payment_id)
        finally:
            calls_out.leave()

    fake = FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), on_charge=on_charge)
    rt = runtime_with(
        mariadb,
        fake,
        relay_concurrency=16,
        relay_provider_concurrency=6,
        relay_db_concurrency=2,
        provider_rate_limit=1e5,
    )
    ids = [new_payment(rt, provider="fake") for _ in range(4 + quick_calls)]

    # Every breaker read goes to the database, as on a machine slow enough for the cache to run out between the
    # claim and the send: each of those reads must wait for a turn like the relay's other statements.
    monkeypatch.setattr(breaker, "CACHE_SECONDS", 0.0)
    turns = WatchedTurns(2)
    monkeypatch.setattr(relay_outbox, "db_turns", lambda size: turns)
    connections = InFlight()
    outside_a_turn: list[str] = []

    def checkout(*_):
        connections.enter()
        if turns.depth() == 0:
            outside_a_turn.append(threading.current_thread().name)

    def checkin(*_):
        connections.leave()

    event.listen(mariadb.pool, "checkout", checkout)
    event.listen(mariadb.pool, "checkin", checkin)
    try:
        relay_outbox.run_once(rt)
    finally:
        event.remove(mariadb.pool, "checkout", checkout)
        event.remove(mariadb.pool, "checkin", checkin)

    assert gave_up == [], "the quick calls waited behind the hanging ones"
    assert calls_out.most <= 6, f"{calls_out.most} calls out to one provider at once; the cap is 6"
    assert calls_out.most >= 5, "the cap, not the database turns, bounds the calls in flight"
    assert outside_a_turn == [], f"connections checked out outside a database turn, by {sorted(set(outside_a_turn))}"
    assert connections.most <= 2, f"{connections.most} connections in use at once; RELAY_DB_CONCURRENCY is 2"
    sent = Counter(key for _, key in fake.charges)
    with mariadb.connect() as conn:
        keys = dict(conn.execute(select(payment.c.payment_id, payment.c.idempotency_key)).all())
        statuses = set(conn.execute(select(payment.c.status)).scalars())
        recorded = conn.execute(select(provider_call.c.payment_id)).scalars().all()
    assert sent == Counter({keys[pid]: 1 for pid in ids}), "each payment sent once, with its own fixed key"
    assert sorted(recorded) == sorted(ids)
    assert statuses == {"Succeeded"}


def test_counting_failed_calls_for_the_breaker_waits_for_a_database_turn(mariadb, monkeypatch):
    # A call with no answer is counted against the breaker in a transaction of its own, after the outcome is applied.
    fake = FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), charges=[Unknown("timeout")] * 3)
    rt = runtime_with(mariadb, fake, relay_concurrency=8, relay_db_concurrency=1, provider_rate_limit=1e5)
    ids = [new_payment(rt, provider="fake") for _ in range(3)]
    turns = WatchedTurns(1)
    monkeypatch.setattr(relay_outbox, "db_turns", lambda size: turns)
    outside_a_turn: list[str] = []

    def checkout(*_):
        if turns.depth() == 0:
            outside_a_turn.append(threading.current_thread().name)

    event.listen(mariadb.pool, "checkout", checkout)
    try:
        relay_outbox.run_once(rt)
    finally:
        event.remove(mariadb.pool, "checkout", checkout)

    assert outside_a_turn == [], f"connections checked out outside a database turn, by {sorted(set(outside_a_turn))}"
    with mariadb.connect() as conn:
        assert conn.execute(select(provider_breaker.c.consecutive_failures)).scalar() == 3, "all three counted"
        assert set(conn.execute(select(payment.c.status).where(payment.c.payment_id.in_(ids))).scalars()) == {"Unknown"}


def test_a_drain_claims_in_batches_not_once_per_finished_unit():
    due = list(range(200))
    asked: list[int] = []

    def claim(n):
        asked.append(n)
        taken, due[:] = due[:n], due[n:]
        return taken

    def work(item):
        time.sleep(0.005 + item % 7 / 1000)  # units finish one by one, not all together
        return item

    results = workpool.drain(claim, work, concurrency=32, max_seconds=10, poll_seconds=0.5, name="batches")
    assert sorted(results) == list(range(200))
    # With a backlog, a claim waits for an eighth of the slots (4) to be free: one claim per finished unit
    # would be ~170 claims of 1.
    assert len(asked) <= 200 / 4 + 5, asked
    assert min(asked[:-1]) >= 4, asked


def test_an_idle_run_with_linger_picks_up_a_row_that_becomes_due_after_its_first_poll():
    due: list[int] = []
    polls: list[float] = []

    def claim(n):
        polls.append(time.monotonic())
        taken, due[:] = due[:n], due[n:]
        return taken

    threading.Timer(0.1, lambda: due.append(1)).start()
    started = time.monotonic()
    results = workpool.drain(
        claim,
        lambda item: item,
        concurrency=4,
        max_seconds=10,
        poll_seconds=0.02,
        name="test-linger",
        linger_seconds=0.3,
    )
    took = time.monotonic() - started
    assert results == [1], "found by a poll of the same run"
    assert 0.3 <= took < 0.6, f"an idle run lingers until linger_seconds after its start, then returns ({took:.2f} s)"
    assert len(polls) >= 5


def test_without_linger_an_idle_run_returns_after_one_poll():
    polls: list[float] = []
    results = workpool.drain(
        lambda n: polls.append(n) or [], lambda item: item, concurrency=4, max_seconds=10, poll_seconds=0.5, name="t"
    )
    assert results == [] and len(polls) == 1
