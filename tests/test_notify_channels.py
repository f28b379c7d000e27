"""Each alert channel delivers to a real local server that checks its format and signature like the service does."""

from __future__ import annotations

import base64
import email
import email.policy
import json
import os
from dataclasses import replace
from datetime import datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.errors import NotificationFailed
from payments.escalation.notify import FIRING, REPEAT, RESOLVED, Notice, aliyun_sms, dingtalk, feishu, render, template
from payments.escalation.notify.channels import build_channels
from tests.notify_fakes import ALIYUN_KEY_ID, ALIYUN_SECRET, TOKEN, FakeService, self_signed, smtp_server
from tests.support import free_port, make_settings

NOTICE = Notice(
    kind=FIRING,
    rule="callback_backlog",
    severity="critical",
    message="150 callbacks waiting (threshold 100)",
    key="callback_backlog",
    alert_id=42,
    details={"backlog": 150},
    first_seen_at=datetime(2026, 1, 2, 3, 0, 0),
    fired_at=datetime(2026, 1, 2, 3, 5, 0),
)
WHSEC = "whsec_" + base64.b64encode(os.urandom(32)).decode()


def _channel(name: str, **settings):
    return build_channels(make_settings(alert_channel_timeout_seconds=5.0, **settings))[name]


def _send(name: str, notice: Notice = NOTICE, **settings) -> str:
    channel = _channel(name, **settings)
    try:
        return channel.send(notice)
    finally:
        channel.close()


def _fails(name: str, notice: Notice = NOTICE, **settings) -> NotificationFailed:
    with pytest.raises(NotificationFailed) as info:
        _send(name, notice, **settings)
    return info.value


# --- DingTalk -----------------------------------------------------------------


def test_dingtalk_delivers_a_signed_markdown_message():
    with FakeService("dingtalk", secret="SECdingtalk-secret") as fake:
        _send("dingtalk", dingtalk_webhook_url=fake.url, dingtalk_secret=("SECdingtalk-secret", "SECold"))
    assert fake.refused == []
    (got,) = fake.received
    assert got.query["access_token"] == TOKEN  # the token in the configured URL is kept beside timestamp and sign
    assert got.data["markdown"]["title"] == "[CRITICAL] callback_backlog firing"
    assert "150 callbacks waiting" in got.data["markdown"]["text"]
    assert "- **backlog**: 150" in got.data["markdown"]["text"]


def test_dingtalk_refuses_a_wrong_signature_and_that_is_permanent_and_names_no_token():
    with FakeService("dingtalk", secret="SECright") as fake:
        error = _fails("dingtalk", dingtalk_webhook_url=fake.url, dingtalk_secret=("SECwrong",))
    assert fake.received == [] and fake.refused == ["sign not match"]
    assert error.permanent and "310000" in str(error) and TOKEN not in str(error)


def test_dingtalk_sign_is_url_encoded_base64_of_hmac_sha256():
    url = dingtalk.signed_url("https://oapi.dingtalk.com/robot/send?access_token=abc", "SECx", 1700000000000)
    sign = dingtalk.sign("SECx", 1700000000000)
    assert url.endswith(
        "&timestamp=1700000000000&sign=" + sign.replace("+", "%2B").replace("/", "%2F").replace("=", "%3D")
    )
    assert len(base64.b64decode(sign)) == 32


# --- Feishu -------------------------------------------------------------------


def test_feishu_delivers_a_signed_interactive_card():
    with FakeService("feishu", secret="feishu-secret") as fake:
        _send("feishu", feishu_webhook_url=fake.url, feishu_secret=("feishu-secret",))
    assert fake.refused == []
    (got,) = fake.received
    assert got.data["card"]["header"]["template"] == "red"
    assert got.data["card"]["header"]["title"]["content"] == "[CRITICAL] callback_backlog firing"


def test_feishu_resolved_notice_is_a_green_card():
    with FakeService("feishu") as fake:
        _send(
            "feishu", replace(NOTICE, kind=RESOLVED, resolved_at=datetime(2026, 1, 2, 4)), feishu_webhook_url=fake.url
        )
    (got,) = fake.received
    assert got.data["card"]["header"]["template"] == "green"
    assert "timestamp" not in got.data  # no secret configured: unsigned, as the bot expects


def test_feishu_refuses_a_wrong_signature_permanently():
    with FakeService("feishu", secret="right") as fake:
        error = _fails("feishu", feishu_webhook_url=fake.url, feishu_secret=("wrong",))
    assert error.permanent and "19021" in str(error)


def test_feishu_sign_keys_the_hmac_with_the_string_to_sign():
    assert (
        feishu.sign("s3cret", 1599360473)
        == base64.b64encode(__import__("hmac").new(b"1599360473\ns3cret", b"", "sha256").digest()).decode()
    )


