"""Charges benchmark: payments created through POST /payments and relayed to the sandbox, beside a direct loop.

    make bench-charges BENCH_ARGS="--payments 2000 --concurrency 8"
    make bench-charges BENCH_ARGS="--payments 1000 --repeats 3 --before-tree /tmp/charges-before"

Starts, with the Procfile's commands, the sandbox platform (zero faults, its
own SQLite file under /tmp, webhooks to the gateway), the gateway under
gunicorn (WEB_WORKERS=2) and the compensator (every job; relay_outbox every
RELAY_INTERVAL_SECONDS), on MariaDB database ``paysync_bench_charges``
(emptied first). Then, in the same run:

- ``direct``: the baseline. ``--concurrency`` threads call ``POST /v1/charges``
  on the sandbox in a loop with the same adapter paysync uses (one
  idempotency key each, no database, no outbox): charges per second and the
  p50/p99 latency of one call. The platform notifies every charge, so the
  baseline has a receiver too: a second sandbox, started for this phase only,
  sends its notifications to the INSERT-only app of ``bench/ingest.py``
  (``bench/baseline_apps.py``: store the body, COMMIT, answer 200, under the
  gateway's gunicorn settings), the least a merchant must do with one. Before
  this stop they went to paysync's own gateway, which stored them and failed
  to apply them (no such payment): the baseline then depended on paysync's
  code, and a cheaper failure path in paysync made the ratio fall.
- ``paysync``: ``--concurrency`` threads ``POST /payments`` (bearer token,
  Idempotency-Key) until ``--payments`` exist; the relay sends them, the
  answers are applied. Payments per second from the first creation to the
  last Succeeded, the creation rate seen by the merchant, and the p50/p99
  time from creation (``payment.created_at``) to Succeeded (the
  ``updated_at`` of that transition), both stamped by paysync's clock.

Prints both and the ratios paysync / direct. Then, unless ``--faults ''``,
``paysync+faults``: the same again with the sandbox's fault knobs set to
``--faults`` (default: 15% of charges committed and their reply held 8 s),
payments per second and latencies (target: still 100 payments/s). Results,
with every latency for the charts, go to ``bench/results/`` (``--json-out``).

Each phase also prints the CPU it cost per payment, by process (gateway,
compensator, sandbox, MariaDB, the bench's own client threads; for the
baseline its sandbox and receiver), read from /proc around the phase
(``common.CpuMeter``). A paysync phase's window runs until its notifications
are all stored and processed (they trail the charges under load), and the
next phase starts only then, so no phase pays for another's.

Each pass ends with the statements (MariaDB round trips, COMMIT included) one
unit of work sends, by path: ``POST /payments``, one relay send, one callback
stored, applied by the consumer and swept by the compensator
(``bench/statements.py``, run on the pass's code and sandbox, on a database
of its own; the budget ``tests/test_statement_budget.py`` holds them to is
``bench/statement_budget.toml``).

``--repeats N`` runs N passes, each its own start of the three processes and
its own direct run, and prints medians (the ratio is the median of the
per-pass ratios). ``--before-tree DIR`` runs a pass of DIR's code (the
gateway, compensator and sandbox of another checkout) back to back with each
of ours, so before and after share the machine's load.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import requests
from common import (  # the bench directory is on sys.path when run as a script
    API_KEY,
    RESULTS,
    ROOT,
    SECRET,
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
from sqlalchemy import func, select, text

from payments.infra.schema import payment, payment_callback_log
from payments.providers.base import ChargeRequest, Succeeded
from payments.providers.sandbox.adapter import SandboxProvider

TOKEN = "bench-merchant-token"
DEFAULT_DATABASE_URL = "mysql+pymysql://root@127.0.0.1:3306/paysync_bench_charges"
DEFAULT_FAULTS = {"timeout_after_commit_rate": 0.15, "hang_seconds": 8.0}
"""The chaos run's hanging calls: 15% of charges made, their reply held 8 s (under PROVIDER_TIMEOUT_SECONDS)."""
TARGET_RATIO = 0.5
TARGET_P50_MS = 250.0
TARGET_FAULTED_PER_SECOND = 100.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/charges.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--payments", type=int, default=2000, help="payments (and direct charges) per side")
    parser.add_argument("--concurrency", type=int, default=8, help="client threads on each side (default 8)")
    parser.add_argument("--relay-concurrency", type=int, help="RELAY_CONCURRENCY (default: the setting's default)")
    parser.add_argument(
        "--faults",
        default=json.dumps(DEFAULT_FAULTS),
        help=f"sandbox fault knobs (JSON) for a second paysync run; '' skips it (default {json.dumps(DEFAULT_FAULTS)})",
    )
    parser.add_argument("--json-out", type=Path, help="write the results here (default bench/results/charges-*.json)")
    parser.add_argument("--relay-interval", type=float, default=0.2, help="RELAY_INTERVAL_SECONDS (default 0.2)")
    parser.add_argument("--workers", type=int, default=2, help="WEB_WORKERS for the gateway (default 2)")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument("--timeout", type=float, default=300, help="give up waiting for Succeeded after this")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="create at most this many payments a second (default 0: as fast as --concurrency allows); "
        "below the relay's capacity, the p50 is that of a system that is not saturated",
    )
    parser.add_argument("--repeats", type=int, default=1, help="passes (each with its own direct run); medians shown")
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="sample the gateway (its workers) and the compensator with py-spy during each paysync phase; "
        "flame graphs (SVG) to this directory",
    )
    parser.add_argument(
        "--before-tree",
        help="another checkout (e.g. a worktree of main): each pass runs its processes too, back to back with ours",
    )
    return parser.parse_args(argv)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
    return ordered[index]


