"""WeCom (企业微信) group robot: a markdown message.

Format (WeCom "group robot" docs): POST the webhook URL
``https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=…`` with
``{"msgtype": "markdown", "markdown": {"content": …}}``; the content is at
most 4096 bytes of UTF-8 and may colour text with ``<font color="info|comment|warning">``.
The robot has no signature: the key in the URL is the credential. A robot
takes at most 20 messages a minute.

The answer is ``{"errcode": 0, "errmsg": "ok"}``; 93000 is an invalid webhook
(permanent), 45009 the rate limit (retried).
"""

from __future__ import annotations

from payments.errors import NotificationFailed
from payments.notify import RESOLVED, Notice, render
from payments.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, check_status, json_body, service_text

NAME = "wecom"
MAX_CONTENT_BYTES = 4096
INVALID_WEBHOOK = 93000


def content(notice: Notice) -> str:
    """The markdown content, with the title coloured by what happened."""
    colour = "info" if notice.kind == RESOLVED else "warning" if notice.severity == "critical" else "comment"
    lines = [f'### <font color="{colour}">{notice.title}</font>', "", notice.message, ""]
    lines += [f"> **{label}**: {value}" for label, value in render.fields(notice)]
    return render.cut_utf8("\n".join(lines), MAX_CONTENT_BYTES)


def payload(notice: Notice) -> dict:
    """The markdown message for ``notice``."""
    return {"msgtype": "markdown", "markdown": {"content": content(notice)}}


def build(url: str, notice: Notice) -> HttpRequest:
    """The request for ``notice``."""
    return HttpRequest(url=url, body=json_body(payload(notice)), headers=JSON_HEADERS)


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless WeCom said errcode 0."""
    check_status(NAME, answer)
    data = answer.json()
    if not isinstance(data, dict) or "errcode" not in data:
        raise NotificationFailed(f"{NAME} answered without an errcode")
    if data["errcode"] != 0:
        raise NotificationFailed(
            f"{NAME} errcode {data['errcode']}: {service_text(data.get('errmsg', ''))}",
            permanent=data["errcode"] == INVALID_WEBHOOK,
        )
    return "posted to the group robot"
