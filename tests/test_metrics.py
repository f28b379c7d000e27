"""/metrics: Prometheus text built from the database, the same on every worker."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway import create_app
from payments.backoff import RetryPolicy
from payments.callbacks import process_callback, store_callback
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
