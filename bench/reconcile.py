"""Reconciliation benchmark: settlement files of 10,000, 100,000 and 1,000,000 lines against matching payments.

    make bench-reconcile BENCH_ARGS="--sizes 10000,100000"

For each size the bench database (``paysync_bench`` unless ``--database-url``)
is rebuilt with that many Succeeded sandbox payments, each confirmed on the
settlement day (its PaymentConfirmed ledger event and lines, as the state
machine writes them), and a sandbox settlement CSV with one matching charge
line per payment (fee column filled) is written under /tmp. Then, each in a
fresh process, measured with ``os.wait4`` (peak RSS of that process alone):

- baseline: read and parse the file with the sandbox parser, nothing else;
- reconcile: ``python -m compensator reconcile --date … --provider sandbox
  --file … --format json``, the real command: hash the file, store every line,
  match it, write the items, the local-only pass, the day's FeeCharged.

Lines/s for reconcile are counted over the run itself (reconciliation_run
started_at to finished_at); the process's wall time (Python start-up and
hashing included) is shown beside it. Every run is checked: every line
matched, nothing unexplained, one FeeCharged with the file's fee total.
Target: memory flat across sizes, at least 20,000 lines/s on MariaDB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import date, datetime, timedelta
from pathlib import Path

from common import DEFAULT_DATABASE_URL, RESULTS, ROOT, loadavg, prepare_database, process_env
from sqlalchemy import Engine, create_engine, func, select, text

from payments.infra.db import insert_ignore_rows
from payments.infra.schema import ledger_entry, ledger_event, payment, reconciliation_run

DAY = date(2024, 3, 1)
TARGET_LINES_PER_SECOND = 20_000
HEADER = "provider_transaction_id,merchant_transaction_id,type,amount,fee,currency,status,created_at\n"
CHUNK = 5000


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/reconcile.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="file sizes in lines (default 10k,100k,1M)")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    parser.add_argument(
        "--before-tree",
        metavar="DIR",
        help="also reconcile with the code of this checkout (e.g. a worktree of main), alternating, same database",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs per size (and tree); medians shown (default 1)")
    parser.add_argument("--json-out", type=Path, help="write the results here (default: a timestamped file)")
    parser.add_argument("--parse-only", metavar="FILE", help=argparse.SUPPRESS)  # the baseline's child process
    return parser.parse_args(argv)


def amount_of(n: int) -> int:
    return 1000 + n % 90_000


def fee_of(n: int) -> int:
    return (amount_of(n) * 6 + 500) // 1000  # 0.6 %, rounded half up, as the sandbox does


def build(engine: Engine, size: int) -> None:
    """``size`` Succeeded payments confirmed on DAY, with their PaymentConfirmed events and lines."""
    confirmed_at = datetime.combine(DAY, datetime.min.time()) + timedelta(hours=10)
    with engine.begin() as conn:
        for start in range(0, size, CHUNK):
            numbers = range(start, min(start + CHUNK, size))
            insert_ignore_rows(
                conn,
                payment,
                [
                    {
                        "payment_id": f"pay_bench{n:012d}",
                        "order_no": f"order-{n}",
                        "amount_minor": amount_of(n),
                        "currency": "CNY",
                        "provider": "sandbox",
                        "provider_transaction_id": f"ch_bench{n:012d}",
                        "status": "Succeeded",
                        "idempotency_key": f"key-{n}",
                        "query_attempts": 0,
                        "created_at": confirmed_at,
                        "updated_at": confirmed_at,
                    }
                    for n in numbers
                ],
            )
            first_id = conn.execute(select(func.coalesce(func.max(ledger_event.c.id), 0))).scalar_one() + 1
            insert_ignore_rows(
                conn,
                ledger_event,
                [
                    {
                        "event_type": "PaymentConfirmed",
                        "payment_id": f"pay_bench{n:012d}",
                        "amount_minor": amount_of(n),
                        "currency": "CNY",
                        "source_type": "callback",
                        "source_id": str(n),
                        "dedupe_key": f"PaymentConfirmed:pay_bench{n:012d}",
                        "created_at": confirmed_at + timedelta(microseconds=n),
                        "id": first_id + i,
                    }
                    for i, n in enumerate(numbers)
                ],
            )
            insert_ignore_rows(
                conn,
                ledger_entry,
                [
                    row
                    for i, n in enumerate(numbers)
                    for row in (
                        {
                            "ledger_event_id": first_id + i,
                            "account": "assets:provider:sandbox",
                            "amount_minor": amount_of(n),
                            "currency": "CNY",
                        },
                        {
                            "ledger_event_id": first_id + i,
                            "account": "income:payments",
                            "amount_minor": -amount_of(n),
                            "currency": "CNY",
                        },
                    )
                ],
            )


def write_file(size: int) -> Path:
    path = Path(f"/tmp/paysync_bench_settlement_{size}_{os.getpid()}.csv")
    with path.open("w") as f:
        f.write(HEADER)
        for n in range(size):
            f.write(
                f"ch_bench{n:012d},pay_bench{n:012d},charge,{amount_of(n)},{fee_of(n)},CNY,succeeded,"
                f"{DAY.isoformat()}T10:{(n // 60) % 60:02d}:{n % 60:02d}Z\n"
            )
    return path


def child(command: list[str], env: dict[str, str], cwd: Path = ROOT) -> tuple[float, int, float, str]:
    """Run ``command`` in ``cwd``; (wall seconds, peak RSS in KiB, CPU seconds of that process, stdout)."""
    out_path = Path(f"/tmp/paysync_bench_reconcile_child_{os.getpid()}.out")
    with out_path.open("wb") as out:
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
    text = out_path.read_text(errors="replace")
    out_path.unlink()
    if proc.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(command[:4])} exited {proc.returncode}:\n{text[-3000:]}")
    return wall, usage.ru_maxrss, usage.ru_utime + usage.ru_stime, text


def parse_only(path: str) -> int:
    """The baseline: read and parse the file, nothing else; print lines and seconds."""
    from payments.providers.sandbox import bill as sandbox_bill

    started = time.monotonic()
    with open(path, "rb") as stream:
        lines = sum(1 for _ in sandbox_bill.parse(stream))
    print(json.dumps({"lines": lines, "seconds": time.monotonic() - started}))
    return 0


def _report(text: str) -> dict:
    """The command's JSON report among its output: log lines (JSON too) may come before or after it."""
    decoder = json.JSONDecoder()
    for i, char in enumerate(text):
        if char == "{" and (i == 0 or text[i - 1] == "\n"):
            try:
                doc, _end = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                continue
            if isinstance(doc, dict) and "run_id" in doc:
                return doc
    raise SystemExit(f"no reconcile report in the command's output: {text[-500:]!r}")


