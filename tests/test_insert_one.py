"""``payments.infra.db.insert_one``: the gateway's INSERT on the pooled driver connection, with SQLAlchemy's error
semantics.

What it must keep from the ``engine.begin()`` path it replaces on MariaDB: the
row committed before it returns, no ROLLBACK sent when the connection goes
back to the pool, a dead pooled connection costing one retry and not the
delivery, and every failure raised as a ``SQLAlchemyError`` (the gateway's 503).
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from payments.inbound.callbacks import _STORE
from payments.infra.db import driver_statement, insert_one, make_engine, utcnow
from payments.infra.schema import payment_callback_log
from payments.states import CallbackStatus

pytestmark = pytest.mark.mariadb


def values(**overrides):
    now = utcnow()
    row = {
        "provider": "sandbox",
        "callback_data": b'{"id": "evt_1"}',
        "headers": "{}",
        "remote_addr": "127.0.0.1",
        "source": "webhook",
        "order_no": None,
        "payment_order_no": None,
        "provider_event_id": "evt_1",
        "event_type": "payment.succeeded",
        "status": CallbackStatus.PENDING,
        "result": None,
        "retry_count": 0,
        "next_retry_at": now,
        "create_time": now,
        "update_time": now,
        "request_id": None,
    }
    return {**row, **overrides}


def store(engine, **overrides):
    v = values(**overrides)
    return insert_one(engine, driver_statement(_STORE, engine.dialect, tuple(v)), v)


def rows(engine):
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log.c.id, payment_callback_log.c.provider_event_id)).all()


def session_counts(engine):
    """The pooled connection's own Com_commit and Com_rollback (a pool of one: always the same connection)."""
    with engine.connect() as conn:
        found = conn.exec_driver_sql("SHOW SESSION STATUS WHERE Variable_name IN ('Com_commit', 'Com_rollback')")
        return {name: int(value) for name, value in found}


@pytest.fixture
def one_connection(mariadb):
    engine = make_engine(mariadb.url.render_as_string(hide_password=False), pool_size=1)
    yield engine
    engine.dispose()


def test_the_row_is_committed_and_its_id_returned(mariadb, one_connection):
    log_id = store(one_connection)
    assert rows(mariadb) == [(log_id, "evt_1")], "visible to another connection: committed"


def test_no_rollback_is_sent_when_the_connection_goes_back_to_the_pool(mariadb, one_connection):
    before = session_counts(one_connection)
    for n in range(3):
        store(one_connection, provider_event_id=f"evt_{n}")
    after = session_counts(one_connection)
    assert after["Com_commit"] - before["Com_commit"] == 3
    # SHOW STATUS's own checkout ends with its one conditional rollback (a read leaves no flag): counted once.
    assert after["Com_rollback"] - before["Com_rollback"] <= 1


def test_a_pooled_connection_killed_behind_its_back_costs_a_retry_not_the_row(mariadb, one_connection):
    with one_connection.connect() as conn:
        thread_id = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
    with mariadb.connect() as conn:
        conn.exec_driver_sql(f"KILL CONNECTION {int(thread_id)}")
    log_id = store(one_connection)
    assert rows(mariadb) == [(log_id, "evt_1")], "stored once, on a fresh connection"
    with one_connection.connect() as conn:
        assert conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar() != thread_id


def test_a_refused_statement_is_a_sqlalchemy_error_and_the_connection_is_usable_after(mariadb, one_connection):
    with pytest.raises(DBAPIError) as caught:
        store(one_connection, provider=None)  # NOT NULL
    assert not caught.value.connection_invalidated
    assert "sandbox" not in str(caught.value), "parameters are never in an error's text"
    log_id = store(one_connection)
    with one_connection.connect() as conn:
        assert conn.execute(select(func.count()).select_from(payment_callback_log)).scalar() == 1
    assert rows(mariadb) == [(log_id, "evt_1")]


def test_a_database_that_cannot_be_reached_is_a_sqlalchemy_error():
    engine = make_engine("mysql+pymysql://root@127.0.0.1:9/paysync_nowhere", connect_args={"connect_timeout": 1})
    try:
        with pytest.raises(SQLAlchemyError):
            store(engine)
    finally:
        engine.dispose()


def test_sqlite_stores_through_a_transaction(sqlite):
    log_id = store(sqlite)
    with sqlite.connect() as conn:
        assert conn.execute(text("SELECT id FROM payment_callback_log")).scalar() == log_id
