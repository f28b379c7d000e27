"""Statements per unit of work, by path, counted at the driver: the statement budget's test and bench/charges.py.

    .venv/bin/python bench/statements.py --sandbox-url http://127.0.0.1:8100

Every round trip PyMySQL makes to the server goes through one method,
``pymysql.connections.Connection._execute_command``: each query, and BEGIN,
COMMIT, ROLLBACK and pings too. Counting there sees what SQLAlchemy's
``before_cursor_execute`` event would miss (the callback INSERT that
``payments.infra.db.DriverStatement`` sends on the raw DBAPI connection, the
commits). Counts do not depend on the machine's load, so unlike a time they
can be a test (``tests/test_statement_budget.py``, budget in
``bench/statement_budget.toml``).

Each path runs once to warm up (a connection opened or a cache filled is not
per-payment work), then ``ROUNDS`` times counted; its count is the fewest of
those (a statement a change adds is in every round; one a clock or a lease's
timing brings in now and then is not). The paths:

- ``post_payment``: one ``POST /payments`` through the gateway app;
- ``relay_send``: one ``relay_outbox.run_once`` relaying one charge (claim,
  prepare, call, apply; then the claim that finds nothing more), with
  RELAY_CONCURRENCY=1 so no claim polls while the call is out (a poll's
  count would depend on how long the call takes);
- ``callback_ingest``: one ``POST /callbacks/sandbox`` (store, verify,
  answer; no broker and no inline processing);
- ``callback_consumer``: ``process_callback`` of that stored delivery, for
  a Pending payment it confirms (the consumer's path);
- ``callback_compensator``: one ``compensate_callbacks.run_once`` sweeping
  one such delivery (claim, process, then the claim that finds nothing).

MariaDB (PyMySQL) only: SQLite's driver is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pymysql.connections
from sqlalchemy import Engine, func, insert, select, text

ROOT = Path(__file__).resolve().parent.parent
# Run as a script: this checkout's packages, unless PYTHONPATH names another one (bench/charges.py --before-tree
# measures that tree's code with this counter), which comes first on sys.path.
sys.path.append(str(ROOT))

from payments.infra.db import utcnow  # noqa: E402
from payments.infra.schema import payment  # noqa: E402
from payments.infra.settings import Settings  # noqa: E402
from payments.runtime import Runtime, build_runtime  # noqa: E402
from sandbox import signing  # noqa: E402

BUDGET_FILE = ROOT / "bench" / "statement_budget.toml"
"""The most statements each path may take; ``tests/test_statement_budget.py`` fails past it."""
PATHS = ("post_payment", "relay_send", "callback_ingest", "callback_consumer", "callback_compensator")
ROUNDS = 3
"""Counted runs of each path after its warm-up; the fewest statements of them is the path's count."""
COMMANDS = {3: "", 14: "PING ", 2: "INIT_DB "}
"""PyMySQL command bytes as the statement list names them (COM_QUERY is the SQL itself)."""


@dataclass
class Counted:
    """The statements one path sent, in order (SQL text, truncated)."""

    statements: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        """How many round trips."""
        return len(self.statements)


class _Counter:
    """Wraps ``Connection._execute_command`` while active; records what every thread of this process sends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sink: list[str] | None = None
        self.original = pymysql.connections.Connection._execute_command

    @contextmanager
    def installed(self) -> Iterator[None]:
        original, counter = self.original, self

        def counted(conn: pymysql.connections.Connection, command: int, sql: Any) -> Any:  # noqa: ANN401
            sink = counter.sink
            if sink is not None:
                text = sql.decode("utf-8", "replace") if isinstance(sql, (bytes, bytearray)) else str(sql)
                sink.append(f"{COMMANDS.get(command, f'COM_{command} ')}{' '.join(text.split())[:300]}")
            return original(conn, command, sql)

        pymysql.connections.Connection._execute_command = counted
        try:
            yield
        finally:
            pymysql.connections.Connection._execute_command = original

    @contextmanager
    def counting(self) -> Iterator[Counted]:
        counted = Counted()
        with self.lock:
            self.sink = counted.statements
        try:
            yield counted
        finally:
            with self.lock:
                self.sink = None


_COUNTER = _Counter()


def load_budget(path: Path = BUDGET_FILE) -> dict[str, int]:
    """The budget file's ``[statements]`` table: path name to the most statements it may take."""
    with path.open("rb") as f:
        budget = tomllib.load(f)["statements"]
    unknown = set(budget) - set(PATHS)
    if unknown or set(PATHS) - set(budget):
        raise ValueError(f"{path}: paths {sorted(budget)} are not {sorted(PATHS)}")
    return {name: int(n) for name, n in budget.items()}


