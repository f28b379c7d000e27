"""DingTalk group robot (自定义机器人): a markdown message, signed when the robot has a secret (加签).

Format (DingTalk "custom robot" docs): POST the webhook URL
``https://oapi.dingtalk.com/robot/send?access_token=…`` with
``{"msgtype": "markdown", "markdown": {"title": …, "text": …}}``; ``title`` is
what the conversation list shows, ``text`` the markdown body.

Signature: with the robot's secret (``SEC…``), append ``timestamp`` (unix
milliseconds) and ``sign`` to the URL's query, where ``sign`` is
base64(HMAC-SHA256(key=secret, msg="{timestamp}\\n{secret}")), URL-encoded.
DingTalk refuses a timestamp more than an hour away from its clock.

The answer is HTTP 200 with ``{"errcode": 0, "errmsg": "ok"}``; any other
errcode is a refusal. Permanent until someone reconfigures (PERMANENT_CODES):
300001 and 300005 (``token is not exist``: the robot was removed or its
access_token revoked), 310000 (the robot's security settings refuse the
message: signature, keyword or IP allow-list), 400013 (the group was
dissolved), 40035 (a malformed message), 430101-430104 (content refused as
unsafe) and 460101 (message too long). Retried: 410100 (more than 20 messages a
minute; the robot blocks it for 10 minutes), -1 (system busy) and any code not
listed, so an unknown answer is retried until alert_channel_failing fires.

@-mentions (``Notice.mentions``): ``"at": {"atMobiles": […], "atUserIds":
[…], "isAtAll": …}`` beside the message; in a markdown message DingTalk
notifies a mobile only if the text also says ``@<mobile>`` (and a user id
``@<userid>``), so the text ends with those.

Every message's text carries ``render.KEYWORD`` (``paysync``), the keyword
docs/operations/alerts.md tells teams to give a robot with keyword security.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from payments.errors import NotificationFailed
from payments.escalation.notify import Notice, render
from payments.escalation.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, check_status, json_body, service_text

NAME = "dingtalk"
SECURITY_REFUSED = 310000
"""errcode for a message the robot's security settings (sign, keywords, IP) refuse."""
PERMANENT_CODES = frozenset({300001, 300005, SECURITY_REFUSED, 400013, 40035, 430101, 430102, 430103, 430104, 460101})
"""errcodes a retry cannot fix (module docstring): the channel fails at once and alert_channel_failing fires."""
THROTTLED = 410100
RETRY_AFTER_THROTTLED = 60.0
"""DingTalk holds a robot that sent more than 20 messages in a minute for a while: no point retrying sooner."""


def sign(secret: str, timestamp_ms: int) -> str:
    """The ``sign`` value (before URL encoding) for ``timestamp_ms``."""
    string_to_sign = f"{timestamp_ms}\n{secret}".encode()
    return base64.b64encode(hmac.new(secret.encode(), string_to_sign, hashlib.sha256).digest()).decode("ascii")


def signed_url(url: str, secret: str, timestamp_ms: int) -> str:
    """``url`` with ``timestamp`` and the URL-encoded ``sign`` added to its query (the access_token kept)."""
    parts = urlsplit(url)
    extra = urlencode({"timestamp": str(timestamp_ms), "sign": sign(secret, timestamp_ms)}, quote_via=quote)
    query = f"{parts.query}&{extra}" if parts.query else extra
    return urlunsplit(parts._replace(query=query))


def payload(notice: Notice) -> dict:
    """The markdown message for ``notice``, with its @-mentions."""
    m = notice.mentions
    text = render.markdown(notice)
    named = [f"@{who}" for who in (*m.dingtalk_mobiles, *m.dingtalk_user_ids)]
    if named:
        text += "\n\n" + " ".join(named)
    body: dict = {"msgtype": "markdown", "markdown": {"title": notice.title, "text": text}}
    if named or m.dingtalk_all:
        body["at"] = {
            "atMobiles": list(m.dingtalk_mobiles),
            "atUserIds": list(m.dingtalk_user_ids),
            "isAtAll": m.dingtalk_all,
        }
    return body


def build(url: str, secret: str, notice: Notice, timestamp_ms: int | None = None) -> HttpRequest:
    """The request for ``notice``; signed when ``secret`` is set."""
    if secret:
        url = signed_url(url, secret, int(time.time() * 1000) if timestamp_ms is None else timestamp_ms)
    return HttpRequest(url=url, body=json_body(payload(notice)), headers=JSON_HEADERS)


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless DingTalk said errcode 0."""
    check_status(NAME, answer)
    data = answer.json()
    if not isinstance(data, dict) or "errcode" not in data:
        raise NotificationFailed(f"{NAME} answered without an errcode")
    if data["errcode"] != 0:
        raise NotificationFailed(
            f"{NAME} errcode {data['errcode']}: {service_text(data.get('errmsg', ''))}",
            permanent=data["errcode"] in PERMANENT_CODES,
            retry_after=RETRY_AFTER_THROTTLED if data["errcode"] == THROTTLED else None,
        )
    return "posted to the group robot"
