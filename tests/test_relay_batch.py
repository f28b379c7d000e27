"""Charges relayed in groups (``payments.outbound.relay_batch``): the same effects as one by one, in far fewer
statements.

Every test runs against real MariaDB (and one on SQLite). The comparison
test relays the same kinds of outcome once through the grouped path and once
through ``outbound_protocol.relay_charge`` and compares everything each payment left:
its row, its calls, its ledger events and lines, its outbox rows, its reviews.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import event, select, update

from compensator import relay_outbox
from payments.infra.db import utcnow
from payments.infra.group_commit import GroupCommit
from payments.infra.schema import (
    ledger_entry,
    ledger_event,
    manual_review,
    outbox,
    payment,
    provider_breaker,
    provider_call,
)
from payments.outbound import breaker, provider_calls
from payments.outbound import protocol as outbound_protocol
from payments.outbound.protocol import Context, Result, charge_params, relay_charge
from payments.outbound.relay_batch import apply_charges, prepare_charges, send_prepared
from payments.providers.base import (
    Capabilities,
    Dedupe,
    Evidence,
    Failed,
    Mismatch,
    Pending,
    Succeeded,
    Unknown,
)
from payments.runtime import build_runtime
from payments.states import BreakerState, OutboxStatus
from tests.fake_provider import FakeProvider
from tests.outbound_support import calls, expire_leases, new_payment, row
from tests.support import make_settings


def runtime_with(engine, provider, **overrides):
    overrides.setdefault("provider_rate_limit", 1e5)
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=5,
        relay_max_seconds=20,
        **overrides,
    )
    rt = build_runtime(settings, engine)
    return replace(rt, providers={**rt.providers, provider.name: provider})


class ByAmount(FakeProvider):
    """Answers each charge by its amount's last digit, so two payments of the same amount get the same answer."""

    ANSWERS = {
        0: lambda r: Succeeded(f"ch_{r.payment_id}", evidence=Evidence(200, '{"status":"succeeded"}', 12)),
        1: lambda r: Failed("card_declined", evidence=Evidence(200, '{"status":"failed"}', 9)),
        2: lambda r: Pending(f"ch_{r.payment_id}", evidence=Evidence(200, '{"status":"processing"}', 7)),
        3: lambda r: Unknown("timeout"),
        4: lambda r: Failed("rate_limited", definitive=False, evidence=Evidence(503, None, 3)),
        5: lambda r: Mismatch(provider_transaction_id=f"ch_{r.payment_id}"),
        6: lambda r: Unknown("review: idempotency_error"),
    }

    def charge(self, payment, idempotency_key, timeout):
        with self._lock:
            self.charges.append((payment, idempotency_key))
        return self.ANSWERS[payment.amount_minor % 10](payment)


def keyed(**kwargs) -> FakeProvider:
    return FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), **kwargs)


def claimed(rt, n=1000):
    """Claim every due relay row as relay_outbox does: (outbox id, provider, lease token) for the charges."""
    rows = outbound_protocol.claim_sends(rt.engine, utcnow(), n, rt.settings.call_lease_seconds)
    return [(outbox_id, provider, lease) for outbox_id, provider, lease, _ in rows]


def relay_grouped(rt):
    """Claim, prepare together, send each, apply together: relay_outbox's grouped path, step by step."""
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepared, others = prepare_charges(ctx, claimed(rt))
    group = GroupCommit(lambda units: apply_charges(ctx, units))
    results = [send_prepared(ctx, charge, group, threading.Lock) for charge in prepared]
    return prepared, others, results, group


