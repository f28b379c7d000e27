"""What the benchmarks share: the bench database, signed sandbox events, processes, RabbitMQ queues.

Every benchmark works in its own MariaDB database (``paysync_bench`` by
default, emptied at start) and its own RabbitMQ queue (deleted at the end), so
it can run beside the test suite. Nothing is written to the repository except
under ``bench/results/`` (gitignored).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, text  # noqa: E402

from payments.infra.db import init_db, make_engine  # noqa: E402
from payments.infra.migrations import VERSION_TABLE  # noqa: E402
from payments.infra.schema import metadata  # noqa: E402
from sandbox import signing  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DEFAULT_DATABASE_URL = "mysql+pymysql://root@127.0.0.1:3306/paysync_bench"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
SECRET = "whsec_bench_fixed_secret"
"""The fixed SANDBOX_WEBHOOK_SECRET every bench process signs and verifies with."""
API_KEY = "sk_bench_sandbox_key"
"""The SANDBOX_API_KEY every bench process shares (the sandbox accepts it, paysync presents it)."""
INSERT_ONLY_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_insert_only ("
    " id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,"
    " body MEDIUMBLOB NOT NULL,"
    " create_time DATETIME(6) NOT NULL"
    ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
)
"""The insert-only baseline's one table (``bench/baseline_apps.py``), created with the schema."""


def prepare_database(url: str) -> Engine:
    """Create the bench database if needed, drop every paysync table in it, and create the schema afresh."""
    engine = make_engine(url, pool_size=4)
    server = make_engine(engine.url.set(database="").render_as_string(hide_password=False), pool_size=1)
    with server.begin() as conn:
        conn.execute(text(f"CREATE DATABASE IF NOT EXISTS `{engine.url.database}` CHARACTER SET utf8mb4"))
    server.dispose()
    with engine.begin() as conn:
        # The ledger's append-only triggers refuse DELETE, so drop and recreate rather than empty.
        for table in reversed(metadata.sorted_tables):
            conn.execute(text(f"DROP TABLE IF EXISTS `{table.name}`"))
        conn.execute(text("DROP TABLE IF EXISTS bench_insert_only"))
        conn.execute(text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
    init_db(engine)
    with engine.begin() as conn:
        conn.execute(text(INSERT_ONLY_DDL))
    return engine


def sandbox_event(payment_id: str, amount: int = 1000, created: int | None = None) -> dict[str, Any]:
    """A distinct ``charge.succeeded`` notification as the sandbox platform sends it."""
    return {
        "id": f"evt_{uuid.uuid4().hex[:24]}",
        "type": "charge.succeeded",
        "created": created or int(time.time()),
        "data": {
            "merchant_transaction_id": payment_id,
            "provider_transaction_id": f"ch_{uuid.uuid4().hex[:24]}",
            "amount": amount,
            "currency": "CNY",
            "failure_code": None,
        },
    }


def signed_body(event: dict[str, Any], timestamp: int | None = None) -> tuple[bytes, str]:
    """(raw body, Sandbox-Signature header value) signed with the bench secret."""
    body = json.dumps(event, separators=(",", ":")).encode()
    return body, signing.sign(SECRET, body, timestamp)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(port: int, path: str = "/healthz", timeout: float = 30.0) -> None:
    """Block until an HTTP server on ``port`` answers ``path`` (any status)."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing answered on port {port} after {timeout} s")


def procfile_command(name: str) -> list[str]:
    """The command of one Procfile line, as honcho runs it."""
    for line in (ROOT / "Procfile").read_text().splitlines():
        key, sep, command = line.partition(":")
        if sep and key.strip() == name:
            return shlex.split(command.strip())
    raise KeyError(f"no {name!r} line in the Procfile")


def process_env(**settings: str) -> dict[str, str]:
    """This environment with the venv first on PATH, the repo on PYTHONPATH, and ``settings``."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["SANDBOX_WEBHOOK_SECRET"] = SECRET
    env["SANDBOX_API_KEY"] = API_KEY
    env["PAYSYNC_ENV"] = "development"  # the benches use development tokens and secrets
    env.setdefault("LOG_LEVEL", "WARNING")
    # A bench client is one address sending at the rate under test: the per-source limit would measure itself.
    env.setdefault("CALLBACK_SOURCE_RATE", "0")
    # Many processes on one host: their own metrics ports (9101/9102 by default) would clash.
    env.setdefault("CONSUMER_METRICS_PORT", "0")
    env.setdefault("COMPENSATOR_METRICS_PORT", "0")
    env.update(settings)
    return env


class Process:
    """A child process with its output in a log file under /tmp; ``stop`` sends SIGTERM, then SIGKILL."""

    def __init__(self, command: list[str], env: dict[str, str], label: str, cwd: Path = ROOT) -> None:
        self.label = label
        self.log_path = Path(f"/tmp/paysync_bench_{label}_{os.getpid()}.log")
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(command, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM, wait, SIGKILL if needed; return the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        code = self.popen.wait(10)
        self._log.close()
        return code

    def tail(self, lines: int = 20) -> str:
        """The last lines of the process's output, for error messages."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def delete_queue(amqp_url: str, queue: str) -> None:
    """Delete a bench queue and its dead-letter queue (best effort)."""
    import pika

    from broker.topology import dead_letter_queue

    try:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        ch = conn.channel()
        ch.queue_delete(queue)
        ch.queue_delete(dead_letter_queue(queue))
        conn.close()
    except Exception as exc:
        print(f"warning: could not delete queue {queue}: {type(exc).__name__}", file=sys.stderr)


def median(values: list[float]) -> float:
    """Median of a non-empty list."""
    return statistics.median(values)


def loadavg() -> str:
    """The 1/5/15-minute load average, to print beside numbers measured on a shared machine."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    """Consecutive slices of ``items`` of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), from /proc."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.extend(int(child) for child in f.read().split())
    except OSError:
        pass
    return found


def _own_cpu(pid: int) -> float:
    """User plus system CPU seconds of one process (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its descendants still running (a gunicorn master and its workers, say)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += _own_cpu(current)
        todo.extend(_children(current))
    return total


def server_pids(name: str) -> list[int]:
    """Pids whose command line starts with a program named ``name`` (``mariadbd``), for its CPU."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                program = f.read().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(program) == name:
            pids.append(int(entry))
    return pids


class CpuMeter:
    """CPU seconds spent by named processes between ``start`` and ``per_unit`` (each a pid and its descendants).

    ``"bench"`` is this process (its client threads). Server processes started
    outside the benchmark (MariaDB) are named by their program.
    """

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = {name: list(ids) for name, ids in pids.items()}
        self.before: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        """CPU seconds so far, by name."""
        totals = {name: sum(tree_cpu(pid) for pid in ids) for name, ids in self.pids.items()}
        usage = os.times()
        totals["bench"] = usage.user + usage.system
        return totals

    def start(self) -> None:
        """Mark the start of the window."""
        self.before = self.read()

    def per_unit(self, units: int) -> dict[str, float]:
        """Milliseconds of CPU per unit of work since ``start``, by name, and their ``total``."""
        after = self.read()
        out = {name: round(1000 * (after[name] - self.before.get(name, 0.0)) / max(units, 1), 3) for name in after}
        out["total"] = round(sum(out.values()), 3)
        return out
