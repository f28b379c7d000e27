"""Every provider route goes through the source check; refused deliveries are kept small and counted."""

from __future__ import annotations

from dataclasses import fields

import pytest
from sqlalchemy import select

from gateway import create_app
from payments.schema import payment_callback_log
from payments.settings import PROVIDERS, Settings
from payments.states import CallbackStatus
from tests.support import create_payment, make_settings, sandbox_event, signed

ALLOWED_NET = ("203.0.113.0/24",)
INSIDE = {"REMOTE_ADDR": "203.0.113.9"}
OUTSIDE = {"REMOTE_ADDR": "198.51.100.7"}


def rows(engine):  # noqa: ANN001, ANN201
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)).all()


def test_every_provider_names_a_source_setting_that_exists():
    from payments.settings import source_cidrs

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
