"""process_batch (the consumer's micro-batches): one transaction, a savepoint per message, every effect kept."""

from __future__ import annotations

import json
from datetime import timedelta

from sqlalchemy import func, select, update

from payments.inbound.callbacks import CallbackResult, process_callback, store_callback
from payments.inbound.processing import process_batch
from payments.infra.backoff import RetryPolicy
from payments.infra.schema import ledger_event, outbox, payment, payment_callback_log, processed_event
from payments.providers import build_providers
from payments.states import CallbackStatus
from tests.support import create_payment, make_settings, sandbox_event, signed


def _stored(engine, event) -> int:
    body, headers = signed(event)
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def _count(engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table).where(*where)).scalar()


def test_a_failing_message_rolls_back_only_itself_and_the_rest_of_the_batch_commits(engine):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=1000 + n) for n in range(3)]
    good = [_stored(engine, sandbox_event(p, amount=1000 + n)) for n, p in enumerate(paid)]
    # No such payment (yet): the message fails, is recorded for a retry, and must not undo its neighbours.
    orphan = _stored(engine, sandbox_event("pay_01NOSUCHPAYMENT0000000000", amount=5))
    twice = create_payment(engine, amount=900)
    duplicate_event = sandbox_event(twice, amount=900)  # one event delivered twice: two rows, one effect
    first_copy, second_copy = _stored(engine, duplicate_event), _stored(engine, duplicate_event)

    messages = [good[0], orphan, good[1], good[1], first_copy, second_copy, good[2], 987654321]
    outcomes = process_batch(engine, providers, messages, RetryPolicy())

    assert [o for _, o in outcomes] == [
        CallbackResult.APPLIED,
        CallbackResult.RETRY,
        CallbackResult.APPLIED,
        CallbackResult.SKIPPED,  # the same row twice in one batch: read once, applied once
        CallbackResult.APPLIED,
        CallbackResult.DUPLICATE,
        CallbackResult.APPLIED,
        CallbackResult.MISSING,
    ]
    with engine.connect() as conn:
        statuses = dict(conn.execute(select(payment_callback_log.c.id, payment_callback_log.c.status)).all())
        orphan_row = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == orphan)).one()
        ours = payment.c.payment_id.in_([*paid, twice])
        paid_status = conn.execute(select(payment.c.status).where(ours)).scalars().all()
    assert {statuses[i] for i in (*good, first_copy, second_copy)} == {CallbackStatus.PROCESSED}
    assert statuses[orphan] == CallbackStatus.FAILED and orphan_row.retry_count == 1
    assert paid_status == ["Succeeded"] * 4
    # Exactly one of each effect per applied payment: the savepoint took back everything the orphan wrote.
    assert _count(engine, ledger_event, ledger_event.c.event_type == "PaymentConfirmed") == 4
    assert _count(engine, outbox, outbox.c.event_type == "PaymentSucceeded") == 4
    assert _count(engine, processed_event) == 4

    # The batch left nothing half-done: processing any row again is a no-op.
    for log_id in good:
        assert process_callback(engine, providers, log_id, RetryPolicy()) == CallbackResult.SKIPPED


def test_stop_finishes_the_message_in_hand_and_leaves_the_rest_untouched(engine):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=700) for _ in range(3)]
    ids = [_stored(engine, sandbox_event(p, amount=700)) for p in paid]
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 1  # stop asked as soon as the first message is done

    outcomes = process_batch(engine, providers, ids, RetryPolicy(), stop=stop)
    assert [o for _, o in outcomes] == [CallbackResult.APPLIED, None, None]
    assert _count(engine, payment_callback_log, payment_callback_log.c.status == CallbackStatus.PENDING) == 2
    assert _count(engine, payment, payment.c.status == "Succeeded") == 1


# --- the set-wise path: the common batch in a few statements, every row's effects exactly as alone ------------


