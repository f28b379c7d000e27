"""POSTing one domain event to the merchant's webhook URL, signed in the Standard Webhooks format.

2xx is delivered. Anything else fails the attempt and is retried with backoff
by the caller: other statuses, timeouts, connection errors, and redirects
(not followed: the spec asks senders to have the URL fixed instead). ``410
Gone`` is the receiver saying it never wants this, so the event gives up at
once. A ``Retry-After`` in seconds (429, 503) is passed on so the next attempt
waits at least that long. Error texts name the exception type only: a merchant
URL may carry a token in its query string.
"""

from __future__ import annotations

import requests

from payments.infra import webhook_signing
from payments.lifecycle.events import WEBHOOK, Attempt

USER_AGENT = "paysync-webhooks/1"


def post_event(session: requests.Session, url: str, secret: str, event_id: str, body: bytes, timeout: float) -> Attempt:
    """Send one event; return what happened as an ``Attempt`` (never raises for HTTP or network trouble)."""
    headers = webhook_signing.headers(secret, event_id, body)
    headers.update({"Content-Type": "application/json", "User-Agent": USER_AGENT})
    try:
        response = session.post(url, data=body, headers=headers, timeout=timeout, allow_redirects=False)
    except requests.RequestException as exc:
        return Attempt(WEBHOOK, ok=False, error=f"webhook {type(exc).__name__}")
    status = response.status_code
    if 200 <= status < 300:
        return Attempt(WEBHOOK, ok=True, http_status=status)
    return Attempt(
        WEBHOOK,
        ok=False,
        error=f"webhook answered HTTP {status}",
        http_status=status,
        permanent=status == 410,
        retry_after=_retry_after(response.headers.get("Retry-After")),
    )


def _retry_after(value: str | None) -> float | None:
    # Only the delta-seconds form; an HTTP date is rare from an order service and the backoff still applies.
    if value and value.strip().isdigit():
        return float(value.strip())
    return None