def effects(rt, payment_id):
    """Everything a payment left behind, with its own numbers and row ids replaced by their roles."""
    p = row(rt, payment_id)
    with rt.engine.connect() as conn:
        call_rows = conn.execute(
            select(provider_call).where(provider_call.c.payment_id == payment_id).order_by(provider_call.c.id)
        ).mappings()
        call_ids = {}
        call_list = []
        for c in call_rows:
            call_ids[c["id"]] = f"call{len(call_ids)}"
            call_list.append(
                (
                    c["operation"],
                    c["outcome"],
                    c["error_code"],
                    c["http_status"],
                    c["response"],
                    c["latency_ms"],
                    c["idempotency_key"] == p["idempotency_key"],
                    c["request_digest"] == provider_calls.request_digest(c["operation"], charge_params(p))
                    if c["operation"] == "charge"
                    else None,
                    c["finished_at"] is not None,
                )
            )
        events = []
        for e in conn.execute(
            select(ledger_event).where(ledger_event.c.payment_id == payment_id).order_by(ledger_event.c.id)
        ).mappings():
            lines = conn.execute(
                select(ledger_entry.c.account, ledger_entry.c.amount_minor, ledger_entry.c.currency)
                .where(ledger_entry.c.ledger_event_id == e["id"])
                .order_by(ledger_entry.c.id)
            ).all()
            source = f"call:{e['source_id']}" if e["source_type"] != "api" else None
            events.append(
                (
                    e["event_type"],
                    e["amount_minor"],
                    e["currency"],
                    e["source_type"],
                    call_ids.get(int(e["source_id"])) if source else None,
                    _without_order_no(json.loads(e["details"]) if e["details"] else None),
                    [tuple(line) for line in lines],
                )
            )
        outbox_rows = []
        for o in conn.execute(
            select(outbox).where(outbox.c.aggregate_id == payment_id).order_by(outbox.c.id)
        ).mappings():
            payload = json.loads(o["payload"])
            payload.pop("occurred_at", None)
            payload = _without_order_no(payload)
            if str(payload.get("source", "")).startswith("call:"):
                payload["source"] = call_ids[int(payload["source"].split(":")[1])]
            outbox_rows.append((o["event_type"], o["status"], o["attempts"], o["last_error"], payload))
        reviews = sorted(
            conn.execute(select(manual_review.c.kind).where(manual_review.c.payment_id == payment_id)).scalars()
        )
    source_kind, _, source_id = (p["status_source"] or "").partition(":")
    return {
        "payment": (
            p["status"],
            p["provider_transaction_id"] and p["provider_transaction_id"].replace(payment_id, "<payment>"),
            p["error_code"],
            p["query_attempts"],
            p["next_query_at"] is not None,
            source_kind,
            call_ids.get(int(source_id)) if source_id.isdigit() else source_id,
        ),
        "calls": call_list,
        "ledger": events,
        "outbox": [
            (t, s, a, e, {k: (v.replace(payment_id, "<payment>") if isinstance(v, str) else v) for k, v in pl.items()})
            for t, s, a, e, pl in outbox_rows
        ],
        "reviews": reviews,
    }


def test_a_group_leaves_each_payment_exactly_what_relaying_it_alone_leaves(mariadb):
    fake = ByAmount(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True))
    rt = runtime_with(mariadb, fake)
    amounts = [1000 + digit for digit in ByAmount.ANSWERS]
    grouped = [new_payment(rt, provider="fake", amount=a) for a in amounts]
    prepared, others, results, group = relay_grouped(rt)
    assert others == [], "every row was a plain first send"
    assert len(prepared) == len(amounts)
    assert group.groups == len(amounts), "sent one after the other, each outcome is its own group here"

    # The same outcomes, one payment at a time through relay_charge.
    alone = [new_payment(rt, provider="fake", amount=a) for a in amounts]
    ctx = Context(rt.engine, rt.providers, rt.settings)
    tokens = {outbox_id: lease for outbox_id, _, lease in claimed(rt)}
    by_payment = _outbox_ids(rt)
    expected = [relay_charge(ctx, by_payment[p], "fake", tokens[by_payment[p]]) for p in alone]

    assert results == expected
    for ours, theirs in zip(grouped, alone, strict=True):
        assert effects(rt, ours) == effects(rt, theirs), row(rt, ours)["amount_minor"]