# --- WeCom --------------------------------------------------------------------


def test_wecom_delivers_markdown_and_cuts_it_to_4096_bytes():
    long = replace(NOTICE, message="积压" * 3000)  # 18000 bytes of UTF-8
    with FakeService("wecom") as fake:
        _send("wecom", long, wecom_webhook_url=fake.url)
    assert fake.refused == []
    content = fake.received[0].data["markdown"]["content"]
    assert content.startswith('### <font color="warning">[CRITICAL] callback_backlog firing</font>')
    assert len(content.encode()) <= 4096


def test_wecom_invalid_webhook_is_permanent():
    with FakeService("wecom") as fake:
        error = _fails("wecom", wecom_webhook_url=fake.url.replace(TOKEN, "nope"))
    assert error.permanent and "93000" in str(error)


# --- Slack --------------------------------------------------------------------


def test_slack_delivers_blocks_with_a_text_fallback_and_escapes_mrkdwn():
    notice = replace(NOTICE, message="backlog <@channel> & more")
    with FakeService("slack") as fake:
        _send("slack", notice, slack_webhook_url=fake.url)
    assert fake.refused == []
    data = fake.received[0].data
    assert data["text"].startswith("[CRITICAL] callback_backlog firing: backlog")
    assert data["blocks"][1]["text"]["text"] == "backlog &lt;@channel&gt; &amp; more"


@pytest.mark.parametrize(
    ("status", "body", "permanent", "retry_after"),
    [
        (404, "no_service", True, None),
        (410, "channel_is_archived", True, None),
        (400, "invalid_payload", True, None),
        (500, "rollup_error", False, None),
    ],
)
def test_slack_errors_say_whether_a_retry_can_help(status, body, permanent, retry_after):
    with FakeService("slack") as fake:
        fake.fail_with = (status, body)
        error = _fails("slack", slack_webhook_url=fake.url)
    assert (error.permanent, error.retry_after) == (permanent, retry_after)
    assert f"HTTP {status}" in str(error) and TOKEN not in str(error)


# --- Generic signed webhook ---------------------------------------------------


def test_the_generic_webhook_is_signed_as_standard_webhooks_with_a_stable_id():
    with FakeService("webhook", secret=WHSEC) as fake:
        _send("webhook", alert_webhook_url=fake.url, alert_webhook_secret=(WHSEC,))
        _send("webhook", alert_webhook_url=fake.url, alert_webhook_secret=(WHSEC,))
    assert fake.refused == []
    first, again = fake.received
    assert first.headers["webhook-id"] == again.headers["webhook-id"] == "alert_42_firing_0"
    assert first.data["type"] == "alert.firing"
    assert first.data["data"]["details"] == {"backlog": 150}
    assert first.data["data"]["fired_at"] == "2026-01-02T03:05:00.000Z"


def test_the_generic_webhook_with_another_secret_is_refused():
    other = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    with FakeService("webhook", secret=WHSEC) as fake:
        error = _fails("webhook", alert_webhook_url=fake.url, alert_webhook_secret=(other,))
    assert fake.refused == ["bad signature"] and not error.permanent


def test_webhook_410_gives_up_and_retry_after_is_passed_on():
    with FakeService("webhook", secret=WHSEC) as fake:
        fake.fail_with = (410, {"error": "gone"})
        assert _fails("webhook", alert_webhook_url=fake.url, alert_webhook_secret=(WHSEC,)).permanent
    assert fake.attempts == 1


# --- SMS gateway --------------------------------------------------------------


def test_the_sms_gateway_gets_one_request_per_phone_from_the_template():
    with FakeService("sms", token="gw-token") as fake:
        what = _send(
            "sms",
            sms_gateway_url=fake.url,
            sms_gateway_token=("gw-token",),
            sms_recipients=("+8613800000001", "+8613800000002"),
            sms_gateway_template='{"to": "{{phone}}", "content": "{{text}}", "meta": {"rule": "{{rule}}"}}',
        )
    assert fake.refused == [] and "2 phone(s)" in what
    assert [r.data["to"] for r in fake.received] == ["+8613800000001", "+8613800000002"]
    text = fake.received[0].data["content"]
    assert text.startswith("[CRITICAL] callback_backlog firing: 150 callbacks") and len(text) <= 160
    assert fake.received[0].data["meta"] == {"rule": "callback_backlog"}


def test_the_sms_gateway_template_can_take_every_phone_as_a_list_in_one_request():
    with FakeService("sms") as fake:
        _send(
            "sms",
            sms_gateway_url=fake.url,
            sms_recipients=("13800000001", "13800000002"),
            sms_gateway_template='{"mobiles": "{{phones}}", "msg": "{{title}}"}',
        )
    (got,) = fake.received
    assert got.data == {"mobiles": ["13800000001", "13800000002"], "msg": "[CRITICAL] callback_backlog firing"}