def run_direct(sandbox_url: str, count: int, concurrency: int) -> dict:
    """The baseline: call the sandbox in a loop from ``concurrency`` threads, no database, no outbox."""
    adapter = SandboxProvider(SECRET, api_url=sandbox_url, api_key=API_KEY)
    latencies: list[float] = []
    lock = threading.Lock()
    prefix = f"direct_{uuid.uuid4().hex[:8]}"

    def one(n: int) -> None:
        started = time.monotonic()
        outcome = adapter.charge(ChargeRequest(f"{prefix}_{n}", 100 + n, "CNY"), f"{prefix}-key-{n}", 10.0)
        elapsed = time.monotonic() - started
        if not isinstance(outcome, Succeeded):
            raise RuntimeError(f"direct charge {n} was {outcome}")
        with lock:
            latencies.append(elapsed)

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))
    elapsed = time.monotonic() - started
    return {
        "prefix": prefix,
        "count": count,
        "seconds": elapsed,
        "per_second": count / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "latencies_ms": [round(x * 1000, 2) for x in latencies],
    }


def run_paysync(
    port: int,
    engine,  # noqa: ANN001
    count: int,
    concurrency: int,
    timeout: float,
    prefix: str = "",
    rate: float = 0.0,
) -> dict:
    """Create ``count`` payments through the gateway (``rate`` a second at most, 0: at once) and wait for Succeeded."""
    sessions = threading.local()
    prefix = f"{prefix}{uuid.uuid4().hex[:8]}"

    def create(n: int) -> None:
        if rate:  # paced: payment n is created no sooner than n / rate seconds in
            time.sleep(max(0.0, started + n / rate - time.monotonic()))
        session = getattr(sessions, "s", None) or requests.Session()
        sessions.s = session
        response = session.post(
            f"http://127.0.0.1:{port}/payments",
            json={"order_no": f"bench-{prefix}-{n}", "amount": 100 + n, "currency": "CNY", "provider": "sandbox"},
            headers={"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": f"bench-{prefix}-{n}"},
            timeout=30,
        )
        if response.status_code != 201:
            raise RuntimeError(f"POST /payments answered {response.status_code}: {response.text[:200]}")

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(create, range(count)))
    created_seconds = time.monotonic() - started

    ours = payment.c.order_no.like(f"bench-{prefix}-%")  # this run's payments only
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            done = conn.execute(select(func.count()).where(ours, payment.c.status == "Succeeded")).scalar()
            other = conn.execute(select(func.count()).where(ours, payment.c.status == "Failed")).scalar()
        if other:
            raise RuntimeError(f"{other} payments ended Failed with no declines configured")
        if done >= count:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {done} of {count} payments Succeeded after {timeout} s")
        time.sleep(0.2)

    with engine.connect() as conn:
        rows = conn.execute(select(payment.c.created_at, payment.c.updated_at).where(ours)).all()
        # An unanswered call is Unknown until the query job asks: converged, but slower, and counted.
        via_unknown = conn.execute(select(func.count()).where(ours, payment.c.status_source.like("query:%"))).scalar()
    first_created = min(c for c, _ in rows)
    last_done = max(u for _, u in rows)
    span = (last_done - first_created).total_seconds()
    latencies = [(u - c).total_seconds() for c, u in rows]
    return {
        "count": count,
        "seconds": span,
        "per_second": count / span,
        "created_per_second": count / created_seconds,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
        "latencies_ms": [round(x * 1000, 2) for x in latencies],
        "via_unknown": via_unknown,
    }


