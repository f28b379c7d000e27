"""Benchmark: domain events relayed by ``publish_events`` vs sending the same messages straight from a loop.

Throughput (events/s) for each destination, beside a baseline measured in the
same run that does the same I/O with no outbox, no claiming and no delivery
bookkeeping (RabbitMQ: one connection publishing with confirms; webhook: one
HTTP session POSTing Standard Webhooks-signed bodies). The receiver runs in
its own process and answers 204 without verifying, so it is never the
bottleneck being measured. Then the latency from the outbox commit to the
merchant's receipt, with run_once called every PUBLISH_EVENTS_INTERVAL_SECONDS as the
compensator's scheduler does.

    .venv/bin/python bench/events.py [--events 2000] [--database-url …] [--amqp-url …]

Works in its own database (``paysync_events_bench``) and exchange, both emptied/deleted.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pika  # noqa: E402
import requests  # noqa: E402
from sqlalchemy import insert, update  # noqa: E402

from bench.common import DEFAULT_AMQP_URL, free_port, loadavg, prepare_database  # noqa: E402
from compensator import publish_events  # noqa: E402
from payments.infra import webhook_signing  # noqa: E402
from payments.infra.db import utcnow  # noqa: E402
from payments.infra.ids import new_id  # noqa: E402
from payments.infra.schema import outbox as outbox_table  # noqa: E402
from payments.infra.settings import Settings  # noqa: E402
from payments.lifecycle.events import envelope  # noqa: E402
from payments.runtime import build_runtime  # noqa: E402
from payments.states import OutboxStatus  # noqa: E402

SECRET = "whsec_" + base64.b64encode(b"paysync-events-bench-secret-32by").decode()


def _serve(port: int, log_path: str) -> None:
    with open(log_path, "a", buffering=1) as out:

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                out.write(f"{self.headers.get('webhook-id')} {time.time():.6f}\n")
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):  # noqa: ANN002
                pass

        ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def add_events(engine, n: int) -> list[str]:
    """n PaymentSucceeded outbox rows, as payments.lifecycle.transitions.apply_decision writes them."""
    now = utcnow()
    rows = []
    for _ in range(n):
        payment_id = new_id("pay")
        payload = {"type": "PaymentSucceeded", "payment_id": payment_id, "amount": 1000, "currency": "CNY"}
        rows.append(
            {
                "event_id": new_id("evt"),
                "event_type": "PaymentSucceeded",
                "aggregate_id": payment_id,
                "payload": json.dumps(payload),
                "status": OutboxStatus.PENDING,
                "attempts": 0,
                "next_attempt_at": now,
                "created_at": now,
                "updated_at": now,
            }
        )
    with engine.begin() as conn:
        conn.execute(insert(outbox_table), rows)
    return [r["event_id"] for r in rows]


def relay(runtime, n: int) -> float:
    """Seconds for run_once to deliver n fresh events."""
    add_events(runtime.engine, n)
    started = time.perf_counter()
    while publish_events.run_once(runtime):
        pass
    return time.perf_counter() - started


def baseline_amqp(amqp_url: str, exchange: str, n: int) -> float:
    """Seconds to publish n confirmed persistent messages from a loop."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    ch.exchange_declare(exchange=exchange, exchange_type="topic", durable=True)
    ch.confirm_delivery()
    body = envelope("evt_x", "PaymentSucceeded", '{"amount":1000}', datetime(2026, 1, 1))
    started = time.perf_counter()
    for i in range(n):
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json", message_id=f"evt_{i}")
        ch.basic_publish(exchange, "PaymentSucceeded", body, props)
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def baseline_webhook(url: str, n: int) -> float:
    """Seconds to POST n signed events from a loop over one session."""
    session = requests.Session()
    body = envelope("evt_x", "PaymentSucceeded", '{"amount":1000}', datetime(2026, 1, 1))
    started = time.perf_counter()
    for i in range(n):
        headers = webhook_signing.headers(SECRET, f"evt_base{i}", body)
        headers["Content-Type"] = "application/json"
        session.post(url, data=body, headers=headers, timeout=15).raise_for_status()
    elapsed = time.perf_counter() - started
    session.close()
    return elapsed


