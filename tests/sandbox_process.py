"""The real sandbox platform as a test fixture: ``python -m sandbox`` (the Procfile line) on a free port.

Import the fixtures into a test module: ``from tests.sandbox_process import sandbox  # noqa: F401``.
Each test gets the platform reset (no charges, no faults) and a small client for its control surface.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import SECRET, Proc, free_port, wait_for_port


@dataclass
class Sandbox:
    """A running sandbox process and its control surface."""

    url: str
    port: int
    proc: Proc

    def faults(self, **knobs: Any) -> dict[str, Any]:
        """Replace the fault knobs (keys not given go back to no fault)."""
        response = requests.post(f"{self.url}/_sandbox/faults", json=knobs, timeout=5)
        response.raise_for_status()
        return response.json()

    def reset(self) -> None:
        """Forget every charge, key and event; no faults."""
        requests.post(f"{self.url}/_sandbox/reset", timeout=5).raise_for_status()

    def truth(self) -> dict[str, Any]:
        """What was really charged: charges, refunds, charge_counts per merchant number."""
        response = requests.get(f"{self.url}/_sandbox/truth", timeout=30)
        response.raise_for_status()
        return response.json()

    def charge_count(self, payment_id: str) -> int:
        """How many charges the platform made for one of our payment ids."""
        return self.truth()["charge_counts"].get(payment_id, 0)


def start_sandbox(tmp: Path, callback_url: str | None = None, **env: str) -> Sandbox:
    """Start ``python -m sandbox`` with its own state file; the caller stops it."""
    port = free_port()
    settings = {
        "SANDBOX_PORT": str(port),
        "SANDBOX_HOST": "127.0.0.1",
        "SANDBOX_DB_PATH": str(tmp / f"sandbox-{port}.db"),
        "SANDBOX_WEBHOOK_SECRET": SECRET,
        # Nobody listens here unless the test says so: webhooks fail and are given up quickly.
        "SANDBOX_CALLBACK_URL": callback_url or f"http://127.0.0.1:{free_port()}/callbacks/sandbox",
        "SANDBOX_WEBHOOK_MAX_ATTEMPTS": "2",
        "SANDBOX_WEBHOOK_BACKOFF_SECONDS": "0.05",
        "LOG_LEVEL": "WARNING",
        **env,
    }
    proc = Proc("sandbox", settings, log_path=tmp / f"sandbox-{port}.log")
    try:
        wait_for_port(port)
    except TimeoutError:
        proc.kill()
        raise AssertionError("sandbox did not start:\n" + proc.output()) from None
    return Sandbox(f"http://127.0.0.1:{port}", port, proc)


@pytest.fixture(scope="session")
def sandbox_process(tmp_path_factory):
    """One sandbox process per test process (xdist worker), reset for each test by ``sandbox``.

    Per worker, not per module: under ``--dist load`` a worker runs tests of many
    modules in turn, and a module-scoped process was started again at every turn.
    """
    sb = start_sandbox(tmp_path_factory.mktemp("sandbox"))
    yield sb
    sb.proc.stop()


@pytest.fixture
def sandbox(sandbox_process) -> Sandbox:
    """The module's sandbox, reset for this test."""
    sandbox_process.reset()
    return sandbox_process


def dumps(value: Any) -> str:
    """JSON for request bodies in tests."""
    return json.dumps(value)
