"""What carrying the delivery in the message costs, isolated from everything else a callback does.

    .venv/bin/python bench/message_cost.py [--messages 20000] [--rounds 5] [--amqp-url …]

On a shared machine the end-to-end benches (``bench-ingest``, ``bench-drain``)
swing by tens of percent from one run to the next; the difference between
publishing ``{"log_id": N}`` and publishing the delivery itself is far
smaller than that. So this measures the difference alone, as CPU time of this
process (all its threads): for each format, encoding a bench callback's
message in the request thread and publishing it through the gateway's own
publisher (``broker.publisher.CallbackPublisher``, asynchronous confirms, a
real RabbitMQ queue) until every message is confirmed; and reading a message
the way the consumer does before it touches the database. Rounds alternate
the two formats, medians are shown, and the extra CPU per callback is set
beside the gateway's whole CPU per callback (``--gateway-cpu-us``, from
``bench-ingest``'s "CPU per request" line) as a share of it. The local
RabbitMQ server's CPU over each round is shown too (it is shared, so other
users' traffic counts in it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

from common import DEFAULT_AMQP_URL, delete_queue, loadavg, median, sandbox_event, signed_body

from broker.publisher import CallbackPublisher
from payments.inbound.delivery import decode_message, encode_message
from payments.infra.db import utcnow
from payments.infra.settings import DEV_DEFAULTS

MAX_BODY = 256 * 1024
KEY = DEV_DEFAULTS["broker_message_secret"][0]
"""What the development consumer verifies messages with (BROKER_MESSAGE_SECRET's default)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/message_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000, help="messages per round and format")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per format, alternating (medians shown)")
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument(
        "--gateway-cpu-us", type=float, default=0.0, help="the gateway's CPU per callback, for the %% share"
    )
    return parser.parse_args(argv)


def callbacks(count: int) -> list[tuple[bytes, dict[str, str]]]:
    """``count`` signed bench callbacks (body, selected headers), as the gateway receives them."""
    out = []
    for n in range(count):
        body, signature = signed_body(sandbox_event(f"pay_bench0000_{n:010d}", amount=1000 + n % 5000))
        out.append((body, {"Content-Type": "application/json", "Sandbox-Signature": signature, "User-Agent": "b"}))
    return out


def pointer(log_id: int, _body: bytes, _headers: dict[str, str], _at: object) -> bytes:
    """The message before: a pointer to the row."""
    return json.dumps({"log_id": log_id}).encode()


def delivery(log_id: int, body: bytes, headers: dict[str, str], at: object) -> bytes:
    """The message now: the delivery itself."""
    return encode_message(log_id, "sandbox", at, body, headers, "127.0.0.1", key=KEY)


def broker_cpu_seconds() -> float | None:
    """CPU time used so far by a RabbitMQ server on this machine (``beam.smp``), or None if there is none."""
    tick = os.sysconf("SC_CLK_TCK")
    total = None
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except (OSError, IndexError, ValueError):
            continue
        if name.startswith("beam"):
            fields = rest.split()
            total = (total or 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return total


def publish_round(amqp_url: str, queue: str, items: list, encode) -> tuple[float, float | None]:  # noqa: ANN001
    """CPU seconds per message (ours, and the local broker's) to encode and publish ``items`` until confirmed."""
    publisher = CallbackPublisher(amqp_url, queue, timeout=2.0)
    try:
        publisher.publish(0, b"{}")  # connect and declare outside the measurement
        if not publisher.flush(30):
            raise SystemExit("FAIL: the broker did not confirm the warm-up message")
        at = utcnow()
        broker_started = broker_cpu_seconds()
        started = time.process_time()
        for log_id, (body, headers) in enumerate(items, start=1):
            while not publisher.publish(log_id, encode(log_id, body, headers, at)):
                time.sleep(0.001)  # the in-process queue is full: wait for confirms, as a gateway would not
            if log_id % 2000 == 0:
                publisher.flush(30)
        if not publisher.flush(60):
            raise SystemExit("FAIL: messages left unconfirmed")
        used = time.process_time() - started
        broker_now = broker_cpu_seconds()
        broker = None if broker_started is None or broker_now is None else (broker_now - broker_started) / len(items)
        if publisher.stats.failed or publisher.stats.dropped:
            raise SystemExit(f"FAIL: publisher lost messages: {publisher.stats}")
    finally:
        publisher.close()
    return used / len(items), broker


def read_round(messages: list[bytes]) -> float:
    """CPU seconds per message for the consumer's reading of a message (before any database work)."""
    started = time.process_time()
    for raw in messages:
        decode_message(raw, MAX_BODY, keys=(KEY,))
    return (time.process_time() - started) / len(messages)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    items = callbacks(args.messages)
    queue = f"bench_message_cost_{uuid.uuid4().hex[:8]}"
    at = utcnow()
    sizes = {
        name: median([len(fn(i, b, h, at)) for i, (b, h) in enumerate(items[:1000], 1)])
        for name, fn in (("pointer", pointer), ("delivery", delivery))
    }
    print(f"message cost: {args.messages} messages x {args.rounds} rounds per format; load before: {loadavg()}")
    cpu: dict[str, list[float]] = {"pointer": [], "delivery": []}
    broker: dict[str, list[float]] = {"pointer": [], "delivery": []}
    try:
        for r in range(args.rounds):
            for name, fn in (("pointer", pointer), ("delivery", delivery)):
                per, per_broker = publish_round(args.amqp_url, queue, items, fn)
                cpu[name].append(per)
                shown = "?" if per_broker is None else f"{per_broker * 1e6:.1f}"
                if per_broker is not None:
                    broker[name].append(per_broker)
                print(
                    f"  round {r + 1} {name:<8} {per * 1e6:7.1f} us CPU per message here, broker {shown} us"
                    f"  load {loadavg()}",
                    flush=True,
                )
    finally:
        delete_queue(args.amqp_url, queue)
    read = [read_round([delivery(i, b, h, at) for i, (b, h) in enumerate(items, 1)]) for _ in range(args.rounds)]
    pointer_us, delivery_us = median(cpu["pointer"]) * 1e6, median(cpu["delivery"]) * 1e6
    extra = delivery_us - pointer_us
    print()
    print(f"median message size: pointer {sizes['pointer']} bytes, delivery {sizes['delivery']} bytes")
    print(f"gateway, encode + publish + confirm: pointer {pointer_us:.1f} us, delivery {delivery_us:.1f} us CPU")
    print(f"extra CPU per callback in the gateway: {extra:.1f} us")
    if args.gateway_cpu_us:
        print(f"  = {extra / args.gateway_cpu_us:.2%} of the gateway's {args.gateway_cpu_us:.0f} us CPU per callback")
    if broker["pointer"] and broker["delivery"]:
        print(
            f"local RabbitMQ (shared: other users' traffic counts too): pointer {median(broker['pointer']) * 1e6:.1f} "
            f"us, delivery {median(broker['delivery']) * 1e6:.1f} us CPU per message"
        )
    print(f"consumer, reading the delivery message: {median(read) * 1e6:.1f} us CPU per message")
    print(f"load after: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