def _go_row_by_row_forbidden(monkeypatch) -> None:  # noqa: ANN001
    """Fail the test if process_batch leaves the set-wise path for this batch."""

    def refuse(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("this batch should have been written set-wise")

    monkeypatch.setattr("payments.inbound.processing._message_by_message", refuse)


def _row_by_row_calls(monkeypatch) -> list[int]:  # noqa: ANN001
    """Count the batches process_batch sends message by message."""
    import payments.inbound.processing

    calls: list[int] = []
    real = payments.inbound.processing._message_by_message

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("payments.inbound.processing._message_by_message", counted)
    return calls


def _scenario(engine, tag: str) -> tuple[list[int], list[str]]:
    """One of every usual case the set-wise path takes; return (callback ids, the references they name)."""
    from tests.test_ledger import create_refund

    def pay(n: int, **kw) -> str:  # noqa: ANN003
        return create_payment(engine, payment_id=f"pay_{tag}_{n}", amount=1000 + n, **kw)

    def event(reference: str, n: int, **kw) -> dict:  # noqa: ANN003
        kw.setdefault("amount", 1000 + n)
        return sandbox_event(reference, event_id=f"evt_{tag}_{n}", provider_transaction_id=f"ch_{tag}_{n}", **kw)

    cases = [
        (pay(0), event(f"pay_{tag}_0", 0)),
        (pay(1, status="Created"), event(f"pay_{tag}_1", 1)),  # walks Created -> Pending -> Succeeded
        (pay(2, status="Unknown"), event(f"pay_{tag}_2", 2)),
        (pay(3), event(f"pay_{tag}_3", 3, event_type="charge.failed", failure_code="card_declined")),
        (pay(4), event(f"pay_{tag}_4", 4, event_type="charge.failed")),  # no code: "declined"
        (pay(5, provider_transaction_id=f"ch_{tag}_5"), event(f"pay_{tag}_5", 5)),  # reference already known
        # Already Succeeded by the provider call's answer: a NOOP, the row processed, nothing else written.
        (pay(7, status="Succeeded", provider_transaction_id=f"ch_{tag}_7"), event(f"pay_{tag}_7", 7)),
    ]
    paid = pay(6, status="Succeeded", provider_transaction_id=f"ch_{tag}_6")
    refund_id = create_refund(engine, paid, 300)
    cases.append((refund_id, event(paid, 6, event_type="refund.succeeded", amount=300, merchant_refund_id=refund_id)))
    ids = [_stored(engine, ev) for _, ev in cases]
    # Stored with no index columns (as an older gateway did): processing writes them from the verified event.
    with engine.begin() as conn:
        conn.execute(
            update(payment_callback_log)
            .where(payment_callback_log.c.id == ids[0])
            .values(order_no=None, payment_order_no=None, provider_event_id=None, event_type=None)
        )
    return ids, [reference for reference, _ in cases]


def _effects(engine, ids: list[int], references: list[str], tag: str) -> list[dict]:
    """Everything processing wrote for each callback, with ids and clocks left out and the tag made neutral."""
    import json

    from payments.infra.schema import ledger_entry, refund

    number = {log_id: n for n, log_id in enumerate(ids)}

    def neutral(value):  # noqa: ANN001, ANN202
        text = json.dumps(value, sort_keys=True, default=str)
        for n, reference in enumerate(references):
            if reference.startswith("re_"):  # refund ids are random: named by their case
                text = text.replace(reference, f"re_case{n}")
        text = text.replace(f"_{tag}_", "_T_")
        for log_id, n in number.items():
            text = text.replace(f'callback:{log_id}"', f'callback:#{n}"').replace(f'"{log_id}"', f'"#{n}"')
        return json.loads(text)

    out = []
    with engine.connect() as conn:
        for log_id, reference in zip(ids, references, strict=True):
            table, key = (
                (refund, refund.c.refund_id) if reference.startswith("re_") else (payment, payment.c.payment_id)
            )
            target = conn.execute(select(table).where(key == reference)).mappings().one()
            row = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == log_id)).one()
            events = conn.execute(
                select(ledger_event).where(ledger_event.c.source_id == str(log_id)).order_by(ledger_event.c.id)
            ).mappings()
            ledger = []
            for ev in events:
                lines = conn.execute(
                    select(ledger_entry.c.account, ledger_entry.c.amount_minor, ledger_entry.c.currency)
                    .where(ledger_entry.c.ledger_event_id == ev["id"])
                    .order_by(ledger_entry.c.id)
                ).all()
                assert ev["created_at"] == row.update_time, "one clock for every effect of a callback"
                ledger.append(
                    {
                        **{k: ev[k] for k in ("event_type", "payment_id", "refund_id", "amount_minor", "currency")},
                        **{k: ev[k] for k in ("source_type", "source_id", "dedupe_key")},
                        "details": json.loads(ev["details"]),
                        "lines": [list(line) for line in lines],
                    }
                )
            domain = conn.execute(
                select(outbox.c.event_type, outbox.c.payload, outbox.c.status, outbox.c.attempts).where(
                    outbox.c.aggregate_id == reference
                )
            ).all()
            inbox = conn.execute(
                select(processed_event.c.provider_event_id, processed_event.c.callback_log_id).where(
                    processed_event.c.callback_log_id == log_id
                )
            ).all()
            effect = {
                "target": {
                    k: target[k]
                    for k in ("status", "status_source", "error_code", "next_query_at")
                    + (("provider_refund_id",) if table is refund else ("provider_transaction_id",))
                },
                "target_updated_at_is_the_callbacks": target["updated_at"] == row.update_time,
                "row": {
                    k: getattr(row, k)
                    for k in ("status", "result", "order_no", "payment_order_no", "provider_event_id", "event_type")
                },
                "ledger": ledger,
                "outbox": [
                    [t, {k: v for k, v in json.loads(p).items() if k != "occurred_at"}, s, a] for t, p, s, a in domain
                ],
                "inbox": [[e, str(c)] for e, c in inbox],
            }
            out.append(neutral(effect))
    return out


