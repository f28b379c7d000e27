"""/metrics: Prometheus text built from the database, the same on every worker."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway import create_app
from payments.inbound.callbacks import process_callback, store_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.settings import load_settings
from payments.providers import build_providers
from tests.support import TcpProxy, create_payment, make_settings, sandbox_event, signed


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_it_counts_callbacks_and_payments_by_status(engine, settings):
    providers = build_providers(settings)
    paid = create_payment(engine)
    create_payment(engine)
    body, headers = signed(sandbox_event(paid))
    applied = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
    store_callback(engine, provider="sandbox", body=b"{}", headers={}, remote_addr=None)
    process_callback(engine, providers, applied, RetryPolicy())

    response = create_app(settings, engine=engine).test_client().get("/metrics")

    assert response.status_code == 200
    got = samples(response.get_data(as_text=True))
    assert got[("paysync_database_up", ())] == 1
    assert got[("paysync_callbacks", (("status", "processed"),))] == 1
    assert got[("paysync_callbacks", (("status", "pending"),))] == 1
    assert got[("paysync_callback_oldest_waiting_seconds", ())] >= 0
    assert got[("paysync_payments", (("status", "Succeeded"),))] == 1
    assert got[("paysync_payments", (("status", "Pending"),))] == 1
    assert got[("paysync_outbox_pending", (("event_type", "PaymentSucceeded"),))] == 1
    assert got[("paysync_broker_connected", (("state", "disabled"),))] == 1


def test_it_still_answers_when_the_database_is_down(mariadb):
    url = mariadb.url
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 3306)
    try:
        settings = make_settings(database_url=url.set(port=proxy.port).render_as_string(hide_password=False))
        client = create_app(settings).test_client()
        assert samples(client.get("/metrics").get_data(as_text=True))[("paysync_database_up", ())] == 1
        proxy.cut()
        response = client.get("/metrics")
        assert response.status_code == 200
        assert samples(response.get_data(as_text=True))[("paysync_database_up", ())] == 0
    finally:
        proxy.close()


OUTSIDE = {"REMOTE_ADDR": "203.0.113.7"}


def test_only_allowed_sources_or_the_ops_token_may_scrape(engine, settings):
    client = create_app(settings, engine=engine).test_client()
    ops = settings.ops_token[0]
    assert client.get("/metrics").status_code == 200  # loopback is allowed by default
    refused = client.get("/metrics", environ_base=OUTSIDE)
    assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "forbidden"
    # A header anyone can write is not believed; a wrong token or the merchant's token is not the ops token.
    assert client.get("/metrics", environ_base=OUTSIDE, headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 403
    for token in ("nope", settings.merchant_api_token[0]):
        headers = {"Authorization": f"Bearer {token}"}
        assert client.get("/metrics", environ_base=OUTSIDE, headers=headers).status_code == 403
    headers = {"Authorization": f"Bearer {ops}"}
    assert client.get("/metrics", environ_base=OUTSIDE, headers=headers).status_code == 200


def test_with_no_allowed_sources_even_loopback_needs_the_token(engine, settings):
    client = create_app(replace(settings, metrics_allow_cidrs=()), engine=engine).test_client()
    assert client.get("/metrics").status_code == 403
    headers = {"Authorization": f"Bearer {settings.ops_token[0]}"}
    assert client.get("/metrics", headers=headers).status_code == 200


def test_settled_counts_are_cached_and_what_can_pile_up_is_not(engine, settings):
    providers = build_providers(settings)
    client = create_app(replace(settings, metrics_settled_cache_seconds=3600), engine=engine).test_client()

    def callbacks() -> dict[str, float]:
        got = samples(client.get("/metrics").get_data(as_text=True))
        return {labels[0][1]: v for (name, labels), v in got.items() if name == "paysync_callbacks"}

    assert callbacks()["processed"] == 0
    body, headers = signed(sandbox_event(create_payment(engine)))
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
    assert callbacks()["pending"] == 1  # read on every scrape
    process_callback(engine, providers, log_id, RetryPolicy())
    after = callbacks()
    assert after["pending"] == 0 and after["processed"] == 0  # the settled count is the cached one
    fresh = create_app(replace(settings, metrics_settled_cache_seconds=0), engine=engine).test_client()
    got = samples(fresh.get("/metrics").get_data(as_text=True))
    assert got[("paysync_callbacks", (("status", "processed"),))] == 1


@pytest.mark.parametrize("peer", ["10.1.2.3", "172.16.0.9", "192.168.1.20", "fd00::7"])
def test_by_default_only_loopback_scrapes_without_a_token_not_every_private_network(engine, peer):
    settings = load_settings(
        {"PAYSYNC_ENV": "development", "DATABASE_URL": engine.url.render_as_string(hide_password=False)}
    )
    client = create_app(settings, engine=engine).test_client()
    assert client.get("/metrics", environ_base={"REMOTE_ADDR": "127.0.0.1"}).status_code == 200
    assert client.get("/metrics", environ_base={"REMOTE_ADDR": "::1"}).status_code == 200
    assert client.get("/metrics", environ_base={"REMOTE_ADDR": peer}).status_code == 403


PROXY = {"REMOTE_ADDR": "10.0.0.2"}


def test_behind_a_trusted_proxy_the_forwarded_client_is_checked_not_the_proxy(engine, settings):
    settings = replace(settings, trusted_proxies=("10.0.0.0/24",), metrics_allow_cidrs=("192.0.2.0/24", "10.0.0.0/8"))
    client = create_app(settings, engine=engine).test_client()
    via_proxy = {"environ_base": PROXY}
    # The proxy's own address is allowed, but it speaks for an outside client: refused.
    assert client.get("/metrics", headers={"X-Forwarded-For": "203.0.113.7"}, **via_proxy).status_code == 403
    # The Prometheus host behind the proxy is allowed.
    assert client.get("/metrics", headers={"X-Forwarded-For": "192.0.2.5"}, **via_proxy).status_code == 200
    # A client that writes its own header before the proxy's is judged by the hop the proxy saw.
    spoofed = {"X-Forwarded-For": "192.0.2.5, 203.0.113.7"}
    assert client.get("/metrics", headers=spoofed, **via_proxy).status_code == 403
    # A peer that is not a trusted proxy is the client, whatever it forwards.
    outside = {"REMOTE_ADDR": "203.0.113.8"}
    assert client.get("/metrics", headers={"X-Forwarded-For": "192.0.2.5"}, environ_base=outside).status_code == 403


METRICS_TOKEN = "mtr_Zt4pK8wQm2xR7vLn9cBs3hJd6fGy"


def test_a_metrics_token_scrapes_and_does_nothing_else(engine, settings):
    settings = replace(settings, metrics_token=(METRICS_TOKEN,), metrics_allow_cidrs=())
    client = create_app(settings, engine=engine).test_client()
    bearer = {"Authorization": f"Bearer {METRICS_TOKEN}"}
    assert client.get("/metrics", environ_base=OUTSIDE).status_code == 403
    assert client.get("/metrics", environ_base=OUTSIDE, headers=bearer).status_code == 200
    # Not an ops login, not the merchant API.
    page = client.get("/ops/login")
    csrf = page.get_data(as_text=True).split('name="csrf" value="', 1)[1].split('"', 1)[0]
    login = client.post("/ops/login", data={"csrf": csrf, "name": "prometheus", "token": METRICS_TOKEN})
    assert login.status_code != 302 and client.get("/ops/").status_code == 302
    assert client.get("/payments/pay_nope", headers=bearer).status_code == 401


def test_the_metrics_token_is_read_from_the_environment():
    assert load_settings({"METRICS_TOKEN": f"{METRICS_TOKEN}, mtr_old"}).metrics_token == (METRICS_TOKEN, "mtr_old")
