"""Helpers for tests that run the real processes: a group of Procfile processes, HTTP posts, broker and DB peeks.

``Stack`` is a context manager: every process and proxy it started is stopped
on exit, whatever the test did, so a failing test leaves nothing running.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pika
import requests
from sqlalchemy import func, select
from sqlalchemy.engine import make_url

from payments.inbound.delivery import decode_messages, encode_message, sign_document
from payments.infra.schema import ledger_event, payment, payment_callback_log, processed_event
from tests.support import BROKER_KEY, SECRET, Proc, TcpProxy, env_for, free_port, wait_for_port, wait_until


def url_via(url: str, port: int) -> str:
    """``url`` (database or broker) rewritten to reach its server through a local proxy on ``port``."""
    if url.startswith("amqp"):
        scheme, rest = url.split("://", 1)
        creds, _, hostpath = rest.rpartition("@")
        path = hostpath.split("/", 1)[1] if "/" in hostpath else ""
        return f"{scheme}://{creds + '@' if creds else ''}127.0.0.1:{port}/{path}"
    return make_url(url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False)


def target_of(url: str) -> tuple[str, int]:
    """(host, port) a database or broker URL points at."""
    if url.startswith("amqp"):
        hostport = url.split("://", 1)[1].rpartition("@")[2].split("/", 1)[0]
        host, _, port = hostport.partition(":")
        return host or "127.0.0.1", int(port or 5672)
    parsed = make_url(url)
    return parsed.host or "127.0.0.1", parsed.port or 3306


def db_url(engine) -> str:  # noqa: ANN001
    """The full URL of a test engine, password included (child processes need it)."""
    return engine.url.render_as_string(hide_password=False)


class Stack:
    """Processes and proxies started by one test; all stopped on ``__exit__``."""

    def __init__(self, tmp_path: Path, **env: str) -> None:
        self.tmp_path = tmp_path
        self.env = {
            "PAYSYNC_ENV": "development",
            "AMQP_URL": "",
            "SANDBOX_WEBHOOK_SECRET": SECRET,
            "LOG_LEVEL": "INFO",
            # Tests share a host: a process serves its own metrics only where a test gives it a port.
            "CONSUMER_METRICS_PORT": "0",
            "COMPENSATOR_METRICS_PORT": "0",
            **env,
        }
        self.procs: list[Proc] = []
        self.proxies: list[TcpProxy] = []

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *_exc: object) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop(timeout=10)
            except Exception:  # noqa: BLE001 - cleanup must reach every process
                proc.kill()
        for proxy in self.proxies:
            proxy.close()

    def proxy(self, url: str) -> TcpProxy:
        """A cuttable proxy in front of the server ``url`` names."""
        proxy = TcpProxy(*target_of(url))
        self.proxies.append(proxy)
        return proxy

    def start(self, name: str, label: str | None = None, **env: str) -> Proc:
        """Start a Procfile line with the stack's settings plus ``env``; output goes to tmp_path/<label>.log."""
        label = label or name
        proc = Proc(name, {**self.env, **env}, log_path=self.tmp_path / f"{label}.log")
        self.procs.append(proc)
        return proc

    def start_web(self, label: str = "web", workers: int = 2, **env: str) -> tuple[Proc, int]:
        """Start the gateway under gunicorn on a free port; return it and the port once it answers."""
        port = free_port()
        proc = self.start("web", label, PORT=str(port), WEB_WORKERS=str(workers), **env)
        try:
            wait_for_port(port, timeout=20)
            wait_until(lambda: len(worker_pids(proc.popen.pid)) >= workers, timeout=20, message="gunicorn workers")
            wait_until(lambda: _healthy(port), timeout=20, message="gateway /healthz")
        except Exception:
            raise AssertionError(f"gateway did not start:\n{proc.output()[-3000:]}") from None
        return proc, port

    def run(self, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        """Run ``python -m …`` to completion with the stack's settings (cron-style commands)."""
        return subprocess.run(
            ["python", *args],
            cwd=Path(__file__).resolve().parent.parent,
            env=env_for({**self.env, **env}),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def output(self) -> str:
        """Everything every process printed so far."""
        return "\n".join(p.output() for p in self.procs)


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def worker_pids(master_pid: int) -> set[int]:
    """The gunicorn worker processes (children) of ``master_pid``, read from /proc."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master_pid:
            pids.add(int(entry))
    return pids


def post(port: int, body: bytes, headers: dict[str, str], path: str = "/callbacks/sandbox") -> requests.Response:
    """POST one delivery to a running gateway (a fresh connection each time, like a provider)."""
    return requests.post(f"http://127.0.0.1:{port}{path}", data=body, headers=headers, timeout=15)


def median_ms(values: Iterable[float]) -> float:
    """Median of seconds, in milliseconds."""
    return statistics.median(values) * 1000


# --- broker peeks --------------------------------------------------------------------------------------------


def amqp_channel(amqp_url: str):  # noqa: ANN201
    """A fresh (connection, channel) pair for peeking and publishing."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    return conn, conn.channel()


def ready_count(amqp_url: str, queue: str) -> int:
    """Messages ready (not held unacked by a consumer) in ``queue``; 0 if it does not exist yet."""
    conn, ch = amqp_channel(amqp_url)
    try:
        return ch.queue_declare(queue, passive=True).method.message_count
    except pika.exceptions.ChannelClosedByBroker:
        return 0
    finally:
        if conn.is_open:
            conn.close()


def queued_callbacks(amqp_url: str, queue: str) -> tuple[int, int]:
    """(messages, callbacks they carry) ready in ``queue``: read without ack, so all of them go back to it."""
    conn, ch = amqp_channel(amqp_url)
    messages = callbacks = 0
    try:
        while True:
            method, _props, body = ch.basic_get(queue, auto_ack=False)
            if method is None:
                break
            messages += 1
            callbacks += len(decode_messages(body, 1 << 20, keys=(BROKER_KEY,)))
    except pika.exceptions.ChannelClosedByBroker:
        pass  # no such queue yet
    finally:
        if conn.is_open:
            conn.close()  # every message read goes back, unacknowledged
    return messages, callbacks


def publish_raw(amqp_url: str, queue: str, bodies: Iterable[bytes]) -> None:
    """Publish raw message bodies to ``queue`` (declared with paysync's topology), persistent."""
    from broker.topology import declare_callback_queue

    conn, ch = amqp_channel(amqp_url)
    try:
        declare_callback_queue(ch, queue)
        ch.confirm_delivery()
        for body in bodies:
            ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    finally:
        conn.close()


def publish_ids(amqp_url: str, queue: str, log_ids: Iterable[int]) -> None:
    """Publish signed ``{"log_id": …}`` messages, the format of earlier versions (the row alone is the truth)."""
    publish_raw(amqp_url, queue, (sign_document({"log_id": i}, BROKER_KEY) for i in log_ids))


def delivery_message(row: Any) -> bytes:
    """The message the gateway publishes for a stored row (``payments.inbound.delivery``)."""
    return encode_message(
        row.id,
        row.provider,
        row.create_time,
        bytes(row.callback_data),
        json.loads(row.headers),
        row.remote_addr,
        key=BROKER_KEY,
    )


def publish_deliveries(amqp_url: str, queue: str, engine, log_ids: Iterable[int]) -> None:  # noqa: ANN001
    """Publish the gateway's message for each stored row, in order."""
    rows = {r.id: r for r in callback_rows(engine)}
    publish_raw(amqp_url, queue, [delivery_message(rows[i]) for i in log_ids])


# --- database peeks ------------------------------------------------------------------------------------------


def callback_rows(engine) -> list[Any]:  # noqa: ANN001
    """Every payment_callback_log row, oldest first."""
    with engine.connect() as conn:
        return list(conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)))


def status_counts(engine) -> dict[int, int]:  # noqa: ANN001
    """{callback status: rows}."""
    t = payment_callback_log
    with engine.connect() as conn:
        return dict(conn.execute(select(t.c.status, func.count()).group_by(t.c.status)).all())


def payment_status(engine, payment_id: str) -> str:  # noqa: ANN001
    """The status column of one payment."""
    with engine.connect() as conn:
        return conn.execute(select(payment.c.status).where(payment.c.payment_id == payment_id)).scalar_one()


def effect_counts(engine, payment_id: str | None = None) -> dict[str, int]:  # noqa: ANN001
    """How many ledger events and processed events exist (for one payment, or in total)."""
    with engine.connect() as conn:
        ledger_q = select(func.count()).select_from(ledger_event)
        if payment_id:
            ledger_q = ledger_q.where(ledger_event.c.payment_id == payment_id)
        return {
            "ledger_events": conn.execute(ledger_q).scalar_one(),
            "processed_events": conn.execute(select(func.count()).select_from(processed_event)).scalar_one(),
        }


def timed(fn, *args: Any, **kwargs: Any) -> tuple[Any, float]:  # noqa: ANN001
    """(fn(*args), seconds it took)."""
    started = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - started
