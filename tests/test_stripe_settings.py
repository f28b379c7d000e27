"""STRIPE_* settings: parsing, what enables the provider, the production check; POST /payments with a PaymentMethod."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
from sqlalchemy import select

from gateway import create_app
from payments.errors import ConfigError
from payments.infra.schema import payment
from payments.infra.settings import load_settings, validate_stripe
from payments.outbound.charges import CreatePayment
from payments.providers import build_providers
from payments.providers.base import Dedupe
from payments.providers.stripe.adapter import StripeProvider
from tests.stripe_support import API_KEY, NEW_SECRET, OLD_SECRET, stripe_settings
from tests.support import make_settings

ENV = {"STRIPE_API_KEY": API_KEY, "STRIPE_WEBHOOK_SECRETS": f" {OLD_SECRET} , {NEW_SECRET} "}


def test_the_stripe_settings_are_read_with_every_listed_secret():
    settings = load_settings(
        {**ENV, "STRIPE_API_BASE": "http://127.0.0.1:8300/", "STRIPE_SOURCE_CIDRS": "3.18.12.63, 2001:db8::/32"}
    )
    assert settings.stripe_api_key == API_KEY
    assert settings.stripe_webhook_secrets == (OLD_SECRET, NEW_SECRET)
    assert settings.stripe_api_base == "http://127.0.0.1:8300"
    assert settings.stripe_source_cidrs == ("3.18.12.63/32", "2001:db8::/32")
    assert load_settings({}).stripe_api_base == "https://api.stripe.com"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STRIPE_API_KEY": "pk_test_" + "a" * 24}, "STRIPE_API_KEY must be a Stripe secret key"),
        ({"STRIPE_API_KEY": "sk_test_short"}, "STRIPE_API_KEY must be a Stripe secret key"),
        ({"STRIPE_WEBHOOK_SECRETS": "whsec_short"}, "STRIPE_WEBHOOK_SECRETS: entry 1"),
        ({"STRIPE_WEBHOOK_SECRETS": f"{OLD_SECRET},not-a-secret"}, "entry 2"),
        ({"STRIPE_WEBHOOK_SECRETS": f"{OLD_SECRET},{OLD_SECRET}"}, "repeats"),
        ({"STRIPE_API_BASE": "ftp://api.stripe.com"}, "STRIPE_API_BASE"),
        ({"STRIPE_SOURCE_CIDRS": "3.18.12.0/33"}, "STRIPE_SOURCE_CIDRS"),
        ({"STRIPE_API_KEY": API_KEY}, "STRIPE_WEBHOOK_SECRETS is required: provider stripe is partly configured"),
        ({"STRIPE_WEBHOOK_SECRETS": OLD_SECRET}, "STRIPE_API_KEY is required: provider stripe is partly configured"),
    ],
)
def test_a_bad_or_half_stripe_configuration_stops_the_process_naming_the_variable_never_the_secret(env, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_settings({**ENV, **env} if "partly" not in message else env)
    for value in env.values():
        if value.startswith(("sk_", "whsec_")) and len(value) > 20:
            assert value not in str(info.value)


def test_the_provider_is_registered_only_when_configured():
    assert "stripe" not in build_providers(make_settings())
    provider = build_providers(stripe_settings())["stripe"]
    assert isinstance(provider, StripeProvider)
    assert (provider.capabilities.dedupe, provider.key_lifetime_seconds) == (Dedupe.KEY, 86400)
    assert provider.capabilities.may_resend and provider.capabilities.query_by_merchant_id


def test_production_refuses_a_test_mode_key_and_a_plain_http_api_base():
    validate_stripe(stripe_settings(), production=False)
    with pytest.raises(ConfigError, match="STRIPE_API_KEY is a test-mode key"):
        validate_stripe(stripe_settings(), production=True)
    live = replace(stripe_settings(), stripe_api_key="sk_live_" + "a" * 24)
    with pytest.raises(ConfigError, match="STRIPE_API_BASE must be https"):
        validate_stripe(live, production=True)
    validate_stripe(replace(live, stripe_api_base="https://api.stripe.com"), production=True)
    validate_stripe(make_settings(), production=True)  # not enabled: nothing to check


def test_an_unconfigured_stripe_has_no_callback_route_and_post_payments_refuses_it(mariadb):
    settings = make_settings(database_url=mariadb.url.render_as_string(hide_password=False), merchant_api_token=("t",))
    client = create_app(settings, engine=mariadb).test_client()
    assert client.post("/callbacks/stripe", data=b"{}").status_code == 404
    answer = client.post(
        "/payments",
        json={"order_no": "o-1", "amount": 100, "currency": "USD", "provider": "stripe"},
        headers={"Authorization": "Bearer t", "Idempotency-Key": "k-1"},
    )
    assert answer.status_code == 400 and answer.get_json()["error"]["code"] == "unknown_provider"


def test_post_payments_stores_the_payment_method_the_provider_is_to_charge(mariadb):
    settings = stripe_settings(
        database_url=mariadb.url.render_as_string(hide_password=False), merchant_api_token=("t",)
    )
    client = create_app(settings, engine=mariadb).test_client()
    headers = {"Authorization": "Bearer t", "Idempotency-Key": "k-pm"}
    data = {"order_no": "o-1", "amount": 500, "currency": "JPY", "provider": "stripe", "payment_method": "pm_card_visa"}
    answer = client.post("/payments", json=data, headers=headers)
    assert answer.status_code == 201
    payment_id = answer.get_json()["payment_id"]
    with mariadb.connect() as conn:
        assert (
            conn.execute(select(payment.c.payment_method).where(payment.c.payment_id == payment_id)).scalar()
            == "pm_card_visa"
        )
    assert client.get(f"/payments/{payment_id}", headers=headers).get_json()["payment_method"] == "pm_card_visa"
    bad = client.post(
        "/payments", json={**data, "payment_method": "pm card"}, headers={**headers, "Idempotency-Key": "k-2"}
    )
    assert bad.status_code == 400 and "payment_method" in bad.get_json()["error"]["message"]


def test_a_request_without_a_payment_method_keeps_the_digest_it_always_had():
    request = CreatePayment("order-1", 1999, "CNY", "sandbox", "tea")
    canonical = {"order_no": "order-1", "amount": 1999, "currency": "CNY", "provider": "sandbox", "description": "tea"}
    expected = hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert request.digest() == expected
    assert CreatePayment("order-1", 1999, "CNY", "sandbox", "tea", "pm_1").digest() != expected
