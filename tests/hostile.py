"""A real gateway (gunicorn, the Procfile's ``web`` line) on the test MariaDB, for the hostile-input tests.

One gateway per test module (``gateway`` fixture, imported by the module):
starting gunicorn per hypothesis example would be far too slow, and tests
compare rows before and after each request instead of emptying tables.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from sqlalchemy import Engine, func, select

from payments.infra.schema import payment_callback_log
from tests.conftest import truncate_all
from tests.stack import Stack, db_url, worker_pids
from tests.support import SECRET, Proc

MERCHANT_TOKEN = "hostile-merchant-token-0123456789abcdef"
OPS_TOKEN = "hostile-ops-token-0123456789abcdef"
SANDBOX_API_KEY = "sk_test_hostile_sandbox_api_key_0123456789"
SECRETS = [SECRET, MERCHANT_TOKEN, OPS_TOKEN, SANDBOX_API_KEY]
"""Everything the gateway knows that must never reach a log."""
WORKERS = 2


@dataclass
class Gateway:
    """A running gateway, the engine on its database, and helpers to talk to it."""

    port: int
    engine: Engine
    stack: Stack
    web: Proc
    session: requests.Session

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        """One request; a read timeout here means a stalled worker, which is a failure."""
        kwargs.setdefault("timeout", 20)
        return self.session.request(method, self.url + path, **kwargs)

    def merchant(self) -> dict[str, str]:
        """The bearer header of the merchant API."""
        return {"Authorization": f"Bearer {MERCHANT_TOKEN}"}

    def last_callback_id(self) -> int:
        """The highest payment_callback_log id (0 when empty)."""
        with self.engine.connect() as conn:
            return conn.execute(select(func.coalesce(func.max(payment_callback_log.c.id), 0))).scalar_one()

    def callbacks_after(self, log_id: int) -> list[Any]:
        """Rows stored after ``log_id``, oldest first."""
        with self.engine.connect() as conn:
            return list(
                conn.execute(
                    select(payment_callback_log)
                    .where(payment_callback_log.c.id > log_id)
                    .order_by(payment_callback_log.c.id)
                )
            )

    def workers(self) -> set[int]:
        """gunicorn's worker pids: a crashed or timed-out worker is replaced and its pid changes."""
        return worker_pids(self.web.popen.pid)

    def assert_responsive(self) -> None:
        """Every worker still answers /healthz quickly (fresh connections spread over the workers)."""
        for _ in range(WORKERS * 3):
            started = time.monotonic()
            answer = requests.get(self.url + "/healthz", timeout=5)
            assert answer.status_code == 200
            assert time.monotonic() - started < 2, "a gateway worker is stalled"


@pytest.fixture(scope="session")
def gateway(mariadb_engine, tmp_path_factory):
    """The gateway under gunicorn with 2 workers, no broker, the sandbox provider: one per test process.

    Per worker, not per module (see tests/sandbox_process.py): the modules that use it
    only ever add rows of their own, and every test truncates what it used.
    """
    truncate_all(mariadb_engine)
    tmp = tmp_path_factory.mktemp("hostile")
    env = {
        "PAYSYNC_ENV": "development",
        "DATABASE_URL": db_url(mariadb_engine),
        "MERCHANT_API_TOKEN": MERCHANT_TOKEN,
        "OPS_TOKEN": OPS_TOKEN,
        "SANDBOX_WEBHOOK_SECRET": SECRET,
        "SANDBOX_API_KEY": SANDBOX_API_KEY,
        "LOG_LEVEL": "INFO",
    }
    with Stack(tmp, **env) as stack:
        web, port = stack.start_web(workers=WORKERS)
        with requests.Session() as session:
            yield Gateway(port, mariadb_engine, stack, web, session)
