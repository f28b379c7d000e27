"""Database access: the engine, schema creation, and the few dialect differences.

MariaDB/MySQL: PyMySQL, utf8mb4, READ COMMITTED (no gap locks between
sweepers), short connect timeout so a dead database turns into a quick 503
rather than a hung request. Two round trips of every unit of work are saved
(they were 2 of the 4 commands of the gateway's INSERT): a connection is
pinged at checkout only after IDLE_PING_SECONDS unused (a busy worker's
connections never are; a dead one in use fails once, SQLAlchemy invalidates
the pool, and callers that can, retry: ``retry_on_disconnect``), and the
rollback on return is sent only when the server's own status flag, read from
the last reply, says a transaction is still open. A connection to the
loopback address opens without TLS (``loopback_connect_args``): PyMySQL
otherwise builds a TLS context for every new connection, loading the system's
CA bundle (22 ms of CPU each, measured), to offer a TLS that protects nothing
on the loopback; a URL naming any ``ssl`` option keeps it.

SQLite (embedded default): WAL so readers never block the writer,
``synchronous=FULL`` so a commit is on disk before it is acknowledged, a busy
timeout so gunicorn workers and the compensator wait for each other instead of
failing, and ``BEGIN IMMEDIATE`` so a transaction takes the write lock up
front: a deferred transaction that reads and then writes can fail with
"database is locked" no matter how long the busy timeout is.
"""

from __future__ import annotations

import io
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Column,
    Connection,
    Engine,
    Row,
    Select,
    Table,
    Update,
    bindparam,
    case,
    create_engine,
    event,
    exc,
    insert,
    update,
)
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.schema import CreateIndex, CreateTable
from sqlalchemy.sql.base import Executable

from payments.errors import ConfigError
from payments.infra.schema import metadata, trigger_ddl

SQLITE_BUSY_TIMEOUT_MS = 10_000
IDLE_PING_SECONDS = 1.0
"""A pooled connection unused for longer is pinged before it is handed out (a restart while it sat idle)."""
_SERVER_STATUS_IN_TRANS = 1
"""MySQL protocol SERVER_STATUS_IN_TRANS: the server reports an open transaction in every reply."""

T = TypeVar("T")


def utcnow() -> datetime:
    """Naive UTC now: the one clock every timestamp column is written with."""
    return datetime.now(UTC).replace(tzinfo=None)


def is_sqlite(engine: Engine) -> bool:
    """True for the embedded SQLite database."""
    return engine.dialect.name == "sqlite"


MYSQL_CHARSET = "utf8mb4"
"""The only connection character set paysync accepts on MySQL/MariaDB (see ``insert_ignore_columns``)."""


def charset_problem(charset: object) -> str | None:
    """Why ``charset`` (a URL's ``charset=`` parameter) will not do, or None for utf8mb4.

    The bulk path writes string literals by hand with backslash escapes, which
    is safe only where no multi-byte character can contain the byte of a
    quote or a backslash: true of UTF-8, false of GBK, Big5 or SJIS (the
    classic escaping bypass). Any other charset would also mangle 4-byte text.
    """
    if isinstance(charset, str) and charset.lower() == MYSQL_CHARSET:
        return None
    shown = charset if isinstance(charset, str) else ",".join(map(str, charset))  # repeated: a tuple
    return f"charset={shown[:32]!r} is not supported: paysync needs charset={MYSQL_CHARSET}"


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost", None})
"""Hosts a connection to never leaves this machine (no host: the local socket)."""


def loopback_connect_args(url: Any, connect_args: Mapping[str, Any]) -> dict[str, Any]:  # noqa: ANN401
    """PyMySQL arguments that skip TLS for a loopback connection, unless the URL or the caller asks for TLS."""
    asked = any(k.startswith("ssl") for k in (*url.query, *connect_args))
    return {"ssl_disabled": True} if url.host in LOOPBACK_HOSTS and not asked else {}