def start_profilers(directory: Path, pids: dict[str, int], tag: str) -> list[tuple[subprocess.Popen, Path]]:
    """One ``py-spy record`` per process (its children too: gunicorn's workers), its stacks to ``<tag>-<name>.txt``.

    Collapsed stacks (one line per distinct stack and its samples): ``profile_table`` reads them, and any flame
    graph tool (flamegraph.pl, speedscope) draws them.
    """
    directory.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        out = directory / f"{tag}-{name}.txt"
        command = [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--subprocesses"]
        command += ["--rate", "200", "--nonblocking", "--format", "raw", "--output", str(out)]
        spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        spies.append((spy, out))
    time.sleep(1.0)  # attached before the phase starts
    return spies


def stop_profilers(spies: list[tuple[subprocess.Popen, Path]]) -> None:
    """Stop sampling (SIGINT makes py-spy write its stacks), wait, and write each one's table beside it (``.md``)."""
    for spy, _ in spies:
        spy.send_signal(signal.SIGINT)
    for spy, out in spies:
        try:
            spy.wait(60)
        except subprocess.TimeoutExpired:
            spy.kill()
        if out.exists():
            out.with_suffix(".md").write_text(profile_table(out.read_text()))


def profile_table(collapsed: str, top: int = 40) -> str:
    """Functions by share of samples (inclusive: on the stack; self: at its top), from py-spy's collapsed stacks.

    Idle stacks (a worker waiting in select, a pool thread waiting for work) are left out of the total, so the
    shares are of the time the process was on a CPU or in a call it waits for (the database, the provider).
    """
    idle = ("select (", "poll (", "wait (", "accept (", "sleep (", "_wait_for_tstate_lock", "epoll")
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames or any(mark in frames[-1] for mark in idle):
            continue
        n = int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
    rows = [f"busy samples: {total}", "", "| inclusive | self | function (file:line) |", "|---:|---:|---|"]
    for frame, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"| {100 * n / max(total, 1):5.1f}% | {100 * own.get(frame, 0) / max(total, 1):5.1f}% | {frame} |")
    rows += ["", "| self | function (file:line) |", "|---:|---|"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"| {100 * n / max(total, 1):5.1f}% | {frame} |")
    return "\n".join(rows) + "\n"


def tree_env(tree: Path, **settings: str) -> dict[str, str]:
    """The environment of a process that runs the code of ``tree`` (this checkout, or ``--before-tree``)."""
    env = process_env(**settings)
    env["PYTHONPATH"] = str(tree)
    return env


def settle(engine, timeout: float = 120.0) -> float:  # noqa: ANN001
    """Wait until every payment's notification is stored and processed (or ``timeout``); return the seconds waited.

    The platform's notifications trail the charges under load; a phase that
    began while the last one's were still arriving would pay for them.
    """
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with engine.connect() as conn:
            payments = conn.execute(select(func.count()).select_from(payment)).scalar()
            log = payment_callback_log
            rows = conn.execute(select(func.count()).select_from(log)).scalar()
            waiting = conn.execute(select(func.count()).where(log.c.status.in_((0, 2)))).scalar()
        if rows >= payments and not waiting:
            break
        time.sleep(0.2)
    return time.monotonic() - started


def cpu_line(cpu: dict[str, float]) -> str:
    """CPU per payment by process, as a bench line prints it."""
    parts = ", ".join(f"{name} {ms:.2f}" for name, ms in cpu.items() if name != "total")
    return f"CPU per payment (ms): {parts}; total {cpu['total']:.2f}"


def received(engine, count: int, timeout: float = 60.0) -> int:  # noqa: ANN001
    """Wait until the INSERT-only receiver stored ``count`` notifications (or ``timeout``); return how many it has."""
    deadline = time.monotonic() + timeout
    while True:
        with engine.connect() as conn:
            stored = conn.execute(text("SELECT COUNT(*) FROM bench_insert_only")).scalar()
        if stored >= count or time.monotonic() > deadline:
            return stored
        time.sleep(0.2)