def latency(runtime, log_path: str, n: int, spread: float) -> list[float]:
    """Seconds from outbox commit to receipt for n events written at random times over ``spread`` seconds."""
    stop = threading.Event()

    def scheduler() -> None:
        while not stop.is_set():
            publish_events.run_once(runtime)
            stop.wait(runtime.settings.publish_events_interval_seconds)

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    written: dict[str, float] = {}
    for _ in range(n):
        time.sleep(random.uniform(0, 2 * spread / n))
        [event_id] = add_events(runtime.engine, 1)
        written[event_id] = time.time()
    deadline = time.monotonic() + 30
    received: dict[str, float] = {}
    while time.monotonic() < deadline and not set(written) <= set(received):
        time.sleep(0.2)
        for line in Path(log_path).read_text().splitlines():
            event_id, at = line.split()
            received.setdefault(event_id, float(at))
    stop.set()
    thread.join(10)
    return sorted(received[e] - written[e] for e in written if e in received)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--database-url", default="mysql+pymysql://root@127.0.0.1:3306/paysync_events_bench")
    parser.add_argument("--amqp-url", default=os.environ.get("AMQP_URL", DEFAULT_AMQP_URL))
    args = parser.parse_args()
    n = args.events

    engine = prepare_database(args.database_url)
    exchange = f"bench_events_{uuid.uuid4().hex[:8]}"
    port = free_port()
    log_path = tempfile.mktemp(prefix="events-bench-", suffix=".log")  # noqa: S306 - a bench scratch file
    receiver = Process(target=_serve, args=(port, log_path), daemon=True)
    receiver.start()
    time.sleep(0.5)
    url = f"http://127.0.0.1:{port}/hooks"
    base = Settings(paysync_env="development", database_url=args.database_url, events_exchange=exchange)
    runtimes = {
        "amqp": build_runtime(Settings(**{**vars(base), "amqp_url": args.amqp_url}), engine=engine),
        "webhook": build_runtime(
            Settings(**{**vars(base), "merchant_webhook_url": url, "merchant_webhook_secret": (SECRET,)}), engine=engine
        ),
        "both": build_runtime(
            Settings(
                **{
                    **vars(base),
                    "amqp_url": args.amqp_url,
                    "merchant_webhook_url": url,
                    "merchant_webhook_secret": (SECRET,),
                }
            ),
            engine=engine,
        ),
    }
    try:
        print(f"publish_events benchmark: {n} events per run, MariaDB + RabbitMQ on this host; load {loadavg()}")
        amqp_base = n / baseline_amqp(args.amqp_url, exchange, n)
        amqp_relay = n / relay(runtimes["amqp"], n)
        hook_base = n / baseline_webhook(url, n)
        hook_relay = n / relay(runtimes["webhook"], n)
        both_relay = n / relay(runtimes["both"], n)
        for name, ours, base, unit in (
            ("amqp", amqp_relay, amqp_base, "msg/s"),
            ("webhook", hook_relay, hook_base, "req/s"),
        ):
            print(f"  {name:7} relay {ours:7.0f} ev/s   baseline loop {base:7.0f} {unit}   ratio {ours / base:.2f}")
        print(f"  both    relay {both_relay:7.0f} ev/s")
        with engine.begin() as conn:  # let the latency run see only its own events
            conn.execute(update(outbox_table).values(status=OutboxStatus.DONE))
        Path(log_path).write_text("")
        lat = latency(runtimes["webhook"], log_path, 200, 10.0)
        every = runtimes["webhook"].settings.publish_events_interval_seconds
        q = statistics.quantiles(lat, n=100)
        print(
            f"  latency outbox commit -> webhook receipt (run_once every {every:.0f} s, "
            f"{len(lat)} events): p50 {statistics.median(lat) * 1000:.0f} ms  p99 {q[98] * 1000:.0f} ms  "
            f"max {lat[-1] * 1000:.0f} ms"
        )
    finally:
        receiver.terminate()
        conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
        conn.channel().exchange_delete(exchange)
        conn.close()
        os.unlink(log_path)
        engine.dispose()


if __name__ == "__main__":
    main()
