"""Shared fixtures: real MariaDB and RabbitMQ when reachable, SQLite always.

Integration tests skip with a reason when a service is unreachable, except
under CI=true, where they fail (DESIGN.md section 5).
"""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import text

from payments import breaker
from payments.db import init_db, make_engine
from payments.migrations import VERSION_TABLE
from payments.schema import metadata
from payments.settings import Settings
from tests.support import make_settings

TEST_DATABASE_URL = os.environ.get("TEST_DATABASE_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
TEST_AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
IN_CI = os.environ.get("CI", "").lower() == "true"


def unavailable(what: str, exc: BaseException) -> None:
    """Skip locally, fail in CI."""
    message = f"{what} unreachable ({type(exc).__name__}: {exc})"
    if IN_CI:
        pytest.fail(message + " and CI=true", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def mariadb_engine():
    """An engine on the test MariaDB with the schema created once per session."""
    engine = make_engine(TEST_DATABASE_URL, pool_size=10)
    try:
        _create_database(engine)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        unavailable(f"MariaDB at {engine.url.render_as_string(hide_password=True)}", exc)
    init_db(engine)
    yield engine
    engine.dispose()


def _create_database(engine) -> None:
    """Create the URL's database afresh, so each checkout has its own and init_db builds it from the first revision.

    Dropped first: a database left by an earlier run of another branch may hold
    tables its migrations do not know.
    """
    server = make_engine(engine.url.set(database="").render_as_string(hide_password=False))
    try:
        with server.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{engine.url.database}`"))
            conn.execute(text(f"CREATE DATABASE `{engine.url.database}` CHARACTER SET utf8mb4"))
    finally:
        server.dispose()


def truncate_all(engine) -> None:
    """Empty every table (TRUNCATE does not fire the ledger's DELETE triggers)."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            # SQLite has no TRUNCATE; the ledger triggers refuse DELETE, so drop and recreate instead.
            metadata.drop_all(conn)
            conn.execute(text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
        else:
            conn.execute(text("SET FOREIGN_KEY_CHECKS = 0"))
            for table in metadata.sorted_tables:
                conn.execute(text(f"TRUNCATE TABLE {table.name}"))
            conn.execute(text("SET FOREIGN_KEY_CHECKS = 1"))
    if engine.dialect.name == "sqlite":
        init_db(engine)
    breaker.clear_cache()  # the process caches breaker rows for 200 ms: none may outlive the tables


@pytest.fixture
def mariadb(mariadb_engine):
    """The MariaDB engine with every table emptied before the test."""
    truncate_all(mariadb_engine)
    return mariadb_engine


@pytest.fixture
def sqlite(tmp_path):
    """A fresh SQLite database file (the embedded default) with the schema."""
    engine = make_engine(f"sqlite:///{tmp_path / 'paysync.db'}")
    init_db(engine)
    breaker.clear_cache()  # cached by id(engine), which a new engine may reuse
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "mariadb"])
def engine(request):
    """Each test that takes ``engine`` runs on both databases."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def amqp_url():
    """The test broker's URL, after checking it answers."""
    import pika

    try:
        pika.BlockingConnection(pika.URLParameters(TEST_AMQP_URL)).close()
    except Exception as exc:  # noqa: BLE001
        unavailable(f"RabbitMQ at {TEST_AMQP_URL.split('@')[-1]}", exc)
    return TEST_AMQP_URL


@pytest.fixture
def amqp_queue(amqp_url):
    """A queue name of this test's own, deleted (with its dead-letter queue) afterwards."""
    import pika

    name = f"test_callbacks_{uuid.uuid4().hex[:10]}"
    yield name
    try:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        ch = conn.channel()
        ch.queue_delete(name)
        ch.queue_delete(f"{name}.dlq")
        conn.close()
    except Exception:  # noqa: BLE001, S110 - cleanup only
        pass


@pytest.fixture
def settings(engine) -> Settings:
    """Settings pointing at the test's database, no broker."""
    return make_settings(database_url=engine.url.render_as_string(hide_password=False))
