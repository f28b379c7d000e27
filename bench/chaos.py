"""``make chaos``: the whole system under faults, then a table of every invariant with its figure.

    make chaos                                   # 10,000 payments, private MariaDB and RabbitMQ
    make chaos CHAOS_ARGS="--payments 300 --process-kills 3 --rate 10"   # the small variant make test runs
    make chaos CHAOS_ARGS="--database-url mysql+pymysql://root@127.0.0.1:3306/paysync_chaos --amqp-url amqp://…"

1. A private stack (``chaos_stack``): a MariaDB server and a RabbitMQ node of
   its own under a temporary directory (or the servers ``--database-url`` /
   ``--amqp-url`` name, which are then never killed), then, each from its
   Procfile line under a restart loop, the sandbox platform with every fault
   on, the gateway under gunicorn (3 workers), 2 consumers and 2
   compensators.
2. The merchant (``chaos_load``) sends ``--payments`` POST /payments at
   ``--concurrency`` with a fixed Idempotency-Key each, retrying every
   transient answer with the same key; a share is sent again (the replay
   check).
   Meanwhile (``chaos_refunds``) the merchant refunds a share
   (``--refund-share``) of each mix's Succeeded payments, once or twice in
   part, with a fixed Idempotency-Key each (some sent twice, some over what
   is left, which must be refused).
3. Meanwhile the seeded schedule (``chaos_kills``) SIGKILLs a gateway worker,
   a consumer or a compensator every few seconds during the first part of the
   run, and SIGKILLs RabbitMQ and MariaDB once each, starting them again.
4. The run waits (up to ``--deadline``) until every payment is terminal,
   every callback row processed or rejected, every outbox row sent and the
   platform has nothing in flight; then each mix checks the converged system
   through paysync's own commands (the sandbox mix: ``compensator reconcile``
   for each day of the run, ``seal_ledger --once``, ``verify-ledger``), and
   the run prints one row per invariant (``chaos_invariants`` and each mix's
   own) and exits 1 if any is violated.
   ``--json-out`` writes the table, the kills and the time series of open
   payments.

The settings below make retries, sweeps and queries quicker than the
defaults so that a run converges in minutes; each is a documented setting,
nothing is patched. QUERY_NOT_FOUND_GRACE_SECONDS is one of them
(``--not-found-grace-seconds``, 10 s here, paysync's own 60 s): a charge or
refund that came back Unknown and is not found at the platform waits that long
after its last send before it is sent again, and a re-sent QR order that is not
found waits as long again before it is closed. The grace is there for a request
the platform may still be working on after we gave up; the fault mix's hangs
last 2.5 s, so 10 s still covers them four times over, while 60 s made each
re-send cycle a minute: a refund whose re-sends met five faults in a row (a
429, a 503, two hangs, a lock timeout: run ab7f52fa) did not converge within
the small run's 300 s, and CI's run 6e50a851 failed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import requests
from chaos_invariants import CHAOS_ALERT_RULES, Database, Row, alert_row, core_rows, progress_sample, read_database
from chaos_kills import KillPlan, KillSchedule
from chaos_load import LoadDriver
from chaos_mix import Mix, RunContext, SandboxMix
from chaos_providers import PROVIDER_MIXES
from chaos_refunds import RefundLoad, read_refunds
from chaos_stack import ExternalServer, PrivateMariaDB, PrivateRabbitMQ, Supervised, free_port, remove_tree, wait_for
from common import ROOT  # the bench directory is on sys.path when run as a script
from sqlalchemy import create_engine, text

from tests.leaks import scan_logs  # the same scan the security tests make

DEFAULT_PROVIDERS = ("sandbox", "alipay", "wechatpay", "stripe")
"""Every provider paysync has, each with its platform (the sandbox, or a real provider's fake)."""
MERCHANT_TOKEN = "chaos-merchant-token-0123456789abcdef"
OPS_TOKEN = "chaos-ops-token-0123456789abcdef"

TUNING = {
    # Sweep quickly, and leave fresh rows to the consumers for 5 s only.
    "COMPENSATOR_INTERVAL_SECONDS": "2",
    "COMPENSATOR_GRACE_SECONDS": "5",
    "RETRY_BASE_SECONDS": "0.5",
    "RETRY_MAX_SECONDS": "10",
    # A held reply (timeout after commit, 2.5 s) becomes Unknown after 1 s and is queried.
    "PROVIDER_TIMEOUT_SECONDS": "1",
    "PROVIDER_RATE_LIMIT": "1000",
    "QUERY_PENDING_AFTER_SECONDS": "5",
    "QUERY_BASE_SECONDS": "1",
    "QUERY_MAX_SECONDS": "10",
    # A request whose worker was killed holds its key this long before the merchant's retry may take over.
    "IDEMPOTENCY_LOCK_SECONDS": "5",
}
"""Settings that shorten the timers so a run converges in minutes (docs/reference/settings.md explains each)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--payments", type=int, default=10_000, help="payments to create (default 10000)")
    p.add_argument("--concurrency", type=int, default=16, help="merchant threads (default 16)")
    p.add_argument("--rate", type=float, default=0.0, help="at most this many new payments per second (0: no limit)")
    p.add_argument("--replay-share", type=float, default=0.1, help="share of payments sent twice (default 0.1)")
    p.add_argument(
        "--refund-share", type=float, default=0.3, help="share of Succeeded payments refunded in part (default 0.3)"
    )
    p.add_argument("--seed", type=int, default=1, help="seeds the kill schedule, the load and the sandbox's dice")
    p.add_argument("--kill-interval", type=float, default=3.0, help="mean seconds between process kills")
    p.add_argument("--kill-until", type=float, default=0.6, help="process kills stop at this share of payments")
    p.add_argument(
        "--process-kills", type=int, default=0, help="make exactly this many process kills (0: until --kill-until)"
    )
    p.add_argument("--no-broker-restart", action="store_true", help="do not kill and restart RabbitMQ")
    p.add_argument("--no-database-restart", action="store_true", help="do not kill and restart MariaDB")
    p.add_argument("--downtime", type=float, default=2.0, help="seconds a killed server stays down")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds to wait for convergence after the load")
    p.add_argument(
        "--not-found-grace-seconds",
        type=float,
        default=10.0,
        help="QUERY_NOT_FOUND_GRACE_SECONDS of the run: a query's NotFound this soon after a send is not believed "
        "(default 10 s, four times the fault mix's hangs; paysync's own default is 60 s)",
    )
    p.add_argument("--database-url", help="use this database (emptied first) instead of a private MariaDB")
    p.add_argument("--amqp-url", help="use this RabbitMQ (queues of the run's own) instead of a private node")
    p.add_argument("--faults", help="JSON object of sandbox fault knobs replacing the defaults")
    p.add_argument(
        "--providers",
        default=",".join(DEFAULT_PROVIDERS),
        help=f"comma-separated providers sharing the payments equally (default {','.join(DEFAULT_PROVIDERS)})",
    )
    p.add_argument("--json-out", type=Path, help="write the table, kills and time series here as JSON")
    p.add_argument("--work-dir", type=Path, help="keep data and logs here (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory at the end")
    p.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    return p.parse_args(argv)


def build_mixes(args: argparse.Namespace) -> list[Mix]:
    """The capabilities in the run: each provider of ``--providers`` (refunds join here too).

    The real providers come before the sandbox, whose checks after convergence
    end with sealing and verifying the ledger: that then covers what their
    reconciliations booked too.
    """
    names = [n.strip() for n in args.providers.split(",") if n.strip()]
    unknown = [n for n in names if n != "sandbox" and n not in PROVIDER_MIXES]
    if unknown or not names:
        raise SystemExit(f"--providers: unknown {unknown} (known: sandbox, {', '.join(PROVIDER_MIXES)})")
    mixes: list[Mix] = [PROVIDER_MIXES[n]() for n in names if n != "sandbox"]
    if "sandbox" in names:
        sandbox = SandboxMix()
        if args.faults:
            sandbox.faults = json.loads(args.faults)
        mixes.append(sandbox)
    return mixes


def base_env() -> dict[str, str]:
    """This environment, the venv first on PATH, the repository importable, development mode."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env["PAYSYNC_ENV"] = "development"
    env["LOG_LEVEL"] = "INFO"
    # Many processes on one host: their own metrics ports (9101/9102 by default) would clash.
    env.setdefault("CONSUMER_METRICS_PORT", "0")
    env.setdefault("COMPENSATOR_METRICS_PORT", "0")
    return env


class Sampler:
    """Samples the database every second: the progress line and the time series of open payments."""

    def __init__(self, engine: Any, clock: Any) -> None:
        self.engine = engine
        self.clock = clock
        self.series: list[dict[str, Any]] = []
        self.latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = round(self.clock(), 2)
            try:
                sample = {"t": t, **progress_sample(self.engine)}
            except Exception as exc:  # the database is being restarted: a gap in the series, not an error
                sample = {"t": t, "error": type(exc).__name__}
            else:
                self.latest = sample
            self.series.append(sample)
            self._stop.wait(1.0)


def converged(sample: dict[str, Any] | None, created: int) -> bool:
    """Database side: every payment created and terminal, no callback waiting, no charge waiting to be sent."""
    return bool(
        sample
        and "error" not in sample
        and sample["payments"] >= created
        and sample["open"] == 0
        and sample["callbacks_waiting"] == 0
        and sample["outbox_pending"] == 0
        and sample.get("refunds_open", 0) == 0
    )


def event_deliveries_pending(engine: Any) -> int:
    """Domain events still waiting for a destination."""
    with engine.connect() as conn:
        return conn.execute(text("SELECT COUNT(*) FROM event_delivery WHERE status = 0")).scalar_one()


def print_table(rows: list[Row]) -> None:
    """The invariants table, grouped by section."""
    width = max(len(r.name) for r in rows)
    exp_width = max(len(r.expected) for r in rows)
    section = None
    for r in rows:
        if r.section != section:
            section = r.section
            print(f"\n  [{section}]")
        mark = "ok  " if r.ok else "FAIL"
        print(f"  {mark}  {r.name:<{width}}  {r.expected:<{exp_width}}  {r.figure}")
        if not r.ok or (r.examples and r.name.startswith("manual-review")):
            for e in r.examples:
                print(f"          - {e}")


class ChaosRun:
    """One run: the stack, the merchant, the schedule, the sampler; ``main`` calls its phases in order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.run_id = uuid.uuid4().hex[:8]
        self.work = args.work_dir or Path(tempfile.mkdtemp(prefix="paysync-chaos-"))
        self.log_dir = self.work / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.database = ExternalServer(args.database_url, "mariadb") if args.database_url else PrivateMariaDB(self.work)
        self.broker = ExternalServer(args.amqp_url, "rabbitmq") if args.amqp_url else PrivateRabbitMQ(self.work)
        self.procs: list[Supervised] = []
        self.paysync_env: dict[str, str] = {}
        """The settings every paysync process of the run gets (the mixes' commands run with them too)."""
        self.engine: Any = None
        self.mixes = build_mixes(args)
        self.refund_loads: dict[str, RefundLoad] = {}
        """mix name -> its refund merchant, for the mixes that take part in refunds."""
        self.started = time.monotonic()
        self.started_wall = time.time()
        """The same moment as ``started`` on the database's clock (UTC): to place its timestamps on the run's."""
        self.phases: dict[str, float] = {}
        """Seconds each phase of the run took (stack start, load and kills, convergence tail, checks)."""

    def clock(self) -> float:
        """Seconds since the load started."""
        return time.monotonic() - self.started

    def start_stack(self) -> None:
        """Servers, schema, the mixes' platforms, the gateway, consumers and compensators."""
        args = self.args
        began = time.monotonic()
        print(f"chaos run {self.run_id}: seed {args.seed}, {args.payments} payments, work directory {self.work}")
        for server in (self.database, self.broker):
            took = server.start()
            where = f"private, ready in {took:.1f} s" if took else "external"
            print(f"  {server.kind}: {where} ({server.url})", flush=True)
        env = base_env()
        if args.database_url:
            empty_database(self.database.url)
        prepare = subprocess_run(["python", "-m", "payments", "init-db"], {**env, "DATABASE_URL": self.database.url})
        if prepare.returncode != 0:
            raise RuntimeError(f"init-db failed: {prepare.stderr[-2000:]}")
        self.engine = create_engine(
            self.database.url, pool_pre_ping=True, pool_size=4, connect_args={"connect_timeout": 3}
        )
        gateway_port = free_port()
        self.ctx = RunContext(self.run_id, args.seed, self.work, self.log_dir, f"http://127.0.0.1:{gateway_port}", env)
        paysync = {
            **env,
            **TUNING,
            "DATABASE_URL": self.database.url,
            "AMQP_URL": self.broker.url,
            "MERCHANT_API_TOKEN": MERCHANT_TOKEN,
            "OPS_TOKEN": OPS_TOKEN,
            "PORT": str(gateway_port),
            "WEB_WORKERS": "3",
            # Alerts with short windows, evaluated often, so the report can show each one firing and resolving.
            "ALERT_RULES_FILE": str(self._alert_rules_file()),
            "EVALUATE_ALERTS_INTERVAL_SECONDS": "1",
        }
        paysync["QUERY_NOT_FOUND_GRACE_SECONDS"] = f"{args.not_found_grace_seconds:g}"
        if args.amqp_url:  # someone else's broker: a queue and an exchange of this run's own
            paysync["AMQP_QUEUE"] = f"paysync_chaos_{self.run_id}"
            paysync["EVENTS_EXCHANGE"] = f"paysync_chaos_events_{self.run_id}"
        for mix in self.mixes:
            self.procs += mix.start(self.ctx)  # first: a fake platform's keys are made as it starts
            paysync.update(mix.paysync_env())
        self.paysync_env = paysync
        self.gateway = Supervised("web", "web", paysync, self.log_dir)
        self.gateway.start()
        self.procs.append(self.gateway)
        wait_for(lambda: healthy(self.ctx.gateway_url), 60, "gateway")
        self.consumers = [Supervised(f"consumer-{i}", "consumer", paysync, self.log_dir) for i in (1, 2)]
        self.compensators = [Supervised(f"compensator-{i}", "compensator", paysync, self.log_dir) for i in (1, 2)]
        for proc in self.consumers + self.compensators:
            proc.start()
            self.procs.append(proc)
        self.phases["stack_start"] = round(time.monotonic() - began, 1)

    def _alert_rules_file(self) -> Path:
        path = self.work / "alert_rules.toml"
        path.write_text(CHAOS_ALERT_RULES)
        return path

    def drive(self) -> None:
        """The load and the kill schedule together, with a progress line; returns when both are done."""
        args = self.args
        payments = []
        share = args.payments // len(self.mixes)
        for i, mix in enumerate(self.mixes):
            count = share + (args.payments - share * len(self.mixes) if i == 0 else 0)
            payments += mix.payments(self.ctx, count, args.replay_share)
        self.total = len(payments)
        self.driver = LoadDriver(
            self.ctx.gateway_url, MERCHANT_TOKEN, concurrency=args.concurrency, rate=args.rate, seed=args.seed
        )
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.sampler = Sampler(self.engine, self.clock)
        self.schedule = KillSchedule(
            KillPlan(
                interval=args.kill_interval,
                kill_until=args.kill_until,
                process_kills=args.process_kills,
                broker_restart=not args.no_broker_restart,
                database_restart=not args.no_database_restart,
                downtime=args.downtime,
            ),
            args.seed,
            self.gateway,
            self.consumers,
            self.compensators,
            {"rabbitmq": self.broker, "mariadb": self.database},
            progress=lambda: self.driver.answered / max(1, self.total),
            clock=self.clock,
        )
        self.sampler.start()
        self.schedule.start()
        load = threading.Thread(target=self.driver.run, args=(payments,), name="merchant", daemon=True)
        load.start()
        self.start_refunds(load)
        self.next_line = 0.0
        while load.is_alive() or not self.schedule.done:
            self.progress()
            time.sleep(0.2)
        self.load_seconds = self.driver.result.finished - self.driver.result.started
        self.load_end = self.clock()
        self.phases["load_and_kills"] = round(self.load_end, 1)
        print(f"load done in {self.load_seconds:.1f} s; waiting for convergence (up to {args.deadline:.0f} s)")

    def start_refunds(self, load: threading.Thread) -> None:
        """A refund merchant per mix that takes part, watching the payments the load creates for it."""
        result = self.driver.result
        for mix in self.mixes:
            if not mix.refunds or self.args.refund_share <= 0:
                continue
            refunds = RefundLoad(
                self.ctx.gateway_url,
                MERCHANT_TOKEN,
                run_id=self.run_id,
                mix=mix.name,
                seed=self.args.seed,
                share=self.args.refund_share,
                deadline=self.args.deadline + 600,
            )

            def created(name: str = mix.name) -> dict[str, str]:
                requests_ = result.requests
                return {k: p for k, p in dict(result.created).items() if k in requests_ and requests_[k].mix == name}

            refunds.start(created, lambda: not load.is_alive())
            self.refund_loads[mix.name] = refunds

    def progress(self) -> None:
        """Print the progress line when it is due."""
        if self.clock() >= self.next_line:
            print(progress_line(self.clock(), self.sampler.latest, self.driver, self.total, self.schedule), flush=True)
            self.next_line = self.clock() + self.args.progress_interval

    def converge(self) -> float | None:
        """Wait until the database and every platform are quiet; the time it happened, or None past the deadline."""
        created = len(self.driver.result.created)
        try:
            while self.clock() - self.load_end < self.args.deadline:
                refunds_done = all(r.done for r in self.refund_loads.values())
                if refunds_done and converged(self.sampler.latest, created) and all(m.quiet() for m in self.mixes):
                    if event_deliveries_pending(self.engine) == 0 and converged(self.sampler.latest, created):
                        return self.clock()
                self.progress()
                time.sleep(1.0)
            return None
        finally:
            self.phases["convergence_tail"] = round(self.clock() - self.load_end, 1)
            self.sampler.stop()

    def report(self, converged_at: float | None) -> bool:
        """Observe, evaluate, print the table, write the JSON; True when every row holds."""
        args, schedule = self.args, self.schedule
        began = time.monotonic()
        for mix in self.mixes:
            mix.after_convergence(lambda command: subprocess_run(command, self.paysync_env))
            mix.observe()
        rows, explained = evaluate(read_database(self.engine), self.driver, self.mixes)
        rows += self.refund_rows()
        rows.append(alert_row(self.engine))
        secrets = [MERCHANT_TOKEN, OPS_TOKEN] + [s for m in self.mixes for s in m.secrets()]
        leaks = scan_logs(sorted(self.log_dir.glob("*.log")), secrets)
        rows.append(
            Row("card numbers, CVVs and secrets in the logs", "0", str(len(leaks)), not leaks, leaks[:5], "logs")
        )
        last_fault = schedule.last_fault_at or 0.0
        took = (
            f"{converged_at - self.load_end:.1f} s after the load, {converged_at - last_fault:.1f} s after the "
            f"last fault, {converged_at:.1f} s in all"
            if converged_at is not None
            else "did not converge"
        )
        rows.append(
            Row("time to converge", f"within {args.deadline:.0f} s of the load's end", took, converged_at is not None)
        )
        rows[-1].section = "run"
        tail = settle_tail(self.engine, self.started_wall, last_fault)
        print(f"\n  {tail_line(tail)}")
        counts = schedule.counts()
        made = ", ".join(f"{k} {n}" for k, n in sorted(counts.items())) or "none"
        late = [k.kind for k in schedule.kills if k.at > self.load_end]
        if late:
            made += f" ({', '.join(late)} after the load had ended)"
        as_planned = not schedule.errors and kills_as_planned(counts, schedule, self.database, self.broker)
        rows.append(Row("kills made", "as planned", made, as_planned, schedule.errors[:5], "run"))
        self.phases["checks"] = round(time.monotonic() - began, 1)
        print_table(rows)
        ph = self.phases
        print(
            f"\n  phases: stack start {ph['stack_start']:.1f} s, load and kills {ph['load_and_kills']:.1f} s, "
            f"convergence after them {ph['convergence_tail']:.1f} s, checks {ph['checks']:.1f} s"
        )
        retries = dict(self.driver.result.retries)
        print(f"\n  merchant retries: {retries or 'none'}")
        for mix in self.mixes:
            print(f"  {mix.name}: {json.dumps(mix.summary())}")
        for name, refunds in self.refund_loads.items():
            print(f"  {name} refunds: {json.dumps(refunds.summary())}")
        ok = all(r.ok for r in rows)
        print(f"\nchaos run {self.run_id}: {'every invariant held' if ok else 'INVARIANTS VIOLATED'}")
        if args.json_out:
            result = {
                "run_id": self.run_id,
                "ok": ok,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "rows": [r.to_dict() for r in rows],
                "explained_reviews": explained,
                "load_seconds": round(self.load_seconds, 2),
                "converge_seconds_after_load": round(converged_at - self.load_end, 2) if converged_at else None,
                "converged_at": round(converged_at, 2) if converged_at else None,
                "last_fault_at": schedule.last_fault_at,
                "converge_seconds_after_last_fault": round(converged_at - last_fault, 2) if converged_at else None,
                "settle_tail": tail,
                "kills": [k.to_dict() for k in schedule.kills],
                "kill_counts": counts,
                "restarts": {p.label: p.starts - 1 for p in self.procs},
                "merchant_retries": retries,
                "mixes": {m.name: m.summary() for m in self.mixes},
                "refunds": {name: r.summary() for name, r in self.refund_loads.items()},
                "phase_seconds": self.phases,
                "timeseries": self.sampler.series,
            }
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(result, indent=1))
            print(f"json: {args.json_out}")
        return ok

    def refund_rows(self) -> list[Row]:
        """Each taking part mix's refund rows, against its platform's refunds."""
        if not self.refund_loads:
            return []
        refunds = read_refunds(self.engine)
        payments = read_database(self.engine).payments
        rows = []
        for mix in self.mixes:
            load = self.refund_loads.get(mix.name)
            if load is not None:
                rows += load.rows(refunds, payments, mix.refund_truth(), mix.name)
        return rows

    def print_logs(self) -> None:
        """The tail of every process log, after a harness failure."""
        for path in sorted(self.log_dir.glob("*.log")):
            tail = path.read_text(errors="replace").splitlines()[-15:]
            print(f"--- {path.name} ---\n" + "\n".join(tail), file=sys.stderr)

    def stop(self, keep: bool) -> None:
        """Stop every process and private server; remove the work directory unless it is to be kept."""
        for proc in reversed(self.procs):
            proc.stop()
        if self.engine is not None:
            self.engine.dispose()
        if self.args.amqp_url:
            delete_broker_objects(self.args.amqp_url, self.run_id)
        for server in (self.broker, self.database):
            server.stop()
        if keep:
            print(f"work directory kept: {self.work}")
        elif self.args.work_dir is None:
            remove_tree(self.work)


def settle_tail(engine: Any, origin_wall: float, last_fault: float) -> dict[str, Any]:  # noqa: ANN401
    """Per payment, creation to its terminal event (PaymentSucceeded/Failed in the outbox): p50, p99, max.

    Also the payments that settled after the last fault ended: how many, and
    how long after it the last of them did, with and without the QR orders
    closed on their expiry (those wait for the payer, then for the expiry).
    """
    query = text(
        "SELECT p.created_at, MIN(o.created_at), EXISTS (SELECT 1 FROM provider_call c WHERE c.payment_id = "
        "p.payment_id AND c.operation = 'close') FROM payment p JOIN outbox o ON o.aggregate_id = p.payment_id "
        "AND o.event_type IN ('PaymentSucceeded', 'PaymentFailed') GROUP BY p.payment_id, p.created_at"
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    if not rows:
        return {"payments": 0}
    epoch = datetime(1970, 1, 1)
    spans = sorted((done - created).total_seconds() for created, done, _ in rows)
    after = [((done - epoch).total_seconds() - origin_wall - last_fault, closed) for _, done, closed in rows]
    late = [a for a, _ in after if a > 0]
    # A QR order nobody paid settles when it is closed, past its expiry (60 s at least) and EXPIRY_MARGIN: the
    # payer's doing, not a fault's, and no query schedule brings it sooner.
    late_faults = [a for a, closed in after if a > 0 and not closed]

    def nearest(q: float) -> float:
        return spans[min(len(spans) - 1, max(0, round(q * len(spans)) - 1))]

    return {
        "payments": len(spans),
        "p50_seconds": round(nearest(0.50), 2),
        "p99_seconds": round(nearest(0.99), 2),
        "max_seconds": round(spans[-1], 2),
        "settled_after_last_fault": len(late),
        "last_settled_seconds_after_last_fault": round(max(late), 2) if late else 0.0,
        "closed_on_expiry": sum(1 for _, closed in after if closed),
        "last_settled_seconds_after_last_fault_not_closed_on_expiry": round(max(late_faults), 2)
        if late_faults
        else 0.0,
    }


def tail_line(tail: dict[str, Any]) -> str:
    """The settle tail as the run prints it."""
    if not tail["payments"]:
        return "per payment, creation to terminal: no payment settled"
    return (
        f"per payment, creation to terminal: p50 {tail['p50_seconds']:.1f} s, p99 {tail['p99_seconds']:.1f} s, "
        f"max {tail['max_seconds']:.1f} s ({tail['payments']} payments); {tail['settled_after_last_fault']} settled "
        f"after the last fault, the last {tail['last_settled_seconds_after_last_fault']:.1f} s after it; "
        f"without the {tail['closed_on_expiry']} QR orders closed on their expiry (never paid), the last "
        f"{tail['last_settled_seconds_after_last_fault_not_closed_on_expiry']:.1f} s after it"
    )


def main(argv: list[str] | None = None) -> int:
    """Start, drive, converge, report; 0 when every invariant held, 1 on a violation, 2 if the run broke."""
    run = ChaosRun(parse_args(argv))
    ok = False
    try:
        run.start_stack()
        run.drive()
        ok = run.report(run.converge())
        return 0 if ok else 1
    except Exception as exc:
        print(f"chaos run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        run.print_logs()
        return 2
    finally:
        run.stop(keep=run.args.keep or (not ok and run.args.work_dir is None))


def evaluate(db: Database, driver: LoadDriver, mixes: list[Mix]) -> tuple[list[Row], dict[int, str]]:
    """Every row: the mixes explain the reviews they expect, then the core rows, then each mix's own."""
    explained: dict[int, str] = {}
    for review in db.reviews:
        for mix in mixes:
            why = mix.explain_review(review, db)
            if why:
                explained[review["id"]] = why
                break
    rows = core_rows(db, driver.result, explained)
    for mix in mixes:
        created = {k: p for k, p in driver.result.created.items() if driver.result.requests[k].mix == mix.name}
        rows += mix.rows(db, created)
    return rows, explained


def kills_as_planned(counts: dict[str, int], schedule: KillSchedule, database: Any, broker: Any) -> bool:
    """Each process kind hit at least once, and each private server restarted once (unless turned off)."""
    plan = schedule.plan
    wanted = {"gateway_worker", "consumer", "compensator"}
    if plan.broker_restart and broker.killable:
        wanted.add("rabbitmq")
    if plan.database_restart and database.killable:
        wanted.add("mariadb")
    return all(counts.get(kind, 0) >= 1 for kind in wanted)


def progress_line(t: float, sample: dict[str, Any] | None, driver: LoadDriver, total: int, schedule: Any) -> str:
    """One line: created, terminal, open, callbacks waiting, kills."""
    s = sample or {}
    kills = schedule.kills
    last = f" (last: {kills[-1].kind} at {kills[-1].at:.0f}s)" if kills else ""
    return (
        f"[{t:7.1f}s] answered {driver.answered}/{total}  in db {s.get('payments', '?')}  "
        f"terminal {s.get('terminal', '?')}  open {s.get('open', '?')}  unknown {s.get('unknown', '?')}  "
        f"callbacks waiting {s.get('callbacks_waiting', '?')}  outbox {s.get('outbox_pending', '?')}  "
        f"refunds open {s.get('refunds_open', '?')}  "
        f"kills {len(kills)}{last}"
    )


def healthy(base_url: str) -> bool:
    """True when the gateway answers /healthz."""
    try:
        return requests.get(f"{base_url}/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def subprocess_run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a paysync command to completion from the repository root."""
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def delete_broker_objects(amqp_url: str, run_id: str) -> None:
    """Delete the queue (and its dead-letter queue) and the exchange a run made on someone else's broker."""
    import pika

    try:
        conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
        channel = conn.channel()
        for queue in (f"paysync_chaos_{run_id}", f"paysync_chaos_{run_id}.dlq"):
            channel.queue_delete(queue)
        channel.exchange_delete(f"paysync_chaos_events_{run_id}")
        conn.close()
    except Exception as exc:
        print(f"warning: could not delete the run's queues on {amqp_url.split('@')[-1]}: {type(exc).__name__}")


def empty_database(url: str) -> None:
    """Create an external chaos database if needed, and drop every table in it, so the run counts only its own rows."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    server = create_engine(parsed.set(database=""))
    try:
        with server.begin() as conn:
            conn.execute(text(f"CREATE DATABASE IF NOT EXISTS `{parsed.database}` CHARACTER SET utf8mb4"))
    finally:
        server.dispose()
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("SET FOREIGN_KEY_CHECKS = 0"))
            for (name,) in conn.execute(text("SHOW TABLES")).all():
                conn.execute(text(f"DROP TABLE `{name}`"))
            conn.execute(text("SET FOREIGN_KEY_CHECKS = 1"))
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