def measure(args: argparse.Namespace, size: int, tree: Path = ROOT) -> dict:
    """One pass at ``size``: a fresh database and file, the parse-only baseline, then ``tree``'s reconcile."""
    engine = prepare_database(args.database_url)
    try:
        clock = time.monotonic()
        build(engine, size)
        path = write_file(size)
        prepared = time.monotonic() - clock
        env = process_env(DATABASE_URL=args.database_url, PAYSYNC_ENV="development")
        wall, rss, _cpu, text = child([sys.executable, str(Path(__file__)), "--parse-only", str(path)], env)
        baseline = json.loads(text.strip().splitlines()[-1])
        baseline.update(wall=wall, rss_kib=rss)
        command = [sys.executable, "-m", "compensator", "reconcile", "--date", DAY.isoformat()]
        command += ["--provider", "sandbox", "--file", str(path), "--format", "json"]
        wall, rss, cpu, text = child(command, {**env, "PYTHONPATH": str(tree)}, cwd=tree)
        report = _report(text)
        with engine.connect() as conn:
            started, finished = conn.execute(
                select(reconciliation_run.c.started_at, reconciliation_run.c.finished_at).where(
                    reconciliation_run.c.id == report["run_id"]
                )
            ).one()
        seconds = (finished - started).total_seconds()
        check(report, size)
        path.unlink()
        return {
            "size": size,
            "prepare_seconds": prepared,
            "baseline": baseline,
            "reconcile": {
                "seconds": seconds,
                "wall": wall,
                "cpu": cpu,
                "rss_kib": rss,
                "lines": report["file"]["lines"],
            },
            "load": loadavg(),
        }
    finally:
        engine.dispose()


