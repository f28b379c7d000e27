"""``python -m compensator`` runs the scheduler; ``python -m compensator JOB --once`` runs one job once.

Jobs: compensate_callbacks (alias compensate), relay_outbox, query_unresolved,
evaluate_alerts, notify_alerts (alerts to email, SMS and chat channels),
publish_events (domain events to RabbitMQ and the merchant's webhook) and
catch_up (missed Stripe events; a no-op without Stripe settings), each on its
interval setting (notify_alerts every 5 s). Each is registered with
``max_instances=1`` and coalescing, so a slow sweep is never run twice at
once in one process and missed runs collapse into one.

``python -m compensator reverify --provider P [--since ISO-TIME]`` re-verifies
rejected callbacks against today's keys after a key fix (compensator/reverify.py).
``python -m compensator alerts test --channel NAME`` sends a test notification
through one alert channel (compensator/alerts_cli.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from datetime import UTC, datetime

from payments.errors import ConfigError
from payments.runtime import Runtime, build_runtime
from payments.settings import start_process

log = logging.getLogger("paysync.compensator")


def _jobs() -> dict[str, tuple[Callable[[Runtime], int], Callable[[Runtime], float]]]:
    """Job name -> (run_once, interval in seconds for these settings)."""
    from compensator import (
        catch_up,
        compensate_callbacks,
        evaluate_alerts,
        notify_alerts,
        publish_events,
        query_unresolved,
        relay_outbox,
    )

    return {
        "compensate_callbacks": (compensate_callbacks.run_once, lambda rt: rt.settings.effective_interval_seconds),
        "evaluate_alerts": (evaluate_alerts.run_once, lambda rt: rt.settings.evaluate_alerts_interval_seconds),
        "notify_alerts": (notify_alerts.run_once, lambda rt: notify_alerts.INTERVAL_SECONDS),
        "publish_events": (publish_events.run_once, lambda rt: rt.settings.publish_events_interval_seconds),
        "relay_outbox": (relay_outbox.run_once, lambda rt: rt.settings.relay_interval_seconds),
        "query_unresolved": (query_unresolved.run_once, lambda rt: rt.settings.query_interval_seconds),
        "catch_up": (catch_up.run_once, lambda rt: catch_up.INTERVAL_SECONDS),
    }


ALIASES = {"compensate": "compensate_callbacks"}


def run_job(runtime: Runtime, name: str) -> int:
    """Run one job once and return its count; exceptions are logged, not raised (a scheduler must live on)."""
    run_once, _ = _jobs()[name]
    try:
        return run_once(runtime)
    except Exception:  # noqa: BLE001
        log.exception("job %s failed", name)
        return -1


def serve(runtime: Runtime) -> None:
    """Run every job on its interval until SIGTERM/SIGINT."""
    from apscheduler.schedulers.blocking import BlockingScheduler

    scheduler = BlockingScheduler(
        job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": 30}, timezone="UTC"
    )
    for name, (_, interval) in _jobs().items():
        scheduler.add_job(
            run_job,
            "interval",
            args=(runtime, name),
            seconds=interval(runtime),
            id=name,
            name=name,
            next_run_time=datetime.now(UTC),  # first run at start, not one interval later
        )

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %s: stopping after running jobs finish", signum)
        scheduler.shutdown(wait=False)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("compensator started", extra={"jobs": sorted(_jobs()), "broker": runtime.settings.has_broker})
    from compensator import notify_alerts

    notify_alerts.log_routing(runtime.settings)
    scheduler.start()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reverify"]:
        return reverify_main(argv[1:])
    if argv[:1] == ["alerts"]:
        from compensator import alerts_cli

        return alerts_cli.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m compensator")
    parser.add_argument(
        "job", nargs="?", help="one job to run: " + ", ".join(sorted([*_jobs(), *ALIASES])) + "; or reverify, alerts"
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
        if name not in _jobs():
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
