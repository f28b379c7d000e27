"""Job ``reconcile``: once a day (RECONCILE_TIME, UTC), the providers' settlement files against our books.

For every configured provider with a settlement parser, the files of the last
RECONCILE_DAYS_BACK days (yesterday included) are downloaded through the
adapter and reconciled by ``payments.reconciliation.reconcile``. A day whose file is
unchanged since a completed run is skipped; a file the provider has not
published yet (or cannot serve) is logged and tried again on the next day's
run, as long as the day is still inside the window. A file past its size cap
(``SettlementTooLarge``: trying again brings the same file) raises the alert
``settlement_too_large`` for a person, once per provider and day; a later
download of that day that fits resolves it. Runs hold the named lock
``payments.reconciliation.reconcile.LOCK_NAME``, so however many compensators run, one
reconciles; re-running a day adds no second adjustment.
"""

from __future__ import annotations

import logging
from datetime import UTC, date, datetime, timedelta
from typing import Any

from payments.escalation import alerts
from payments.infra.db import batch_engine, utcnow
from payments.infra.locks import named_lock
from payments.providers.base import ProviderUnavailable, SettlementTooLarge
from payments.providers.settlement import SettlementFormatError
from payments.reconciliation.reconcile import (
    LOCK_NAME,
    PARSERS,
    ReconcileError,
    Report,
    Source,
    download,
    open_file,
    reconcile,
)
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.reconcile")

STATEMENT_TIMEOUT_SECONDS = 600.0
"""Read timeout of the reconciliation's own connections: one batch's statement on a large day may take minutes."""


def days_to_check(today: date, days_back: int) -> list[date]:
    """The days the daily run looks at, oldest first: today - days_back … yesterday."""
    return [today - timedelta(days=n) for n in range(days_back, 0, -1)]


def reconcilable(runtime: Runtime) -> list[str]:
    """Configured providers whose settlement files paysync can read."""
    return sorted(name for name in runtime.providers if name in PARSERS)


def run_once(runtime: Runtime, *, today: date | None = None) -> int:
    """Reconcile every provider's recent days; return how many runs completed (0 if another compensator runs it)."""
    today = today or datetime.now(UTC).date()
    completed = 0
    with named_lock(runtime.engine, LOCK_NAME) as locked:
        if not locked:
            log.info("another compensator is reconciling; skipping this run")
            return 0
        for provider in reconcilable(runtime):
            for day in days_to_check(today, runtime.settings.reconcile_days_back):
                try:
                    report = reconcile_download(runtime, provider, day, started_by="daily", skip_unchanged=True)
                except (ProviderUnavailable, SettlementFormatError) as exc:
                    log.warning("reconciliation %s %s not done: %s", provider, day.isoformat(), exc)
                    continue
                if report.skipped:
                    log.debug("reconciliation %s %s: %s", provider, day.isoformat(), report.skipped)
                    continue
                completed += 1
    return completed


def reconcile_download(
    runtime: Runtime, provider: str, day: date, *, started_by: str, skip_unchanged: bool = False
) -> Report:
    """Download ``provider``'s file for ``day`` through its adapter and reconcile it (the caller holds the lock)."""
    adapter = runtime.providers.get(provider)
    if adapter is None:
        raise ReconcileError(f"provider {provider!r} is not configured: give its file with --file")
    key = f"settlement_too_large:{provider}:{day.isoformat()}"
    try:
        source = download(adapter, day, runtime.settings.provider_timeout_seconds)
    except SettlementTooLarge as exc:
        with runtime.engine.begin() as conn:
            alerts.observe(
                conn,
                rule="settlement_too_large",
                key=key,
                message=str(exc),
                now=utcnow(),
                severity="critical",
                details={"provider": provider, "day": day.isoformat()},
            )
        raise
    with runtime.engine.begin() as conn:
        alerts.clear(conn, key=key, now=utcnow())
    try:
        return _reconcile(runtime, provider, day, source, started_by=started_by, skip_unchanged=skip_unchanged)
    finally:
        source.close()


def _reconcile(runtime: Runtime, provider: str, day: date, source: Source, **options: Any) -> Report:
    engine = batch_engine(runtime.engine, STATEMENT_TIMEOUT_SECONDS)
    try:
        return reconcile(engine, provider, day, source, **options)
    finally:
        if engine is not runtime.engine:
            engine.dispose()


def reconcile_command(
    runtime: Runtime, day: date, providers: list[str], path: str | None, *, wait_seconds: float = 30.0
) -> list[Report]:
    """``python -m compensator reconcile --date …``: reconcile one day now, waiting a while for the lock."""
    reports = []
    with named_lock(runtime.engine, LOCK_NAME, wait_seconds) as locked:
        if not locked:
            raise ReconcileError(f"another reconciliation holds the lock {LOCK_NAME!r}; try again later")
        for provider in providers:
            if path is not None:
                source = open_file(path)
                try:
                    reports.append(_reconcile(runtime, provider, day, source, started_by="manual"))
                finally:
                    source.close()
            else:
                reports.append(reconcile_download(runtime, provider, day, started_by="manual"))
    return reports
