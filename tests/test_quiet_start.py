"""`make run` starts quietly: the gateway and the sandbox each say where they listen in one line, not gunicorn's five.

gunicorn's own start-up lines (its version, the worker class, each worker booting) are left out in development
unless LOG_LEVEL=DEBUG; production keeps them (operators read worker restarts there).
"""

from __future__ import annotations

import json

import pytest

from tests.sandbox_process import start_sandbox
from tests.stack import Stack
from tests.support import wait_until

pytestmark = pytest.mark.server  # each test starts a gateway or a sandbox process

GUNICORN_CHATTER = ("Starting gunicorn", "Using worker", "Booting worker", "Listening at")


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


def test_the_gateway_says_where_it_listens_in_one_line(tmp_path):
    with Stack(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path / 'paysync.db'}") as stack:
        web, port = stack.start_web(workers=2)
        wait_until(lambda: "gateway listening on" in web.output(), timeout=20, message="the gateway's line")
        lines = _lines(web.output())
    said = [json.loads(line) for line in lines]
    # Development's one warning about its defaults, then one line: where (the loopback, as development binds),
    # how many workers and threads.
    assert [(line["level"], line["logger"]) for line in said] == [("WARNING", "paysync.web"), ("INFO", "paysync.web")]
    assert said[1]["msg"] == f"gateway listening on http://127.0.0.1:{port} (2 workers, 16 threads each)"


def test_log_level_debug_brings_gunicorns_own_lines_back(tmp_path):
    with Stack(tmp_path, DATABASE_URL=f"sqlite:///{tmp_path / 'paysync.db'}", LOG_LEVEL="DEBUG") as stack:
        web, _ = stack.start_web(workers=1)
        wait_until(lambda: "Booting worker" in web.output(), timeout=20, message="gunicorn's boot line")
        output = web.output()
    assert all(chatter in output for chatter in GUNICORN_CHATTER), output[-3000:]


def test_the_sandbox_says_where_it_listens_in_one_line(tmp_path):
    sandbox = start_sandbox(tmp_path, LOG_LEVEL="INFO")
    try:
        wait_until(lambda: "listening on" in sandbox.proc.output(), timeout=20, message="the sandbox's line")
        sandbox.reset()  # a request answered: the worker is up, and would have logged its boot by now
        lines = _lines(sandbox.proc.output())
    finally:
        sandbox.proc.stop()
    assert len(lines) == 1, lines
    assert json.loads(lines[0])["msg"].startswith(f"sandbox payment platform listening on {sandbox.url} ")


def test_the_sandbox_names_its_fault_knobs_when_one_is_turned(tmp_path):
    sandbox = start_sandbox(tmp_path, LOG_LEVEL="INFO", SANDBOX_FAULTS='{"decline_rate": 0.5}')
    try:
        wait_until(lambda: "fault knobs" in sandbox.proc.output(), timeout=20, message="the fault knobs line")
        output = sandbox.proc.output()
    finally:
        sandbox.proc.stop()
    assert "'decline_rate': 0.5" in output
    assert not any(chatter in output for chatter in GUNICORN_CHATTER), output
