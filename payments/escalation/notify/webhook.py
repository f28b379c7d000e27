"""A generic JSON webhook, signed in the Standard Webhooks format (payments/infra/webhook_signing.py).

Body: ``{"type": "alert.firing|alert.repeat|alert.resolved|alert.test",
"timestamp": ISO-8601, "data": {…}}`` (the spec's recommended envelope), with
``webhook-id`` stable across retries (``alert_<id>_<kind>_<n>``: receivers
dedupe on it), ``webhook-timestamp`` of the attempt and ``webhook-signature``
``v1,<base64 HMAC-SHA256>`` by the first secret of ALERT_WEBHOOK_SECRET.

2xx is delivered; 410 Gone means the receiver never wants it (permanent);
other answers and network errors are retried, honouring Retry-After.
"""

from __future__ import annotations

from datetime import UTC, datetime

from payments.errors import NotificationFailed
from payments.escalation.notify import Notice
from payments.escalation.notify.http import JSON_HEADERS, HttpAnswer, HttpRequest, json_body, retry_after
from payments.infra import webhook_signing

NAME = "webhook"


def _iso(value: datetime | None) -> str | None:
    return value.isoformat(timespec="milliseconds") + "Z" if value else None


def payload(notice: Notice, now: datetime | None = None) -> dict:
    """The event for ``notice``."""
    at = now or datetime.now(UTC).replace(tzinfo=None)
    return {
        "type": f"alert.{notice.kind}",
        "timestamp": _iso(at),
        "data": {
            "alert_id": notice.alert_id,
            "rule": notice.rule,
            "key": notice.key,
            "severity": notice.severity,
            "title": notice.title,
            "message": notice.message,
            "details": dict(notice.details),
            "first_seen_at": _iso(notice.first_seen_at),
            "fired_at": _iso(notice.fired_at),
            "resolved_at": _iso(notice.resolved_at),
            "repeat": notice.repeat,
            "links": dict(notice.links),
            "related": [
                {"alert_id": m.alert_id, "rule": m.rule, "severity": m.severity, "key": m.key, "message": m.message}
                for m in notice.members
            ],
        },
    }


def build(url: str, secret: str, notice: Notice, timestamp: int | None = None) -> HttpRequest:
    """The signed request for ``notice``."""
    body = json_body(payload(notice))
    headers = {**JSON_HEADERS, **webhook_signing.headers(secret, notice.message_id, body, timestamp)}
    return HttpRequest(url=url, body=body, headers=headers)


def check(answer: HttpAnswer) -> str:
    """Raise NotificationFailed unless the receiver answered 2xx."""
    if 200 <= answer.status < 300:
        return f"receiver answered HTTP {answer.status}"
    raise NotificationFailed(
        f"{NAME} answered HTTP {answer.status}", permanent=answer.status == 410, retry_after=retry_after(answer)
    )