def over_budget(counts: dict[str, Counted], budget: dict[str, int]) -> list[str]:
    """One report per path whose count grew past its budget: the count, the budget and every statement sent."""
    reports = []
    for name, counted in counts.items():
        if counted.count > budget[name]:
            listing = "\n".join(f"  {n:2d}. {s}" for n, s in enumerate(counted.statements, 1))
            reports.append(f"{name}: {counted.count} statements, budget {budget[name]}:\n{listing}")
    return reports


def _pending_payment(engine: Engine, amount: int) -> str:
    """A Pending payment, as a charge the provider has not answered yet leaves it (inserted directly)."""
    payment_id = f"pay_{uuid.uuid4().hex[:20]}"
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(payment).values(
                payment_id=payment_id,
                order_no=f"stmt-{payment_id[-12:]}",
                amount_minor=amount,
                currency="CNY",
                provider="sandbox",
                status="Pending",
                idempotency_key=f"key-{payment_id}",
                created_at=now,
                updated_at=now,
            )
        )
    return payment_id


def _signed_success(settings: Settings, payment_id: str, amount: int) -> tuple[bytes, dict[str, str]]:
    """A signed ``charge.succeeded`` delivery for the payment, as the sandbox platform sends it."""
    event = {
        "id": f"evt_{uuid.uuid4().hex[:20]}",
        "type": "charge.succeeded",
        "created": int(time.time()),
        "data": {
            "merchant_transaction_id": payment_id,
            "provider_transaction_id": f"ch_{uuid.uuid4().hex[:20]}",
            "amount": amount,
            "currency": "CNY",
            "failure_code": None,
        },
    }
    body = json.dumps(event).encode()
    header = signing.sign(settings.sandbox_webhook_secret[0], body)
    return body, {signing.HEADER: header, "Content-Type": "application/json"}


class _NoPublisher:
    """No broker: the gateway stores callbacks and leaves them to the consumer or compensator paths measured here."""

    state = "disabled"
    enabled = False

    def publish(self, log_id: int, body: bytes) -> bool:
        return False


