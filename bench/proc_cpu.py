"""CPU per stored row of each server process, over a window of a running benchmark.

    python bench/ingest.py --apps gateway --concurrency 8 --duration 20 --repeats 1 &
    sleep 14; python bench/proc_cpu.py --seconds 6 --database paysync_bench --table payment_callback_log

Reads /proc of every gunicorn process (gateway or baseline workers), mariadbd and
RabbitMQ's beam.smp before and after the window, counts the rows the table gained
meanwhile, and prints µs of CPU per row for each. For the per-process breakdown
in BENCHMARKS.md (Ingest); run one app at a time, so no other gunicorn is up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

KINDS = {"gunicorn": "gunicorn", "mariadbd": "mariadb", "beam.smp": "rabbitmq"}


def processes() -> dict[str, str]:
    """pid -> kind for every process this benchmark measures."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for needle, kind in KINDS.items():
            if needle in command and "chaos" not in command:
                found[pid] = kind
                break
    return found


def cpu_seconds(pid: str) -> float | None:
    """User plus system CPU seconds of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rows(database: str, table: str) -> int:
    """The table's row count, through the mariadb client (as root on the local socket)."""
    query = f"SELECT COUNT(*) FROM `{table}`"
    return int(subprocess.check_output(["mariadb", "-uroot", "-N", "-e", query, database]).strip())


def main() -> None:
    """Measure one window and print rows/s and µs per row by process kind."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="length of the window (default 6)")
    parser.add_argument("--database", default="paysync_bench")
    parser.add_argument("--table", default="payment_callback_log", help="bench_insert_only for the baseline")
    args = parser.parse_args()
    pids = processes()
    before = {pid: cpu_seconds(pid) for pid in pids}
    rows_before, started = rows(args.database, args.table), time.monotonic()
    time.sleep(args.seconds)
    after = {pid: cpu_seconds(pid) for pid in pids}
    stored, elapsed = rows(args.database, args.table) - rows_before, time.monotonic() - started
    totals: dict[str, float] = {}
    for pid, kind in pids.items():
        if before[pid] is not None and after[pid] is not None:
            totals[kind] = totals.get(kind, 0.0) + after[pid] - before[pid]
    per_row = ", ".join(f"{kind} {1e6 * cpu / max(stored, 1):.0f} µs" for kind, cpu in sorted(totals.items()))
    print(f"{stored / elapsed:.0f} rows/s over {elapsed:.1f} s; CPU per row: {per_row}")


if __name__ == "__main__":
    main()
