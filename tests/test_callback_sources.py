"""Every provider route goes through the source check; refused deliveries are kept small and counted."""

from __future__ import annotations

from dataclasses import fields

import pytest
from sqlalchemy import select

from gateway import create_app
from payments.infra.schema import payment_callback_log
from payments.infra.settings import PROVIDERS, Settings
from payments.states import CallbackStatus
from tests.support import create_payment, make_settings, sandbox_event, signed

ALLOWED_NET = ("203.0.113.0/24",)
INSIDE = {"REMOTE_ADDR": "203.0.113.9"}
OUTSIDE = {"REMOTE_ADDR": "198.51.100.7"}


def rows(engine):  # noqa: ANN001, ANN201
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)).all()


def test_every_provider_names_a_source_setting_that_exists():
    from payments.infra.settings import source_cidrs

    names = {f.name for f in fields(Settings)}
    for provider, spec in PROVIDERS.items():
        assert spec.sources in names, provider
        assert source_cidrs(make_settings(**{spec.sources: ALLOWED_NET}), provider) == ALLOWED_NET


@pytest.mark.parametrize("route", ["sandbox", "sandbox_legacy"])
def test_the_sandbox_allow_list_holds_on_every_sandbox_route(engine, route):
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        sandbox_legacy_enabled=True,
        sandbox_source_cidrs=ALLOWED_NET,
    )
    client = create_app(settings, engine=engine).test_client()
    payment_id = create_payment(engine, provider=route)
    body, headers = signed(sandbox_event(payment_id))

    refused = client.post(f"/callbacks/{route}", data=body, headers=headers, environ_base=OUTSIDE)
    assert refused.status_code == 403 and "source_not_allowed" in refused.get_data(as_text=True)
    assert "SANDBOX_SOURCE_CIDRS" in refused.get_data(as_text=True)
    stored = rows(engine)[-1]
    assert (stored.provider, stored.status, stored.remote_addr) == (route, CallbackStatus.REJECTED, "198.51.100.7")

    accepted = client.post(f"/callbacks/{route}", data=body, headers=headers, environ_base=INSIDE)
    assert accepted.status_code == 200
    assert rows(engine)[-1].status != CallbackStatus.REJECTED


# --- item 14: refused deliveries kept small, per-source rate limits, counted and alerted --------------------

BIG = 200 * 1024


def sourced_app(engine, **overrides):  # noqa: ANN001, ANN003, ANN201
    overrides.setdefault("sandbox_source_cidrs", ALLOWED_NET)
    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False), **overrides)
    return create_app(settings, engine=engine).test_client()


def refused_count(reason: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value("paysync_callbacks_refused_total", {"provider": "sandbox", "reason": reason})
    return value or 0.0


def test_a_delivery_refused_for_its_source_keeps_its_headers_and_first_bytes_only(engine):
    client = sourced_app(engine)
    body, headers = signed(sandbox_event(create_payment(engine), padding="x" * BIG))
    before = refused_count("source_not_allowed")
    answer = client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=OUTSIDE)
    assert answer.status_code == 403
    (stored,) = rows(engine)
    assert stored.status == CallbackStatus.REJECTED and stored.remote_addr == "198.51.100.7"
    assert bytes(stored.callback_data) == body[:4096]
    assert "Sandbox-Signature" in stored.headers
    assert stored.result.startswith("rejected: source_not_allowed") and "first 4096 bytes" in stored.result
    assert refused_count("source_not_allowed") == before + 1
    # The same delivery from an allowed network is stored whole.
    assert client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=INSIDE).status_code == 200
    assert bytes(rows(engine)[-1].callback_data) == body


def test_past_its_burst_a_refused_source_gets_429_and_nothing_more_is_stored(engine):
    client = sourced_app(engine, refused_source_rate=0.001, refused_source_burst=3)
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id))
    before = refused_count("rate_limited")
    answers = [client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=OUTSIDE) for _ in range(10)]
    assert [a.status_code for a in answers] == [403] * 3 + [429] * 7
    assert int(answers[-1].headers["Retry-After"]) >= 1
    assert answers[-1].get_json()["error"]["code"] == "rate_limited"
    assert len(rows(engine)) == 3
    assert refused_count("rate_limited") == before + 7
    # Meanwhile a verified callback from the allowed network is accepted.
    assert client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=INSIDE).status_code == 200
    assert rows(engine)[-1].status != CallbackStatus.REJECTED


def test_every_source_is_rate_limited_on_the_callback_routes_and_others_are_not_held_back(engine):
    client = sourced_app(engine, sandbox_source_cidrs=(), callback_source_rate=0.001, callback_source_burst=4)
    body, headers = signed(sandbox_event(create_payment(engine)))
    first = {"REMOTE_ADDR": "2001:db8:1:2::7"}
    same_64 = {"REMOTE_ADDR": "2001:db8:1:2::8"}  # one host's /64: one bucket
    other = {"REMOTE_ADDR": "2001:db8:1:3::7"}
    statuses = [client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=first).status_code]
    statuses += [
        client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=same_64).status_code
        for _ in range(4)
    ]
    assert statuses == [200] * 4 + [429]
    assert len(rows(engine)) == 4
    assert client.post("/callbacks/sandbox", data=body, headers=headers, environ_base=other).status_code == 200


def test_refused_deliveries_raise_their_own_alert_and_not_the_signature_one(engine):
    from datetime import timedelta

    from compensator import evaluate_alerts
    from payments.inbound.callbacks import store_callback
    from payments.infra.db import utcnow
    from payments.infra.schema import alert
    from payments.runtime import build_runtime

    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False))
    runtime = build_runtime(settings, engine=engine)
    now = utcnow()
    for n in range(51):
        store_callback(
            engine,
            provider="sandbox",
            body=b"{}",
            headers={},
            remote_addr=f"198.51.100.{n % 3}",
            now=now - timedelta(seconds=n),
            rejected="source_not_allowed: source 198.51.100.1 is outside SANDBOX_SOURCE_CIDRS",
        )
    store_callback(engine, provider="sandbox", body=b"{}", headers={}, remote_addr=None, now=now)  # keep rate sane
    evaluate_alerts.run_once(runtime, now=now)
    with engine.connect() as conn:
        found = {r.dedupe_key: r for r in conn.execute(select(alert))}
    assert set(found) >= {"refused_sources:sandbox"} and "signature_failures:sandbox" not in found
    assert "51 deliveries to /callbacks/sandbox from 3 source(s)" in found["refused_sources:sandbox"].message
