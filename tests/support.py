"""Test helpers: settings, rows, signed events, Procfile processes and a TCP proxy that can be cut."""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import insert

from payments.infra.db import utcnow
from payments.infra.schema import payment
from payments.infra.settings import DEV_DEFAULTS, Settings
from sandbox import signing

ROOT = Path(__file__).resolve().parent.parent
SECRET = "whsec_test_secret"
API_KEY = "sk_sandbox_test_key"
"""The sandbox API key every test process shares (SANDBOX_API_KEY); not the development default, on purpose."""
API_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BROKER_KEY = DEV_DEFAULTS["broker_message_secret"][0]
"""The key that signs callback messages in tests (BROKER_MESSAGE_SECRET's development default, as processes get)."""
"""What a test sends to the sandbox's /v1/* when it calls the platform itself."""


def make_settings(**overrides: Any) -> Settings:
    """Settings for tests: development, the test secret and API key, fast retries, then ``overrides``."""
    base = Settings(
        paysync_env="development",
        merchant_api_token=DEV_DEFAULTS["merchant_api_token"],
        ops_token=DEV_DEFAULTS["ops_token"],
        sandbox_webhook_secret=(SECRET,),
        sandbox_api_key=(API_KEY,),
        broker_message_secret=(BROKER_KEY,),
        retry_base_seconds=0.01,
        retry_max_seconds=0.05,
    )
    return replace(base, **overrides)


def env_for(settings_env: dict[str, str]) -> dict[str, str]:
    """A process environment: this one, the venv's bin first on PATH, development, plus the given settings."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("PAYSYNC_ENV", "development")
    env.setdefault("SANDBOX_WEBHOOK_SECRET", SECRET)
    env.setdefault("SANDBOX_API_KEY", API_KEY)
    # Test stacks send every callback from 127.0.0.1, as fast as they can: the per-source limit is tested on its own.
    env.setdefault("CALLBACK_SOURCE_RATE", "0")
    env.update(settings_env)
    return env


def create_payment(
    engine,
    *,
    payment_id: str | None = None,
    amount: int = 1000,
    currency: str = "CNY",
    status: str = "Pending",
    provider: str = "sandbox",
    provider_transaction_id: str | None = None,
) -> str:
    """Insert a payment row directly (as the merchant API would have); return its payment_id."""
    payment_id = payment_id or f"pay_{uuid.uuid4().hex[:20]}"
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(payment).values(
                payment_id=payment_id,
                order_no=f"order-{payment_id[-8:]}",
                amount_minor=amount,
                currency=currency,
                provider=provider,
                provider_transaction_id=provider_transaction_id,
                status=status,
                idempotency_key=f"key-{payment_id}",
                created_at=now,
                updated_at=now,
            )
        )
    return payment_id


def sandbox_event(
    payment_id: str,
    *,
    event_type: str = "charge.succeeded",
    amount: int = 1000,
    currency: str = "CNY",
    event_id: str | None = None,
    provider_transaction_id: str | None = None,
    failure_code: str | None = None,
    **data: Any,
) -> dict[str, Any]:
    """A sandbox notification as the platform sends it."""
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:20]}",
        "type": event_type,
        "created": int(time.time()),
        "data": {
            "merchant_transaction_id": payment_id,
            "provider_transaction_id": provider_transaction_id or f"ch_{uuid.uuid4().hex[:20]}",
            "amount": amount,
            "currency": currency,
            "failure_code": failure_code,
            **data,
        },
    }


def signed(event: dict[str, Any] | bytes, secret: str = SECRET, timestamp: int | None = None) -> tuple[bytes, dict]:
    """(body, headers) for a signed sandbox delivery."""
    body = event if isinstance(event, bytes) else json.dumps(event).encode()
    return body, {signing.HEADER: signing.sign(secret, body, timestamp), "Content-Type": "application/json"}


_PORT_BLOCK = 1000
_PORT_BLOCKS = 12
"""Blocks of ports below the kernel's ephemeral range (32768 and up): 20000-20999, 21000-21999, ..., 31000-31999."""
_PORT_LOCKS = Path(os.environ.get("PAYSYNC_TEST_PORT_LOCKS", "/tmp/paysync-test-ports"))
_next_port = itertools.count()
_port_lock = threading.Lock()
_block: tuple[int, Any] | None = None
"""This process's block: (first port, the open lock file that holds it)."""


