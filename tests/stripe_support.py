"""Stripe test kit: keys, the fake platform on a real socket, events as Stripe sends them.

Notifications are signed with the fake platform's own signing code
(``sandbox.fakes.stripe.signature_header``), written independently of the
adapter's, so one misreading of Stripe's scheme would have to be made twice.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import uuid
from dataclasses import replace
from datetime import timedelta
from typing import Any

from werkzeug.serving import WSGIRequestHandler, make_server

from payments.infra.db import utcnow
from payments.infra.settings import Settings
from payments.providers.base import ChargeRequest
from sandbox.fakes import stripe as fake
from tests.support import make_settings

API_KEY = "sk_test_" + secrets.token_hex(16)
OLD_SECRET = "whsec_" + secrets.token_urlsafe(24).replace("-", "A").replace("_", "B")
NEW_SECRET = "whsec_" + secrets.token_urlsafe(24).replace("-", "C").replace("_", "D")
STRANGER_SECRET = "whsec_" + secrets.token_urlsafe(24).replace("-", "E").replace("_", "F")


def stripe_settings(
    api_base: str = "http://127.0.0.1:9", secrets_: tuple[str, ...] = (OLD_SECRET,), **overrides: Any
) -> Settings:
    """Settings with Stripe configured (the sandbox stays as it is)."""
    return replace(
        make_settings(**overrides), stripe_api_key=API_KEY, stripe_webhook_secrets=secrets_, stripe_api_base=api_base
    )


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class Served:
    """A WSGI app on a free port in a thread of this process (the fake platform, or a gateway)."""

    def __init__(self, app: Any) -> None:
        self.server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_Quiet)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()


class FakeServer(Served):
    """The fake Stripe platform served over HTTP, its webhook sender running."""

    def __init__(self, platform: fake.FakeStripe) -> None:
        super().__init__(platform.app())
        self.platform = platform
        platform.start()

    def close(self) -> None:
        """Stop the webhook sender, then the server."""
        self.platform.stop()
        super().close()


def new_fake(**config: Any) -> fake.FakeStripe:
    """A fake account for API_KEY, signing with OLD_SECRET unless told otherwise; no webhooks unless a URL is given."""
    config.setdefault("webhook_secrets", [OLD_SECRET])
    config.setdefault("webhook_backoff_seconds", 0.01)
    return fake.FakeStripe(fake.FakeConfig(api_key=API_KEY, **config))


def payment_intent(
    payment_id: str | None,
    *,
    amount: int = 1000,
    currency: str = "usd",
    status: str = "succeeded",
    pi_id: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A PaymentIntent object in Stripe's layout (as a webhook's data.object carries it)."""
    pi_id = pi_id or f"pi_{uuid.uuid4().hex[:24]}"
    obj = {
        "id": pi_id,
        "object": "payment_intent",
        "amount": amount,
        "amount_received": amount if status == "succeeded" else 0,
        "capture_method": "automatic",
        "client_secret": f"{pi_id}_secret_{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "currency": currency,
        "last_payment_error": None,
        "latest_charge": f"ch_{uuid.uuid4().hex[:24]}",
        "livemode": False,
        "metadata": {"payment_id": payment_id} if payment_id else {},
        "status": status,
    }
    obj.update(extra)
    return obj


def refund_object(
    refund_id: str | None,
    payment_id: str | None = None,
    *,
    amount: int = 300,
    currency: str = "usd",
    status: str = "succeeded",
    **extra: Any,
) -> dict[str, Any]:
    """A Refund object in Stripe's layout."""
    metadata = {}
    if refund_id:
        metadata["refund_id"] = refund_id
    if payment_id:
        metadata["payment_id"] = payment_id
    obj = {
        "id": f"re_{uuid.uuid4().hex[:24]}",
        "object": "refund",
        "amount": amount,
        "charge": f"ch_{uuid.uuid4().hex[:24]}",
        "created": int(time.time()),
        "currency": currency,
        "failure_reason": None,
        "metadata": metadata,
        "payment_intent": f"pi_{uuid.uuid4().hex[:24]}",
        "status": status,
    }
    obj.update(extra)
    return obj


def event(event_type: str, obj: dict[str, Any], *, event_id: str | None = None) -> dict[str, Any]:
    """An Event in Stripe's layout."""
    return {
        "id": event_id or f"evt_{uuid.uuid4().hex[:24]}",
        "object": "event",
        "api_version": fake.ACCOUNT_VERSION,
        "created": int(time.time()),
        "data": {"object": obj},
        "livemode": False,
        "pending_webhooks": 1,
        "request": {"id": f"req_{uuid.uuid4().hex[:14]}", "idempotency_key": None},
        "type": event_type,
    }


def signed(
    evt: dict[str, Any] | bytes, secrets_: tuple[str, ...] = (OLD_SECRET,), timestamp: float | None = None
) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a webhook delivery as Stripe sends it, signed with each of ``secrets_``."""
    body = evt if isinstance(evt, bytes) else json.dumps(evt, indent=2).encode()
    t = int(time.time() if timestamp is None else timestamp)
    return body, {
        "Stripe-Signature": fake.signature_header(list(secrets_), body, t),
        "Content-Type": "application/json; charset=utf-8",
        "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
    }


def charge_request(
    payment_id: str = "pay_1",
    amount: int = 1000,
    currency: str = "USD",
    pm: str | None = "pm_card_visa",
    age: float = 0.0,
    sent_ago: float | None = 0.0,
    provider_transaction_id: str | None = None,
) -> ChargeRequest:
    """What the relay sends for a payment created ``age`` seconds ago, paid with PaymentMethod ``pm``.

    ``sent_ago``: how long ago its previous charge call started (None: never sent).
    """
    return ChargeRequest(
        payment_id,
        amount,
        currency,
        created_at=utcnow() - timedelta(seconds=age),
        payment_method=pm,
        provider_transaction_id=provider_transaction_id,
        sent_before=None if sent_ago is None else utcnow() - timedelta(seconds=sent_ago),
    )
