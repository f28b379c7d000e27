"""``payments.infra.db.make_engine``'s connections: no TLS context on the loopback (22 ms of CPU each), TLS kept
elsewhere."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from payments.infra.db import loopback_connect_args, make_engine


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]"])
def test_a_loopback_connection_opens_without_tls(host):
    assert loopback_connect_args(make_url(f"mysql+pymysql://u@{host}:3306/db"), {}) == {"ssl_disabled": True}


def test_a_socket_connection_opens_without_tls():
    url = make_url("mysql+pymysql://u@/db?unix_socket=/run/mysqld/mysqld.sock")
    assert loopback_connect_args(url, {}) == {"ssl_disabled": True}


def test_a_remote_database_keeps_pymysqls_tls():
    assert loopback_connect_args(make_url("mysql+pymysql://u@db.internal:3306/db"), {}) == {}


def test_tls_asked_for_by_the_url_or_the_caller_is_kept_on_the_loopback_too():
    assert loopback_connect_args(make_url("mysql+pymysql://u@127.0.0.1/db?ssl_ca=/etc/ca.pem"), {}) == {}
    assert loopback_connect_args(make_url("mysql+pymysql://u@127.0.0.1/db"), {"ssl": {"ca": "/etc/ca.pem"}}) == {}


@pytest.mark.mariadb
def test_a_new_pooled_connection_to_the_test_mariadb_has_no_tls_context(mariadb):
    engine = make_engine(mariadb.url.render_as_string(hide_password=False), pool_size=1, max_overflow=0)
    try:
        if engine.url.host not in ("127.0.0.1", "localhost", None):
            pytest.skip("the test database is not on the loopback")
        raw = engine.raw_connection()
        try:
            assert raw.dbapi_connection.ssl is False and not hasattr(raw.dbapi_connection, "ctx")
        finally:
            raw.close()
        assert (engine.pool.size(), engine.pool._max_overflow) == (1, 0)
    finally:
        engine.dispose()