def test_a_usual_batch_is_written_set_wise_with_every_effect_each_row_gets_alone(engine, monkeypatch):
    providers = build_providers(make_settings())
    alone_ids, alone_refs = _scenario(engine, "alone")
    expected = [CallbackResult.APPLIED] * 6 + [CallbackResult.NOOP, CallbackResult.APPLIED]
    assert [process_callback(engine, providers, log_id, RetryPolicy()) for log_id in alone_ids] == expected
    batch_ids, batch_refs = _scenario(engine, "batch")
    _go_row_by_row_forbidden(monkeypatch)
    # A redelivery in the same batch, a row already processed and a row the database lost ride along.
    messages = [*batch_ids, batch_ids[2], alone_ids[0], 987654321]
    outcomes = process_batch(engine, providers, messages, RetryPolicy())

    assert [o for _, o in outcomes] == expected + [
        CallbackResult.SKIPPED,
        CallbackResult.SKIPPED,
        CallbackResult.MISSING,
    ]
    alone = _effects(engine, alone_ids, alone_refs, "alone")
    batch = _effects(engine, batch_ids, batch_refs, "batch")
    for n, (a, b) in enumerate(zip(alone, batch, strict=True)):
        assert b == a, f"case {n}"
    # Spot checks that the comparison compares something.
    assert batch[1]["ledger"][0]["details"]["path"] == ["Pending", "Succeeded"]
    assert batch[3]["target"]["error_code"] == "card_declined" and batch[4]["target"]["error_code"] == "declined"
    assert batch[7]["ledger"][0]["event_type"] == "RefundConfirmed"
    assert batch[0]["row"]["provider_event_id"] == "evt_T_0"
    assert batch[6]["row"]["result"] == "noop: already Succeeded" and batch[6]["ledger"] == []
    assert all(len(effect["inbox"]) == 1 for effect in batch)
    assert [len(effect["outbox"]) for effect in batch] == [1] * 6 + [0, 1]
    # The set-wise path records each row's attempt too (one multi-row INSERT), as the per-row path does.
    assert _attempts(engine, batch_ids) == _attempts(engine, alone_ids) == [[o.value] for o in expected]


def _attempts(engine, ids) -> list[list[str]]:
    from payments.infra.schema import callback_attempt

    t = callback_attempt
    with engine.connect() as conn:
        rows = conn.execute(select(t.c.callback_log_id, t.c.outcome).order_by(t.c.id)).all()
    return [[outcome for log_id, outcome in rows if log_id == i] for i in ids]


