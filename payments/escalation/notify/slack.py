"""Slack incoming webhook: a message with Block Kit blocks and a plain ``text`` fallback.

Format (Slack "Sending messages using incoming webhooks" and the Block Kit
reference): POST JSON to ``https://hooks.slack.com/services/T…/B…/…`` with
``text`` (shown in notifications and where blocks cannot be) and ``blocks``: a
``header`` (plain_text, at most 150 characters), a ``section`` with the
message in ``mrkdwn`` and one with up to 10 ``fields`` (Slack refuses more, so
the fields past the tenth are folded into a text section after them). In
mrkdwn ``&``, ``<`` and ``>`` must be escaped as ``&amp;``, ``&lt;``, ``&gt;``,
the top-level ``text`` included (it is mrkdwn too): unescaped, ``<!channel>``
in an alert's message would notify the whole channel and ``<url|label>`` would
show a link under another name. No signature: the URL is the credential.

The answer is HTTP 200 with body ``ok``. Errors come as a status and a short
text: 400 ``invalid_payload``, 403 ``action_prohibited``, 404
``channel_not_found``/``no_service``, 410 ``channel_is_archived`` (all
permanent), 429 rate limited (with Retry-After) and 5xx (retried).
"""

from __future__ import annotations

from payments.escalation.notify import Notice, render
from payments.escalation.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, check_status, json_body

NAME = "slack"
MAX_FIELDS = 10
"""Block Kit's limit on one section's ``fields``."""
MAX_TEXT = 3000
"""Block Kit's limit on one section's text."""


def escape(text: str) -> str:
    """Escape the three characters mrkdwn reserves for its own syntax."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def payload(notice: Notice) -> dict:
    """The message for ``notice``: every field is shown, the ones past MAX_FIELDS as lines of their own section."""
    pairs = render.fields(notice)
    fields = [{"type": "mrkdwn", "text": f"*{escape(k)}*\n{escape(v)}"} for k, v in pairs[:MAX_FIELDS]]
    blocks = [
        {"type": "header", "text": {"type": "plain_text", "text": notice.title[:150]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": escape(notice.message)[:MAX_TEXT]}},
        {"type": "section", "fields": fields},
    ]
    for text in _chunks([f"*{escape(k)}*: {escape(v)}" for k, v in pairs[MAX_FIELDS:]]):
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": text}})
    return {"text": escape(render.summary(notice)), "blocks": blocks}


def _chunks(lines: list[str]) -> list[str]:
    """``lines`` joined into texts of at most MAX_TEXT characters (a line is at most ~400: a detail is cut at 200)."""
    out: list[str] = []
    for line in lines:
        if out and len(out[-1]) + 1 + len(line) <= MAX_TEXT:
            out[-1] += "\n" + line
        else:
            out.append(line[:MAX_TEXT])
    return out


def build(url: str, notice: Notice) -> HttpRequest:
    """The request for ``notice``."""
    return HttpRequest(url=url, body=json_body(payload(notice)), headers=JSON_HEADERS)


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless Slack took it (HTTP 2xx)."""
    check_status(NAME, answer)
    return "posted to the channel"
