"""The HTTP side shared by the webhook-style channels: a request as data, one POST, the answer as data.

A channel module provides two pure functions, ``build(notice) -> HttpRequest``
and ``check(answer)`` (raises NotificationFailed when the service says no);
``HttpChannel`` joins them with the one network call. Redirects are not
followed (a webhook that moved must be reconfigured, not chased), and error
texts name the exception type only: the URL may hold the robot's token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

from payments.errors import NotificationFailed
from payments.escalation.notify import Notice
from payments.infra.logs import scrub

USER_AGENT = "paysync-alerts/1"
MAX_ANSWER_BYTES = 64 * 1024
"""Enough of an answer to read a JSON error code (what is kept of it)."""


@dataclass(frozen=True)
class HttpRequest:
    """Everything one channel call sends."""

    url: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)
    method: str = "POST"


@dataclass(frozen=True)
class HttpAnswer:
    """What came back."""

    status: int
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        """The body as JSON, or None if it is not JSON."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def json_body(payload: Any) -> bytes:
    """Compact UTF-8 JSON, non-ASCII kept as is (the services count bytes, and Chinese reads better)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


JSON_HEADERS = {"Content-Type": "application/json; charset=utf-8"}


def retry_after(answer: HttpAnswer) -> float | None:
    """The delta-seconds form of Retry-After, if present."""
    value = {k.lower(): v for k, v in answer.headers.items()}.get("retry-after", "").strip()
    return float(value) if value.isdigit() else None


def service_text(value: object, limit: int = 200) -> str:
    """A service's own error text, scrubbed and cut, fit for a log line and the last_error column."""
    return scrub(" ".join(str(value).split()))[:limit]


def check_status(name: str, answer: HttpAnswer) -> None:
    """The plain HTTP reading: 2xx is fine; 408, 429 and 5xx are worth retrying; other answers are permanent.

    A 4xx other than 408/429 says the request itself is wrong (bad token, gone
    webhook, malformed body): retrying sends the same wrong request.
    """
    if 200 <= answer.status < 300:
        return
    transient = answer.status in (408, 429) or answer.status >= 500
    raise NotificationFailed(
        f"{name} answered HTTP {answer.status}: {service_text(answer.body.decode('utf-8', 'replace'), 120)}",
        permanent=not transient,
        retry_after=retry_after(answer),
    )


def post(session: requests.Session, name: str, request: HttpRequest, timeout: float) -> HttpAnswer:
    """Send one request; network trouble becomes a transient NotificationFailed naming only the exception type."""
    headers = {"User-Agent": USER_AGENT, **request.headers}
    try:
        response = session.request(
            request.method, request.url, data=request.body, headers=headers, timeout=timeout, allow_redirects=False
        )
        body = response.content[:MAX_ANSWER_BYTES]
    except requests.RequestException as exc:
        raise NotificationFailed(f"{name}: {type(exc).__name__}") from None
    return HttpAnswer(status=response.status_code, body=body, headers=dict(response.headers))


class HttpChannel:
    """A channel that is one HTTP request per notice: ``build`` and ``check`` are the channel's pure functions."""

    def __init__(
        self,
        name: str,
        build: Callable[[Notice], HttpRequest],
        check: Callable[[HttpAnswer], str],
        timeout: float,
    ) -> None:
        self.name = name
        self._build = build
        self._check = check
        self._timeout = timeout
        self._session = requests.Session()

    def send(self, notice: Notice) -> str:
        """Build, POST, check; return the check's description of success."""
        return self._check(post(self._session, self.name, self._build(notice), self._timeout))

    def close(self) -> None:
        """Close the HTTP session."""
        self._session.close()
