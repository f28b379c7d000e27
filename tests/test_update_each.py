"""payments.infra.db.update_each: several rows by id in one guarded UPDATE, each row given exactly its own values."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select

from payments.infra import db
from payments.infra.db import UPDATE_EACH_MAX, update_each
from payments.infra.schema import provider_call

T0 = datetime(2026, 12, 1, 12, 0, 0, 123456)


def started(conn, count: int) -> list[int]:
    """``count`` provider_call rows, their outcome not recorded yet; return their ids."""
    conn.execute(
        insert(provider_call),
        [
            {
                "payment_id": f"pay_{n}",
                "provider": "sandbox",
                "operation": "charge" if n % 7 else "query",
                "request_digest": "d" * 64,
                "started_at": T0,
            }
            for n in range(count)
        ],
    )
    return list(conn.execute(select(provider_call.c.id).order_by(provider_call.c.id)).scalars())


@pytest.mark.parametrize("count", [1, 2, 3, 5, 64, 65, 100, UPDATE_EACH_MAX + 1, 2 * UPDATE_EACH_MAX + 7])
def test_each_row_gets_its_own_values_and_the_rowcount_is_the_rows_updated(engine, count):
    with engine.begin() as conn:
        ids = started(conn, count)
        values = {
            i: {
                "outcome": "Succeeded" if k % 3 else "Failed",
                "response": f"answer {k} with 'quotes' and \\ backslash",
                "latency_ms": k,
                "finished_at": T0 + timedelta(microseconds=k),
            }
            for k, i in enumerate(ids)
        }
        assert update_each(conn, provider_call, values, provider_call.c.operation, ["charge", "query"]) == count
        got = {
            r.id: {
                "outcome": r.outcome,
                "response": r.response,
                "latency_ms": r.latency_ms,
                "finished_at": r.finished_at,
            }
            for r in conn.execute(select(provider_call))
        }
    assert got == values


def test_rows_the_guard_excludes_are_left_alone_and_missing_from_the_rowcount(engine):
    with engine.begin() as conn:
        ids = started(conn, 10)
        operations = dict(conn.execute(select(provider_call.c.id, provider_call.c.operation)).all())
        values = {i: {"latency_ms": n, "outcome": "Succeeded"} for n, i in enumerate(ids)}
        changed = update_each(conn, provider_call, values, provider_call.c.operation, ["charge"])
        after = dict(conn.execute(select(provider_call.c.id, provider_call.c.latency_ms)).all())
    charges = [i for i in ids if operations[i] == "charge"]
    assert changed == len(charges) < 10
    assert {i: after[i] for i in ids} == {i: (values[i]["latency_ms"] if i in charges else None) for i in ids}


def test_groups_of_every_size_share_a_few_statements(sqlite, monkeypatch):
    monkeypatch.setattr(db, "_UPDATE_EACH", {})
    with sqlite.begin() as conn:
        ids = started(conn, 100)
        for size in range(1, 101):
            rows = {i: {"latency_ms": size * 1000 + k} for k, i in enumerate(ids[:size])}
            update_each(conn, provider_call, rows, provider_call.c.operation, ["charge", "query"])
    # One statement per power of two (1, 2, 4, ..., 128 WHENs), not one per size.
    assert len(db._UPDATE_EACH) == 8, sorted(key[3] for key in db._UPDATE_EACH)