def _port_block() -> int | None:
    """The first port of a block this test process holds alone, or None when every block is taken.

    A block is held by an exclusive ``flock`` on its lock file for the life of
    the process, so two pytest sessions on one machine (a developer's run beside
    CI, or xdist workers of two runs, whose names are both gw0...gw5) never hand
    out the same port: when blocks were named after the worker, a server of one
    run could take a port the other run had just found free.
    """
    global _block
    with _port_lock:
        if _block is None:
            _PORT_LOCKS.mkdir(parents=True, exist_ok=True)
            for k in range(_PORT_BLOCKS):
                handle = open(_PORT_LOCKS / f"block-{k}.lock", "w")  # noqa: SIM115 - held until the process ends
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    handle.close()
                    continue
                _block = (20000 + _PORT_BLOCK * k, handle)
                break
            else:
                return None
        return _block[0]


def free_port() -> int:
    """A TCP port nobody listens on right now, from this process's own block of ports.

    Ports come from a block below the kernel's ephemeral range that this
    process holds alone (``_port_block``), handed out in turn: a port the kernel
    picks could otherwise be picked again, for another process's server or for
    an outgoing connection, in the moment before the caller binds it.
    """
    base = _port_block()
    if base is None:  # more test processes than blocks: the kernel's pick, the best left
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(_PORT_BLOCK):
        with _port_lock:
            port = base + next(_next_port) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORT_BLOCK - 1}")


WAIT_SCALE = float(os.environ.get("PAYSYNC_TEST_WAIT_SCALE", "4"))
"""How far past its nominal bound a wait may go before the test fails (PAYSYNC_TEST_WAIT_SCALE, default 4).

A wait returns the moment its event happens, so the bound costs nothing when
things work; it is there so that a hung test fails instead of hanging. On a
busy machine (parallel workers, a CPU hog beside the suite) a process start
that takes 2 s on a quiet one can take 20: a bound that tight turns load into
failures that say nothing about the code. A test that means to assert a speed
belongs in bench/, not in a wait.
"""


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    """Block until something accepts connections on ``port``."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout} s")


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05, message: str = "condition"):  # noqa: ANN001
    """Poll ``predicate`` until it returns something truthy; return that, or fail (after ``timeout`` x WAIT_SCALE)."""
    timeout *= WAIT_SCALE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


def procfile_command(name: str) -> list[str]:
    """The command line of one Procfile entry, exactly as honcho would run it."""
    for line in (ROOT / "Procfile").read_text().splitlines():
        key, sep, command = line.partition(":")
        if sep and key.strip() == name:
            return shlex.split(command.strip())
    raise KeyError(f"no {name!r} line in the Procfile")


class Proc:
    """A Procfile process started for a test; stopped (SIGTERM, then SIGKILL) by ``stop``."""

    def __init__(self, name: str, env: dict[str, str], log_path: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.popen = subprocess.Popen(
            procfile_command(name), cwd=ROOT, env=env_for(env), stdout=out, stderr=subprocess.STDOUT
        )

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process (and, for gunicorn, its master forwards it)."""
        self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; return the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(10)

    def output(self) -> str:
        """What the process printed so far (when started with a log path)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""


class TcpProxy:
    """A TCP forwarder to ``target`` that a test can cut and restore, to make a service unreachable.

    ``cut()`` closes every open connection and refuses new ones (like a stopped
    server); ``restore()`` accepts again.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self._up = True
        self._closed = False
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self._up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        """Drop every connection and refuse new ones."""
        self._up = False
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def restore(self) -> None:
        """Accept connections again."""
        self._up = True

    def close(self) -> None:
        """Stop listening and drop everything."""
        self._closed = True
        self.cut()
        self.listener.close()
