"""Every Procfile process starts the same way: a bad setting is one line and exit 2; failpoints work everywhere.

The gateway runs under gunicorn, whose master reads ``gateway/gunicorn_conf.py``
first: that is where a bad setting must stop it, before gunicorn can wrap the
error in a traceback or a "worker failed to boot" loop.
"""

from __future__ import annotations

import pytest
import requests

from payments.states import CallbackStatus
from tests.stack import Stack, callback_rows, db_url, worker_pids
from tests.support import Proc, create_payment, free_port, sandbox_event, signed, wait_until

pytestmark = pytest.mark.slow

BAD = [
    ("LOG_LEVEL", "LOUD", "LOG_LEVEL must be DEBUG, INFO, WARNING, ERROR or CRITICAL"),
    ("COMPENSATOR_MAX_RETRIES", "0", "COMPENSATOR_MAX_RETRIES must be >= 1"),
    ("CALLBACK_PROCESS_INLINE", "yes", "CALLBACK_PROCESS_INLINE must be 'true' or 'false'"),
    ("CALLBACK_INLINE_BUDGET_SECONDS", "-1", "CALLBACK_INLINE_BUDGET_SECONDS must be >= 0.01"),
    ("DATABASE_URL", "postgres://x", "DATABASE_URL must start with one of sqlite, mysql, mariadb"),
]


@pytest.mark.parametrize("process", ["web", "consumer", "compensator"])
@pytest.mark.parametrize(("name", "value", "message"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_setting_stops_every_process_with_one_line_and_exit_2(tmp_path, process, name, value, message):
    proc = Proc(process, {"PORT": str(free_port()), name: value}, log_path=tmp_path / f"{process}.log")
    try:
        assert proc.popen.wait(30) == 2, proc.output()
    finally:
        proc.kill()
    lines = proc.output().strip().splitlines()
    assert lines == [f"{process}: bad configuration: {lines[0].split(': ', 2)[2]}"], lines
    assert message in lines[0]


def test_a_bad_sandbox_setting_stops_the_sandbox_with_one_line_and_exit_2(tmp_path):
    proc = Proc("sandbox", {"SANDBOX_PORT": "0"}, log_path=tmp_path / "sandbox.log")
    try:
        assert proc.popen.wait(30) == 2
    finally:
        proc.kill()
    assert proc.output().strip().splitlines() == [
        "sandbox: bad configuration: SANDBOX_PORT must be between 1 and 65535, got 0"
    ]


@pytest.mark.mariadb
def test_a_failpoint_armed_in_the_web_process_kills_its_worker_after_the_row_is_committed(mariadb, tmp_path):
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb)) as stack:
        web, port = stack.start_web(workers=1, FAILPOINTS="gateway.after_store")
        (worker,) = worker_pids(web.popen.pid)
        payment_id = create_payment(mariadb)
        body, headers = signed(sandbox_event(payment_id))
        with pytest.raises(requests.ConnectionError):
            requests.post(f"http://127.0.0.1:{port}/callbacks/sandbox", data=body, headers=headers, timeout=15)
        wait_until(lambda: "failpoint gateway.after_store: SIGKILL" in web.output(), timeout=10, message="failpoint")
        # No answer reached the provider, but the delivery was already committed (invariants 1 and 2).
        (row,) = callback_rows(mariadb)
        assert bytes(row.callback_data) == body and row.status == CallbackStatus.PENDING
        wait_until(lambda: worker_pids(web.popen.pid) - {worker}, timeout=20, message="gunicorn replaced the worker")
        assert web.popen.poll() is None
