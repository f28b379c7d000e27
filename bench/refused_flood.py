"""Refused-source flood: how much 10,000 POSTs from one unlisted address grow the database (target: < 5 MB).

    .venv/bin/python bench/refused_flood.py [--posts 10000] [--body-kib 256] [--database-url URL]

Starts the real gateway (the Procfile's ``web``, two gunicorn workers, no
broker: callbacks processed inline) on MariaDB (database
``paysync_bench_refused``, emptied first) with ``SANDBOX_SOURCE_CIDRS`` set to
203.0.113.0/24 and ``TRUSTED_PROXIES`` 127.0.0.0/8, as behind a load balancer,
and the per-source limits at their defaults. Then, at once:

- a flood: ``--posts`` POSTs of ``--body-kib`` KiB each to /callbacks/sandbox
  from 198.51.100.7 (an address outside the allow-list, named by the proxy's
  X-Forwarded-For), over 8 keep-alive connections;
- verified traffic: signed ``charge.succeeded`` callbacks from 203.0.113.9
  (inside the allow-list) for ``--verified`` Pending payments, about 30 a
  second for as long as the flood lasts (at least one per payment); each must
  be answered 200 and every payment end Succeeded.

Printed: the flood's answers by status, the verified callbacks' outcome and
latency, and the growth of the database (``payment_callback_log`` after
ANALYZE TABLE: data plus index length, and the bytes the rows hold) against
the 5 MB target. On c47b480 (every refused POST stored whole) 100 such POSTs
added about 26 MB. Results also go to ``bench/results/refused_flood.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import func, insert, select, text  # noqa: E402

from bench.common import (  # noqa: E402
    DEFAULT_DATABASE_URL,
    RESULTS,
    Process,
    free_port,
    prepare_database,
    process_env,
    procfile_command,
    sandbox_event,
    signed_body,
    wait_for_http,
)
from payments.infra.db import utcnow  # noqa: E402
from payments.infra.schema import payment, payment_callback_log  # noqa: E402
from payments.infra.settings import Settings  # noqa: E402

TARGET_BYTES = 5_000_000
FLOODER = "198.51.100.7"
PROVIDER_HOST = "203.0.113.9"
CONNECTIONS = 8


def table_bytes(engine) -> tuple[int, int]:  # noqa: ANN001
    """(data + index length of payment_callback_log after ANALYZE, bytes its rows hold)."""
    with engine.begin() as conn:
        conn.execute(text("ANALYZE TABLE payment_callback_log"))
        allocated = conn.execute(
            text(
                "SELECT COALESCE(SUM(data_length + index_length), 0) FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = 'payment_callback_log'"
            )
        ).scalar_one()
        t = payment_callback_log
        held = conn.execute(
            select(
                func.coalesce(
                    func.sum(
                        func.length(t.c.callback_data)
                        + func.length(t.c.headers)
                        + func.coalesce(func.length(t.c.result), 0)
                        + 200  # the fixed-size columns and the row header, roughly
                    ),
                    0,
                )
            )
        ).scalar_one()
    return int(allocated), int(held)


def flood(port: int, posts: int, body: bytes, statuses: dict, lock: threading.Lock) -> None:
    """Send ``posts`` POSTs from FLOODER over CONNECTIONS keep-alive connections, counting the answers."""
    counter = iter(range(posts))
    counter_lock = threading.Lock()
    headers = {"Content-Type": "application/json", "X-Forwarded-For": FLOODER, "Sandbox-Signature": "t=1,v1=00"}

    def send(conn: http.client.HTTPConnection) -> int:
        conn.request("POST", "/callbacks/sandbox", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status

    def post(state: dict) -> int:
        """One POST; on a kept-alive connection the gateway closed, sent again on a new one (as urllib3 does)."""
        for _ in range(2):
            reused = state["uses"] > 0
            try:
                status = send(state["conn"])
                state["uses"] += 1
                return status
            except (OSError, http.client.HTTPException):
                state["conn"].close()
                state["conn"], state["uses"] = http.client.HTTPConnection("127.0.0.1", port, timeout=30), 0
                if not reused:
                    return 0  # failed on a new connection: a real socket error
                # The gateway closes a connection whose body it did not read all of (a refusal).
                with lock:
                    statuses["reconnects"] = statuses.get("reconnects", 0) + 1
        return 0

    def worker() -> None:
        state = {"conn": http.client.HTTPConnection("127.0.0.1", port, timeout=30), "uses": 0}
        while True:
            with counter_lock:
                if next(counter, None) is None:
                    break
            status = post(state)
            with lock:
                statuses[status] = statuses.get(status, 0) + 1
        state["conn"].close()

    threads = [threading.Thread(target=worker) for _ in range(CONNECTIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def verified(port: int, payment_ids: list[str], flood_done: threading.Event, out: list[tuple[int, float]]) -> None:
    """Signed callbacks from PROVIDER_HOST, about 30 a second, until every payment had one and the flood is over.

    Past the first round a payment's callback comes again (a new event for a settled payment: answered
    200, applied as a no-op), so verified traffic runs for the whole flood however long it takes.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    sent = 0
    while sent < len(payment_ids) or not flood_done.is_set():
        body, signature = signed_body(sandbox_event(payment_ids[sent % len(payment_ids)]))
        headers = {"Content-Type": "application/json", "X-Forwarded-For": PROVIDER_HOST, "Sandbox-Signature": signature}
        started = time.perf_counter()
        try:
            conn.request("POST", "/callbacks/sandbox", body=body, headers=headers)
            response = conn.getresponse()
            response.read()
            out.append((response.status, time.perf_counter() - started))
        except (OSError, http.client.HTTPException):
            out.append((0, time.perf_counter() - started))
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        sent += 1
        time.sleep(0.03)
    conn.close()


