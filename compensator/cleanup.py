"""Job ``cleanup``: archive, then delete, processed and rejected callback rows past their retention.

What goes and how it is kept safe is ``payments.infra.retention``; this module runs
it in batches (one transaction each, CLEANUP_BATCH_SIZE rows) until nothing
is due or the time budget is spent, so a first run over years of rows never
holds locks for long, and the next run carries on.

    python -m compensator cleanup --once       one run (cron-style)
    python -m compensator cleanup --dry-run    how many rows of each kind are due; nothing written or deleted
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from payments.infra import metrics, retention
from payments.infra.db import utcnow
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.cleanup")

BUDGET_SECONDS = 60.0
"""One run stops starting batches after this long; the next run continues."""


def run_once(runtime: Runtime, *, budget: float = BUDGET_SECONDS) -> int:
    """Archive and delete due rows, batch by batch; return how many rows were deleted."""
    settings = runtime.settings
    now = utcnow()
    started = time.monotonic()
    total = 0
    for kind in retention.kinds(
        settings.callback_retention_days, settings.rejected_retention_days, settings.refused_retention_days
    ):
        done = 0
        while time.monotonic() - started < budget:
            n = retention.archive_batch(
                runtime.engine, kind, now, settings.cleanup_batch_size, Path(settings.archive_dir)
            )
            done += n
            if n < settings.cleanup_batch_size:
                break
        if done:
            metrics.CLEANUP_ROWS.labels(kind.name).inc(done)
            log.info(
                "archived and deleted %s %s callback rows", done, kind.name, extra={"archive_dir": settings.archive_dir}
            )
        total += done
    return total


def dry_run(runtime: Runtime) -> dict[str, int]:
    """Kind -> rows due now (nothing written)."""
    settings = runtime.settings
    now = utcnow()
    with runtime.engine.connect() as conn:
        return {
            kind.name: retention.count_due(conn, kind, now)
            for kind in retention.kinds(
                settings.callback_retention_days, settings.rejected_retention_days, settings.refused_retention_days
            )
        }


def main(argv: list[str]) -> int:
    """``python -m compensator cleanup [--once | --dry-run]``."""
    from payments.runtime import build_runtime, start_process

    parser = argparse.ArgumentParser(prog="python -m compensator cleanup", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--once", action="store_true", help="run the job once and exit")
    group.add_argument("--dry-run", action="store_true", help="count the rows due; write and delete nothing")
    args = parser.parse_args(argv)
    runtime = build_runtime(start_process("compensator"), pool_size=2)
    try:
        if args.dry_run:
            due = dry_run(runtime)
            for name, count in due.items():
                print(
                    f"cleanup --dry-run: {count} {name} callback rows due (archive to {runtime.settings.archive_dir})"
                )
            if not due:
                print("cleanup --dry-run: retention is off (CALLBACK_RETENTION_DAYS and REJECTED_RETENTION_DAYS are 0)")
            return 0
        try:
            count = run_once(runtime)
        except Exception:  # noqa: BLE001 - a failed batch rolled back: nothing was deleted that is not archived
            log.exception("job cleanup failed")
            return 1
        print(f"cleanup: {count}")
        return 0
    finally:
        runtime.engine.dispose()
