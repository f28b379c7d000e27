"""``python -m compensator`` runs the scheduler; ``python -m compensator JOB --once`` runs one job once.

Jobs: compensate_callbacks (alias compensate), relay_outbox, query_unresolved,
evaluate_alerts, notify_alerts (alerts to email, SMS and chat channels, every 5 s),
publish_events (domain events to RabbitMQ and the merchant's webhook), catch_up
(missed Stripe events; a no-op without Stripe settings) and seal_ledger, each on
its interval setting, cleanup (retention: archive, then delete, old processed and
rejected callback rows; ``cleanup --dry-run`` counts them), and reconcile (daily at RECONCILE_TIME). Each is registered
with ``max_instances=1`` and coalescing, so a slow sweep is never run twice at
once in one process and missed runs collapse into one. relay_outbox is the
exception: it runs back to back in a thread of its own
(``relay_outbox.run_forever``), polling continuously, so it never meets its
own previous run at a scheduler tick.

Commands for operators (each exits 0 when all is well, 1 when not, 2 on bad usage):

- ``reverify --provider P [--since ISO-TIME]``: re-verify rejected callbacks against
  today's keys after a key fix (compensator/reverify.py)
- ``reconcile --date YYYY-MM-DD [--provider P] [--file PATH] [--format text|json]``
- ``verify-ledger [--format text|json]``: walk the seal chain
- ``aging [--format text|json]``: callback log vs local status vs settlement, by age
- ``alerts test --channel NAME``: send a test notification through one alert channel;
  ``alerts list|show|ack|silence|assign``: act on alerts as the console does (compensator/alerts_cli.py)
- ``review list|show|resolve``: the manual queue, as the ops console works it
  (compensator/review_cli.py)
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, date, datetime

from payments.errors import ConfigError
from payments.runtime import Runtime, build_runtime, start_process

log = logging.getLogger("paysync.compensator")


def _jobs() -> dict[str, tuple[Callable[[Runtime], int], Callable[[Runtime], float]]]:
    """Job name -> (run_once, interval in seconds for these settings)."""
    from compensator import (
        catch_up,
        cleanup,
        compensate_callbacks,
        evaluate_alerts,
        notify_alerts,
        publish_events,
        query_unresolved,
        relay_outbox,
        seal_ledger,
    )

    return {
        "compensate_callbacks": (compensate_callbacks.run_once, lambda rt: rt.settings.effective_interval_seconds),
        "evaluate_alerts": (evaluate_alerts.run_once, lambda rt: rt.settings.evaluate_alerts_interval_seconds),
        "notify_alerts": (notify_alerts.run_once, lambda rt: notify_alerts.INTERVAL_SECONDS),
        "publish_events": (publish_events.run_once, lambda rt: rt.settings.publish_events_interval_seconds),
        "relay_outbox": (relay_outbox.run_once, lambda rt: rt.settings.relay_interval_seconds),
        "query_unresolved": (query_unresolved.run_once, lambda rt: rt.settings.query_interval_seconds),
        "catch_up": (catch_up.run_once, lambda rt: catch_up.INTERVAL_SECONDS),
        "seal_ledger": (seal_ledger.run_once, lambda rt: rt.settings.seal_interval_seconds),
        "cleanup": (cleanup.run_once, lambda rt: rt.settings.cleanup_interval_seconds),
    }


def _daily_jobs() -> dict[str, tuple[Callable[[Runtime], int], Callable[[Runtime], str]]]:
    """Job name -> (run_once, UTC time of day HH:MM for these settings)."""
    from compensator import reconcile

    return {"reconcile": (reconcile.run_once, lambda rt: rt.settings.reconcile_time)}


ALIASES = {"compensate": "compensate_callbacks"}


OUTAGE_ERRORS = frozenset({1047, 1205, 1213, 1927, 2002, 2003, 2006, 2013, 2055, 4031})
"""MariaDB errors of a database that is away or failing over, not of a bug: WSREP not ready (1047), lock wait
(1205), deadlock / Galera certification (1213), connection killed (1927), can't connect (2002, 2003), gone
away / lost (2006, 2013, 2055), idle disconnect (4031)."""


def outage_of(exc: BaseException) -> str | None:
    """'database' when ``exc`` says the database is unreachable or failing over (not a defect); else None."""
    from sqlalchemy import exc as sa_exc

    if isinstance(exc, sa_exc.DBAPIError):
        args = getattr(exc.orig, "args", ())
        code = args[0] if args and isinstance(args[0], int) else None
        if exc.connection_invalidated or code in OUTAGE_ERRORS or isinstance(exc, sa_exc.InterfaceError):
            return "database"
        return None
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.DisconnectionError):  # pool exhausted waiting, or a dead pool
        return "database"
    return None


class Outages:
    """One WARNING when a dependency starts failing jobs, one INFO when a job succeeds again: no traceback per
    job per failover. Jobs run in the scheduler's threads, so the state is behind a lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[str, float] = {}
        self._failed: dict[str, int] = {}

    def failed(self, what: str, job: str, exc: BaseException) -> None:
        """A job failed because ``what`` is away: say so once per outage."""
        with self._lock:
            first = what not in self._since
            if first:
                self._since[what] = time.monotonic()
                self._failed[what] = 0
            self._failed[what] += 1
        if first:
            log.warning(
                "%s unavailable (job %s: %s); every job retries on its interval, and nothing more is logged "
                "about it until it is back",
                what,
                job,
                f"{type(exc).__name__} {getattr(getattr(exc, 'orig', None), 'args', ('',))[0]}".strip(),
            )

    def succeeded(self, job: str, reachable: Callable[[], bool]) -> None:
        """A job ran to the end: if ``reachable()`` (a probe of the database) agrees, the outage is over.

        The probe, since a job may succeed without touching the database (catch_up without Stripe).
        """
        if not self._since or not reachable():
            return
        with self._lock:
            over, self._since = self._since, {}
            failed, self._failed = self._failed, {}
        for what, since in over.items():
            log.info(
                "%s back after %.1f s (job %s ran; %s job runs failed meanwhile)",
                what,
                time.monotonic() - since,
                job,
                failed.get(what, 0),
            )