def test_outcomes_that_arrive_together_are_written_in_one_transaction(mariadb):
    gate = threading.Event()
    fake = keyed(on_charge=lambda request, key: gate.wait(5))
    # The default rate: the leases leave the sends a wait of seconds, so none needs a statement to go out.
    rt = runtime_with(mariadb, fake, provider_rate_limit=50)
    ids = [new_payment(rt, provider="fake", amount=1000 + n) for n in range(30)]
    ctx = Context(rt.engine, rt.providers, rt.settings)

    statements: list[str] = []
    commits: list[int] = []

    def on_statement(conn, cursor, statement, *args):
        statements.append(statement)

    def on_commit(conn):
        commits.append(1)

    rows = claimed(rt)
    event.listen(mariadb, "before_cursor_execute", on_statement)
    event.listen(mariadb, "commit", on_commit)
    try:
        prepared, others = prepare_charges(ctx, rows)
        prepare_statements, prepare_commits = len(statements), len(commits)
        group = GroupCommit(lambda units: apply_charges(ctx, units))
        threads = [threading.Thread(target=send_prepared, args=(ctx, c, group, threading.Lock)) for c in prepared]
        for t in threads:
            t.start()
        time.sleep(0.3)  # every call is out, waiting for the provider
        gate.set()
        for t in threads:
            t.join(10)
    finally:
        event.remove(mariadb, "before_cursor_execute", on_statement)
        event.remove(mariadb, "commit", on_commit)

    assert others == [] and len(prepared) == 30
    assert prepare_statements <= 8 and prepare_commits == 1, statements[:prepare_statements]
    apply_statements = len(statements) - prepare_statements
    # Alone, each payment's apply costs about eight statements and a COMMIT: 240 and 30.
    assert group.groups <= 5, f"{group.groups} groups for 30 outcomes that came back together"
    assert apply_statements <= 10 * group.groups, apply_statements
    assert len(commits) - prepare_commits == group.groups
    assert {row(rt, pid)["status"] for pid in ids} == {"Succeeded"}
    for pid in ids:
        (call,) = calls(rt, pid)
        assert row(rt, pid)["status_source"] == f"call:{call['id']}" and call["outcome"] == "Succeeded"


def test_rows_that_are_not_a_plain_first_send_are_left_to_relay_charge(mariadb):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    plain = new_payment(rt, provider="fake")
    sent_before = new_payment(rt, provider="fake")
    past_deadline = new_payment(rt, provider="fake")
    already_done = new_payment(rt, provider="fake")
    other_adapter = new_payment(rt, provider="fake")
    with rt.engine.begin() as conn:
        provider_calls.start(conn, provider="fake", operation="charge", params={}, now=utcnow(), payment_id=sent_before)
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == past_deadline)
            .values(deadline_at=utcnow() - timedelta(seconds=1))
        )
        conn.execute(update(payment).where(payment.c.payment_id == already_done).values(status="Succeeded"))
        conn.execute(update(payment).where(payment.c.payment_id == other_adapter).values(provider="sandbox"))
    rows = claimed(rt)
    by_payment = _outbox_ids(rt)
    ctx = Context(rt.engine, rt.providers, rt.settings)

    prepared, others = prepare_charges(ctx, rows)

    assert [c.current["payment_id"] for c in prepared] == [plain]
    assert sorted(others) == sorted(by_payment[p] for p in (sent_before, past_deadline, already_done, other_adapter))
    assert calls(rt, past_deadline) == [] and row(rt, past_deadline)["status"] == "Created", "nothing written"
    # The rows left out are still claimed by us: relay_charge takes them with the claim's token.
    tokens = {outbox_id: lease for outbox_id, _, lease in rows}
    results = {oid: relay_charge(ctx, oid, "fake", tokens[oid]) for oid in others}
    assert results[by_payment[sent_before]] == Result.APPLIED, "a re-send with the same key (the fake dedupes)"
    assert results[by_payment[past_deadline]] == Result.REVIEW
    assert results[by_payment[already_done]] == Result.SKIPPED
    assert results[by_payment[other_adapter]] == Result.REVIEW


def test_a_row_whose_lease_another_worker_holds_is_neither_prepared_nor_sent(mariadb):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    stale = claimed(rt)
    with rt.engine.begin() as conn:  # our lease ran out and another worker claimed the row
        conn.execute(update(outbox).values(next_attempt_at=utcnow()))
    fresh = claimed(rt)
    ctx = Context(rt.engine, rt.providers, rt.settings)

    prepared, others = prepare_charges(ctx, stale)
    assert prepared == [] and others == [stale[0][0]]
    assert relay_charge(ctx, *stale[0]) == Result.SKIPPED
    assert calls(rt, payment_id) == [] and fake.charges == []
    prepared, _ = prepare_charges(ctx, fresh)
    assert [c.current["payment_id"] for c in prepared] == [payment_id]


