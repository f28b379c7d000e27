"""The compensator at default settings: the relay runs back to back, not on the scheduler's ticks.

Run as a scheduled job lingering for most of its interval, each relay run
ended just after the next tick, and APScheduler logged "maximum number of
running instances reached" for it about twice a second. Here the real
``compensator`` process relays payments created one after another while the
test reads its log.
"""

from __future__ import annotations

import time

from payments.runtime import build_runtime
from payments.states import PaymentStatus
from tests.outbound_support import new_payment, row
from tests.sandbox_process import start_sandbox
from tests.stack import Stack, db_url
from tests.support import make_settings, wait_until

SKIPPED = "maximum number of running instances"


def test_the_compensator_relays_at_default_settings_without_skipped_run_warnings(mariadb, tmp_path):
    rt = build_runtime(make_settings(database_url=db_url(mariadb)), engine=mariadb)
    sandbox = start_sandbox(tmp_path)
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb)) as stack:
        stack.procs.append(sandbox.proc)
        compensator = stack.start("compensator", SANDBOX_API_URL=sandbox.url)
        wait_until(lambda: "compensator started" in compensator.output(), message="the compensator to start")
        latencies = []
        # One payment at a time, each relayed before the next is made: twenty relay runs at the least.
        for _ in range(20):
            started = time.monotonic()
            payment_id = new_payment(rt)
            wait_until(
                lambda pid=payment_id: row(rt, pid)["status"] != PaymentStatus.CREATED,
                timeout=20,
                message=f"{payment_id} to be relayed",
            )
            latencies.append(time.monotonic() - started)
        assert compensator.stop() == 0
    log = compensator.output()
    assert 'charge and refund requests"' in log  # the relay ran, and said so
    assert [line for line in log.splitlines() if SKIPPED in line and "relay_outbox" in line] == []
    assert "Traceback" not in log
    # Not slower: a row committed during a run is claimed by a poll of that run (POLL_SECONDS), not a later run.
    latencies.sort()
    assert latencies[len(latencies) // 2] < 1.0, latencies