def main() -> int:
    """Run the flood once; exit status 1 if the target or a verified callback failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--posts", type=int, default=10_000)
    parser.add_argument("--body-kib", type=int, default=256)
    parser.add_argument("--verified", type=int, default=200)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL.rsplit("/", 1)[0] + "/paysync_bench_refused")
    args = parser.parse_args()

    engine = prepare_database(args.database_url)
    now = utcnow()
    payment_ids = [f"pay_{uuid.uuid4().hex[:20]}" for _ in range(args.verified)]
    with engine.begin() as conn:
        conn.execute(
            insert(payment),
            [
                {
                    "payment_id": pid,
                    "order_no": f"order-{pid[-8:]}",
                    "amount_minor": 1000,
                    "currency": "CNY",
                    "provider": "sandbox",
                    "status": "Pending",
                    "idempotency_key": f"key-{pid}",
                    "created_at": now,
                    "updated_at": now,
                }
                for pid in payment_ids
            ],
        )
    before = table_bytes(engine)

    port = free_port()
    defaults = Settings()
    env = process_env(
        DATABASE_URL=args.database_url,
        AMQP_URL="",
        PORT=str(port),
        WEB_WORKERS="2",
        SANDBOX_SOURCE_CIDRS="203.0.113.0/24",
        TRUSTED_PROXIES="127.0.0.0/8",
        # The shipped defaults, spelled out (process_env turns the per-source limit off for the other benches).
        CALLBACK_SOURCE_RATE=str(defaults.callback_source_rate),
        CALLBACK_SOURCE_BURST=str(defaults.callback_source_burst),
        REFUSED_SOURCE_RATE=str(defaults.refused_source_rate),
        REFUSED_SOURCE_BURST=str(defaults.refused_source_burst),
        REFUSED_BODY_BYTES=str(defaults.refused_body_bytes),
    )
    web = Process(procfile_command("web"), env, "refused_flood_web")
    try:
        wait_for_http(port)
        body = json.dumps({"id": "evt_flood", "type": "charge.succeeded", "pad": "x" * (args.body_kib * 1024)}).encode()
        body = body[: args.body_kib * 1024]
        statuses: dict = {}
        lock = threading.Lock()
        results: list[tuple[int, float]] = []
        flood_done = threading.Event()
        good = threading.Thread(target=verified, args=(port, payment_ids, flood_done, results))
        started = time.monotonic()
        good.start()
        flood(port, args.posts, body, statuses, lock)
        flood_seconds = time.monotonic() - started
        flood_done.set()
        good.join()
        if not web.alive():
            print(web.tail(), file=sys.stderr)
            return 1
    finally:
        web.stop()

    after = table_bytes(engine)
    with engine.connect() as conn:
        stored = conn.execute(select(func.count()).select_from(payment_callback_log)).scalar_one()
        succeeded = conn.execute(
            select(func.count()).select_from(payment).where(payment.c.status == "Succeeded")
        ).scalar_one()
    growth = max(after[0] - before[0], after[1] - before[1])
    accepted = sum(1 for status, _ in results if status == 200)
    sent = len(results)
    latencies = sorted(seconds for _, seconds in results)
    p99 = latencies[int(len(latencies) * 0.99) - 1] if latencies else 0.0
    ok = growth < TARGET_BYTES and accepted == sent and succeeded == args.verified

    print(f"refused flood: {args.posts} POSTs of {args.body_kib} KiB from {FLOODER} in {flood_seconds:.1f} s")
    reconnects = statuses.pop("reconnects", 0)
    answers = ", ".join(f"{status or 'socket error'}: {n}" for status, n in sorted(statuses.items()))
    answers += f" (the gateway closed {reconnects} connections after a refusal: the POST was sent again)"
    print(f"  answers: {answers}")
    print(f"  rows stored: {stored} (of which verified callbacks: {sent})")
    print(
        f"verified from {PROVIDER_HOST} during the flood: {accepted}/{sent} answered 200, "
        f"{succeeded}/{args.verified} payments Succeeded; "
        f"latency median {statistics.median(latencies) * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms"
    )
    print(
        f"database growth: {growth / 1e6:.2f} MB (table data+index {(after[0] - before[0]) / 1e6:.2f} MB, "
        f"row bytes {(after[1] - before[1]) / 1e6:.2f} MB) vs target < {TARGET_BYTES / 1e6:.2f} MB: "
        f"{'PASS' if ok else 'FAIL'}"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "refused_flood.json").write_text(
        json.dumps(
            {
                "at": datetime.now().isoformat(timespec="seconds"),
                "posts": args.posts,
                "body_kib": args.body_kib,
                "answers": {str(k): v for k, v in statuses.items()},
                "flood_seconds": round(flood_seconds, 2),
                "rows_stored": stored,
                "verified_sent": sent,
                "verified_accepted": accepted,
                "verified_succeeded": succeeded,
                "growth_bytes": growth,
                "target_bytes": TARGET_BYTES,
                "pass": ok,
            },
            indent=2,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