OUTAGES = Outages()
"""This process's outage log (one scheduler per process)."""


def run_job(runtime: Runtime, name: str) -> int:
    """Run one job once and return its count; exceptions are logged, not raised (a scheduler must live on).

    A database outage (a writer failover, a node that is not ready) is one WARNING for the whole outage and
    one INFO when it is over (``Outages``); anything else is a traceback, since it is a defect to look at.
    """
    run_once, _ = {**_jobs(), **_daily_jobs()}[name]
    try:
        count = run_once(runtime)
    except Exception as exc:  # noqa: BLE001
        what = outage_of(exc)
        if what is None:
            log.exception("job %s failed", name)
        else:
            OUTAGES.failed(what, name, exc)
        return -1
    OUTAGES.succeeded(name, lambda: _database_answers(runtime))
    return count


def _database_answers(runtime: Runtime) -> bool:
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    try:
        with runtime.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError:
        return False
    return True


LOOPS = ("relay_outbox",)
"""Jobs that run back to back in a thread of their own rather than on the scheduler (relay_outbox.run_forever)."""


def serve(runtime: Runtime) -> None:
    """Run every job on its interval, and the relay back to back, until SIGTERM/SIGINT."""
    from apscheduler.schedulers.blocking import BlockingScheduler

    from compensator import relay_outbox

    scheduler = BlockingScheduler(
        job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": 30}, timezone="UTC"
    )
    for name, (_, interval) in _jobs().items():
        if name in LOOPS:
            continue
        scheduler.add_job(
            run_job,
            "interval",
            args=(runtime, name),
            seconds=interval(runtime),
            id=name,
            name=name,
            next_run_time=datetime.now(UTC),  # first run at start, not one interval later
        )

    stopping = threading.Event()
    relay = threading.Thread(target=relay_outbox.run_forever, args=(runtime, stopping), name="relay_outbox")

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %s: stopping after running jobs finish", signum)
        stopping.set()
        scheduler.shutdown(wait=False)

    for name, (_, time_of_day) in _daily_jobs().items():
        hour, minute = time_of_day(runtime).split(":")
        scheduler.add_job(
            run_job,
            "cron",
            args=(runtime, name),
            hour=int(hour),
            minute=int(minute),
            id=name,
            name=name,
            misfire_grace_time=6 * 3600,  # a compensator down at that minute still runs it when it is back
        )

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    jobs = sorted([*_jobs(), *_daily_jobs()])
    log.info("compensator started", extra={"jobs": jobs, "broker": runtime.settings.has_broker})
    from compensator import notify_alerts
    from payments.infra import metrics

    notify_alerts.log_routing(runtime.settings)
    metrics.serve_for(runtime.settings, runtime.settings.compensator_metrics_port, "compensator")
    relay.start()
    try:
        scheduler.start()
    finally:
        stopping.set()
        relay.join()  # the run in progress finishes its calls and applies their outcomes


COMMANDS = ("reconcile", "verify-ledger", "aging")


def _setup() -> Runtime:
    """Settings, logging and the runtime for a command (bad configuration exits 2 in start_process)."""
    return build_runtime(start_process("compensator"), pool_size=4)


def command(argv: list[str]) -> int:
    """The operator commands (module docstring)."""
    parser = argparse.ArgumentParser(prog=f"python -m compensator {argv[0]}")
    parser.add_argument("--format", choices=("text", "json"), default="text")
    if argv[0] == "reconcile":
        parser.add_argument("--date", help="the settlement day, YYYY-MM-DD (UTC)")
        parser.add_argument("--provider", help="one provider (default: every configured one with settlement files)")
        parser.add_argument("--file", help="reconcile this file instead of downloading the provider's")
        parser.add_argument("--once", action="store_true", help="run the daily job once (the last N days)")
    args = parser.parse_args(argv[1:])
    if argv[0] == "reconcile" and not args.once and not args.date:
        parser.error("give --date YYYY-MM-DD (or --once for the daily job)")
    if argv[0] == "reconcile" and args.date:
        try:
            day = date.fromisoformat(args.date) if re.fullmatch(r"\d{4}-\d{2}-\d{2}", args.date) else None
        except ValueError:
            day = None
        if day is None:
            parser.error(f"--date must be a real day YYYY-MM-DD, got {args.date!r}")
    runtime = _setup()
    try:
        if argv[0] == "verify-ledger":
            return _verify(runtime, args.format)
        if argv[0] == "aging":
            return _aging(runtime, args.format)
        if args.once and not args.date:
            count = run_job(runtime, "reconcile")
            print(f"reconcile: {count}")
            return 0 if count >= 0 else 1
        return _reconcile(runtime, day, args, parser)
    finally:
        runtime.engine.dispose()