def test_the_sms_gateway_without_its_token_is_refused_permanently():
    with FakeService("sms", token="gw-token") as fake:
        error = _fails("sms", sms_gateway_url=fake.url, sms_recipients=("13800000001",))
    assert error.permanent and "HTTP 401" in str(error)


def test_templates_refuse_unknown_placeholders_and_json_that_is_not_an_object():
    with pytest.raises(ValueError, match=r"unknown placeholder \{\{txet\}\}"):
        template.parse('{"to": "{{phone}}", "text": "{{txet}}"}', ("phone", "text"))
    with pytest.raises(ValueError, match="JSON object"):
        template.parse('["{{text}}"]', ("text",))
    values = {"text": 'a "quoted" line\nwith a newline'}
    assert json.loads(json.dumps(template.render({"t": "{{text}}!"}, values))) == {"t": values["text"] + "!"}


# --- Aliyun SMS ---------------------------------------------------------------

ALIYUN_DOC_PARAMS = {
    "AccessKeyId": "testId",
    "Action": "SendSms",
    "Format": "XML",
    "OutId": "123",
    "PhoneNumbers": "15300000001",
    "RegionId": "cn-hangzhou",
    "SignName": "阿里云短信测试专用",
    "SignatureMethod": "HMAC-SHA1",
    "SignatureNonce": "45e25e9b-0a6f-4070-8c85-2956eda1b466",
    "SignatureVersion": "1.0",
    "TemplateCode": "SMS_71390007",
    "TemplateParam": '{"customer":"test"}',
    "Timestamp": "2017-07-12T02:42:19Z",
    "Version": "2017-05-25",
}


def test_aliyun_signature_matches_the_worked_example_of_the_sms_docs():
    # The example in Aliyun's SMS "signature method" documentation (GET, testId / testSecret).
    assert aliyun_sms.string_to_sign("GET", ALIYUN_DOC_PARAMS).startswith(
        "GET&%2F&AccessKeyId%3DtestId%26Action%3DSendSms%26Format%3DXML%26OutId%3D123%26PhoneNumbers%3D15300000001"
    )
    assert aliyun_sms.signature("testSecret", "GET", ALIYUN_DOC_PARAMS) == "zJDF+Lrzhj/ThnlvIToysFRq6t4="


@given(st.text())
def test_aliyun_percent_encoding_is_the_documented_recipe(value):
    assert aliyun_sms.percent_encode(value) == FakeService.aliyun_encode(value)


def _aliyun(fake: FakeService, secret: str = ALIYUN_SECRET, **extra) -> dict:
    return {
        "aliyun_sms_endpoint": fake.url,
        "aliyun_sms_access_key_id": ALIYUN_KEY_ID,
        "aliyun_sms_access_key_secret": (secret,),
        "aliyun_sms_sign_name": "支付监控",
        "aliyun_sms_template_code": "SMS_123456789",
        "aliyun_sms_phone_numbers": ("13800000001", "13800000002"),
        **extra,
    }


def test_aliyun_sendsms_is_accepted_by_a_fake_that_checks_the_signature():
    with FakeService("aliyun") as fake:
        what = _send("aliyun_sms", **_aliyun(fake))
        _send("aliyun_sms", **_aliyun(fake))  # a fresh nonce each call: the fake refuses a reused one
    assert fake.refused == [] and "BizId" in what
    params = fake.received[0].params
    assert params["PhoneNumbers"] == "13800000001,13800000002"
    assert params["SignName"] == "支付监控"
    assert json.loads(params["TemplateParam"]) == {"rule": "callback_backlog", "status": "firing"}
    assert params["OutId"] == "alert_42_firing_0"
    assert fake.received[0].body.startswith(b"AccessKeyId=")  # a form body: nothing secret in the URL


def test_aliyun_with_the_wrong_secret_is_refused_permanently():
    with FakeService("aliyun") as fake:
        error = _fails("aliyun_sms", **_aliyun(fake, secret="not-the-secret"))
    assert error.permanent and "SignatureDoesNotMatch" in str(error)
    assert "not-the-secret" not in str(error)


def test_aliyun_throttling_is_retried():
    with FakeService("aliyun") as fake:
        fake.fail_with = (400, {"Code": "isv.BUSINESS_LIMIT_CONTROL", "Message": "触发分钟级流控Permits:1"})
        error = _fails("aliyun_sms", **_aliyun(fake))
    assert not error.permanent and "BUSINESS_LIMIT_CONTROL" in str(error)


# --- Network trouble ----------------------------------------------------------


