"""``make bench``: every benchmark in ``bench/`` with the same settings, then the charts (``bench/charts.py``).

    make bench                  # the full run behind BENCHMARKS.md
    make bench BENCH_QUICK=1    # a quick check, under 5 minutes

Each benchmark writes its JSON to ``bench/results/<name>.json`` (the
machine's description goes to ``machine.json``); ``bench/charts.py`` then
draws ``bench/results/*.png`` from those files alone, so a chart can be
redrawn without measuring again. A benchmark that fails stops the run
(its JSON from an earlier run is left as it was, and no chart is drawn
from it). ``--only ingest,drain`` runs some of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime

from common import DEFAULT_AMQP_URL, DEFAULT_DATABASE_URL, RESULTS, ROOT, loadavg

FULL = {
    "ingest": ["--concurrency", "1,8,32", "--duration", "10", "--repeats", "3"],
    "drain": ["--rows", "5000", "--consumers", "1,2,4", "--repeats", "3"],
    "charges": ["--payments", "2000", "--repeats", "3"],
    "reconcile": ["--sizes", "10000,100000,1000000", "--repeats", "3"],
    "chaos": ["--payments", "1000"],
}
"""The settings of the run behind BENCHMARKS.md."""
QUICK = {
    "ingest": ["--concurrency", "1,8,32", "--duration", "2", "--repeats", "1", "--warmup", "1"],
    "drain": ["--rows", "1000", "--consumers", "1,2,4", "--repeats", "1"],
    "charges": ["--payments", "200"],
    "reconcile": ["--sizes", "10000,30000"],
    # Fewer payments than 150 end the load before the kill schedule has made its kills ("kills made" fails).
    # A NotFound is believed after 10 s instead of 60 (still above the fakes' 1 s search lag and 2.5 s held
    # answers): with 60 the tail was two graces in a row (Unknown -> NotFound -> re-send -> NotFound -> close).
    "chaos": ["--payments", "150", "--process-kills", "3", "--no-database-restart", "--not-found-grace-seconds", "10"],
}
"""``BENCH_QUICK=1``: every benchmark, small, to see that each still runs and roughly where it stands."""
SCRIPTS = {name: f"bench/{name}.py" for name in FULL}


def machine() -> dict:
    """Cores, memory and the versions every figure depends on."""
    import pika
    from sqlalchemy import create_engine, text

    memory_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                memory_kib = int(line.split()[1])
    engine = create_engine(DEFAULT_DATABASE_URL.rsplit("/", 1)[0] + "/")
    with engine.connect() as conn:
        mariadb = conn.execute(text("SELECT VERSION()")).scalar()
    engine.dispose()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(DEFAULT_AMQP_URL))
        rabbitmq = conn._impl.server_properties.get("version", b"?")
        rabbitmq = rabbitmq.decode() if isinstance(rabbitmq, bytes) else str(rabbitmq)
        conn.close()
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        rabbitmq = f"unreachable ({type(exc).__name__})"
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(memory_kib / 1024 / 1024, 1),
        "mariadb": mariadb,
        "rabbitmq": rabbitmq,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "load_before": loadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/run_all.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", default=os.environ.get("BENCH_QUICK", "") not in ("", "0"))
    parser.add_argument("--only", default="", help="comma-separated subset of " + ",".join(FULL))
    parser.add_argument(
        "--database-url",
        default=os.environ.get("BENCH_DATABASE_URL", ""),
        help="database for every bench but chaos (its own MariaDB), e.g. one per checkout (default: each bench's)",
    )
    parser.add_argument(
        "--before-tree",
        default=os.environ.get("BENCH_BEFORE_TREE", ""),
        help="also run ingest and drain with this checkout (`git archive main | tar -x -C DIR`): before/after",
    )
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    names = [n for n in args.only.split(",") if n] or list(settings)
    RESULTS.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["quick"] = args.quick
    info["commands"] = {}
    started = time.monotonic()
    for name in names:
        out = RESULTS / f"{name}.json"
        extra = ["--database-url", args.database_url] if args.database_url and name != "chaos" else []
        if args.before_tree and name in ("ingest", "drain"):
            extra += ["--before-tree", args.before_tree]
        command = [sys.executable, SCRIPTS[name], *settings[name], *extra, "--json-out", str(out)]
        shown = " ".join(["python", SCRIPTS[name], *settings[name], *extra, "--json-out", f"bench/results/{name}.json"])
        info["commands"][name] = shown
        print(f"\n=== {name}: {shown}", flush=True)
        t0 = time.monotonic()
        code = subprocess.run(command, cwd=ROOT, check=False).returncode
        info.setdefault("seconds", {})[name] = round(time.monotonic() - t0, 1)
        if code != 0:
            print(f"FAIL: {name} exited {code}", file=sys.stderr)
            return code
    info["total_seconds"] = round(time.monotonic() - started, 1)
    info["load_after"] = loadavg()
    previous = RESULTS / "machine.json"
    if args.only and previous.exists():  # a partial run keeps the other benches' commands on record
        merged = json.loads(previous.read_text())
        merged_commands = {**merged.get("commands", {}), **info["commands"]}
        info = {**merged, **info, "commands": merged_commands}
    previous.write_text(json.dumps(info, indent=2))
    print(f"\nall benchmarks ran in {info['total_seconds']:.0f} s; drawing the charts", flush=True)
    return subprocess.run([sys.executable, "bench/charts.py"], cwd=ROOT, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