def test_a_batch_with_unusual_rows_goes_row_by_row_and_each_row_gets_its_own_outcome(engine, monkeypatch):
    from payments.infra.schema import manual_review

    providers = build_providers(make_settings())
    good = [create_payment(engine, amount=500 + n) for n in range(4)]
    settled = create_payment(engine, status="Succeeded", provider_transaction_id="ch_settled", amount=800)
    failed = create_payment(engine, status="Failed", amount=700)
    earlier = _stored(engine, applied_event := sandbox_event(good[3], amount=503))
    assert process_callback(engine, providers, earlier, RetryPolicy()) == CallbackResult.APPLIED
    body, headers = signed(sandbox_event(good[2], amount=502), secret="whsec_not_the_right_one")
    forged = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    ids = [
        _stored(engine, sandbox_event(good[0], amount=500)),
        forged,  # bad signature: rejected (status 3), never applied
        _stored(engine, sandbox_event(settled, amount=800, provider_transaction_id="ch_settled")),  # stale: noop
        _stored(engine, sandbox_event("pay_01NOSUCHPAYMENT0000000000", amount=5)),  # no payment: retried
        _stored(engine, sandbox_event(failed, amount=700)),  # success for a Failed payment: conflict
        _stored(engine, applied_event),  # the event applied by ``earlier``: a duplicate
        _stored(engine, sandbox_event(good[1], amount=501)),
    ]
    calls = _row_by_row_calls(monkeypatch)
    outcomes = process_batch(engine, providers, ids, RetryPolicy())

    assert calls == [1]
    assert [o for _, o in outcomes] == [
        CallbackResult.APPLIED,
        CallbackResult.REJECTED,
        CallbackResult.NOOP,
        CallbackResult.RETRY,
        CallbackResult.CONFLICT,
        CallbackResult.DUPLICATE,
        CallbackResult.APPLIED,
    ]
    with engine.connect() as conn:
        status = dict(conn.execute(select(payment.c.payment_id, payment.c.status)).all())
        reviews = conn.execute(select(manual_review.c.kind, manual_review.c.callback_log_id)).all()
    assert [status[p] for p in good] == ["Succeeded", "Succeeded", "Pending", "Succeeded"]
    assert (status[settled], status[failed]) == ("Succeeded", "Failed")
    assert reviews == [("conflicting_report", ids[4])]
    # One effect per applied row, none for the others (the earlier callback's included).
    assert _count(engine, ledger_event) == 3
    assert _count(engine, outbox, outbox.c.event_type == "PaymentSucceeded") == 3
    assert _count(engine, processed_event) == 5  # claimed: earlier, the noop, the conflict and both applied
    rows = {r.id: r for r in _rows(engine)}
    assert rows[forged].status == CallbackStatus.REJECTED
    assert (rows[ids[3]].status, rows[ids[3]].retry_count) == (CallbackStatus.FAILED, 1)
    assert {rows[i].status for i in (ids[0], ids[2], ids[4], ids[5], ids[6])} == {CallbackStatus.PROCESSED}
    # One attempt row per message, with its own outcome: the failed one's savepoint took nothing else with it.
    assert _attempts(engine, ids) == [[o.value] for _, o in outcomes]


def test_a_duplicate_found_only_by_the_inbox_sends_the_batch_row_by_row_with_nothing_applied_twice(engine, monkeypatch):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=600 + n) for n in range(3)]
    events = [sandbox_event(p, amount=600 + n) for n, p in enumerate(paid)]
    first = _stored(engine, events[1])
    assert process_callback(engine, providers, first, RetryPolicy()) == CallbackResult.APPLIED
    # Every row verifies and names a Pending-or-done payment: only the INSERT into processed_event tells.
    ids = [_stored(engine, ev) for ev in events]
    calls = _row_by_row_calls(monkeypatch)
    outcomes = process_batch(engine, providers, ids, RetryPolicy())

    assert calls == [1]
    assert [o for _, o in outcomes] == [CallbackResult.APPLIED, CallbackResult.DUPLICATE, CallbackResult.APPLIED]
    assert _count(engine, ledger_event) == 3 and _count(engine, outbox) == 3 and _count(engine, processed_event) == 3
    assert _count(engine, payment, payment.c.status == "Succeeded") == 3


