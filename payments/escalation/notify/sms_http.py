"""A generic HTTP SMS gateway: one JSON POST per phone (or one for all), built from SMS_GATEWAY_TEMPLATE.

Most SMS gateways take a JSON body naming the recipient and the text; their
field names differ, so the body is a template (``payments/escalation/notify/template.py``)
such as ``{"to": "{{phone}}", "text": "{{text}}"}``. A template that uses
``{{phone}}`` is sent once per number in SMS_RECIPIENTS; one that uses
``{{phones}}`` (a comma-joined string, or a list where it is the whole value)
is sent once. SMS_GATEWAY_TOKEN, when set, goes as ``Authorization: Bearer``.

``text`` is the one-line summary, at most ``MAX_TEXT_CHARS``: an SMS is short.
Any 2xx answer is delivered; the rest follows the plain HTTP reading
(``check_status``). When one of several per-phone requests fails the whole
notification is retried, so a phone may get the same text twice: better than
an on-call engineer getting it never.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import requests

from payments.escalation.notify import Notice, render, template
from payments.escalation.notify.http import JSON_HEADERS, HttpRequest, check_status, json_body, post

NAME = "sms"
MAX_TEXT_CHARS = 160
ALLOWED = template.NOTICE_FIELDS + template.PHONE_FIELDS


def values(notice: Notice) -> dict[str, str]:
    """What a notice fills into a template."""
    link = render.console_link(notice)
    text = render.summary(notice, MAX_TEXT_CHARS - len(link) - 1) + f" {link}" if link else ""
    return {
        "text": text or render.summary(notice, MAX_TEXT_CHARS),
        "link": link,
        "title": notice.title,
        "message": notice.message,
        "rule": notice.rule,
        "severity": notice.severity,
        "kind": notice.kind,
    }


def build(url: str, body_template: Any, token: str, phones: Sequence[str], notice: Notice) -> list[HttpRequest]:
    """The requests that tell every phone about ``notice``."""
    headers = {**JSON_HEADERS, **({"Authorization": f"Bearer {token}"} if token else {})}
    filled = values(notice)
    if "phone" in template.placeholders(body_template):
        bodies = [template.render(body_template, {**filled, "phone": phone}) for phone in phones]
    else:
        bodies = [template.render(body_template, filled, list(phones))]
    return [HttpRequest(url=url, body=json_body(body), headers=headers) for body in bodies]


class SmsGatewayChannel:
    """Posts each request of ``build``; the first refusal fails the notification."""

    name = NAME

    def __init__(self, url: str, body_template: Any, token: str, phones: Sequence[str], timeout: float) -> None:
        self._args = (url, body_template, token, tuple(phones))
        self._timeout = timeout
        self._session = requests.Session()

    def send(self, notice: Notice) -> str:
        """Send to every recipient."""
        requests_ = build(*self._args, notice)
        for request in requests_:
            check_status(NAME, post(self._session, NAME, request, self._timeout))
        return f"sent to {len(self._args[3])} phone(s) in {len(requests_)} request(s)"

    def close(self) -> None:
        """Close the HTTP session."""
        self._session.close()
