"""Outbound charges end to end: gateway (gunicorn), compensator and sandbox as real processes on MariaDB.

- 1,000 payments against a sandbox with 20% timeout-after-commit, 10% 5xx, 10%
  dropped webhooks (and 10% declines): every payment ends Succeeded or Failed,
  exactly as the platform's own truth says, no merchant number charged twice,
  every provider_transaction_id unique, the ledger balanced.
- The relay is fast enough to feel synchronous: a created payment reaches the
  provider within one second at the median.
"""

from __future__ import annotations

import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from sqlalchemy import func, select

from payments.schema import ledger_entry, ledger_event, manual_review, payment, provider_call
from tests.sandbox_process import start_sandbox
from tests.stack import Stack, db_url
from tests.support import wait_until

pytestmark = [pytest.mark.mariadb, pytest.mark.slow, pytest.mark.alone]

TOKEN = "soak-merchant-token"

RELAY_SETTINGS = {
    # Hung replies are cut at 0.3 s; unresolved payments are queried after 0.2-0.4 s, then at most every 2 s.
    "PROVIDER_TIMEOUT_SECONDS": "0.3",
    "RELAY_CONCURRENCY": "16",
    "RELAY_INTERVAL_SECONDS": "0.1",
    "QUERY_INTERVAL_SECONDS": "0.2",
    "QUERY_BASE_SECONDS": "0.4",
    "QUERY_MAX_SECONDS": "2",
    "QUERY_PENDING_AFTER_SECONDS": "2",
    "PROVIDER_RATE_LIMIT": "2000",
    # 30% of calls fail by design here; a breaker trip would only slow the test down.
    "BREAKER_FAILURE_THRESHOLD": "40",
    "COMPENSATOR_INTERVAL_SECONDS": "0.5",
}


@pytest.fixture
def stack(mariadb, tmp_path):
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), MERCHANT_API_TOKEN=TOKEN, LOG_LEVEL="WARNING") as s:
        yield s


def start_all(stack, tmp_path, faults: dict):
    web, port = stack.start_web(workers=2)
    sandbox = start_sandbox(
        tmp_path,
        callback_url=f"http://127.0.0.1:{port}/callbacks/sandbox",
        SANDBOX_WEBHOOK_MAX_ATTEMPTS="3",
    )
    stack.procs.append(sandbox.proc)
    sandbox.faults(**faults)
    stack.start("compensator", SANDBOX_API_URL=sandbox.url, **RELAY_SETTINGS)
    return port, sandbox


def create(port: int, session: requests.Session, n: int) -> str:
    response = session.post(
        f"http://127.0.0.1:{port}/payments",
        json={"order_no": f"order-{n}", "amount": 100 + n, "currency": "CNY", "provider": "sandbox"},
        headers={"Authorization": f"Bearer {TOKEN}", "Idempotency-Key": f"soak-{n}-{uuid.uuid4().hex[:8]}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return response.json()["payment_id"]


def test_a_thousand_payments_through_faults_all_end_as_the_provider_says(stack, mariadb, tmp_path):
    port, sandbox = start_all(
        stack,
        tmp_path,
        {
            "timeout_after_commit_rate": 0.2,
            "hang_seconds": 1.0,
            "error_5xx_rate": 0.1,
            "drop_rate": 0.1,
            "decline_rate": 0.1,
            "seed": 20261130,
        },
    )
    sessions = [requests.Session() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda n: create(port, sessions[n % 8], n), range(1000)))
    assert len(set(ids)) == 1000

    def unresolved() -> int:
        with mariadb.connect() as conn:
            return conn.execute(select(func.count()).where(payment.c.status.not_in(("Succeeded", "Failed")))).scalar()

    wait_until(lambda: unresolved() == 0, timeout=240, interval=1, message="every payment terminal")

    truth = sandbox.truth()
    with mariadb.connect() as conn:
        rows = conn.execute(select(payment.c.payment_id, payment.c.status, payment.c.provider_transaction_id)).all()
        ledger_sum, lines = conn.execute(
            select(func.coalesce(func.sum(ledger_entry.c.amount_minor), 0), func.count())
        ).one()
        confirmed = conn.execute(select(func.count()).where(ledger_event.c.event_type == "PaymentConfirmed")).scalar()
        reviews = conn.execute(select(manual_review.c.kind, manual_review.c.reason)).all()
        outcomes = dict(
            conn.execute(select(provider_call.c.outcome, func.count()).group_by(provider_call.c.outcome)).all()
        )
    assert truth["multiple_charges"] == [], "no merchant number charged twice"
    charges = {c["merchant_transaction_id"]: c for c in truth["charges"]}
    assert set(charges) == set(ids), "every payment was charged exactly once at the platform"
    expected = {"succeeded": "Succeeded", "failed": "Failed"}
    mismatched = [
        (pid, status, charges[pid]["status"]) for pid, status, _ in rows if expected[charges[pid]["status"]] != status
    ]
    assert mismatched == []
    assert [(pid, txn) for pid, _, txn in rows if txn != charges[pid]["id"]] == []
    assert len({txn for _, _, txn in rows}) == 1000, "every provider_transaction_id unique"
    succeeded = sum(1 for _, status, _ in rows if status == "Succeeded")
    assert confirmed == succeeded and ledger_sum == 0 and lines == 2 * succeeded
    assert reviews == []
    # The faults really happened: calls timed out and 5xx'ed, and queries resolved them.
    assert outcomes.get("Unknown", 0) >= 200 and outcomes.get("NotFound", 0) >= 50


def test_a_created_payment_reaches_the_provider_within_a_second_at_the_median(stack, mariadb, tmp_path):
    port, _ = start_all(stack, tmp_path, {})
    session = requests.Session()
    ids = []
    for n in range(40):
        ids.append(create(port, session, n))
        time.sleep(0.05)

    def latencies():
        with mariadb.connect() as conn:
            rows = conn.execute(
                select(payment.c.created_at, func.min(provider_call.c.started_at))
                .join(provider_call, provider_call.c.payment_id == payment.c.payment_id)
                .group_by(payment.c.payment_id, payment.c.created_at)
            ).all()
        return [(sent - created).total_seconds() for created, sent in rows]

    wait_until(lambda: len(latencies()) == 40, timeout=30, message="every payment sent")
    values = latencies()
    median = statistics.median(values)
    assert median < 1.0, f"median creation-to-provider latency {median:.3f} s"

    def statuses() -> set[str]:
        with mariadb.connect() as conn:
            return set(conn.execute(select(payment.c.status)).scalars())

    wait_until(lambda: statuses() == {"Succeeded"}, timeout=20, message="all succeeded")