def check(report: dict, size: int) -> None:
    matched = report["categories"]["matched"]["count"]
    fees = sum(fee_of(n) for n in range(size))
    if report["status"] != "completed" or matched != size or report["unexplained"] != 0:
        raise SystemExit(f"FAIL: expected {size} matched and nothing unexplained, got {json.dumps(report)[:2000]}")
    if report["fees_booked"] != {"CNY": fees}:
        raise SystemExit(f"FAIL: expected FeeCharged CNY {fees}, got {report['fees_booked']}")


def buffer_pool_mib(url: str) -> int:
    """The server's InnoDB buffer pool: at 1,000,000 lines the day's tables outgrow MariaDB's default 128 MiB."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT @@innodb_buffer_pool_size")).scalar_one()) // (1 << 20)
    finally:
        engine.dispose()


def median_pass(passes: list[dict]) -> dict:
    """The pass with the median reconcile time (its baseline and memory beside it), and every pass's rate."""
    ordered = sorted(passes, key=lambda p: p["reconcile"]["seconds"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["passes"] = [p["size"] / p["reconcile"]["seconds"] for p in passes]
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parse_only:
        return parse_only(args.parse_only)
    RESULTS.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    trees = {"": ROOT}
    if args.before_tree:
        trees = {"before": Path(args.before_tree).resolve(), "": ROOT}
    pool_mib = buffer_pool_mib(args.database_url)
    print(
        f"reconcile bench: sizes {sizes}, {args.repeats} pass(es), trees {list(trees.values())}, "
        f"database {args.database_url.rsplit('/', 1)[-1]} (innodb_buffer_pool_size {pool_mib} MiB); load {loadavg()}"
    )
    passes: dict[str, dict[int, list[dict]]] = {label: {} for label in trees}
    for size in sizes:
        for _ in range(args.repeats):
            for label, tree in trees.items():  # alternating, so both see the same machine
                result = measure(args, size, tree)
                passes[label].setdefault(size, []).append(result)
                b, r = result["baseline"], result["reconcile"]
                print(
                    f"  {label or 'this':>6} {size:>9} lines: parse {size / b['seconds']:9.0f} lines/s "
                    f"{b['rss_kib'] / 1024:6.1f} MiB | reconcile {size / r['seconds']:7.0f} lines/s "
                    f"{r['rss_kib'] / 1024:6.1f} MiB (run {r['seconds']:.1f} s, process {r['wall']:.1f} s, "
                    f"{r['cpu'] * 1e6 / size:.0f} µs CPU/line; "
                    f"load {result['load']})",
                    flush=True,
                )
    medians = {label: [median_pass(by_size[size]) for size in sizes] for label, by_size in passes.items()}
    results = medians[""]
    print()
    header = f"{'lines':>9} | {'parse lines/s':>13} | {'parse RSS':>9} | {'reconcile lines/s':>17} | "
    print(header + f"{'reconcile RSS':>13} | {'vs parse':>8} | {'vs before':>9} | target")
    print("-" * 116)
    for i, result in enumerate(results):
        size, b, r = result["size"], result["baseline"], result["reconcile"]
        rate, base = size / r["seconds"], size / b["seconds"]
        versus = "-"
        if "before" in medians:
            before = medians["before"][i]
            versus = f"{rate / (size / before['reconcile']['seconds']):.2f}x"
        verdict = f">= {TARGET_LINES_PER_SECOND}: {'met' if rate >= TARGET_LINES_PER_SECOND else 'MISSED'}"
        print(
            f"{size:>9} | {base:>13.0f} | {b['rss_kib'] / 1024:>5.1f} MiB | {rate:>17.0f} | "
            f"{r['rss_kib'] / 1024:>9.1f} MiB | {rate / base:>7.2f}x | {versus:>9} | {verdict}"
        )
    if "before" in medians:
        rates = ", ".join(f"{m['size']}: {m['size'] / m['reconcile']['seconds']:.0f}" for m in medians["before"])
        print(f"before tree, reconcile lines/s (median): {rates}")
    rss = [r["reconcile"]["rss_kib"] for r in results]
    if len(rss) > 1:
        print(f"reconcile peak RSS, largest / smallest size: {max(rss) / min(rss):.2f}x")
    print(f"load after: {loadavg()}")
    out = args.json_out or RESULTS / f"reconcile-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    document = {"args": vars(args), "innodb_buffer_pool_mib": pool_mib, "results": results}
    if "before" in medians:
        document["before"] = medians["before"]
    out.write_text(json.dumps(document, indent=2, default=str))
    print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
