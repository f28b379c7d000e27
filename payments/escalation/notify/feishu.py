"""Feishu / Lark custom bot (自定义机器人): an interactive card, signed when the bot has a secret (签名校验).

Format (Feishu "custom bot" docs): POST the webhook URL
``https://open.feishu.cn/open-apis/bot/v2/hook/…`` (Lark:
``https://open.larksuite.com/…``) with ``{"msg_type": "interactive", "card":
{…}}``: a header (title, colour template) and ``div`` elements whose text is
``lark_md``. A body is at most 20 KB.

Signature: ``timestamp`` (unix seconds, within an hour of Feishu's clock) and
``sign`` go in the JSON body, where ``sign`` is base64(HMAC-SHA256(key =
"{timestamp}\\n{secret}", message = empty)); note the key, not the message,
carries the string to sign (unlike DingTalk).

The answer is ``{"code": 0, "msg": "success"}``; another code is a refusal.
Permanent until someone reconfigures (PERMANENT_CODES): 19001 (``incoming
webhook access token invalid``: the bot was removed or its webhook reset),
19021 a signature or timestamp mismatch, 19022 an IP not allowed, 19024 a
missing keyword, 9499 a malformed body. Retried: 11232 (frequency limited:
100 a minute, 5 a second per bot) and any code not listed.

@-mentions (``Notice.mentions``) use the card's own syntax inside the
``lark_md`` text: ``<at id=ou_…></at>`` per open_id and ``<at id=all></at>``
for everyone (a text or post message would say ``<at user_id="…">``; a card
does not take that form).

Every card's text carries ``render.KEYWORD`` (``paysync``), the keyword the
alerts page (docs/operations/alerts.md) tells teams to give a bot with keyword security.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import replace

from payments.errors import NotificationFailed
from payments.escalation.notify import RESOLVED, TEST, Notice, render
from payments.escalation.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, check_status, json_body, service_text

NAME = "feishu"
MAX_BODY_BYTES = 20 * 1024
PERMANENT_CODES = frozenset({9499, 19001, 19021, 19022, 19024})
"""codes a retry cannot fix (module docstring): the channel fails at once and alert_channel_failing fires."""
COLOURS = {"critical": "red", "warning": "orange", "info": "blue"}


def sign(secret: str, timestamp: int) -> str:
    """The ``sign`` field for ``timestamp`` (unix seconds)."""
    key = f"{timestamp}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode("ascii")


def card(notice: Notice) -> dict:
    """The interactive card for ``notice``."""
    colour = "green" if notice.kind == RESOLVED else "grey" if notice.kind == TEST else COLOURS.get(notice.severity)
    return {
        "config": {"wide_screen_mode": True},
        "header": {"title": {"tag": "plain_text", "content": notice.title}, "template": colour or "orange"},
        "elements": [{"tag": "div", "text": {"tag": "lark_md", "content": render.markdown(notice) + _ats(notice)}}],
    }


def _ats(notice: Notice) -> str:
    m = notice.mentions
    ats = [f"<at id={who}></at>" for who in m.feishu_open_ids] + (["<at id=all></at>"] if m.feishu_all else [])
    return "\n\n" + " ".join(ats) if ats else ""


def payload(notice: Notice, secret: str = "", timestamp: int | None = None) -> dict:
    """The body: the card, plus timestamp and sign when ``secret`` is set."""
    body: dict = {"msg_type": "interactive", "card": card(notice)}
    if secret:
        ts = int(time.time()) if timestamp is None else timestamp
        body = {"timestamp": str(ts), "sign": sign(secret, ts), **body}
    return body


def build(url: str, secret: str, notice: Notice, timestamp: int | None = None) -> HttpRequest:
    """The request for ``notice`` (a body over 20 KB has its detail cut)."""
    body = json_body(payload(notice, secret, timestamp))
    if len(body) > MAX_BODY_BYTES:
        short = replace(notice, details={}, message=render.cut_utf8(notice.message, 2000))
        body = json_body(payload(short, secret, timestamp))
    return HttpRequest(url=url, body=body, headers=JSON_HEADERS)


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless Feishu said code 0."""
    check_status(NAME, answer)
    data = answer.json()
    if not isinstance(data, dict):
        raise NotificationFailed(f"{NAME} answered something that is not JSON")
    code = data.get("code", data.get("StatusCode"))
    if code != 0:
        raise NotificationFailed(
            f"{NAME} code {code}: {service_text(data.get('msg', data.get('StatusMessage', '')))}",
            permanent=code in PERMANENT_CODES,
        )
    return "posted to the group bot"