def _verify(runtime: Runtime, fmt: str) -> int:
    from compensator import seal_ledger

    result = seal_ledger.verify(runtime.engine)
    print(json.dumps(result.as_dict(), indent=2) if fmt == "json" else seal_ledger.describe(result))
    return 0 if result.ok else 1


def _aging(runtime: Runtime, fmt: str) -> int:
    from payments.reconciliation import aging

    report = aging.aging(runtime.engine)
    print(json.dumps(report, indent=2) if fmt == "json" else aging.describe(report))
    return 0


def _reconcile(runtime: Runtime, day: date, args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from compensator.reconcile import reconcilable, reconcile_command
    from payments.providers.base import ProviderUnavailable
    from payments.providers.settlement import SettlementFormatError
    from payments.reconciliation import reconcile

    if args.provider:
        providers = [args.provider]
    elif args.file:
        parser.error("--file needs --provider (whose format the file is in)")
    else:
        providers = reconcilable(runtime)
        if not providers:
            print("reconcile: no configured provider has settlement files", file=sys.stderr)
            return 1
    try:
        reports = reconcile_command(runtime, day, providers, args.file)
    except (reconcile.ReconcileError, ProviderUnavailable, SettlementFormatError, OSError) as exc:
        print(f"reconcile: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        body = [r.as_dict() for r in reports]
        print(json.dumps(body[0] if len(body) == 1 else body, indent=2, sort_keys=True))
    else:
        print("\n".join(reconcile.describe(r) for r in reports))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reverify"]:
        return reverify_main(argv[1:])
    if argv and argv[0] in COMMANDS:
        return command(argv)
    if argv[:1] == ["cleanup"]:
        from compensator import cleanup

        return cleanup.main(argv[1:])
    if argv[:1] == ["alerts"]:
        from compensator import alerts_cli

        return alerts_cli.main(argv[1:])
    if argv[:1] == ["review"]:
        from compensator import review_cli

        return review_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m compensator")
    jobs = sorted([*_jobs(), *_daily_jobs(), *ALIASES])
    parser.add_argument(
        "job",
        nargs="?",
        help="one job to run: " + ", ".join(jobs) + "; or " + ", ".join(["reverify", *COMMANDS, "alerts", "review"]),
    )
    parser.add_argument("--once", action="store_true", help="run the job once and exit (for cron)")
    args = parser.parse_args(argv)
    settings = start_process("compensator")
    # Jobs run side by side, their worker threads each holding a connection for the length of a
    # transaction (never across a provider call); capped so many compensators fit max_connections.
    pool_size = min(32, 4 + settings.compensator_concurrency + settings.relay_concurrency)
    runtime = build_runtime(settings, pool_size=pool_size)
    if args.job:
        name = ALIASES.get(args.job, args.job)
        if name not in _jobs() and name not in _daily_jobs():
            parser.error(f"unknown job {args.job!r}")
        if not args.once:
            parser.error("a job name needs --once (the scheduler runs every job)")
        count = run_job(runtime, name)
        print(f"{name}: {count}")
        return 0 if count >= 0 else 1
    serve(runtime)
    return 0


def _iso_time(raw: str) -> datetime:
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {raw[:40]!r}") from None
    # Stored times are naive UTC; a time given with an offset is converted, one without is taken as UTC.
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


def reverify_main(argv: list[str]) -> int:
    """``python -m compensator reverify --provider P [--since ISO-TIME]`` (compensator/reverify.py)."""
    from compensator import reverify

    parser = argparse.ArgumentParser(
        prog="python -m compensator reverify",
        description="re-verify rejected (status 3) callbacks against today's keys; send those that verify on",
    )
    parser.add_argument("--provider", required=True, help="provider name, as in /callbacks/<provider>")
    parser.add_argument("--since", type=_iso_time, help="only rows received at or after this time (ISO 8601, UTC)")
    args = parser.parse_args(argv)
    settings = start_process("compensator")
    runtime = build_runtime(settings)
    try:
        result = reverify.run(runtime, args.provider, args.since)
    except ConfigError as exc:
        print(f"reverify: {exc}", file=sys.stderr)
        return 2
    print(f"reverify {args.provider}: {result.accepted} of {result.checked} rejected callbacks now verify (status 0)")
    if result.source_refused:
        print(f"reverify {args.provider}: {result.source_refused} refused for their source stay refused (status 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
