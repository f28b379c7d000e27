"""The two parts of a charge paysync does beside the provider, each alone: the relay, and POST /payments.

    python bench/charge_parts.py --payments 2000 --repeats 3 --before-tree /tmp/before

``bench/charges.py`` measures the whole pipeline, where every process shares
two cores and a change in one part moves all the figures. This one measures
a part at a time, on the same MariaDB, so a change to it shows:

- ``relay``: ``--payments`` payments created in MariaDB database
  ``paysync_bench_parts`` (``create_payment``, as POST /payments does), then
  one ``relay_outbox.run_once`` in a process of its own against the sandbox
  (its notifications go to a port nobody listens on, one attempt each, so no
  gateway runs). Prints payments per second and CPU per payment of the relay
  process, the sandbox and MariaDB.
- ``post``: the gateway alone (the Procfile's ``web``, 2 workers, no broker,
  no compensator) under wrk, 8 connections, each request a new payment with
  its own Idempotency-Key (``bench/post_payments.lua``). Prints requests per
  second and CPU per payment of the gateway and MariaDB.

``--before-tree DIR`` runs each pass of each part with DIR's code too, right
after this tree's, and prints the ratios; medians over ``--repeats`` passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

from common import (  # the bench directory is on sys.path when run as a script
    ROOT,
    CpuMeter,
    Process,
    free_port,
    loadavg,
    prepare_database,
    process_env,
    procfile_command,
    server_pids,
    wait_for_http,
)

DEFAULT_DATABASE_URL = "mysql+pymysql://root@127.0.0.1:3306/paysync_bench_parts"
TOKEN = "bench-parts-merchant-token-0123456789"
LUA = Path(__file__).with_name("post_payments.lua")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/charge_parts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="relay,post", help="which of relay,post to run")
    parser.add_argument("--payments", type=int, default=2000, help="payments the relay sends per pass")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of wrk per pass of post")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--before-tree", help="another checkout: each pass runs its code too")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--json-out", type=Path)
    return parser.parse_args(argv)


RELAY_CHILD = """
import json, os, time
from compensator import relay_outbox
from payments.runtime import build_runtime
from payments.infra.settings import load_settings
runtime = build_runtime(load_settings(), pool_size=10)
started = time.monotonic()
handled = relay_outbox.run_once(runtime)
seconds = time.monotonic() - started
usage = os.times()
print(json.dumps({"handled": handled, "seconds": seconds, "cpu_seconds": usage.user + usage.system}))
"""
"""The relay process: ``python -c`` in the tree under test (its own code on the path, not this checkout's)."""


def relay_pass(args: argparse.Namespace, tree: Path) -> dict:
    """Create the payments, then relay them in a process of ``tree``'s code; rates and CPU per payment."""
    engine = prepare_database(args.database_url)
    sandbox_port = free_port()
    state = Path(f"/tmp/paysync_bench_parts_sandbox_{uuid.uuid4().hex[:8]}.db")
    env = process_env(
        DATABASE_URL=args.database_url,
        AMQP_URL="",
        MERCHANT_API_TOKEN=TOKEN,
        SANDBOX_API_URL=f"http://127.0.0.1:{sandbox_port}",
        SANDBOX_PORT=str(sandbox_port),
        SANDBOX_DB_PATH=str(state),
        SANDBOX_CALLBACK_URL=f"http://127.0.0.1:{free_port()}/callbacks/sandbox",
        SANDBOX_WEBHOOK_MAX_ATTEMPTS="1",
        PROVIDER_RATE_LIMIT="100000",
    )
    env["PYTHONPATH"] = str(tree)
    sandbox = Process(procfile_command("sandbox"), env, label="parts_sandbox", cwd=tree)
    try:
        wait_for_http(sandbox_port, "/_sandbox/truth")
        from payments.outbound.charges import CreatePayment, create_payment

        prefix = uuid.uuid4().hex[:8]
        for n in range(args.payments):
            create_payment(
                engine,
                CreatePayment(f"parts-{prefix}-{n}", 100 + n, "CNY", "sandbox", None),
                f"parts-{prefix}-{n}",
                deadline_seconds=3600,
                lock_seconds=60,
            )
        child = subprocess.Popen(
            [sys.executable, "-c", RELAY_CHILD],
            cwd=tree,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        meter = CpuMeter({"sandbox": [sandbox.popen.pid], "mariadb": server_pids("mariadbd")})
        meter.start()
        stdout, _ = child.communicate(timeout=600)
        cpu = meter.per_unit(args.payments)
        out = json.loads(stdout.strip().splitlines()[-1])
        # The relay process reports its own CPU (start-up included: imports, the engine, the adapters).
        cpu = {"relay": round(1000 * out["cpu_seconds"] / args.payments, 3), **cpu}
        cpu.pop("bench", None)
        cpu["total"] = round(sum(v for k, v in cpu.items() if k != "total"), 3)
        with engine.connect() as conn:
            from sqlalchemy import func, select

            from payments.infra.schema import payment

            succeeded = conn.execute(select(func.count()).where(payment.c.status == "Succeeded")).scalar()
        if succeeded != args.payments:
            raise RuntimeError(f"only {succeeded} of {args.payments} payments Succeeded")
        return {"per_second": args.payments / out["seconds"], "cpu_ms": cpu}
    finally:
        sandbox.stop()
        state.unlink(missing_ok=True)
        engine.dispose()


def post_pass(args: argparse.Namespace, tree: Path) -> dict:
    """The gateway of ``tree`` alone under wrk POST /payments; requests/s and CPU per payment."""
    engine = prepare_database(args.database_url)
    port = free_port()
    env = process_env(
        DATABASE_URL=args.database_url, AMQP_URL="", MERCHANT_API_TOKEN=TOKEN, PORT=str(port), WEB_WORKERS="2"
    )
    env["PYTHONPATH"] = str(tree)
    env["BENCH_TOKEN"] = TOKEN
    web = Process(procfile_command("web"), env, label="parts_web", cwd=tree)
    try:
        wait_for_http(port)
        url = f"http://127.0.0.1:{port}"
        wrk = ["wrk", "-t2", "-c8", "-s", str(LUA), url]
        subprocess.run([*wrk[:1], "-d2s", *wrk[1:]], env=env, capture_output=True, check=True)  # warm-up
        from sqlalchemy import func, select

        from payments.infra.schema import payment

        def created() -> int:
            with engine.connect() as conn:
                return conn.execute(select(func.count()).select_from(payment)).scalar()

        before = created()
        meter = CpuMeter({"gateway": [web.popen.pid], "mariadb": server_pids("mariadbd")})
        meter.start()
        result = subprocess.run(
            [*wrk[:1], f"-d{args.duration:g}s", *wrk[1:]], env=env, capture_output=True, text=True, check=True
        )
        count = created() - before
        cpu = meter.per_unit(count)
        cpu.pop("bench", None)
        cpu["total"] = round(sum(v for k, v in cpu.items() if k != "total"), 3)
        answers = [line for line in result.stdout.splitlines() if "Non-2xx" in line]
        if answers:
            raise RuntimeError(f"POST /payments: {answers[0].strip()}")
        return {"per_second": count / args.duration, "cpu_ms": cpu}
    finally:
        web.stop()
        engine.dispose()


PARTS = {"relay": relay_pass, "post": post_pass}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"": ROOT}
    if args.before_tree:
        trees["before"] = Path(args.before_tree).resolve()
    parts = [p for p in args.parts.split(",") if p]
    runs: dict[str, dict[str, list[dict]]] = {part: {label: [] for label in trees} for part in parts}
    for repeat in range(args.repeats):
        for part in parts:
            for label, tree in trees.items():
                got = PARTS[part](args, tree)
                runs[part][label].append(got)
                cpu = ", ".join(f"{k} {v:.2f}" for k, v in got["cpu_ms"].items())
                print(
                    f"pass {repeat + 1} {part:<5} {label or 'this':<6} {got['per_second']:7.1f}/s   "
                    f"CPU per payment (ms): {cpu}   (load {loadavg()})",
                    flush=True,
                )
    print(f"\nmedians of {args.repeats} pass(es):")
    summary: dict = {}
    for part in parts:
        for label in trees:
            passes = runs[part][label]
            names = passes[0]["cpu_ms"]
            m = {
                "per_second": statistics.median(p["per_second"] for p in passes),
                "cpu_ms": {n: statistics.median(p["cpu_ms"][n] for p in passes) for n in names},
            }
            summary.setdefault(part, {})[label or "this"] = m
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in m["cpu_ms"].items())
            print(f"  {part:<5} {label or 'this':<6} {m['per_second']:7.1f}/s   CPU per payment (ms): {cpu}")
        if args.before_tree:
            ours, theirs = summary[part]["this"], summary[part]["before"]
            print(
                f"  {part:<5} this/before: rate {ours['per_second'] / theirs['per_second']:.2f}x, "
                f"CPU per payment {ours['cpu_ms']['total'] / theirs['cpu_ms']['total']:.2f}x"
            )
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": vars(args), "summary": summary, "runs": runs}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
