"""Rotating secrets without losing a delivery: lists of keys, backlogs under the old key, reverify after a fix."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import select

from compensator import reverify
from gateway import create_app
from payments.errors import ConfigError
from payments.inbound.callbacks import CallbackResult, process_callback, reject_callback, store_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import payment_callback_log
from payments.infra.settings import load_settings
from payments.providers import build_providers
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import Stack, db_url, payment_status
from tests.support import create_payment, make_settings, sandbox_event, signed

OLD = "whsec_rotation_old_" + "o" * 16
NEW = "whsec_rotation_new_" + "n" * 16
WRONG = "whsec_rotation_typo_" + "t" * 16


def _settings(engine, *secrets: str, **more):  # noqa: ANN001, ANN202
    return make_settings(database_url=db_url(engine), sandbox_webhook_secret=secrets, **more)


def _row(engine, log_id: int):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == log_id)).one()


def test_every_listed_key_is_accepted_and_an_unlisted_one_is_not(engine):
    client = create_app(_settings(engine, NEW, OLD), engine=engine).test_client()
    payment_id = create_payment(engine)
    for secret, expected in ((NEW, 200), (OLD, 200), (WRONG, 401)):
        body, headers = signed(sandbox_event(payment_id), secret=secret)
        assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == expected, secret


def test_every_listed_merchant_token_is_accepted(engine):
    settings = _settings(engine, NEW, merchant_api_token=("tok_new_" + "n" * 20, "tok_old_" + "o" * 20))
    client = create_app(settings, engine=engine).test_client()
    for token, expected in (("tok_new_" + "n" * 20, 404), ("tok_old_" + "o" * 20, 404), ("tok_" + "x" * 24, 401)):
        answer = client.get("/payments/pay_none", headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == expected, token


def test_the_comma_separated_settings_become_lists_and_refuse_empty_entries():
    settings = load_settings(
        {"SANDBOX_WEBHOOK_SECRET": f" {NEW} , {OLD} ", "SANDBOX_API_KEY": "sk_new, sk_old", "OPS_TOKEN": "a" * 24}
    )
    assert settings.sandbox_webhook_secret == (NEW, OLD)
    assert settings.sandbox_api_key == ("sk_new", "sk_old")
    assert settings.ops_token == ("a" * 24,)
    with pytest.raises(ConfigError, match="MERCHANT_API_TOKEN"):
        load_settings({"MERCHANT_API_TOKEN": "a" * 24 + ",,"})


def test_a_backlog_stored_under_the_old_key_is_processed_after_the_new_key_comes_first(engine):
    payment_id = create_payment(engine)
    # Stored while the provider still signed with the old key, not processed yet (a consumer outage, say).
    body, headers = signed(sandbox_event(payment_id), secret=OLD)
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    # The rotation: the new key first, the old one still listed. Processing re-verifies the stored row.
    rotated = build_providers(_settings(engine, NEW, OLD))
    assert process_callback(engine, rotated, log_id, RetryPolicy()) == CallbackResult.APPLIED
    assert _row(engine, log_id).status == CallbackStatus.PROCESSED
    assert payment_status(engine, payment_id) == "Succeeded"


def test_a_backlog_row_is_rejected_once_its_key_is_no_longer_listed(engine):
    payment_id = create_payment(engine)
    body, headers = signed(sandbox_event(payment_id), secret=OLD)
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    assert (
        process_callback(engine, build_providers(_settings(engine, NEW)), log_id, RetryPolicy())
        == CallbackResult.REJECTED
    )


def test_reverify_takes_a_rejected_row_back_after_the_key_is_fixed(engine):
    payment_id = create_payment(engine)
    # The provider rotated to NEW; we listed a typo instead. The gateway stores and rejects the delivery.
    client = create_app(_settings(engine, WRONG), engine=engine).test_client()
    body, headers = signed(sandbox_event(payment_id), secret=NEW)
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 401
    forged_body, forged_headers = signed(sandbox_event(payment_id), secret="whsec_someone_else_" + "f" * 16)
    assert client.post("/callbacks/sandbox", data=forged_body, headers=forged_headers).status_code == 401
    genuine, forged = (r.id for r in _rows(engine))
    assert _row(engine, genuine).status == CallbackStatus.REJECTED

    # Reverifying against the wrong key again moves nothing.
    assert reverify.run(build_runtime(_settings(engine, WRONG), engine=engine), "sandbox").accepted == 0

    fixed = build_runtime(_settings(engine, NEW, WRONG), engine=engine)
    result = reverify.run(fixed, "sandbox")
    assert (result.checked, result.accepted) == (2, 1)
    row = _row(engine, genuine)
    assert row.status == CallbackStatus.PENDING
    assert row.result.startswith("reverified at ") and "was rejected: invalid_signature" in row.result
    assert _row(engine, forged).status == CallbackStatus.REJECTED  # still not genuine
    # Sent on: processed like any new delivery.
    assert process_callback(engine, fixed.providers, genuine, RetryPolicy()) == CallbackResult.APPLIED
    assert payment_status(engine, payment_id) == "Succeeded"
    assert reverify.run(fixed, "sandbox").accepted == 0  # safe to run again


def test_reverify_since_leaves_older_rows_alone_and_needs_an_enabled_provider(engine):
    payment_id = create_payment(engine)
    long_ago = utcnow() - timedelta(days=2)
    signed_at = int((long_ago - datetime(1970, 1, 1)).total_seconds())
    body, headers = signed(sandbox_event(payment_id), secret=NEW, timestamp=signed_at)
    old_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="x", now=long_ago)
    reject_callback(engine, old_id, "invalid_signature: no signature matches the body")
    runtime = build_runtime(_settings(engine, NEW), engine=engine)
    # Verified at the time it was received: its two-day-old signature was fresh then.
    assert reverify.run(runtime, "sandbox", since=utcnow() - timedelta(days=1)).checked == 0
    assert reverify.run(runtime, "sandbox", since=long_ago - timedelta(seconds=1)).accepted == 1
    with pytest.raises(ConfigError, match="not enabled"):
        reverify.run(runtime, "alipay")


def test_reverify_leaves_a_row_refused_for_its_source_refused(engine):
    payment_id = create_payment(engine)
    provider_net = ("10.0.0.0/8",)
    # The key was a typo, and the allow-list held: one genuine delivery from the provider's network, refused for
    # the key; one with the same good signature from elsewhere (a leaked key, say), refused for its source.
    guarded = create_app(_settings(engine, WRONG, sandbox_source_cidrs=provider_net), engine=engine).test_client()
    body, headers = signed(sandbox_event(payment_id), secret=NEW)

    def post(client, peer: str) -> int:  # noqa: ANN001
        return client.post(
            "/callbacks/sandbox", data=body, headers=headers, environ_base={"REMOTE_ADDR": peer}
        ).status_code

    assert post(guarded, "10.1.2.3") == 401
    assert post(guarded, "203.0.113.9") == 403
    # Before the allow-list existed, a delivery from elsewhere was refused for its key alone.
    assert post(create_app(_settings(engine, WRONG), engine=engine).test_client(), "203.0.113.9") == 401
    by_key, by_source, by_key_from_elsewhere = (r.id for r in _rows(engine))

    result = reverify.run(
        build_runtime(_settings(engine, NEW, sandbox_source_cidrs=provider_net), engine=engine), "sandbox"
    )
    assert _row(engine, by_key).status == CallbackStatus.PENDING
    assert _row(engine, by_source).status == CallbackStatus.REJECTED
    assert _row(engine, by_source).result.startswith("rejected: source_not_allowed")
    assert _row(engine, by_key_from_elsewhere).status == CallbackStatus.REJECTED  # outside today's allow-list
    assert (result.checked, result.accepted, result.source_refused) == (3, 1, 2)
    # Even with the allow-list gone, a row refused for its source is not taken back by its signature.
    assert reverify.run(build_runtime(_settings(engine, NEW), engine=engine), "sandbox").accepted == 1
    assert _row(engine, by_source).status == CallbackStatus.REJECTED
    assert _row(engine, by_key_from_elsewhere).status == CallbackStatus.PENDING


def _rows(engine):  # noqa: ANN001, ANN202
    with engine.connect() as conn:
        return list(conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)))


@pytest.mark.mariadb
@pytest.mark.slow
def test_the_reverify_command(mariadb, tmp_path):
    payment_id = create_payment(mariadb)
    body, headers = signed(sandbox_event(payment_id), secret=NEW)
    log_id = store_callback(mariadb, provider="sandbox", body=body, headers=headers, remote_addr="x")
    reject_callback(mariadb, log_id, "invalid_signature: no signature matches the body")
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), SANDBOX_WEBHOOK_SECRET=f"{NEW},{OLD}") as stack:
        bad = stack.run("-m", "compensator", "reverify", "--provider", "sandbox", "--since", "yesterday")
        assert bad.returncode == 2 and "ISO 8601" in bad.stderr
        done = stack.run("-m", "compensator", "reverify", "--provider", "sandbox", "--since", "2020-01-01T00:00:00Z")
        assert done.returncode == 0, done.stderr[-2000:]
        assert "1 of 1 rejected callbacks now verify" in done.stdout
    assert _row(mariadb, log_id).status == CallbackStatus.PENDING
