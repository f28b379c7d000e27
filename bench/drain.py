"""Drain benchmark: how fast a backlog of pending callback rows is processed, by consumers and by the compensator.

    make bench-drain BENCH_ARGS="--rows 20000 --consumers 1,2"

For each phase the bench database (``paysync_bench``) is rebuilt with
``--rows`` Pending payments and, for each, one stored ``charge.succeeded``
callback row (status 0, a valid signed body, as the gateway stores it). Then:

- consumer path, with 1 and 2 ``python -m consumer`` processes (the Procfile
  line) on a queue of the bench's own: once they are consuming, one message
  per row is published, as that tree's gateway would publish it (the delivery
  itself, ``payments.inbound.delivery``; ``{log_id}`` for a tree from before that
  format), and the clock runs from the first publish to the last row's commit
  (its ``update_time``);
- compensator path: one ``python -m compensator compensate --once`` with
  COMPENSATOR_GRACE_SECONDS=0 and a rate limit far above what it can do; the
  clock runs from launching the process (Python start-up included) to the
  last row's commit.

Every phase checks the result, not just the speed: all rows status 1, every
payment Succeeded, exactly one ledger event, one outbox domain event and one
processed_event per row. The original cron design drains 100 rows a minute;
the table shows each rate against that too.

``--seal`` runs every phase a second time with a ledger sealer beside the
writers (``seal_ledger.run_once`` every SEAL_INTERVAL_SECONDS in a process of
its own, as in the compensator), alternating with the plain run, and shows
the ratio: what tamper evidence costs the writers. After each sealed phase it
waits for the chain to cover every event (the seal lag after the last commit)
and verifies it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path

from common import (  # the bench directory is on sys.path when run as a script
    DEFAULT_AMQP_URL,
    DEFAULT_DATABASE_URL,
    RESULTS,
    ROOT,
    Process,
    chunks,
    delete_queue,
    loadavg,
    median,
    prepare_database,
    process_env,
    procfile_command,
    sandbox_event,
    signed_body,
)
from sqlalchemy import Engine, func, insert, select, text

from payments.inbound.delivery import encode_batch, encode_message
from payments.infra.db import utcnow
from payments.infra.schema import outbox, payment, payment_callback_log, processed_event
from payments.infra.settings import DEV_DEFAULTS
from payments.states import CallbackStatus
from sandbox import signing

CRON_ROWS_PER_SECOND = 100 / 60
"""The original design: a cron job every minute, 100 rows each."""
TARGET_CONSUMER = 1000.0
TARGET_COMPENSATOR = 800.0
"""Issue 12: one compensator (``compensate --once``) at 800 rows/s or more."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/drain.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000, help="backlog size (default 20000)")
    parser.add_argument("--consumers", default="1,2,4", help="consumer process counts to try (default 1,2,4)")
    parser.add_argument(
        "--compensator-concurrency",
        default="",
        help="COMPENSATOR_CONCURRENCY values to try, e.g. 1,4 (default: the setting's default)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per phase; medians shown (default 1)")
    parser.add_argument(
        "--per-message",
        type=int,
        default=1,
        help="callbacks packed into each message, as the gateway's publisher packs them (default 1: one each)",
    )
    parser.add_argument("--skip-compensator", action="store_true")
    parser.add_argument("--skip-consumer", action="store_true")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument(
        "--before-tree",
        help="also run every phase with the code of this checkout (`git archive <rev> | tar -x -C DIR`), "
        "alternating with this one, for before/after ratios",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a phase after this many seconds")
    parser.add_argument("--json-out", type=Path, help="write the results here (default: a timestamped file)")
    parser.add_argument("--seal", action="store_true", help="also run every phase with a ledger sealer alongside")
    parser.add_argument("--seal-interval", type=float, default=2.0, help="SEAL_INTERVAL_SECONDS of the sealer")
    parser.add_argument("--sealer-loop", action="store_true", help=argparse.SUPPRESS)  # the sealer's own process
    return parser.parse_args(argv)


def sealer_loop(interval: float) -> int:
    """Seal every ``interval`` seconds until SIGTERM, as the compensator's seal_ledger job does."""
    import signal

    from compensator import seal_ledger
    from payments.infra.settings import load_settings
    from payments.runtime import build_runtime

    runtime = build_runtime(load_settings())
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while not stopping:
        started = time.monotonic()
        seal_ledger.run_once(runtime)
        time.sleep(max(0.0, interval - (time.monotonic() - started)))
    return 0


def start_sealer(args: argparse.Namespace) -> Process:
    """The sealer runs this checkout's code, whichever tree the writers run."""
    env = code_env(ROOT, DATABASE_URL=args.database_url, PAYSYNC_ENV="development")
    command = [sys.executable, str(ROOT / "bench" / "drain.py"), "--sealer-loop"]
    return Process(command + ["--seal-interval", str(args.seal_interval)], env, "drain_sealer")


def wait_sealed(engine: Engine, rows: int, timeout: float, sealer: Process) -> float:
    """Seconds from the last row's commit until every ledger event is sealed; then verify the chain."""
    from compensator import seal_ledger

    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            sealed = conn.execute(text("SELECT COUNT(*) FROM ledger_seal")).scalar()
        if sealed >= rows:
            break
        if not sealer.alive():
            raise SystemExit(f"FAIL: the sealer died:\n{sealer.tail()}")
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: {sealed} of {rows} ledger events sealed after {timeout:g} s")
        time.sleep(0.1)
    lag = (utcnow() - last_commit(engine)).total_seconds()
    result = seal_ledger.verify(engine)
    if not result.ok or result.verified != rows:
        raise SystemExit(f"FAIL: seal chain: {seal_ledger.describe(result)}")
    return lag


def build_backlog(engine: Engine, rows: int) -> list[int]:
    """``rows`` Pending payments, each with one pending signed success callback; return the log ids."""
    now = utcnow()
    signed_at = int(time.time())
    payments, logs = [], []
    for n in range(rows):
        payment_id = f"pay_drain{uuid.uuid4().hex[:20]}"
        amount = 1000 + n % 5000
        payments.append(
            {
                "payment_id": payment_id,
                "order_no": f"order-{n}",
                "amount_minor": amount,
                "currency": "CNY",
                "provider": "sandbox",
                "status": "Pending",
                "idempotency_key": f"key-{payment_id}",
                "query_attempts": 0,
                "created_at": now,
                "updated_at": now,
            }
        )
        event = sandbox_event(payment_id, amount=amount, created=signed_at)
        body, signature = signed_body(event, signed_at)
        headers = {"Content-Type": "application/json", signing.HEADER: signature, "User-Agent": "paysync-bench"}
        logs.append(
            {
                "provider": "sandbox",
                "callback_data": body,
                "headers": json.dumps(headers, sort_keys=True),
                "remote_addr": "127.0.0.1",
                "order_no": payment_id,
                "payment_order_no": event["data"]["provider_transaction_id"],
                "provider_event_id": event["id"],
                "event_type": event["type"],
                "status": CallbackStatus.PENDING,
                "retry_count": 0,
                "next_retry_at": now,
                "create_time": now,
                "update_time": now,
            }
        )
    with engine.begin() as conn:
        for part in chunks(payments, 1000):
            conn.execute(insert(payment), part)
        for part in chunks(logs, 1000):
            conn.execute(insert(payment_callback_log), part)
        return list(conn.execute(select(payment_callback_log.c.id).order_by(payment_callback_log.c.id)).scalars())


def status_counts(engine: Engine) -> dict[int, int]:
    """Callback rows per status."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(payment_callback_log.c.status, func.count()).group_by(payment_callback_log.c.status)
        ).all()
    return {status: count for status, count in rows}


def wait_drained(engine: Engine, rows: int, timeout: float, procs: list[Process]) -> None:
    """Poll until every row left status 0; fail if any ended anywhere but status 1."""
    deadline = time.monotonic() + timeout
    while True:
        counts = status_counts(engine)
        if counts.get(0, 0) == 0:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL: backlog not drained after {timeout:g} s: {counts}")
        for proc in procs:
            if not proc.alive() and proc.label.startswith("drain_consumer"):
                raise SystemExit(f"FAIL: {proc.label} died:\n{proc.tail()}")
        time.sleep(0.2)
    if counts.get(1, 0) != rows or len(counts) != 1:
        raise SystemExit(f"FAIL: expected {rows} rows processed (status 1), got {counts}")


def last_commit(engine: Engine) -> datetime:
    """The update_time of the last processed row (naive UTC, the clock paysync writes with)."""
    with engine.connect() as conn:
        return conn.execute(select(func.max(payment_callback_log.c.update_time))).scalar()


def check_effects(engine: Engine, rows: int) -> None:
    """Exactly one effect per row: payment Succeeded, one ledger event, one domain event, one inbox row."""
    with engine.connect() as conn:
        succeeded = conn.execute(select(func.count()).where(payment.c.status == "Succeeded")).scalar()
        ledger = conn.execute(text("SELECT COUNT(*) FROM ledger_event WHERE event_type = 'PaymentConfirmed'")).scalar()
        events = conn.execute(select(func.count()).where(outbox.c.event_type == "PaymentSucceeded")).scalar()
        inbox = conn.execute(select(func.count()).select_from(processed_event)).scalar()
    got = {"succeeded": succeeded, "ledger": ledger, "outbox": events, "processed_event": inbox}
    if any(value != rows for value in got.values()):
        raise SystemExit(f"FAIL: expected {rows} of each effect, got {got}")


def messages(engine: Engine, tree: Path, per_message: int = 1) -> list[bytes]:
    """The backlog rows in id order, ``per_message`` to a message, in the format the gateway of ``tree`` publishes."""
    with engine.connect() as conn:
        rows = conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)).all()
    delivery = tree / "payments" / "delivery.py"
    if not delivery.exists():
        return [json.dumps({"log_id": r.id}).encode() for r in rows]  # the format before the delivery message
    one = [
        encode_message(
            r.id,
            r.provider,
            r.create_time,
            bytes(r.callback_data),
            json.loads(r.headers),
            r.remote_addr,
            key=DEV_DEFAULTS["broker_message_secret"][0],  # what the bench's development consumers verify with
        )
        for r in rows
    ]
    if per_message <= 1 or "def encode_batch" not in delivery.read_text():
        return one  # a tree from before batched messages: one each
    return [encode_batch(one[i : i + per_message]) for i in range(0, len(one), per_message)]


def code_env(tree: Path, **settings: str) -> dict[str, str]:
    """The environment of a process that runs the code of ``tree`` (this checkout, or ``--before-tree``)."""
    env = process_env(**settings)
    env["PYTHONPATH"] = str(tree)
    return env


def consumer_phase(args: argparse.Namespace, consumers: int, tree: Path = ROOT, seal: bool = False) -> dict:
    """Drain the backlog through ``consumers`` consumer processes fed one message per row."""
    import pika

    from broker.topology import declare_callback_queue

    engine = prepare_database(args.database_url)
    build_backlog(engine, args.rows)
    bodies = messages(engine, tree, args.per_message)
    sealer = start_sealer(args) if seal else None
    lag = None
    queue = f"bench_drain_{uuid.uuid4().hex[:8]}"
    env = code_env(tree, DATABASE_URL=args.database_url, AMQP_URL=args.amqp_url, AMQP_QUEUE=queue)
    conn = pika.BlockingConnection(pika.URLParameters(args.amqp_url))
    procs: list[Process] = []
    try:
        channel = conn.channel()
        declare_callback_queue(channel, queue)
        procs = [Process(procfile_command("consumer"), env, f"drain_consumer{i}", cwd=tree) for i in range(consumers)]
        deadline = time.monotonic() + 30
        while channel.queue_declare(queue, passive=True).method.consumer_count < consumers:
            if time.monotonic() > deadline:
                raise SystemExit("FAIL: consumers did not start:\n" + "\n".join(p.tail() for p in procs))
            time.sleep(0.1)
        props = pika.BasicProperties(delivery_mode=2, content_type="application/json")
        started = utcnow()
        for body in bodies:
            channel.basic_publish("", queue, body, props)
        conn.close()  # an idle connection would miss heartbeats while we wait
        published = (utcnow() - started).total_seconds()
        wait_drained(engine, args.rows, args.timeout, procs)
        seconds = (last_commit(engine) - started).total_seconds()
        check_effects(engine, args.rows)
        if sealer is not None:
            lag = wait_sealed(engine, args.rows, args.timeout, sealer)
    finally:
        for proc in procs + ([sealer] if sealer else []):
            proc.stop()
        if conn.is_open:
            with contextlib.suppress(Exception):
                conn.close()
        delete_queue(args.amqp_url, queue)
        engine.dispose()
    return {
        "seconds": seconds,
        "rows_per_s": args.rows / seconds,
        "publish_seconds": published,
        "seal_lag_seconds": lag,
        "load": loadavg(),
    }


def compensator_phase(args: argparse.Namespace, tree: Path = ROOT, concurrency: str = "", seal: bool = False) -> dict:
    """Drain the backlog with one ``python -m compensator compensate --once``."""
    engine = prepare_database(args.database_url)
    build_backlog(engine, args.rows)
    sealer = start_sealer(args) if seal else None
    lag = None
    env = code_env(
        tree,
        DATABASE_URL=args.database_url,
        # A broker URL keeps the production timing rules; the sweep itself never touches the broker.
        AMQP_URL=args.amqp_url,
        AMQP_QUEUE=f"bench_drain_unused_{uuid.uuid4().hex[:8]}",
        COMPENSATOR_GRACE_SECONDS="0",
        COMPENSATOR_RATE_LIMIT="1000000",
        # run_once's time budget is 5 intervals: make it long enough for the whole backlog.
        COMPENSATOR_INTERVAL_SECONDS="3600",
    )
    if concurrency:
        env["COMPENSATOR_CONCURRENCY"] = concurrency
    started = utcnow()
    clock = time.monotonic()
    command = [sys.executable, "-m", "compensator", "compensate", "--once"]
    proc = Process(command, env, "drain_compensator", cwd=tree)
    try:
        code = proc.popen.wait(args.timeout)
        wall = time.monotonic() - clock
        if code != 0:
            raise SystemExit(f"FAIL: compensator exited {code}:\n{proc.tail()}")
        wait_drained(engine, args.rows, 1.0, [])
        seconds = (last_commit(engine) - started).total_seconds()
        check_effects(engine, args.rows)
        if sealer is not None:
            lag = wait_sealed(engine, args.rows, args.timeout, sealer)
    finally:
        proc.stop()
        if sealer is not None:
            sealer.stop()
    engine.dispose()
    return {
        "seconds": seconds,
        "rows_per_s": args.rows / seconds,
        "process_wall_seconds": wall,
        "seal_lag_seconds": lag,
        "load": loadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sealer_loop:
        return sealer_loop(args.seal_interval)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    phases: dict[str, list[dict]] = {}
    print(f"drain bench: backlog {args.rows} rows, {args.repeats} run(s) per phase; load before: {loadavg()}")
    trees = {"": ROOT}
    if args.before_tree:
        trees = {"before ": Path(args.before_tree).resolve(), "": ROOT}
    sweeps = [] if args.skip_compensator else args.compensator_concurrency.split(",")
    seal_modes = [False, True] if args.seal else [False]
    for _ in range(args.repeats):
        for prefix, tree in trees.items():
            if not args.skip_consumer:
                for consumers in [int(c) for c in args.consumers.split(",") if c]:
                    for seal in seal_modes:
                        name = f"{prefix}consumer x{consumers}" + (" +sealer" if seal else "")
                        result = consumer_phase(args, consumers, tree, seal)
                        phases.setdefault(name, []).append(result)
                        print(
                            f"  {name:<26} {result['rows_per_s']:8.0f} rows/s  ({result['seconds']:.1f} s; "
                            f"publishing took {result['publish_seconds']:.1f} s;{_lag(result)} load {result['load']})",
                            flush=True,
                        )
            for concurrency in sweeps:
                for seal in seal_modes:
                    name = f"{prefix}compensator x1" + (f" c={concurrency}" if concurrency else "")
                    name += " +sealer" if seal else ""
                    result = compensator_phase(args, tree, concurrency, seal)
                    phases.setdefault(name, []).append(result)
                    print(
                        f"  {name:<26} {result['rows_per_s']:8.0f} rows/s  ({result['seconds']:.1f} s; "
                        f"process wall {result['process_wall_seconds']:.1f} s;{_lag(result)} load {result['load']})",
                        flush=True,
                    )

    print()
    versus_what = "vs unsealed" if args.seal and not args.before_tree else "vs before"
    print(f"{'path':<26} | {'rows/s':>8} | {'vs cron 100/min':>15} | {versus_what:>11} | target")
    print("-" * 86)
    summary = {}
    for name, runs in phases.items():
        rate = median([r["rows_per_s"] for r in runs])
        summary[name] = {"rows_per_s": rate, "runs": len(runs)}
        before = phases.get(f"before {name}")
        if name.endswith(" +sealer"):
            before = phases.get(name.removesuffix(" +sealer"))  # the plain run beside it
        versus = ""
        if before:
            # Median of per-repeat ratios: the two runs of a repeat are back to back and share the load.
            ratio = median([a["rows_per_s"] / b["rows_per_s"] for a, b in zip(runs, before, strict=True)])
            summary[name]["vs_before"] = ratio
            versus = f"{ratio:.2f}x"
        target = TARGET_COMPENSATOR if "compensator" in name else TARGET_CONSUMER
        verdict = f">= {target:.0f}: {'met' if rate >= target else 'MISSED'}"
        if name.startswith("before "):
            verdict = ""
        print(f"{name:<26} | {rate:8.0f} | {rate / CRON_ROWS_PER_SECOND:14.0f}x | {versus:>11} | {verdict}")
    print(f"load after: {loadavg()}")
    out = args.json_out or RESULTS / f"drain-{stamp}.json"
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "runs": phases}, indent=2, default=str))
    print(f"raw results: {out}")
    return 0


def _lag(result: dict) -> str:
    lag = result.get("seal_lag_seconds")
    return "" if lag is None else f" sealed {lag:.1f} s after the last commit;"


if __name__ == "__main__":
    sys.exit(main())