def test_a_row_failing_inside_a_multi_row_statement_fails_alone(engine, monkeypatch):
    providers = build_providers(make_settings())
    paid = [create_payment(engine, amount=400 + n) for n in range(3)]
    # Two payments the provider says are one charge: the UNIQUE provider_transaction_id refuses the second,
    # which only the set-wise UPDATE of both finds out.
    ids = [
        _stored(engine, sandbox_event(paid[0], amount=400, provider_transaction_id="ch_same")),
        _stored(engine, sandbox_event(paid[1], amount=401)),
        _stored(engine, sandbox_event(paid[2], amount=402, provider_transaction_id="ch_same")),
    ]
    calls = _row_by_row_calls(monkeypatch)
    outcomes = process_batch(engine, providers, ids, RetryPolicy())

    assert calls == [1]
    assert [o for _, o in outcomes] == [CallbackResult.APPLIED, CallbackResult.APPLIED, CallbackResult.RETRY]
    with engine.connect() as conn:
        status = dict(conn.execute(select(payment.c.payment_id, payment.c.status)).all())
    assert [status[p] for p in paid] == ["Succeeded", "Succeeded", "Pending"]
    assert _count(engine, ledger_event) == 2 and _count(engine, outbox) == 2 and _count(engine, processed_event) == 2
    assert {r.id: r.retry_count for r in _rows(engine)}[ids[2]] == 1


def test_two_reports_for_one_payment_in_a_batch_are_applied_in_their_order(engine, monkeypatch):
    providers = build_providers(make_settings())
    paid = create_payment(engine, amount=300, status="Created")
    ids = [
        _stored(engine, sandbox_event(paid, amount=300, event_type="charge.failed", failure_code="expired")),
        _stored(engine, sandbox_event(paid, amount=300)),  # contradicts the first: a conflict, not a success
    ]
    calls = _row_by_row_calls(monkeypatch)
    outcomes = process_batch(engine, providers, ids, RetryPolicy())
    assert calls == [1]
    assert [o for _, o in outcomes] == [CallbackResult.APPLIED, CallbackResult.CONFLICT]
    assert _count(engine, payment, payment.c.status == "Failed") == 1
    assert _count(engine, ledger_event) == 1


def _rows(engine) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(payment_callback_log)))


def test_a_lost_rows_copy_beside_a_noop_on_its_reused_id_is_restored_and_applied(engine, monkeypatch):
    """Invariant 12 in the set-wise path: the MISSING delivery keeps its own outcome, so it is restored."""
    from payments.inbound.delivery import Delivery, body_digest

    providers = build_providers(make_settings())
    lost_payment, settled = create_payment(engine, amount=400), create_payment(engine, amount=500)
    charge = "ch_settled_reused_id_0001"
    first = _stored(engine, sandbox_event(settled, amount=500, provider_transaction_id=charge))
    assert process_callback(engine, providers, first, RetryPolicy()) == CallbackResult.APPLIED
    # A second report of the same success: a fresh event, nothing left to change (a NOOP).
    reused = _stored(engine, sandbox_event(settled, amount=500, provider_transaction_id=charge))
    with engine.connect() as conn:
        row = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == reused)).one()
    here = Delivery(
        reused,
        "sandbox",
        row.create_time,
        bytes(row.callback_data),
        json.loads(row.headers),
        None,
        body_digest(bytes(row.callback_data)),
    )
    # The delivery acknowledged under this id before a failover lost its row and the id was handed out again.
    lost_body, lost_headers = signed(sandbox_event(lost_payment, amount=400))
    lost = Delivery(
        reused,
        "sandbox",
        row.create_time.replace(microsecond=0) - timedelta(seconds=5),
        lost_body,
        lost_headers,
        None,
        body_digest(lost_body),
    )
    calls = _row_by_row_calls(monkeypatch)

    outcomes = process_batch(engine, providers, [here, lost], RetryPolicy())

    assert calls == [], "the batch took the set-wise path"
    assert outcomes[0] == (reused, CallbackResult.NOOP)
    restored, outcome = outcomes[1]
    assert restored != reused and outcome == CallbackResult.APPLIED, outcomes
    with engine.connect() as conn:
        back = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == restored)).one()
        status = conn.execute(select(payment.c.status).where(payment.c.payment_id == lost_payment)).scalar_one()
    assert bytes(back.callback_data) == lost_body and back.create_time == lost.received_at
    assert status == "Succeeded"
    assert _count(engine, ledger_event, ledger_event.c.event_type == "PaymentConfirmed") == 2