def measure(settings: Settings, engine: Engine) -> dict[str, Counted]:
    """Run each path twice on ``engine`` (MariaDB) and the sandbox ``settings`` names; count the second run."""
    from compensator import compensate_callbacks, relay_outbox
    from gateway import create_app
    from payments.inbound.callbacks import CallbackResult, process_callback
    from payments.infra.schema import payment_callback_log
    from payments.outbound import breaker

    settings = replace(
        settings,
        amqp_url="",
        callback_process_inline=False,
        relay_concurrency=1,
        compensator_concurrency=1,
        compensator_grace_seconds=0.0,
    )
    runtime: Runtime = build_runtime(settings, engine)
    app = create_app(runtime=runtime, publisher=_NoPublisher())
    client = app.test_client()
    token = settings.merchant_api_token[0]
    counted: dict[str, list[Counted]] = {name: [] for name in PATHS}

    def new_payment() -> None:
        key = f"stmt-{uuid.uuid4().hex}"
        response = client.post(
            "/payments",
            json={"order_no": key, "amount": 1234, "currency": "CNY", "provider": "sandbox"},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
        )
        if response.status_code != 201:
            raise RuntimeError(f"POST /payments answered {response.status_code}: {response.get_data(as_text=True)}")

    def post_payment() -> None:
        with _COUNTER.counting() as c:
            new_payment()
        counted["post_payment"].append(c)

    def relay_send() -> None:
        relay_outbox.run_once(runtime)  # the charges post_payment created, sent uncounted: one is due below
        new_payment()
        with _COUNTER.counting() as c:
            handled = relay_outbox.run_once(runtime)
        if handled != 1:
            raise RuntimeError(f"the relay handled {handled} rows, not the one charge due")
        counted["relay_send"].append(c)

    def ingest() -> int:
        payment_id = _pending_payment(engine, 1500)
        body, headers = _signed_success(settings, payment_id, 1500)
        with _COUNTER.counting() as c:
            response = client.post("/callbacks/sandbox", data=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"POST /callbacks/sandbox answered {response.status_code}")
        counted["callback_ingest"].append(c)
        with engine.connect() as conn:
            last = select(func.max(payment_callback_log.c.id)).where(payment_callback_log.c.order_no == payment_id)
            return conn.execute(last).scalar_one()

    def callback_consumer() -> None:
        log_id = ingest()
        with _COUNTER.counting() as c:
            outcome = process_callback(engine, runtime.providers, log_id, runtime.callback_policy)
        if outcome != CallbackResult.APPLIED:
            raise RuntimeError(f"callback {log_id} was {outcome}, not applied")
        counted["callback_consumer"].append(c)

    def callback_compensator() -> None:
        ingest()
        with _COUNTER.counting() as c:
            done = compensate_callbacks.run_once(runtime)
        if done != 1:
            raise RuntimeError(f"the sweep processed {done} rows, not the one callback due")
        counted["callback_compensator"].append(c)

    # The breaker's row is read at most every breaker.CACHE_SECONDS whatever the traffic: under load one read
    # shared by every payment in its window, here one per unit or none depending on the clock. Held for the
    # whole measurement, so no count depends on that timing.
    # Likewise the pool's idle ping (payments.infra.db.IDLE_PING_SECONDS): a connection unused for a second is pinged,
    # which a busy worker never is and a counted unit on a loaded machine may be, now and then.
    from payments.infra import db

    held_for, idle_ping = breaker.CACHE_SECONDS, db.IDLE_PING_SECONDS
    breaker.CACHE_SECONDS = db.IDLE_PING_SECONDS = 3600.0
    try:
        with _COUNTER.installed():
            for unit in (post_payment, relay_send, callback_consumer, callback_compensator):
                for _ in range(1 + ROUNDS):
                    unit()
    finally:
        breaker.CACHE_SECONDS, db.IDLE_PING_SECONDS = held_for, idle_ping
    # The first of each is the warm-up (connections opened, caches filled); of the rest the fewest: a statement a
    # change adds is in every round, one that a clock or a lease's timing brings in now and then is not.
    return {name: min(counted[name][1:], key=lambda c: c.count) for name in PATHS}


def main(argv: list[str] | None = None) -> int:
    from payments.infra.db import init_db, make_engine
    from payments.infra.settings import DEV_DEFAULTS

    parser = argparse.ArgumentParser(prog="bench/statements.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="mysql+pymysql://root@127.0.0.1:3306/paysync_bench_statements")
    parser.add_argument("--sandbox-url", required=True, help="a running sandbox platform (python -m sandbox)")
    parser.add_argument("--secret", required=True, help="its SANDBOX_WEBHOOK_SECRET")
    parser.add_argument("--api-key", required=True, help="its SANDBOX_API_KEY")
    parser.add_argument("--list", action="store_true", help="print every statement of each path")
    parser.add_argument("--json", action="store_true", help="print {path: count} as one JSON line")
    args = parser.parse_args(argv)
    settings = replace(
        Settings(**DEV_DEFAULTS, paysync_env="development"),
        database_url=args.database_url,
        sandbox_api_url=args.sandbox_url,
        sandbox_webhook_secret=(args.secret,),
        sandbox_api_key=(args.api_key,),
    )
    engine = make_engine(args.database_url)
    server = make_engine(engine.url.set(database="").render_as_string(hide_password=False), pool_size=1)
    with server.begin() as conn:
        conn.execute(text(f"CREATE DATABASE IF NOT EXISTS `{engine.url.database}` CHARACTER SET utf8mb4"))
    server.dispose()
    init_db(engine)
    counts = measure(settings, engine)
    engine.dispose()
    if args.json:
        print(json.dumps({name: counted.count for name, counted in counts.items()}))
        return 0
    budget = load_budget()
    for name, counted in counts.items():
        print(f"{name:<22} {counted.count:3d} statements (budget {budget[name]})")
        if args.list:
            print("\n".join(f"    {s}" for s in counted.statements))
    return 1 if over_budget(counts, budget) else 0


if __name__ == "__main__":
    sys.exit(main())
