"""Shared fixtures: real MariaDB and RabbitMQ when reachable, SQLite always.

Integration tests skip with a reason when a service is unreachable, except
under CI=true, where they fail (docs/design.md section 5).
"""

from __future__ import annotations

import os
import shutil
import uuid
import warnings
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from payments.infra.db import init_db, make_engine
from payments.infra.migrations import VERSION_TABLE
from payments.infra.schema import metadata
from payments.infra.settings import Settings
from payments.outbound import breaker
from tests import vhosts
from tests.support import make_settings

IN_CI = os.environ.get("CI", "").lower() == "true"
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
"""The xdist worker this process is ("gw0", "gw1", ...), or "" when the suite runs in one process."""


def worker_database_url(url: str, worker: str = WORKER) -> str:
    """``url`` with a database of this worker's own (``test`` becomes ``test_gw0``), so workers never share rows."""
    if not worker:
        return url
    parsed = make_url(url)
    return parsed.set(database=f"{parsed.database}_{worker}").render_as_string(hide_password=False)


TEST_DATABASE_URL = worker_database_url(os.environ.get("TEST_DATABASE_URL", "mysql+pymysql://root@127.0.0.1:3306/test"))
BASE_AMQP_URL = os.environ.get("TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


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
        engine = _create_database(engine)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        unavailable(f"MariaDB at {engine.url.render_as_string(hide_password=True)}", exc)
    init_db(engine)
    yield engine
    engine.dispose()
    if WORKER:
        try:
            _drop_database(engine.url)
        except OperationalError as exc:  # the next session takes another name (see _create_database)
            warnings.warn(f"could not drop {engine.url.database}: {exc.orig}", stacklevel=1)


def _drop_database(url) -> None:
    """Drop a worker's database at the end of the session (the shared one is kept for a look after a failure)."""
    server = make_engine(url.set(database="").render_as_string(hide_password=False))
    try:
        with server.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{url.database}`"))
    finally:
        server.dispose()


def _create_database(engine):
    """Create the URL's database afresh, so each checkout has its own and init_db builds it from the first revision;
    return the engine on it.

    Dropped first: a database left by an earlier run of another branch may hold
    tables its migrations do not know. MariaDB cannot drop a database whose
    directory holds a file it did not make (error 1010: a trigger's ``.TRG-``
    backup, left when a session was killed mid-DDL, is one): then this session
    takes a database of another name rather than fail every test.
    """
    try:
        _drop_database(engine.url)
    except OperationalError as exc:
        if exc.orig.args[0] != 1010:
            raise
        stuck = engine.url.database
        engine.dispose()
        engine = make_engine(
            engine.url.set(database=f"{stuck}_{uuid.uuid4().hex[:6]}").render_as_string(hide_password=False),
            pool_size=10,
        )
        warnings.warn(f"{stuck} cannot be dropped ({exc.orig}); this session uses {engine.url.database}", stacklevel=1)
    server = make_engine(engine.url.set(database="").render_as_string(hide_password=False))
    try:
        with server.begin() as conn:
            conn.execute(text(f"CREATE DATABASE `{engine.url.database}` CHARACTER SET utf8mb4"))
    finally:
        server.dispose()
    return engine


def truncate_all(engine) -> None:
    """Empty every table (TRUNCATE does not fire the ledger's DELETE triggers)."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            # SQLite has no TRUNCATE; the ledger triggers refuse DELETE, so drop and recreate instead.
            metadata.drop_all(conn)
            conn.execute(text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
        else:
            used = _used_tables(conn)
            if used:
                conn.execute(text("SET FOREIGN_KEY_CHECKS = 0"))
                for name in used:
                    conn.execute(text(f"TRUNCATE TABLE {name}"))
                conn.execute(text("SET FOREIGN_KEY_CHECKS = 1"))
    if engine.dialect.name == "sqlite":
        init_db(engine)
    breaker.clear_cache()  # the process caches breaker rows for 200 ms: none may outlive the tables


def _used_tables(conn) -> list[str]:
    """The tables a test left rows in, or advanced the AUTO_INCREMENT of: TRUNCATE is DDL (a few ms a table), so
    emptying only these instead of all 23 takes most of the per-test setup away."""
    names = [table.name for table in metadata.sorted_tables]
    probe = " UNION ALL ".join(f"SELECT '{name}' FROM (SELECT 1 FROM {name} LIMIT 1) AS t" for name in names)
    used = set(conn.execute(text(probe)).scalars())
    advanced = conn.execute(
        text("SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() AND auto_increment > 1")
    ).scalars()
    used.update(name for name in advanced if name in names)
    return [name for name in names if name in used]


@pytest.fixture
def mariadb(mariadb_engine):
    """The MariaDB engine with every table emptied before the test."""
    truncate_all(mariadb_engine)
    return mariadb_engine


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory) -> Path:
    """A SQLite file with the whole schema, built once per worker: copying it is 50x faster than migrating anew."""
    path = tmp_path_factory.mktemp("sqlite-template") / "paysync.db"
    engine = make_engine(f"sqlite:///{path}")
    init_db(engine)
    engine.dispose()  # closes the last connection, which checkpoints the WAL into the file
    return path


@pytest.fixture
def sqlite(tmp_path, sqlite_template):
    """A fresh SQLite database file (the embedded default) with the schema."""
    path = tmp_path / "paysync.db"
    shutil.copyfile(sqlite_template, path)
    engine = make_engine(f"sqlite:///{path}")
    breaker.clear_cache()  # cached by id(engine), which a new engine may reuse
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "mariadb"])
def engine(request):
    """Each test that takes ``engine`` runs on both databases."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def amqp_url():
    """The test broker's URL, after checking it answers: a vhost of this worker's own where one can be made."""
    import pika

    url = vhosts.worker_vhost_url(BASE_AMQP_URL, WORKER)
    try:
        pika.BlockingConnection(pika.URLParameters(url)).close()
    except Exception as exc:  # noqa: BLE001
        unavailable(f"RabbitMQ at {url.split('@')[-1]}", exc)
    yield url
    if url != BASE_AMQP_URL:
        vhosts.delete_vhost(url)


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


# --- scheduling and layers -------------------------------------------------------------------------------------

NOT_FAST_FIXTURES = {
    # real services
    "mariadb", "mariadb_engine", "amqp_url", "amqp_queue",
    # a database of any kind (SQLite included: building its schema runs every migration)
    "engine", "sqlite", "settings", "scratch", "scratch_mariadb", "scratch_sqlite", "fresh_databases", "property_db",
    "one_connection", "runtime", "alipay_rt", "sandbox_runtime",
    # a process or a server of the test's own
    "sandbox_process", "sandbox", "fake_alipay", "gateway", "live_gateway", "served", "service", "stack", "receiver",
    "browser", "console", "platform", "echo_provider",
}  # fmt: skip
"""A test using one of these (directly or through another fixture) is not in the fast layer."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "server: starts a process or a server of its own (not in the fast layer)")
    config.addinivalue_line("markers", "alone: whole-stack runs that load both cores; scheduled first, one per worker")
    config.addinivalue_line("markers", "fast: needs no service and no process of its own (`make test-fast`)")


def _uses_a_database_or_server(item: pytest.Item) -> bool:
    if set(getattr(item, "fixturenames", ())) & NOT_FAST_FIXTURES:
        return True
    callspec = getattr(item, "callspec", None)
    return bool(callspec and "mariadb" in callspec.params.values())


FAST_EXAMPLES = 20


def _fewer_examples(items: list[pytest.Item], most: int) -> None:
    """Cap every property test at ``most`` examples, those that set their own count included (`make test-fast`)."""
    for item in items:
        test = getattr(item, "obj", None)
        own = getattr(test, "_hypothesis_internal_use_settings", None)  # where @settings and @given keep them
        if own is not None and own.max_examples > most:
            test._hypothesis_internal_use_settings = hypothesis_settings(own, max_examples=most)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the fast layer, and put the longest runs first so that xdist starts them before the many short tests.

    A worker that picks up a 3-minute run near the end of the session would
    make the session 3 minutes longer than its other workers; started first,
    it runs while the other workers drain everything else.
    """
    for item in items:
        if not (
            _uses_a_database_or_server(item)
            or item.get_closest_marker("server")
            or item.get_closest_marker("slow")
            or item.get_closest_marker("alone")
            or item.get_closest_marker("mariadb")
            or item.get_closest_marker("rabbitmq")
        ):
            item.add_marker(pytest.mark.fast)
    if os.environ.get("HYPOTHESIS_PROFILE") == "fast":
        _fewer_examples(items, FAST_EXAMPLES)
    alone = [item for item in items if item.get_closest_marker("alone")]
    slow = [item for item in items if item.get_closest_marker("slow") and item not in alone]
    rest = [item for item in items if item not in alone and item not in slow]
    # xdist (--maxschedchunk 1) hands each worker two tests to start with, in collection order: one long run
    # and one short test per worker, so no two long runs queue behind each other on one worker.
    ordered: list[pytest.Item] = []
    for long_run in alone + slow:
        ordered += [long_run, rest.pop(0)] if rest else [long_run]
    items[:] = ordered + rest


# Hypothesis: no per-example deadline (a busy machine is not a failing property); `make test-fast` runs fewer
# examples of the tests that do not fix their own count.
hypothesis_settings.register_profile("default", deadline=None)
hypothesis_settings.register_profile("fast", deadline=None, max_examples=FAST_EXAMPLES)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


# Servers that many modules share, one per test process (their modules say why). Imported last: tests.hostile
# imports truncate_all from this module.
from tests.hostile import gateway  # noqa: E402, F401
from tests.sandbox_process import sandbox, sandbox_process  # noqa: E402, F401