def test_a_prepared_charge_whose_breaker_opened_meanwhile_is_not_sent_and_comes_back_as_a_first_send(mariadb):
    # A refusal answers the later send: Failed on a first send, Unknown on a re-send (reported_status). The
    # withheld call went nowhere, so the later send is a plain first send and its refusal is final.
    refused = Failed("invalid_request", definitive=True, refusal=True)
    fake = FakeProvider(Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True), charges=[refused])
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepared, _ = prepare_charges(ctx, claimed(rt))
    retry_at = utcnow() + timedelta(seconds=30)
    with rt.engine.begin() as conn:
        conn.execute(
            provider_breaker.insert().values(
                provider="fake",
                state=BreakerState.OPEN,
                consecutive_failures=5,
                open_count=1,
                retry_at=retry_at,
                updated_at=utcnow(),
            )
        )
    breaker.clear_cache()

    group = GroupCommit(lambda units: apply_charges(ctx, units))
    assert send_prepared(ctx, prepared[0], group, threading.Lock) == Result.DEFERRED

    assert fake.charges == []
    (call,) = calls(rt, payment_id)
    assert (call["outcome"], call["error_code"], call["http_status"]) == ("Failed", "not_sent_circuit_open", None)
    with rt.engine.connect() as conn:
        due = conn.execute(select(outbox.c.next_attempt_at).where(outbox.c.event_type == "ChargeRequested")).scalar()
    assert retry_at <= due <= retry_at + timedelta(seconds=1)

    with rt.engine.begin() as conn:  # the breaker closes and the row is due again
        conn.execute(provider_breaker.delete())
        conn.execute(update(outbox).values(next_attempt_at=utcnow()))
    breaker.clear_cache()
    relay_outbox.run_once(rt)
    assert len(fake.charges) == 1
    assert row(rt, payment_id)["status"] == "Failed"
    with rt.engine.connect() as conn:
        assert conn.execute(select(manual_review.c.kind)).scalars().all() == []


def test_a_crash_between_the_grouped_prepare_and_the_send_sends_nothing_of_a_non_deduping_provider_to_review(mariadb):
    # Neither dedupes nor can be queried: a charge whose call is on file without an outcome can only go to a
    # person. A grouped prepare puts many on file long before they go out (they wait for provider slots), so
    # such charges are never prepared in groups: each is prepared right before its own send.
    fake = FakeProvider(Capabilities(dedupe=Dedupe.NONE, query_by_merchant_id=False))
    rt = runtime_with(mariadb, fake)
    ids = [new_payment(rt, provider="fake", amount=1000 + n) for n in range(3)]
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepare_charges(ctx, claimed(rt))  # the relay claims and prepares, and is killed before any send

    expire_leases(rt)
    relay_outbox.run_once(rt)  # another relay takes the rows over once the leases ran out

    assert len(fake.charges) == 3
    assert {row(rt, pid)["status"] for pid in ids} == {"Succeeded"}
    with rt.engine.connect() as conn:
        assert conn.execute(select(manual_review.c.kind)).scalars().all() == []


def deadlocked(*args, **kwargs):
    raise RuntimeError("Deadlock found when trying to get lock")


def test_a_prepare_that_fails_writes_nothing_and_leaves_every_row_to_relay_charge(mariadb, monkeypatch):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    ids = [new_payment(rt, provider="fake") for _ in range(3)]
    rows = claimed(rt)
    ctx = Context(rt.engine, rt.providers, rt.settings)
    monkeypatch.setattr("payments.outbound.relay_batch.apply_planned", deadlocked)
    prepared, others = prepare_charges(ctx, rows)
    assert prepared == [] and sorted(others) == sorted(outbox_id for outbox_id, _, _ in rows)
    assert all(calls(rt, pid) == [] and row(rt, pid)["status"] == "Created" for pid in ids), "rolled back"
    monkeypatch.undo()
    assert [relay_charge(ctx, *r) for r in rows] == [Result.APPLIED] * 3
    assert {row(rt, pid)["status"] for pid in ids} == {"Succeeded"}


