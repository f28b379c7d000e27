"""WeCom (企业微信) group robot: a markdown message.

Format (WeCom "group robot" docs): POST the webhook URL
``https://qyapi.weixin.qq.com/cgi-bin/webhook/send?key=…`` with
``{"msgtype": "markdown", "markdown": {"content": …}}``; the content is at
most 4096 bytes of UTF-8 and may colour text with ``<font color="info|comment|warning">``.
The robot has no signature: the key in the URL is the credential. A robot
takes at most 20 messages a minute.

@-mentions (``Notice.mentions``): a markdown message mentions by user id
only, with ``<@userid>`` in its content; phone numbers and everyone
(``mentioned_mobile_list``, ``@all``) are fields of the ``text`` message
alone. So a notice that names phones or everyone goes as a text message
(at most 2048 bytes) carrying them, and one that names user ids only stays
markdown.

The answer is ``{"errcode": 0, "errmsg": "ok"}``; 93000 is an invalid webhook
(permanent), 45009 the rate limit (retried).
"""

from __future__ import annotations

from payments.errors import NotificationFailed
from payments.escalation.notify import RESOLVED, Notice, render
from payments.escalation.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, check_status, json_body, service_text

NAME = "wecom"
MAX_CONTENT_BYTES = 4096
MAX_TEXT_BYTES = 2048
"""A text message's content limit (the type that takes mentioned_mobile_list)."""
INVALID_WEBHOOK = 93000


def content(notice: Notice) -> str:
    """The markdown content, with the title coloured by what happened."""
    colour = "info" if notice.kind == RESOLVED else "warning" if notice.severity == "critical" else "comment"
    lines = [f'### <font color="{colour}">{notice.title}</font>', "", notice.message, ""]
    lines += [f"> **{label}**: {value}" for label, value in render.fields(notice)]
    ats = " ".join(f"<@{who}>" for who in notice.mentions.wecom_user_ids)
    # The mentions last but never cut: a mention lost to the byte limit wakes nobody.
    tail = f"\n\n{ats}" if ats else ""
    return render.cut_utf8("\n".join(lines), MAX_CONTENT_BYTES - len(tail.encode())) + tail


def payload(notice: Notice) -> dict:
    """The message for ``notice``: markdown, or text when it must @-mention phones or everyone."""
    m = notice.mentions
    if m.wecom_mobiles or m.wecom_all:
        text = render.cut_utf8(render.plain_text(notice), MAX_TEXT_BYTES)
        mentioned = list(m.wecom_user_ids) + (["@all"] if m.wecom_all else [])
        return {
            "msgtype": "text",
            "text": {"content": text, "mentioned_list": mentioned, "mentioned_mobile_list": list(m.wecom_mobiles)},
        }
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
