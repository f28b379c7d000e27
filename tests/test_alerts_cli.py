"""``python -m compensator alerts test --channel NAME``: a test notification through one channel, and what happened."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.notify_fakes import TOKEN, FakeService, smtp_server
from tests.support import ROOT, env_for, free_port

pytestmark = pytest.mark.server  # each test runs the command as a process


def _alerts_test(channel: str, tmp_path, **settings: str) -> subprocess.CompletedProcess:
    env = env_for({"DATABASE_URL": f"sqlite:///{tmp_path / 'never-created' / 'x.db'}", **settings})
    return subprocess.run(
        [sys.executable, "-m", "compensator", "alerts", "test", "--channel", channel],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_alerts_test_sends_through_the_channel_and_says_so(tmp_path):
    with FakeService("dingtalk", secret="SECcli") as fake:
        done = _alerts_test("dingtalk", tmp_path, DINGTALK_WEBHOOK_URL=fake.url, DINGTALK_SECRET="SECcli")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("alerts test: dingtalk: sent in ")
    (got,) = fake.received
    assert got.data["markdown"]["title"] == "[TEST] paysync alert channel test"
    assert not (tmp_path / "never-created").exists(), "a channel test touches no database"


def test_alerts_test_by_email(tmp_path):
    with smtp_server() as (inbox, port):
        done = _alerts_test(
            "email",
            tmp_path,
            SMTP_HOST="127.0.0.1",
            SMTP_PORT=str(port),
            SMTP_TLS="off",
            SMTP_FROM="paysync@example.com",
            SMTP_TO="oncall@example.com",
        )
    assert done.returncode == 0, done.stderr
    assert "sent to 1 of 1 recipient(s)" in done.stdout
    assert b"Subject: [TEST] paysync alert channel test" in inbox.mails[0].content


def test_alerts_test_exits_1_and_says_why_when_the_channel_refuses(tmp_path):
    with FakeService("dingtalk", secret="SECright") as fake:
        done = _alerts_test("dingtalk", tmp_path, DINGTALK_WEBHOOK_URL=fake.url, DINGTALK_SECRET="SECwrong")
    assert done.returncode == 1
    assert "alerts test: dingtalk: FAILED (permanent)" in done.stderr and "errcode 310000" in done.stderr
    assert TOKEN not in done.stderr + done.stdout and "SECwrong" not in done.stderr + done.stdout


def test_alerts_test_exits_1_when_nobody_listens(tmp_path):
    done = _alerts_test("slack", tmp_path, SLACK_WEBHOOK_URL=f"http://127.0.0.1:{free_port()}/services/T/B/{TOKEN}")
    assert done.returncode == 1
    assert "alerts test: slack: FAILED (transient)" in done.stderr and "ConnectionError" in done.stderr
    assert TOKEN not in done.stderr


def test_alerts_test_of_a_channel_not_configured_names_its_settings(tmp_path):
    done = _alerts_test("aliyun_sms", tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "alerts test: aliyun_sms: not configured (set ALIYUN_SMS_ACCESS_KEY_ID, ALIYUN_SMS_ACCESS_KEY_SECRET, "
        "ALIYUN_SMS_SIGN_NAME, ALIYUN_SMS_TEMPLATE_CODE, ALIYUN_SMS_PHONE_NUMBERS)"
    )


def test_alerts_test_refuses_an_unknown_channel(tmp_path):
    done = _alerts_test("pager", tmp_path)
    assert done.returncode == 2 and "invalid choice: 'pager'" in done.stderr