def test_a_group_whose_transaction_fails_is_applied_one_by_one(mariadb, monkeypatch):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    ids = [new_payment(rt, provider="fake") for _ in range(3)]
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepared, _ = prepare_charges(ctx, claimed(rt))
    monkeypatch.setattr("payments.outbound.relay_batch.apply_planned", deadlocked)
    group = GroupCommit(lambda units: apply_charges(ctx, units))
    results = [send_prepared(ctx, charge, group, threading.Lock) for charge in prepared]
    assert len(prepared) == 3 and results == [Result.APPLIED] * 3
    for pid in ids:
        (call,) = calls(rt, pid)
        assert row(rt, pid)["status"] == "Succeeded" and call["outcome"] == "Succeeded"
        assert row(rt, pid)["status_source"] == f"call:{call['id']}"
    with rt.engine.connect() as conn:
        confirmed = conn.execute(
            select(ledger_event.c.payment_id).where(ledger_event.c.event_type == "PaymentConfirmed")
        ).scalars()
        assert sorted(confirmed) == sorted(ids), "the failed group wrote nothing: one confirmation each"


def test_an_answer_for_a_payment_the_notification_already_settled_changes_only_the_call_and_the_row(mariadb):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepared, _ = prepare_charges(ctx, claimed(rt))
    with rt.engine.begin() as conn:  # the provider's notification was applied while the call was out
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id)
            .values(status="Succeeded", status_source="callback:1", provider_transaction_id=f"ch_{payment_id}")
        )
    group = GroupCommit(lambda units: apply_charges(ctx, units))
    assert send_prepared(ctx, prepared[0], group, threading.Lock) == Result.UNCHANGED
    assert group.units == 1, "applied with its group, not one by one"
    assert row(rt, payment_id)["status_source"] == "callback:1"
    (call,) = calls(rt, payment_id)
    assert call["outcome"] == "Succeeded"
    with rt.engine.connect() as conn:
        assert conn.execute(select(outbox.c.status).where(outbox.c.event_type == "ChargeRequested")).scalar() == (
            OutboxStatus.DONE
        )


def test_two_compensators_relaying_one_backlog_send_each_payment_once(mariadb):
    fake = keyed(on_charge=lambda request, key: time.sleep(0.005))
    rt = runtime_with(mariadb, fake, relay_concurrency=32, relay_provider_concurrency=32)
    other = replace(rt, settings=replace(rt.settings, provider_rate_limit=1.0001e5))  # its own limiter
    ids = [new_payment(rt, provider="fake", amount=1000 + n) for n in range(150)]
    runs = [threading.Thread(target=relay_outbox.run_once, args=(r,)) for r in (rt, other)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(60)
    sent = Counter(request.payment_id for request, _ in fake.charges)
    assert sent == Counter(dict.fromkeys(ids, 1))
    with rt.engine.connect() as conn:
        assert set(conn.execute(select(payment.c.status)).scalars()) == {"Succeeded"}
        assert conn.execute(select(provider_call.c.payment_id)).scalars().all().__len__() == 150
        confirmed = conn.execute(
            select(ledger_event.c.payment_id).where(ledger_event.c.event_type == "PaymentConfirmed")
        ).scalars()
        assert Counter(confirmed) == Counter(dict.fromkeys(ids, 1)), "one confirmation each in the ledger"


def test_grouped_relaying_works_on_the_embedded_sqlite_database(sqlite):
    fake = ByAmount(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True))
    rt = runtime_with(sqlite, fake)
    ids = {digit: new_payment(rt, provider="fake", amount=1000 + digit) for digit in (0, 1, 2, 3)}
    relay_outbox.run_once(rt, max_seconds=5)
    assert row(rt, ids[0])["status"] == "Succeeded"
    assert row(rt, ids[1])["status"] == "Failed"
    assert row(rt, ids[2])["status"] == "Pending"
    assert row(rt, ids[3])["status"] == "Unknown"