def test_a_channel_nobody_listens_on_fails_transiently_without_naming_its_url():
    url = f"http://127.0.0.1:{free_port()}/robot/send?access_token={TOKEN}"
    error = _fails("dingtalk", dingtalk_webhook_url=url)
    assert not error.permanent and str(error) == "dingtalk: ConnectionError"


# --- Email --------------------------------------------------------------------


def _mail(content: bytes) -> email.message.EmailMessage:
    return email.message_from_bytes(content, policy=email.policy.default)


def test_email_is_delivered_to_a_real_smtp_server():
    with smtp_server() as (inbox, port):
        what = _send(
            "email",
            smtp_host="127.0.0.1",
            smtp_port=port,
            smtp_tls="off",
            smtp_from="paysync@example.com",
            smtp_to=("oncall@example.com", "finance@example.com"),
        )
    assert "2 of 2" in what
    (mail,) = inbox.mails
    assert mail.mail_from == "paysync@example.com"
    assert mail.rcpt_tos == ["oncall@example.com", "finance@example.com"]
    msg = _mail(mail.content)
    assert msg["Subject"] == "[CRITICAL] callback_backlog firing: 150 callbacks waiting (threshold 100)"
    assert msg["Message-ID"] == "<alert-42-firing-0@example.com>"
    assert msg["Auto-Submitted"] == "auto-generated"
    body = msg.get_content()
    assert "150 callbacks waiting" in body and "Firing since: 2026-01-02 03:05:00 UTC" in body


def test_email_reminders_and_the_resolved_notice_thread_under_the_firing_mail():
    with smtp_server() as (inbox, port):
        for notice in (replace(NOTICE, kind=REPEAT, repeat=2), replace(NOTICE, kind=RESOLVED)):
            _send(
                "email",
                notice,
                smtp_host="127.0.0.1",
                smtp_port=port,
                smtp_tls="off",
                smtp_from="a@b.cn",
                smtp_to=("c@d.cn",),
            )
    reminder, resolved = (_mail(m.content) for m in inbox.mails)
    assert reminder["Message-ID"] == "<alert-42-repeat-2@b.cn>"
    assert reminder["In-Reply-To"] == resolved["References"] == "<alert-42-firing-0@b.cn>"
    assert resolved["Subject"].startswith("[RESOLVED] callback_backlog (was: 150 callbacks")


def test_email_with_starttls_and_auth_against_a_self_signed_certificate(tmp_path):
    cert = self_signed(tmp_path)
    users = {"alerts": "p@ss,word"}  # a comma in a password: SMTP_PASSWORD is one value, not a list
    with smtp_server(tls="starttls", cert=cert, users=users) as (inbox, port):
        common = dict(
            smtp_host="localhost", smtp_port=port, smtp_from="paysync@example.com", smtp_to=("oncall@example.com",)
        )
        _send(
            "email",
            smtp_tls="starttls",
            smtp_username="alerts",
            smtp_password="p@ss,word",
            smtp_ca_file=str(cert[0]),
            **common,
        )
        untrusted = _fails("email", smtp_tls="starttls", smtp_username="alerts", smtp_password="p@ss,word", **common)
        refused = _fails(
            "email",
            smtp_tls="starttls",
            smtp_username="alerts",
            smtp_password="wrong",
            smtp_ca_file=str(cert[0]),
            **common,
        )
    (mail,) = inbox.mails
    assert mail.tls and mail.authenticated
    assert "certificate not trusted" in str(untrusted) and not untrusted.permanent  # verification is on
    assert refused.permanent and "login refused (535)" in str(refused) and "wrong" not in str(refused)


def test_email_with_implicit_tls(tmp_path):
    cert = self_signed(tmp_path)
    with smtp_server(tls="implicit", cert=cert) as (inbox, port):
        _send(
            "email",
            smtp_host="127.0.0.1",
            smtp_port=port,
            smtp_tls="implicit",
            smtp_ca_file=str(cert[0]),
            smtp_from="paysync@example.com",
            smtp_to=("oncall@example.com",),
        )
    assert inbox.mails[0].tls


def test_an_smtp_server_nobody_runs_fails_transiently():
    error = _fails(
        "email", smtp_host="127.0.0.1", smtp_port=free_port(), smtp_tls="off", smtp_from="a@b.cn", smtp_to=("c@d.cn",)
    )
    assert not error.permanent and str(error) == "email: ConnectionRefusedError"


# --- Rendering ----------------------------------------------------------------


def test_render_summaries_fit_and_utf8_cuts_never_split_a_character():
    assert len(render.summary(replace(NOTICE, message="x" * 1000), 160)) == 160
    cut = render.cut_utf8("积" * 100, 10)
    assert len(cut.encode()) <= 10 and cut.endswith("…")