def make_engine(url: str, *, pool_size: int = 5, max_overflow: int | None = None, **kwargs: Any) -> Engine:
    """Create the engine for ``url`` with the settings described in this module's docstring.

    ``pool_size`` connections are kept open, and up to ``max_overflow`` (default: as many again) more are opened
    when all are in use and closed when handed back.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(url, **kwargs)
    query = dict(parsed.query)
    query.setdefault("charset", MYSQL_CHARSET)
    problem = charset_problem(query["charset"])
    if problem:
        raise ConfigError(f"DATABASE_URL {problem}")
    parsed = parsed.set(query=query)
    # Well under gunicorn's 30 s worker timeout, so a hung database still gets the provider a 503.
    connect_args = {"connect_timeout": 3, "read_timeout": 10, "write_timeout": 10}
    connect_args.update(kwargs.pop("connect_args", {}))
    connect_args.update(loopback_connect_args(parsed, connect_args))
    engine = create_engine(
        parsed,
        pool_pre_ping=False,  # replaced by the idle ping below: a ping per checkout is a round trip per unit of work
        pool_reset_on_return=None,  # replaced by the conditional rollback below
        pool_recycle=1800,
        pool_size=pool_size,
        max_overflow=pool_size if max_overflow is None else max_overflow,
        pool_timeout=5,
        isolation_level="READ COMMITTED",
        hide_parameters=True,  # error texts end up in logs and result columns: no bodies, no secrets
        connect_args=connect_args,
        **kwargs,
    )
    _install_cheap_pool_hooks(engine)
    return engine


def batch_engine(engine: Engine, read_timeout: float) -> Engine:
    """An engine to ``engine``'s database for a batch job whose statements may take minutes; dispose it after.

    The 10 s read timeout of ``make_engine`` is for request paths (a hung
    database turns into a quick 503); a day's reconciliation on a large, cold
    database can need longer for one batch's statement, and failing it there
    would fail the whole run. SQLite has no read timeout: ``engine`` itself.
    """
    if engine.dialect.name == "sqlite":
        return engine
    timeouts = {"read_timeout": read_timeout, "write_timeout": read_timeout}
    return make_engine(engine.url.render_as_string(hide_password=False), pool_size=2, connect_args=timeouts)


def _install_cheap_pool_hooks(engine: Engine) -> None:
    """The idle ping and the conditional rollback-on-return (module docstring)."""

    @event.listens_for(engine, "connect")
    def _fresh(_dbapi_conn, record):  # noqa: ANN001
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkin")
    def _idle(_dbapi_conn, record):  # noqa: ANN001
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping_if_idle(dbapi_conn, record, _proxy):  # noqa: ANN001
        record.info["ended"] = False  # until this user's transaction is seen committed or rolled back
        if time.monotonic() - record.info.get("idle_since", 0.0) <= IDLE_PING_SECONDS:
            return
        try:
            dbapi_conn.ping(reconnect=False)
        except Exception as error:
            # The pool discards this connection and hands out (or opens) another one.
            raise exc.DisconnectionError(f"idle connection is gone: {type(error).__name__}") from error

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _ended(conn):  # noqa: ANN001
        if not conn.invalidated:  # an invalidated connection is discarded, not reset
            conn.info["ended"] = True

    @event.listens_for(engine.pool, "reset")
    def _rollback_if_open(dbapi_conn, record, state):  # noqa: ANN001
        # SQLAlchemy's Connection rolls back its own unfinished transaction on close (transaction_was_reset).
        # One it committed leaves nothing to undo: skip the ROLLBACK when the commit was seen and the
        # server's reply to it reports no open transaction. The flag alone is not enough (a locking SELECT
        # opens a transaction MariaDB does not report), so anything else, a raw connection, is rolled back.
        if state.transaction_was_reset or not state.asyncio_safe:
            return
        status = getattr(dbapi_conn, "server_status", None)
        if record is not None and record.info.get("ended") and status is not None:
            if not status & _SERVER_STATUS_IN_TRANS:
                return
        dbapi_conn.rollback()


def retry_on_disconnect(fn: Callable[[], T]) -> T:
    """Run ``fn``; if it failed because its pooled connection was dead (now invalidated), run it once more.

    For units of work that are safe to repeat: a dead connection found on
    first use, instead of a ping before every use.
    """
    try:
        return fn()
    except exc.DBAPIError as error:
        if not error.connection_invalidated:
            raise
    return fn()


def _sqlite_engine(url: str, **kwargs: Any) -> Engine:
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, hide_parameters=True, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):  # noqa: ANN001
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite's own is deferred).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        # FULL: WAL with NORMAL may lose the last commits in a power cut, and an acknowledged callback or an
        # answered POST /payments must survive one.
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):  # noqa: ANN001
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def init_db(engine: Engine) -> None:
    """Bring the schema to the newest migration (payments/infra/migrations); safe to run again, and concurrently."""
    from payments.infra.migrations import upgrade  # Alembic is only needed here, not by every process that imports db

    upgrade(engine)


def schema_sql() -> str:
    """The MySQL/MariaDB DDL for the whole schema, as written to schema.sql."""
    from sqlalchemy.dialects import mysql

    dialect = mysql.dialect()
    out = io.StringIO()
    out.write("-- paysync schema for MySQL 8 / MariaDB 10.6+ (InnoDB, utf8mb4).\n")
    out.write("-- Generated from payments/infra/schema.py by `python -m payments schema-sql`; do not edit by hand.\n")
    out.write("-- tests/test_schema.py checks that this file, applied to MariaDB, matches init-db.\n\n")
    for table in metadata.sorted_tables:
        ddl = str(CreateTable(table).compile(dialect=dialect)).strip()
        out.write("\n".join(line.rstrip() for line in ddl.splitlines()) + ";\n\n")
        for index in sorted(table.indexes, key=lambda i: i.name or ""):
            out.write(str(CreateIndex(index).compile(dialect=dialect)).strip() + ";\n\n")
    for statement in trigger_ddl("mysql"):
        out.write(statement + ";\n\n")
    return out.getvalue()


def claim_rows(engine: Engine, query: Select, table: Table, lease_column: Column, lease_until: datetime) -> list[Row]:
    """Claim the rows ``query`` selects (it must select ``table.c.id``) and lease them, in one short transaction.

    On MariaDB the rows are read ``FOR UPDATE SKIP LOCKED``, so concurrent
    claimers skip each other's rows instead of waiting; on SQLite the write lock
    taken by ``BEGIN IMMEDIATE`` already serialises claimers. The lease
    (``lease_column`` pushed to ``lease_until``) keeps the rows invisible to
    other claimers after this transaction commits; if the claimer dies, they
    come back when it runs out.
    """
    if not is_sqlite(engine):
        query = query.with_for_update(skip_locked=True)
    with engine.begin() as conn:
        rows = conn.execute(query).all()
        if rows:
            conn.execute(update(table).where(table.c.id.in_([r.id for r in rows])).values({lease_column: lease_until}))
    return rows


UPDATE_EACH_MAX = 128
"""``update_each`` writes at most this many rows a statement (more take several)."""


def update_each(
    conn: Connection, table: Table, rows: Mapping[int, Mapping[str, Any]], guard: Column, allowed: Sequence[Any]
) -> int:
    """One UPDATE for several rows by id, each with its own values (same columns for all); return the rowcount.

    ``UPDATE t SET c = CASE t.id WHEN :id0 THEN :c0 WHEN :id1 THEN :c1 END,
    d = :d WHERE t.id IN (:id0, :id1) AND <guard> IN (<allowed>)``: a column
    whose value is the same for every row is a plain SET, one that differs a
    CASE on the id. The guard (``status IN ('Pending')``, say) holds for every
    row, so a rowcount short of ``len(rows)`` means some row was no longer as
    the caller saw it. The statement for each shape (table, columns, which of
    them differ, guard, and the number of ids) is built once and kept. The
    ids come in powers of two, the last row's repeated to fill them: with a
    shape per row count, groups of every size from 1 to 100 compiled a new
    statement most of the time, and compiling a CASE of many WHENs cost more
    than running it. More than UPDATE_EACH_MAX rows take several statements.
    """
    ids = list(rows)
    if len(ids) > UPDATE_EACH_MAX:
        return sum(
            update_each(conn, table, {i: rows[i] for i in ids[n : n + UPDATE_EACH_MAX]}, guard, allowed)
            for n in range(0, len(ids), UPDATE_EACH_MAX)
        )
    first = rows[ids[0]]
    varying = tuple(name for name in first if any(rows[i][name] != first[name] for i in ids[1:]))
    slots = 1 << (len(ids) - 1).bit_length()
    key = (table.name, tuple(first), varying, slots, guard.name, len(allowed))
    statement = _UPDATE_EACH.get(key)
    if statement is None:
        statement = _UPDATE_EACH[key] = _update_each_statement(table, tuple(first), varying, slots, guard, len(allowed))
    params: dict[str, Any] = {f"allowed_{n}": value for n, value in enumerate(allowed)}
    for k in range(slots):
        i = ids[min(k, len(ids) - 1)]
        params[f"id_{k}"] = i
        for name in varying:
            params[f"{name}_{k}"] = rows[i][name]
    for name in first:
        if name not in varying:
            params[f"set_{name}"] = first[name]
    return conn.execute(statement, params).rowcount


_UPDATE_EACH: dict[tuple, Update] = {}


def _update_each_statement(
    table: Table, columns: tuple[str, ...], varying: tuple[str, ...], slots: int, guard: Column, allowed: int
) -> Update:
    """The UPDATE ``update_each`` runs for one shape, with a named parameter for every value.

    Plain parameters throughout, no expanding IN lists: those are rendered anew at every execution.
    """
    values: dict[str, Any] = {}
    for name in columns:
        column = table.c[name]
        if name in varying:
            whens = {bindparam(f"id_{k}"): bindparam(f"{name}_{k}", type_=column.type) for k in range(slots)}
            values[name] = case(whens, value=table.c.id)
        else:
            values[name] = bindparam(f"set_{name}", type_=column.type)
    ids = [bindparam(f"id_{k}") for k in range(slots)]
    guards = [bindparam(f"allowed_{n}", type_=guard.type) for n in range(allowed)]
    return update(table).where(table.c.id.in_(ids), guard.in_(guards)).values(values)


def upsert(conn: Connection, table: Table, values: dict[str, Any], key: Column, changes: dict[str, Any]) -> None:
    """INSERT ``values``; if a row with the same UNIQUE ``key`` exists, apply ``changes`` to it instead.

    One statement (``ON DUPLICATE KEY UPDATE`` on MySQL, ``ON CONFLICT … DO
    UPDATE`` on SQLite) that takes the row's exclusive lock at once. INSERT
    IGNORE followed by an UPDATE takes a shared lock on the existing row
    first, and two callers each holding one while asking for the exclusive
    lock deadlock. In ``changes`` a column expression reads the existing row
    (MySQL applies the changes in order, so a later one sees an earlier one's
    new value: list the ones that read a column before the one that sets it).
    """
    if conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        statement = sqlite_insert(table).values(**values).on_conflict_do_update(index_elements=[key], set_=changes)
    else:
        from sqlalchemy.dialects.mysql import insert as mysql_insert

        statement = mysql_insert(table).values(**values).on_duplicate_key_update(list(changes.items()))
    conn.execute(statement)


def insert_ignore(table):  # noqa: ANN001, ANN201
    """``INSERT IGNORE`` on MySQL, ``INSERT OR IGNORE`` on SQLite: rowcount 0 means the key existed."""
    return (
        insert(table)
        .prefix_with("IGNORE", dialect="mysql")
        .prefix_with("IGNORE", dialect="mariadb")
        .prefix_with("OR IGNORE", dialect="sqlite")
    )


BULK_STATEMENT_CHARS = 1_000_000
"""One statement of ``insert_ignore_rows`` stays under this many characters (PyMySQL's own executemany limit),
well inside MariaDB's 16 MiB max_allowed_packet even in 4-byte characters; a longer row goes alone."""


class DriverStatement:
    """A Core statement compiled once to the driver's own SQL, run with ``conn.exec_driver_sql(sql, params(values))``.

    For a statement run on every callback: this skips SQLAlchemy's
    per-execution work (cache key, compiled-parameter construction, result
    set-up), about 0.1 ms of the gateway's 1 ms of CPU per callback. Each
    value still goes through its column type's bind processor, as
    ``conn.execute`` would send it.
    """

    def __init__(self, statement: Executable, dialect: Dialect, keys: Sequence[str]) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(keys))
        self.sql = str(compiled)
        self.positional = compiled.positiontup  # None for named parameter styles (PyMySQL)
        names = self.positional if self.positional is not None else list(compiled.binds)
        self.binds = {name: compiled.binds[name] for name in names}
        missing = set(self.binds) - set(keys)
        if missing:  # a default SQLAlchemy would fill in: not for this shortcut
            raise ValueError(f"values for {sorted(missing)} are needed")
        self._processors = {
            name: processor
            for name, bind in self.binds.items()
            if (processor := bind.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }

    def params(self, values: Mapping[str, Any]) -> Any:
        """The driver's parameters for ``values`` (a tuple or a dict, as the driver's style wants)."""
        processors = self._processors
        if self.positional is not None:
            return tuple(
                processors[name](values[name]) if name in processors else values[name] for name in self.positional
            )
        return {name: processors[name](value) if name in processors else value for name, value in values.items()}


_DRIVER_STATEMENTS: weakref.WeakKeyDictionary[Dialect, dict[tuple[Executable, tuple[str, ...]], DriverStatement]] = (
    weakref.WeakKeyDictionary()
)
"""Per dialect object (an engine's), not per id(): a disposed engine's id may come back as another database's."""


def driver_statement(statement: Executable, dialect: Dialect, keys: Sequence[str]) -> DriverStatement:
    """The ``DriverStatement`` of ``statement`` for ``dialect`` bound with ``keys``, built once."""
    built = _DRIVER_STATEMENTS.setdefault(dialect, {})
    cache_key = (statement, tuple(keys))
    found = built.get(cache_key)
    if found is None:
        found = built[cache_key] = DriverStatement(statement, dialect, keys)
    return found


def insert_one(engine: Engine, statement: DriverStatement, values: Mapping[str, Any]) -> int:
    """INSERT one row of ``statement`` and COMMIT it; return its id (the driver's lastrowid).

    On MariaDB the statement runs on the pooled DBAPI connection itself,
    without SQLAlchemy's Connection and Transaction objects around it: a
    fifth of the gateway's interpreter time per callback went to them. The
    pool is the same, and so are its checkout ping and its conditional
    rollback on return (the commit is marked seen here, as the ``commit``
    event marks it). A pooled connection found dead is invalidated and the
    INSERT is run once more through ``engine.begin()`` (``retry_on_disconnect``),
    where SQLAlchemy invalidates the rest of the pool as for any unit of work;
    any other driver error is raised as SQLAlchemy's ``DBAPIError``, as
    ``conn.execute`` raises it. Elsewhere (SQLite): ``engine.begin()``.
    """

    def through_sqlalchemy() -> int:
        with engine.begin() as conn:
            return int(conn.exec_driver_sql(statement.sql, statement.params(values)).lastrowid)

    dialect = engine.dialect
    if dialect.name != "mysql":
        return retry_on_disconnect(through_sqlalchemy)
    driver_error = dialect.loaded_dbapi.Error
    try:
        fairy = engine.raw_connection()
    except driver_error as error:  # a new connection that could not be made: the pool hands these on as they are
        raise exc.DBAPIError.instance(None, None, error, driver_error, hide_parameters=True, dialect=dialect) from None
    try:
        cursor = fairy.cursor()
        try:
            cursor.execute(statement.sql, statement.params(values))
            row_id = cursor.lastrowid
        finally:
            cursor.close()
        fairy.commit()
    except driver_error as error:
        if not dialect.is_disconnect(error, fairy.dbapi_connection, None):
            raise exc.DBAPIError.instance(
                statement.sql, None, error, driver_error, hide_parameters=True, dialect=dialect
            ) from None
        fairy.invalidate(error)
    else:
        fairy.info["ended"] = True
        return int(row_id)
    finally:
        fairy.close()
    # Safe to repeat, as for retry_on_disconnect: a lost reply to a COMMIT that did commit stores the row twice.
    return retry_on_disconnect(through_sqlalchemy)


LITERAL_ROWS = 1000
"""``insert_ignore_columns`` writes the literals of this many rows at a time (memory: not a whole batch's)."""


def insert_ignore_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> int:
    """``insert_ignore(table)`` of many rows (same keys each) in as few statements as fit: how many were new.

    On PyMySQL the VALUES list is written here (``insert_ignore_columns``);
    elsewhere it is the plain executemany.
    """
    if not rows:
        return 0
    keys = rows[0].keys()
    if any(row.keys() != keys for row in rows):  # before anything is sent: all of the rows or none
        raise ValueError("insert_ignore_rows: every row needs the same columns")
    if conn.dialect.driver != "pymysql":
        return max(conn.execute(insert_ignore(table), list(rows)).rowcount, 0)
    return insert_ignore_columns(conn, table, {name: [row[name] for row in rows] for name in keys})


def insert_ignore_columns(conn: Connection, table: Table, columns: Mapping[str, Sequence[Any]]) -> int:
    """``insert_ignore_rows`` given column by column: ``columns`` maps each column to its values, row by row.

    The form a caller holding objects (not dicts) can build cheaply. On
    PyMySQL the VALUES list is written here: PyMySQL's executemany, under
    SQLAlchemy's per-row parameter processing, escapes each value through
    several layers of dispatch, which was most of the CPU of a settlement
    import. Here each column's SQLAlchemy bind processor (if its type has
    one) still runs; then None, plain ints, plain strs and naive datetimes
    are written inline exactly as PyMySQL's ``escape`` writes them (its
    quoting rules, which follow the session's NO_BACKSLASH_ESCAPES), and every
    other value goes through the driver's own ``escape``. The connection must
    be utf8mb4 (``charset_problem``; ConfigError otherwise): in UTF-8 no byte
    of a multi-byte character is a quote or a backslash, so escaping those
    characters one by one cannot be undone by the server's decoding.
    """
    names = list(columns)
    values = [columns[name] for name in names]
    count = len(values[0]) if values else 0
    if any(len(column) != count for column in values):
        raise ValueError("insert_ignore_columns: every column needs a value for each row")
    if not count:
        return 0
    if conn.dialect.driver != "pymysql":
        rows = [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]
        return max(conn.execute(insert_ignore(table), rows).rowcount, 0)
    dbapi_conn = conn.connection.dbapi_connection
    problem = charset_problem(getattr(dbapi_conn, "charset", None) or "")
    if problem:
        # A connection not made by make_engine: its literals could not be proven safe, so none are written.
        raise ConfigError(f"insert_ignore_columns: connection {problem}")
    quote = conn.dialect.identifier_preparer.quote
    head = f"INSERT IGNORE INTO {quote(table.name)} ({', '.join(quote(name) for name in names)}) VALUES "
    processors = [table.c[name].type.dialect_impl(conn.dialect).bind_processor(conn.dialect) for name in names]
    inserted, chunk, size = 0, [], len(head)
    for first in range(0, count, LITERAL_ROWS):  # a slice of rows at a time: their literals are short-lived
        literals = []
        for column, process in zip(values, processors, strict=True):
            part = column[first : first + LITERAL_ROWS]
            literals.append(_literals([process(value) for value in part] if process else part, dbapi_conn))
        for row in zip(*literals, strict=True):
            value = "(" + ",".join(row) + ")"
            if chunk and size + len(value) + 1 > BULK_STATEMENT_CHARS:
                inserted += _execute_literal(conn, head + ",".join(chunk))
                chunk, size = [], len(head)
            chunk.append(value)
            size += len(value) + 1
    inserted += _execute_literal(conn, head + ",".join(chunk))
    return inserted


_NO_BACKSLASH_ESCAPES = 512
"""MySQL protocol SERVER_STATUS_NO_BACKSLASH_ESCAPES: the session's sql_mode quotes only by doubling quotes."""
_ESCAPES = {"\0": "\\0", "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\032": "\\Z", '"': '\\"', "'": "\\'"}
"""PyMySQL's ``converters.escape_string`` (backslash escapes): these characters and what each becomes."""
_ESCAPE_TABLE = [_ESCAPES.get(chr(code), chr(code)) for code in range(128)]
"""The same as a list, as PyMySQL has it: str.translate's fast path takes a list three times as fast as a dict."""


def _literals(values: Sequence[Any], dbapi_conn: Any) -> list[str]:
    """SQL literals of ``values``, each as PyMySQL's ``Connection.escape`` writes it."""
    escape = dbapi_conn.escape
    doubled = bool(dbapi_conn.server_status & _NO_BACKSLASH_ESCAPES)
    out = []
    append = out.append
    for value in values:
        kind = type(value)
        if value is None:
            append("NULL")
        elif kind is int:  # not bool, not an IntEnum: those go through the driver's encoders
            append(str(value))
        elif kind is str:
            # Most values need no escaping; seven substring tests are cheaper than translating each character.
            if (
                "'" in value
                or "\\" in value
                or '"' in value
                or "\n" in value
                or "\r" in value
                or "\0" in value
                or "\032" in value
            ):
                value = value.replace("'", "''") if doubled else value.translate(_ESCAPE_TABLE)
            append("'" + value + "'")
        elif kind is datetime and value.tzinfo is None:  # PyMySQL's escape_datetime: microseconds only if any
            append("'" + value.isoformat(" ") + "'")
        else:
            append(escape(value))
    return out


def _execute_literal(conn: Connection, statement: str) -> int:
    # no_parameters: the driver gets the statement alone, so a "%" in a value is not taken for a placeholder.
    result = conn.exec_driver_sql(statement, execution_options={"no_parameters": True})
    return max(result.rowcount, 0)