def _without_order_no(doc):
    """Each payment has its own order number: compared as a role, like the payment's own number."""
    return {k: ("<order>" if k == "order_no" else v) for k, v in doc.items()} if doc else doc


def _outbox_ids(rt):
    with rt.engine.connect() as conn:
        rows = conn.execute(select(outbox.c.id, outbox.c.payload).where(outbox.c.event_type == "ChargeRequested")).all()
    return {json.loads(payload)["payment_id"]: outbox_id for outbox_id, payload in rows}


# GroupCommit on its own: threads, groups, errors.


def test_each_unit_gets_its_own_result_and_units_that_wait_together_share_a_group():
    release = threading.Event()
    written: list[list[int]] = []

    def write(units):
        written.append(list(units))
        if len(written) == 1:
            release.wait(5)  # the first group is slow; everybody else queues behind it
        return [u * 10 for u in units]

    group: GroupCommit[int, int] = GroupCommit(write, max_group=100)
    results: dict[int, int] = {}

    def submit(n):
        results[n] = group.submit(n)

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    time.sleep(0.05)
    others = [threading.Thread(target=submit, args=(n,)) for n in range(1, 41)]
    for t in others:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in [first, *others]:
        t.join(5)
    assert results == {n: n * 10 for n in range(41)}
    assert written[0] == [0]
    assert sorted(u for g in written for u in g) == list(range(41))
    assert len(written) <= 3, f"40 units that waited together were written in {len(written)} groups"


def test_a_group_capped_at_max_group_leaves_the_rest_to_the_next_leader():
    release = threading.Event()
    sizes: list[int] = []

    def write(units):
        sizes.append(len(units))
        if len(sizes) == 1:
            release.wait(5)
        return list(units)

    group: GroupCommit[int, int] = GroupCommit(write, max_group=4)
    threads = [threading.Thread(target=group.submit, args=(n,)) for n in range(13)]
    threads[0].start()
    time.sleep(0.05)
    for t in threads[1:]:
        t.start()
    time.sleep(0.2)
    release.set()
    for t in threads:
        t.join(5)
    assert sum(sizes) == 13 and max(sizes) <= 4 and (group.groups, group.units) == (len(sizes), 13)


def test_an_error_reaches_every_unit_of_its_group_and_no_other():
    calls_made = []

    def write(units):
        calls_made.append(list(units))
        if "bad" in units:
            raise ValueError("boom")
        return ["ok"] * len(units)

    group: GroupCommit[str, str] = GroupCommit(write)
    with pytest.raises(ValueError, match="boom"):
        group.submit("bad")
    assert group.submit("good") == "ok"
    assert calls_made == [["bad"], ["good"]]


def test_a_call_recorded_as_never_sent_starts_no_not_found_grace(mariadb):
    # Withheld by the breaker before it went out: a NotFound about the payment is the whole truth at once.
    from payments.outbound.protocol import query_payment
    from tests.outbound_support import claim_for_query

    fake = keyed()
    rt = runtime_with(mariadb, fake)
    assert rt.settings.query_not_found_grace_seconds == 60
    payment_id = new_payment(rt, provider="fake")
    ctx = Context(rt.engine, rt.providers, rt.settings)
    prepared, _ = prepare_charges(ctx, claimed(rt))
    with rt.engine.begin() as conn:
        conn.execute(
            provider_breaker.insert().values(
                provider="fake",
                state=BreakerState.OPEN,
                consecutive_failures=5,
                open_count=1,
                retry_at=utcnow() + timedelta(seconds=30),
                updated_at=utcnow(),
            )
        )
    breaker.clear_cache()
    assert send_prepared(ctx, prepared[0], GroupCommit(lambda u: apply_charges(ctx, u)), threading.Lock) == (
        Result.DEFERRED
    )

    lease = claim_for_query(rt.engine, payment_id)
    assert query_payment(ctx, payment_id, "fake", lease, budget_ok=True) == Result.RESEND
    assert row(rt, payment_id)["next_query_at"] < utcnow() + timedelta(seconds=60), "no grace to wait out"
    assert fake.charges == [] and fake.queries == [payment_id]