def run_direct_phase(args: argparse.Namespace, tree: Path, engine, label: str) -> dict:  # noqa: ANN001
    """The baseline: a sandbox of its own, its notifications to the INSERT-only receiver; both stopped after."""
    receiver_port, sandbox_port = free_port(), free_port()
    state = Path(f"/tmp/paysync_bench_charges_direct_{uuid.uuid4().hex[:8]}.db")
    receiver_env = process_env(
        DATABASE_URL=args.database_url, PORT=str(receiver_port), WEB_WORKERS=str(args.workers), AMQP_URL=""
    )
    receiver_command = [
        sys.executable,
        "-m",
        "gunicorn",
        "-c",
        "gateway/gunicorn_conf.py",
        "bench.baseline_apps:insert_app",
    ]
    sandbox_env = tree_env(
        tree,
        SANDBOX_PORT=str(sandbox_port),
        SANDBOX_DB_PATH=str(state),
        SANDBOX_CALLBACK_URL=f"http://127.0.0.1:{receiver_port}/callbacks/sandbox",
    )
    procs = [
        Process(receiver_command, receiver_env, label="charges_receiver"),
        Process(procfile_command("sandbox"), sandbox_env, label="charges_direct_sandbox", cwd=tree),
    ]
    try:
        wait_for_http(sandbox_port, "/_sandbox/truth")
        wait_for_http(receiver_port, "/")
        meter = CpuMeter(
            {"sandbox": [procs[1].popen.pid], "receiver": [procs[0].popen.pid], "mariadb": server_pids("mariadbd")}
        )
        meter.start()
        direct = run_direct(f"http://127.0.0.1:{sandbox_port}", args.payments, args.concurrency)
        print(
            f"{label}direct : {direct['per_second']:8.1f} charges/s   p50 {direct['p50_ms']:7.1f} ms   "
            f"p99 {direct['p99_ms']:7.1f} ms   ({direct['count']} calls in {direct['seconds']:.1f} s)",
            flush=True,
        )
        direct["notifications_received"] = received(engine, args.payments)
        direct["cpu_ms"] = meter.per_unit(args.payments)
        print(f"{label}direct : {direct['notifications_received']} notifications stored by the receiver", flush=True)
        print(f"{label}direct : {cpu_line(direct['cpu_ms'])}", flush=True)
        return direct
    except Exception:
        for proc in procs:
            print(f"--- {proc.label} ---\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        state.unlink(missing_ok=True)


def count_statements(args: argparse.Namespace, tree: Path, sandbox_port: int, label: str) -> dict[str, int]:
    """Statements per payment by path in ``tree``'s code (``bench/statements.py``, on a database of its own)."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "statements.py"),
        "--database-url",
        f"{args.database_url}_statements{'_before' if label else ''}",  # each tree its own schema
        "--sandbox-url",
        f"http://127.0.0.1:{sandbox_port}",
        "--secret",
        SECRET,
        "--api-key",
        API_KEY,
        "--json",
    ]
    done = subprocess.run(command, env=tree_env(tree), capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"bench/statements.py failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def statements_line(counts: dict[str, int]) -> str:
    """Statements per unit of work by path, as a bench line prints it."""
    return "statements (round trips) per unit: " + ", ".join(f"{name} {n}" for name, n in counts.items())


def one_pass(args: argparse.Namespace, tree: Path, label: str) -> dict:
    """Start sandbox, gateway and compensator from ``tree``'s code; measure direct, paysync and paysync+faults."""
    engine = prepare_database(args.database_url)
    web_port, sandbox_port = free_port(), free_port()
    state = Path(f"/tmp/paysync_bench_charges_sandbox_{uuid.uuid4().hex[:8]}.db")
    common_env = {
        "DATABASE_URL": args.database_url,
        "AMQP_URL": "",
        "MERCHANT_API_TOKEN": TOKEN,
        "SANDBOX_API_URL": f"http://127.0.0.1:{sandbox_port}",
        "SANDBOX_PORT": str(sandbox_port),
        "SANDBOX_CALLBACK_URL": f"http://127.0.0.1:{web_port}/callbacks/sandbox",
        "SANDBOX_DB_PATH": str(state),
        "PORT": str(web_port),
        "WEB_WORKERS": str(args.workers),
        **({"RELAY_CONCURRENCY": str(args.relay_concurrency)} if args.relay_concurrency else {}),
        "RELAY_INTERVAL_SECONDS": str(args.relay_interval),
        "PROVIDER_RATE_LIMIT": "100000",
    }
    procs = []
    try:
        for name in ("sandbox", "web", "compensator"):
            procs.append(
                Process(procfile_command(name), tree_env(tree, **common_env), label=f"charges_{name}", cwd=tree)
            )
        wait_for_http(sandbox_port, "/_sandbox/truth")
        wait_for_http(web_port)
        load_before = loadavg()
        print(f"{label}load average before: {load_before}", flush=True)

        direct = run_direct_phase(args, tree, engine, label)

        meter = CpuMeter(
            {
                "gateway": [procs[1].popen.pid],
                "compensator": [procs[2].popen.pid],
                "sandbox": [procs[0].popen.pid],
                "mariadb": server_pids("mariadbd"),
            }
        )
        spies = []
        if args.profile_dir:
            pids = {"gateway": procs[1].popen.pid, "compensator": procs[2].popen.pid}
            spies = start_profilers(args.profile_dir, pids, f"{label.strip() or 'after'}-{uuid.uuid4().hex[:4]}")
        meter.start()
        paysync = run_paysync(web_port, engine, args.payments, args.concurrency, args.timeout, rate=args.rate)
        paysync["settle_seconds"] = settle(engine)
        paysync["cpu_ms"] = meter.per_unit(args.payments)
        stop_profilers(spies)
        print(
            f"{label}paysync: {paysync['per_second']:8.1f} payments/s  p50 {paysync['p50_ms']:7.1f} ms   "
            f"p99 {paysync['p99_ms']:7.1f} ms   (creation to Succeeded; POST /payments at "
            f"{paysync['created_per_second']:.1f}/s; {paysync['via_unknown']} via Unknown)",
            flush=True,
        )
        print(
            f"{label}paysync: its notifications all processed {paysync['settle_seconds']:.1f} s after the last "
            f"Succeeded; {cpu_line(paysync['cpu_ms'])}",
            flush=True,
        )
        truth = requests.get(f"http://127.0.0.1:{sandbox_port}/_sandbox/truth", timeout=60).json()
        if truth["multiple_charges"]:
            raise RuntimeError(f"charged twice: {truth['multiple_charges'][:5]}")

        ratio = paysync["per_second"] / direct["per_second"]
        print(
            f"{label}ratio paysync/direct: throughput {ratio:.2f}x, "
            f"p50 latency {paysync['p50_ms'] / direct['p50_ms']:.1f}x, "
            f"p99 latency {paysync['p99_ms'] / direct['p99_ms']:.1f}x   (load average after: {loadavg()})",
            flush=True,
        )
        faulted = None
        if args.faults:
            faults = json.loads(args.faults)
            requests.post(
                f"http://127.0.0.1:{sandbox_port}/_sandbox/faults", json=faults, timeout=10
            ).raise_for_status()
            meter.start()
            faulted = run_paysync(
                web_port, engine, args.payments, args.concurrency, args.timeout, prefix="faulted", rate=args.rate
            )
            faulted["settle_seconds"] = settle(engine)
            faulted["cpu_ms"] = meter.per_unit(args.payments)
            faulted["faults"] = faults
            print(
                f"{label}paysync+faults: {faulted['per_second']:8.1f} payments/s  p50 {faulted['p50_ms']:7.1f} ms   "
                f"p99 {faulted['p99_ms']:7.1f} ms   (faults {args.faults})",
                flush=True,
            )
            print(
                f"{label}paysync+faults: notifications processed {faulted['settle_seconds']:.1f} s after; "
                f"{cpu_line(faulted['cpu_ms'])}",
                flush=True,
            )
            truth = requests.get(f"http://127.0.0.1:{sandbox_port}/_sandbox/truth", timeout=60).json()
            if truth["multiple_charges"]:
                raise RuntimeError(f"charged twice: {truth['multiple_charges'][:5]}")
        # Last, so its few charges (their notifications find no payment in the bench database) cost no phase.
        statements = count_statements(args, tree, sandbox_port, label)
        print(f"{label}paysync: {statements_line(statements)}", flush=True)
        return {
            "direct": direct,
            "paysync": paysync,
            "faulted": faulted,
            "statements": statements,
            "ratio": ratio,
            "load_before": load_before,
            "load_after": loadavg(),
        }
    except Exception:
        for proc in procs:
            print(f"--- {proc.label} ---\n{proc.tail()}", file=sys.stderr)
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
        state.unlink(missing_ok=True)
        engine.dispose()


def summarize(passes: list[dict]) -> dict:
    """The medians over passes of the figures the targets are about."""
    figures = {
        "direct_per_second": [p["direct"]["per_second"] for p in passes],
        "paysync_per_second": [p["paysync"]["per_second"] for p in passes],
        "ratio": [p["ratio"] for p in passes],
        "p50_ms": [p["paysync"]["p50_ms"] for p in passes],
        "p99_ms": [p["paysync"]["p99_ms"] for p in passes],
        "created_per_second": [p["paysync"]["created_per_second"] for p in passes],
    }
    if all(p["faulted"] for p in passes):
        figures["faulted_per_second"] = [p["faulted"]["per_second"] for p in passes]
        figures["faulted_p50_ms"] = [p["faulted"]["p50_ms"] for p in passes]
    medians: dict = {name: statistics.median(values) for name, values in figures.items()}
    # Counts do not vary from pass to pass; the median guards against one that did.
    medians["statements"] = {n: statistics.median(p["statements"][n] for p in passes) for n in passes[0]["statements"]}
    for phase in ("direct", "paysync", "faulted"):
        if all(p[phase] and "cpu_ms" in p[phase] for p in passes):
            names = passes[0][phase]["cpu_ms"]
            medians[f"{phase}_cpu_ms"] = {n: statistics.median(p[phase]["cpu_ms"][n] for p in passes) for n in names}
    return medians


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = {"": ROOT}
    if args.before_tree:
        trees = {"before ": Path(args.before_tree).resolve(), "": ROOT}
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    try:
        for repeat in range(args.repeats):
            for label, tree in trees.items():
                print(f"-- pass {repeat + 1}/{args.repeats} {label or 'this tree '}({tree})", flush=True)
                runs[label].append(one_pass(args, tree, label))
    except Exception as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1

    summaries = {label: summarize(passes) for label, passes in runs.items()}
    print(f"\nmedians of {args.repeats} pass(es), {args.payments} payments each:")
    for label, m in summaries.items():
        faulted = f"   with faults {m['faulted_per_second']:6.1f}/s" if "faulted_per_second" in m else ""
        print(
            f"  {label or 'after ' if args.before_tree else ''}{'paysync':<8} {m['paysync_per_second']:6.1f}/s vs "
            f"direct {m['direct_per_second']:6.1f}/s = {m['ratio']:.2f}x   p50 {m['p50_ms']:7.1f} ms   "
            f"p99 {m['p99_ms']:7.1f} ms   POST /payments {m['created_per_second']:6.1f}/s{faulted}"
        )
        for phase in ("direct", "paysync", "faulted"):
            if f"{phase}_cpu_ms" in m:
                print(f"      {phase:<8} {cpu_line(m[f'{phase}_cpu_ms'])}")
        print(f"      {statements_line(m['statements'])}")
    ours = summaries[""]
    verdict = "met" if ours["ratio"] >= TARGET_RATIO else "MISSED"
    print(f"target throughput >= {TARGET_RATIO:g}x direct: {ours['ratio']:.2f}x {verdict}")
    print(
        f"target p50 < {TARGET_P50_MS:g} ms: {ours['p50_ms']:.0f} ms "
        f"{'met' if ours['p50_ms'] < TARGET_P50_MS else 'MISSED (saturated: see the creation rate)'}"
    )
    if "faulted_per_second" in ours:
        met = ours["faulted_per_second"] >= TARGET_FAULTED_PER_SECOND
        print(
            f"target with faults >= {TARGET_FAULTED_PER_SECOND:g} payments/s: {ours['faulted_per_second']:.0f}/s "
            f"{'met' if met else 'MISSED'}"
        )
    print(f"load average after: {loadavg()}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = args.json_out or RESULTS / f"charges-{datetime.now().strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # The top-level direct/paysync/faulted/ratio are this tree's median pass by throughput (for the charts).
    passes = sorted(runs[""], key=lambda p: p["paysync"]["per_second"])
    doc = {
        "args": vars(args),
        **passes[len(passes) // 2],
        "medians": ours,
        "passes": runs[""],
        **({"before": {"medians": summaries["before "], "passes": runs["before "]}} if args.before_tree else {}),
    }
    out.write_text(json.dumps(doc, indent=2, default=str))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
