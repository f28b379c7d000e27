"""``payments.infra.db.DriverStatement``: the callback INSERT as driver SQL stores exactly what the Core statement
stores."""

from __future__ import annotations

from datetime import datetime

import pytest
from sqlalchemy import select

from payments.inbound.callbacks import _STORE, store_callback
from payments.infra.db import DriverStatement, driver_statement, make_engine
from payments.infra.schema import payment_callback_log
from payments.states import CallbackStatus


def test_a_row_stored_through_the_driver_sql_equals_one_stored_through_core(engine):
    at = datetime(2026, 12, 1, 18, 30, 0, 123456)
    index = {"order_no": "o-1", "payment_order_no": None, "provider_event_id": "evt_é", "event_type": "charge"}
    body = bytes(range(256)) * 3
    fast = store_callback(
        engine,
        provider="sandbox",
        body=body,
        headers={"A": "ü"},
        remote_addr=None,
        index=index,
        now=at,
        rejected="source_not_allowed: x",
        request_id="req-1",
    )
    values = {
        "provider": "sandbox",
        "callback_data": body,
        "headers": '{"A": "ü"}',
        "remote_addr": None,
        "source": "webhook",
        "status": CallbackStatus.REJECTED,
        "result": "rejected: source_not_allowed: x",
        "retry_count": 0,
        "next_retry_at": at,
        "create_time": at,
        "update_time": at,
        "request_id": "req-1",
        **index,
    }
    with engine.begin() as conn:
        core = conn.execute(_STORE, values).inserted_primary_key[0]
        rows = {r.id: r._asdict() for r in conn.execute(select(payment_callback_log))}
    assert fast != core
    assert {k: v for k, v in rows[fast].items() if k != "id"} == {k: v for k, v in rows[core].items() if k != "id"}
    assert rows[fast]["create_time"] == at and bytes(rows[fast]["callback_data"]) == body


def test_it_is_built_once_per_dialect_and_refuses_to_skip_a_default(engine):
    keys = ("provider", "callback_data", "create_time")
    with pytest.raises(ValueError, match="retry_count"):
        DriverStatement(_STORE, engine.dialect, keys)
    full = tuple(c.name for c in payment_callback_log.columns if c.name != "id")
    assert driver_statement(_STORE, engine.dialect, full) is driver_statement(_STORE, engine.dialect, full)


def test_each_engine_has_its_own_statement_in_its_drivers_style(engine, tmp_path):
    # Keyed by the dialect object itself: an id() of a disposed engine's dialect may come back as another's.
    other = make_engine(f"sqlite:///{tmp_path / 'other.db'}")
    full = tuple(c.name for c in payment_callback_log.columns if c.name != "id")
    mine, theirs = driver_statement(_STORE, engine.dialect, full), driver_statement(_STORE, other.dialect, full)
    assert mine is not theirs
    assert theirs.positional is not None and "?" in theirs.sql  # SQLite: qmark
    assert (mine.positional is None) == (engine.dialect.paramstyle == "pyformat")
    other.dispose()
