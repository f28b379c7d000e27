"""Alert channel settings: enabled by their own variables, refused when they do not hold together, secrets unlogged."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest

from payments.errors import ConfigError
from payments.escalation.evaluators import check_alerting
from payments.escalation.notify.channels import build_channels, enabled_channels
from payments.infra.settings import load_settings
from tests.support import ROOT, env_for

DEV = {"PAYSYNC_ENV": "development"}
WHSEC = "whsec_" + base64.b64encode(os.urandom(32)).decode()
ALL = {
    "SMTP_HOST": "smtp.example.com",
    "SMTP_FROM": "paysync@example.com",
    "SMTP_TO": "a@example.com, b@example.com",
    "SMTP_USERNAME": "alerts",
    "SMTP_PASSWORD": "pa,ss",
    "SMS_GATEWAY_URL": "https://sms.example.com/send",
    "SMS_RECIPIENTS": "+86 138-0000-0001,13800000002",
    "ALIYUN_SMS_ACCESS_KEY_ID": "LTAI5tAbc",
    "ALIYUN_SMS_ACCESS_KEY_SECRET": "new-secret,old-secret",
    "ALIYUN_SMS_SIGN_NAME": "支付监控",
    "ALIYUN_SMS_TEMPLATE_CODE": "SMS_123",
    "ALIYUN_SMS_PHONE_NUMBERS": "13800000001",
    "DINGTALK_WEBHOOK_URL": "https://oapi.dingtalk.com/robot/send?access_token=t",
    "DINGTALK_SECRET": "SECnew,SECold",
    "FEISHU_WEBHOOK_URL": "https://open.feishu.cn/open-apis/bot/v2/hook/t",
    "WECOM_WEBHOOK_URL": "https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=t",
    "SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T/B/t",
    "ALERT_WEBHOOK_URL": "https://ops.example.com/alerts",
    "ALERT_WEBHOOK_SECRET": WHSEC,
}


def test_no_channel_settings_no_channels():
    assert enabled_channels(load_settings(DEV)) == []


def test_every_channel_is_enabled_by_its_own_settings_and_lists_parse():
    settings = load_settings({**DEV, **ALL})
    assert enabled_channels(settings) == [
        "email",
        "sms",
        "aliyun_sms",
        "dingtalk",
        "feishu",
        "wecom",
        "slack",
        "webhook",
    ]
    assert settings.smtp_to == ("a@example.com", "b@example.com")
    assert settings.smtp_password == "pa,ss"  # one value: commas are legal in passwords
    assert settings.sms_recipients == ("+8613800000001", "13800000002")
    assert settings.dingtalk_secret == ("SECnew", "SECold")
    assert sorted(build_channels(settings)) == sorted(enabled_channels(settings))


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"SMTP_HOST": "smtp.example.com"}, "SMTP_FROM, SMTP_TO are required: alert channel email is partly"),
        ({"SMTP_TO": "not-an-address"}, "SMTP_TO must be plain addresses"),
        ({"SMTP_TLS": "ssl"}, "SMTP_TLS must be one of starttls, implicit, off"),
        ({"SMTP_PORT": "0"}, "SMTP_PORT must be >= 1"),
        (
            {"SMTP_HOST": "h", "SMTP_FROM": "a@b.cn", "SMTP_TO": "c@d.cn", "SMTP_USERNAME": "u"},
            "SMTP_USERNAME and SMTP_PASSWORD go together",
        ),
        (
            {"SMTP_HOST": "h", "SMTP_FROM": "a@b.cn", "SMTP_TO": "c@d.cn", "SMTP_USERNAME": "u", "SMTP_PASSWORD": "p"}
            | {"SMTP_TLS": "off"},
            "SMTP_PASSWORD needs SMTP_TLS=starttls or implicit",
        ),
        ({"SMS_GATEWAY_URL": "https://sms.example.com"}, "SMS_RECIPIENTS is required: alert channel sms"),
        ({"SMS_RECIPIENTS": "12a45"}, "SMS_RECIPIENTS must be comma-separated phone numbers"),
        (
            {"SMS_GATEWAY_TEMPLATE": '{"to": "{{phone}}", "text": "{{txt}}"}'},
            "SMS_GATEWAY_TEMPLATE: unknown placeholder",
        ),
        ({"SMS_GATEWAY_TEMPLATE": "{to: 1}"}, "SMS_GATEWAY_TEMPLATE: not valid JSON"),
        (
            {"SMS_GATEWAY_URL": "https://s.example.com", "SMS_RECIPIENTS": "13800000001"}
            | {"SMS_GATEWAY_TEMPLATE": '{"text": "{{text}}"}'},
            "SMS_GATEWAY_TEMPLATE names no recipient",
        ),
        ({"ALIYUN_SMS_ACCESS_KEY_ID": "LTAI5t"}, "ALIYUN_SMS_ACCESS_KEY_SECRET, ALIYUN_SMS_SIGN_NAME,"),
        ({"ALIYUN_SMS_TEMPLATE_CODE": "123"}, "ALIYUN_SMS_TEMPLATE_CODE must be a template code such as SMS_"),
        ({"ALIYUN_SMS_TEMPLATE_PARAM": '{"x": "{{phone}}"}'}, "ALIYUN_SMS_TEMPLATE_PARAM: unknown placeholder"),
        ({"DINGTALK_SECRET": "SECx"}, "DINGTALK_WEBHOOK_URL is required: alert channel dingtalk"),
        ({"SLACK_WEBHOOK_URL": "hooks.slack.com/x"}, "SLACK_WEBHOOK_URL must start with one of http://, https://"),
        ({"ALERT_WEBHOOK_URL": "https://x.example.com"}, "ALERT_WEBHOOK_SECRET is required: alert channel webhook"),
        ({"ALERT_WEBHOOK_SECRET": "not-whsec"}, "ALERT_WEBHOOK_SECRET: a webhook secret must start with 'whsec_'"),
        ({"DINGTALK_SECRET": "SECa,,SECb"}, "DINGTALK_SECRET has an empty entry"),
        ({"ALERT_NOTIFY_MAX_ATTEMPTS": "0"}, "ALERT_NOTIFY_MAX_ATTEMPTS must be >= 1"),
        (
            {"ALERT_NOTIFY_RETRY_BASE_SECONDS": "60", "ALERT_NOTIFY_RETRY_MAX_SECONDS": "10"},
            "ALERT_NOTIFY_RETRY_MAX_SECONDS must be >= ALERT_NOTIFY_RETRY_BASE_SECONDS",
        ),
    ],
)
def test_a_bad_or_partial_channel_setting_is_refused_naming_the_variable(environ, message):
    # Refused at start-up: by the settings' own parsing, or by the channels checking theirs (check_alerting).
    with pytest.raises(ConfigError) as info:
        check_alerting(load_settings({**DEV, **environ}))
    assert message in str(info.value)


def test_production_refuses_plain_http_for_a_url_that_carries_a_token_but_not_to_loopback():
    with pytest.raises(ConfigError, match="WECOM_WEBHOOK_URL must be https:// in production"):
        check_alerting(load_settings({"WECOM_WEBHOOK_URL": "http://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=t"}))
    check_alerting(load_settings({"WECOM_WEBHOOK_URL": "http://127.0.0.1:9000/cgi-bin/webhook/send?key=t"}))
    check_alerting(load_settings({**DEV, "WECOM_WEBHOOK_URL": "http://wecom.internal/cgi-bin/webhook/send?key=t"}))


def test_a_bad_channel_setting_stops_the_process_with_one_line_and_no_secret(tmp_path):
    env = env_for(
        {
            "DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}",
            "ALIYUN_SMS_ACCESS_KEY_ID": "LTAI5tAbc",
            "ALIYUN_SMS_ACCESS_KEY_SECRET": "very-secret-value",
        }
    )
    done = subprocess.run(
        [sys.executable, "-m", "compensator", "notify_alerts", "--once"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("compensator: bad configuration: ")
    assert "ALIYUN_SMS_SIGN_NAME" in done.stderr and "very-secret-value" not in done.stderr
