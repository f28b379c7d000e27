"""Job ``notify_alerts``: tell people about alerts through every configured channel, reliably.

Each run:

1. plans (``payments.escalation.notifications.plan``): a firing notification per channel
   for each alert that started firing, a reminder each rule cooldown while it
   fires, a resolved notice when it clears;
2. claims due notifications (``SELECT … FOR UPDATE SKIP LOCKED`` and a lease,
   so several compensators share the work);
3. sends them outside any transaction, one thread per channel, so a channel
   that hangs or refuses holds up nobody else; a channel that fails with a
   transient error is not tried again in this run (its other notifications go
   back unsent, due with the failed one), so a dead server costs one timeout
   per run, not one per alert;
4. writes each outcome: sent, backed off (ALERT_NOTIFY_RETRY_* backoff), or
   given up after ALERT_NOTIFY_MAX_ATTEMPTS (or at once when the service says
   the request itself is wrong), which fires ``alert_channel_failing``.

Which channels exist is configuration (``payments/escalation/notify/channels.py``); which
alert goes where is the rules file (``ops/alert_rules.toml``).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timedelta

from payments.errors import NotificationFailed
from payments.escalation import evaluators as alert_evaluators
from payments.escalation import notifications
from payments.escalation.notifications import Claimed
from payments.escalation.notify import Channel, links
from payments.escalation.notify.channels import build_channels, enabled_channels
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.settings import Settings
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.notify")

INTERVAL_SECONDS = 5.0
"""How often the scheduler runs this job: a firing alert reaches people within seconds of firing."""
BATCH_SIZE = 200
"""Notifications claimed per run (alerts are few; a storm waits for the next run)."""


def retry_policy(settings: Settings) -> RetryPolicy:
    """Backoff and give-up bound of one notification on one channel."""
    return RetryPolicy(
        max_retries=settings.alert_notify_max_attempts,
        base_seconds=settings.alert_notify_retry_base_seconds,
        max_seconds=settings.alert_notify_retry_max_seconds,
    )


def routing_report(settings: Settings) -> tuple[list[str], list[str]]:
    """(configured channels, rules that reach none of them): what the compensator says once at start."""
    configured = enabled_channels(settings)
    rules = alert_evaluators.rules_for(settings)
    unreached = sorted(name for name, r in rules.rules.items() if r.channels and not set(r.channels) & set(configured))
    return configured, unreached


def log_routing(settings: Settings) -> None:
    """Log the configured channels, and warn about rules whose alerts reach nobody but the log."""
    configured, unreached = routing_report(settings)
    log.info("alert channels configured: %s", ", ".join(configured) or "none (alerts are log lines only)")
    if configured and unreached:
        log.warning("alert rules that reach no configured channel (log only): %s", ", ".join(unreached))


def run_once(runtime: Runtime, *, now: datetime | None = None) -> int:
    """Plan, claim, send and record; return how many notifications were sent.

    ``now`` fixes the clock for the whole run (tests move through time with it).
    """
    settings = runtime.settings
    clock: Callable[[], datetime] = (lambda: now) if now is not None else utcnow
    channels = build_channels(settings)
    if not channels:
        return 0  # alerts are log lines only; once a channel is configured, the alerts firing then are told
    try:
        rules = alert_evaluators.rules_for(settings)
        notifications.plan(runtime.engine, rules, list(channels), clock())
        claimed = notifications.claim(runtime.engine, clock(), BATCH_SIZE, list(channels))
        if not claimed:
            return 0
        claimed = [
            replace(
                c,
                notice=links.dress(
                    c.notice,
                    rules.mentions(c.notice.rule, c.notice.severity),
                    settings.ops_console_url,
                    settings.alert_runbook_url,
                ),
            )
            for c in claimed
        ]
        by_channel: dict[str, list[Claimed]] = defaultdict(list)
        for item in claimed:
            by_channel[item.channel].append(item)
        severity = rules.route(notifications.CHANNEL_FAILING).severity
        policy = retry_policy(settings)
        with ThreadPoolExecutor(max_workers=len(by_channel), thread_name_prefix="notify") as pool:
            futures = [
                pool.submit(_send_all, runtime, channels[name], items, policy, clock, severity)
                for name, items in by_channel.items()
            ]
            outcomes = {name: future.result() for name, future in zip(by_channel, futures, strict=True)}
    finally:
        for channel in channels.values():
            channel.close()
    log.info("alert notifications", extra={"outcomes": outcomes})
    return sum(sent for sent, _ in outcomes.values())


def _send_all(
    runtime: Runtime,
    channel: Channel,
    items: list[Claimed],
    policy: RetryPolicy,
    clock: Callable[[], datetime],
    severity: str,
) -> tuple[int, int]:
    """Send one channel's notifications in order; return (sent, failed)."""
    engine = runtime.engine
    started = time.monotonic()
    # Stop starting sends while the slowest one could still end inside the lease.
    budget = notifications.LEASE_SECONDS - 2 * runtime.settings.alert_channel_timeout_seconds - 10
    sent = failed = 0
    for i, item in enumerate(items):
        if time.monotonic() - started > budget:
            notifications.release(engine, items[i:], clock(), clock())
            break
        try:
            what = channel.send(item.notice)
        except NotificationFailed as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a bug in one channel must not stop the others
            log.exception("alert channel %s raised", channel.name)
            error = NotificationFailed(f"{channel.name}: {type(exc).__name__}")
        else:
            notifications.record_sent(engine, item, clock())
            sent += 1
            log.info(
                "alert notification sent: %s",
                what,
                extra={"channel": channel.name, "alert_id": item.notice.alert_id, "kind": item.kind},
            )
            continue
        failed += 1
        status = notifications.record_failure(engine, item, error, policy, clock(), severity)
        log.warning(
            "alert notification failed: %s",
            error,
            extra={"channel": channel.name, "alert_id": item.notice.alert_id, "kind": item.kind, "now": status},
        )
        if not error.permanent and items[i + 1 :]:
            # The channel is down: give the rest back, due when the failed one is, instead of timing out on each.
            wait = max(policy.delay(item.attempts + 1), error.retry_after or 0.0)
            notifications.release(engine, items[i + 1 :], clock() + timedelta(seconds=wait), clock())
            break
    return sent, failed
