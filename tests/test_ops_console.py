"""The ops console's auth and actions through the Flask test client: login, roles, CSRF, cookie flags, pages."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
from sqlalchemy import select

from compensator import review_cli
from gateway import create_app
from gateway.ops import LOGIN_FAILURES, throttle
from payments.errors import ConfigError
from payments.infra.schema import manual_review, ops_action, payment_callback_log
from payments.infra.settings import load_settings
from payments.runtime import build_runtime, check_deployment
from payments.states import CallbackStatus
from tests.ops_support import given_up_callback, review_for, settled_review
from tests.support import create_payment, make_settings

OPS = "dev-ops-token"
READONLY = "readonly-token-for-tests-0001"


@pytest.fixture(autouse=True)
def _fresh_throttle():
    throttle._failures.clear()
    yield
    throttle._failures.clear()


def _app(engine, **overrides):
    values = {"ops_readonly_token": (READONLY,), **overrides}
    settings = make_settings(database_url=engine.url.render_as_string(hide_password=False), **values)
    return create_app(settings, engine=engine)


def _csrf(page: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', page).group(1)


def _login(client, token=OPS, name="alice", **kw):
    page = client.get("/ops/login", **kw)
    return client.post("/ops/login", data={"csrf": _csrf(page.text), "name": name, "token": token}, **kw)


def _cookie(response) -> str:
    return next(v for k, v in response.headers.items() if k == "Set-Cookie" and v.startswith("paysync_ops="))


@pytest.fixture
def app(sqlite):
    return _app(sqlite)


def test_every_page_redirects_to_login_without_a_session(app):
    client = app.test_client()
    for path in ("/ops/", "/ops/callbacks", "/ops/reviews", "/ops/reviews/1", "/ops/payments", "/ops/aging"):
        response = client.get(path)
        assert response.status_code == 302 and response.headers["Location"].startswith("/ops/login?next=")
    assert client.post("/ops/callbacks/replay", data={"id": "1", "note": "x"}).status_code == 401


def test_login_with_the_ops_token_opens_an_httponly_samesite_session_scoped_to_ops(app):
    client = app.test_client()
    response = _login(client)
    assert response.status_code == 302 and response.headers["Location"] == "/ops/"
    cookie = _cookie(response)
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/ops" in cookie
    assert "Secure" not in cookie  # plain http: a Secure cookie would never come back
    page = client.get("/ops/")
    assert page.status_code == 200 and "alice (operator)" in page.text
    assert (
        page.headers["Cache-Control"] == "no-store"
        and "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    )
    assert "Set-Cookie" not in client.get("/healthz").headers  # no session outside /ops


def test_the_cookie_is_secure_over_tls_and_behind_a_trusted_proxy_only(sqlite):
    direct = _app(sqlite).test_client()
    assert "Secure" in _cookie(_login(direct, base_url="https://ops.example"))

    proxied = _app(sqlite, trusted_proxies=("127.0.0.0/8",)).test_client()
    assert "Secure" in _cookie(_login(proxied, headers={"X-Forwarded-Proto": "https"}))

    untrusted = _app(sqlite, trusted_proxies=("10.0.0.0/8",)).test_client()
    assert "Secure" not in _cookie(_login(untrusted, headers={"X-Forwarded-Proto": "https"}))


def test_a_wrong_token_is_refused_logged_without_the_token_and_throttled(app, caplog):
    client = app.test_client()
    caplog.set_level(logging.WARNING, logger="paysync.gateway.ops")
    for _ in range(LOGIN_FAILURES):
        assert _login(client, token="guess-the-ops-token").status_code == 401
    assert "guess-the-ops-token" not in caplog.text and "ops login failed" in caplog.text
    blocked = _login(client)  # even the right token, from this address, until the window passes
    assert blocked.status_code == 429 and int(blocked.headers["Retry-After"]) > 0
    assert client.get("/ops/").status_code == 302


def test_a_name_is_required_to_log_in(app):
    assert _login(app.test_client(), name="  ").status_code == 400


def test_the_readonly_token_reads_but_cannot_act(sqlite):
    app = _app(sqlite)
    log_id = given_up_callback(sqlite, "pay_console000000001")
    review_id = review_for(sqlite, callback_log_id=log_id)
    client = app.test_client()
    _login(client, token=READONLY, name="auditor")
    page = client.get(f"/ops/reviews/{review_id}")
    assert page.status_code == 200 and 'id="close-form"' not in page.text
    csrf = _csrf(page.text)  # the logout form's
    replay = client.post("/ops/callbacks/replay", data={"csrf": csrf, "id": str(log_id), "note": "n"})
    close = client.post(f"/ops/reviews/{review_id}/resolve", data={"csrf": csrf, "action": "close", "note": "n"})
    assert replay.status_code == 403 and close.status_code == 403
    with sqlite.connect() as conn:
        assert conn.execute(select(ops_action)).first() is None
        assert conn.execute(select(manual_review.c.status)).scalar() == "open"


def test_a_post_without_or_with_a_wrong_csrf_token_is_refused(sqlite):
    app = _app(sqlite)
    log_id = given_up_callback(sqlite, "pay_console000000002")
    client = app.test_client()
    _login(client)
    for data in ({"id": str(log_id), "note": "n"}, {"csrf": "forged", "id": str(log_id), "note": "n"}):
        assert client.post("/ops/callbacks/replay", data=data).status_code == 400
    with sqlite.connect() as conn:
        status = conn.execute(select(payment_callback_log.c.status)).scalar()
    assert status == CallbackStatus.GAVE_UP


def test_replay_and_close_through_the_console_record_the_logged_in_name(sqlite):
    app = _app(sqlite)
    payment_id = "pay_console000000003"
    log_id = given_up_callback(sqlite, payment_id)
    create_payment(sqlite, payment_id=payment_id)
    client = app.test_client()
    _login(client, name="carol")
    page = client.get(f"/ops/callbacks/{log_id}")
    response = client.post(
        "/ops/callbacks/replay",
        data={"csrf": _csrf(page.text), "id": str(log_id), "note": "payment restored", "back": "https://evil.example/"},
    )
    assert response.status_code == 302 and response.headers["Location"] == "/ops/"  # never off-site
    assert "processed after replay" in client.get("/ops/").text
    with sqlite.connect() as conn:
        assert conn.execute(select(payment_callback_log.c.status)).scalar() == CallbackStatus.PROCESSED
        actions = conn.execute(select(ops_action)).mappings().all()  # the reset, then what processing did
    assert {(a["actor"], a["via"], a["action"]) for a in actions} == {("carol", "console", "replay")}
    assert len(actions) == 2

    other = create_payment(sqlite, status="Failed")
    review_id, _ = settled_review(sqlite, other)
    page = client.get(f"/ops/reviews/{review_id}")
    assert "abc123secret" not in page.text and "settlement line" in page.text
    confirmed = {"csrf": _csrf(page.text), "confirmed": "yes"}  # what the confirmation page posts
    client.post(f"/ops/reviews/{review_id}/resolve", data={**confirmed, "action": "apply", "note": "n"})
    assert "state machine refuses" in client.get(f"/ops/reviews/{review_id}").text
    bad = client.post(
        f"/ops/reviews/{review_id}/resolve",
        data={**confirmed, "action": "adjust", "amount_minor": "1.5", "note": "n"},
    )
    assert bad.status_code == 400
    client.post(f"/ops/reviews/{review_id}/resolve", data={**confirmed, "action": "close", "note": "ok"})
    assert "resolved" in client.get(f"/ops/reviews/{review_id}").text


def test_bad_search_input_is_a_400(app):
    client = app.test_client()
    _login(client)
    for query in ("status=9", "status=x", "since=yesterday", "before_id=-1"):
        assert client.get(f"/ops/callbacks?{query}").status_code == 400
    assert client.get("/ops/reviews?status=maybe").status_code == 400
    assert client.get("/ops/payments?status=Lost").status_code == 400


def test_logout_ends_the_session(app):
    client = app.test_client()
    _login(client)
    page = client.get("/ops/")
    assert client.post("/ops/logout", data={"csrf": _csrf(page.text)}).status_code == 302
    assert client.get("/ops/").status_code == 302


def test_a_session_ends_when_its_token_leaves_the_settings_and_survives_rotation(sqlite):
    old, new = "old-ops-token-000000000000001", "new-ops-token-000000000000002"
    client = _app(sqlite, ops_token=(old,)).test_client()
    _login(client, token=old)
    client.application = _app(sqlite, ops_token=(new, old))
    assert client.get("/ops/").status_code == 200  # signed with old's key: a fallback now
    client.application = _app(sqlite, ops_token=(new,))
    assert client.get("/ops/").status_code == 302


def test_a_readonly_session_ends_when_its_token_is_removed(sqlite):
    client = _app(sqlite).test_client()
    _login(client, token=READONLY)
    assert client.get("/ops/").status_code == 200
    client.application = _app(sqlite, ops_readonly_token=("another-readonly-token-00001",))  # same signing key
    assert client.get("/ops/").status_code == 302


def test_a_readonly_token_is_held_to_production_rules_and_must_differ_from_ops_token():
    strong = "ops_Hc5tW8qNz2mRx7kVb4sLp9dFj3gY"
    merchant = "mt_Qm7rT2xK9vLw4pZs8nBc3hJd6fGy"
    base = make_settings(paysync_env="production", merchant_api_token=(merchant,), ops_token=(strong,))
    base = replace(base, sandbox_webhook_secret=(), sandbox_api_key=())
    assert check_deployment(base) is None
    with pytest.raises(ConfigError, match="OPS_READONLY_TOKEN is shorter"):
        check_deployment(replace(base, ops_readonly_token=("short",)))
    with pytest.raises(ConfigError, match="OPS_READONLY_TOKEN repeats"):
        load_settings({"PAYSYNC_ENV": "development", "OPS_TOKEN": strong, "OPS_READONLY_TOKEN": strong})
    with pytest.raises(ConfigError, match="TRUSTED_PROXIES"):
        load_settings({"PAYSYNC_ENV": "development", "TRUSTED_PROXIES": "10.0.0.1/8"})


def test_review_command_lists_shows_and_resolves(sqlite, capsys):
    runtime = build_runtime(make_settings(database_url=str(sqlite.url)), sqlite)
    log_id = given_up_callback(sqlite, "pay_cli0000000000001")
    review_id = review_for(sqlite, callback_log_id=log_id)

    assert review_cli.main(["list"], runtime) == 0
    assert f"callback:{log_id}" in capsys.readouterr().out
    assert review_cli.main(["show", str(review_id)], runtime) == 0
    shown = capsys.readouterr().out
    assert f"review {review_id}: callback_gave_up (open)" in shown and "callbacks (1)" in shown
    assert review_cli.main(["show", "999"], runtime) == 1
    with pytest.raises(SystemExit) as usage:
        review_cli.main(["resolve", str(review_id), "--action", "adjust", "--note", "n", "--actor", "ci"], runtime)
    assert usage.value.code == 2
    args = ["resolve", str(review_id), "--action", "close", "--note", "known duplicate", "--actor", "ci-bot"]
    assert review_cli.main([*args, "--format", "json"], runtime) == 0
    assert '"action": "close"' in capsys.readouterr().out
    assert review_cli.main(args, runtime) == 1
    assert "already resolved" in capsys.readouterr().err
    with sqlite.connect() as conn:
        assert conn.execute(select(ops_action.c.actor, ops_action.c.via)).one() == ("ci-bot", "cli")
    assert review_cli.main(["list", "--status", "resolved", "--format", "json"], runtime) == 0
    assert f'"id": {review_id}' in capsys.readouterr().out


@pytest.mark.mariadb
def test_the_console_pages_render_on_mariadb(mariadb):
    app = _app(mariadb)
    payment_id = create_payment(mariadb, status="Unknown")
    review_id, _ = settled_review(mariadb, payment_id)
    client = app.test_client()
    _login(client)
    for path in (
        "/ops/",
        "/ops/callbacks",
        "/ops/reviews",
        f"/ops/reviews/{review_id}",
        "/ops/payments",
        f"/ops/payments/{payment_id}",
        "/ops/refunds",
        "/ops/reconciliation",
        "/ops/reconciliation/1",
        "/ops/aging",
        "/ops/actions",
    ):
        assert client.get(path).status_code == 200, path


@pytest.mark.parametrize("target", ["https://evil.example/ops/", "//evil.example/ops/", "/payments", "/ops/reviews"])
def test_login_returns_only_to_a_page_of_the_console(app, target):
    client = app.test_client()
    page = client.get("/ops/login")
    response = client.post("/ops/login", data={"csrf": _csrf(page.text), "name": "alice", "token": OPS, "next": target})
    assert response.headers["Location"] == (target if target == "/ops/reviews" else "/ops/")


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"card": "4111111111111111", "a":' * 5_000],
    ids=["unclosed arrays", "closed arrays", "objects"],
)
def test_a_deeply_nested_body_is_shown_as_text_not_a_500(engine, body):
    from payments.ops.actions import MAX_BODY_DEPTH
    from tests.support import signed

    app = _app(engine)
    client = app.test_client()
    assert client.post("/callbacks/sandbox", data=body, headers=signed(body)[1]).status_code == 400  # stored, rejected
    with engine.connect() as conn:
        log_id = conn.execute(select(payment_callback_log.c.id)).scalar_one()
    _login(client)
    page = client.get(f"/ops/callbacks/{log_id}")
    assert page.status_code == 200
    assert f"nested deeper than {MAX_BODY_DEPTH} levels: shown as text" in page.text
    assert "4111111111111111" not in page.text  # still scrubbed


def _session_cookie(client) -> str:
    return client.get_cookie("paysync_ops", path="/ops").value


def test_logout_revokes_the_session_on_the_server_so_a_copied_cookie_opens_nothing(engine):
    from payments.infra.schema import ops_session

    app = _app(engine)
    client = app.test_client()
    _login(client, name="dora")
    copied = _session_cookie(client)
    thief = app.test_client()
    thief.set_cookie("paysync_ops", copied, path="/ops")
    assert thief.get("/ops/").status_code == 200  # the copy works while the session lives

    page = client.get("/ops/")
    assert client.post("/ops/logout", data={"csrf": _csrf(page.text)}).status_code == 302
    assert client.get("/ops/").status_code == 302  # the browser that logged out
    answer = thief.get("/ops/")  # and the copy taken before: the server no longer knows the session
    assert answer.status_code == 302 and answer.headers["Location"].startswith("/ops/login")
    assert thief.post("/ops/callbacks/replay", data={"csrf": "x", "id": "1", "note": "n"}).status_code == 401
    with engine.connect() as conn:
        row = conn.execute(select(ops_session.c.actor, ops_session.c.revoked_at)).one()
    assert row.actor == "dora" and row.revoked_at is not None


def test_logging_in_again_ends_the_session_it_replaces(sqlite):
    app = _app(sqlite)
    client = app.test_client()
    _login(client, name="erin")
    before = _session_cookie(client)
    csrf = _csrf(client.get("/ops/").text)
    assert client.post("/ops/login", data={"csrf": csrf, "name": "erin", "token": OPS}).status_code == 302
    assert _session_cookie(client) != before and client.get("/ops/").status_code == 200
    old = app.test_client()
    old.set_cookie("paysync_ops", before, path="/ops")
    assert old.get("/ops/").status_code == 302


def test_an_action_records_the_session_and_token_that_vouch_for_the_typed_name(engine, capsys):
    import os

    from gateway.ops import fingerprint
    from payments.infra.schema import ops_session

    app = _app(engine)
    runtime = build_runtime(make_settings(database_url=str(engine.url)), engine)
    payment_id = "pay_console000000027"
    first, second = given_up_callback(engine, payment_id), given_up_callback(engine, payment_id)
    create_payment(engine, payment_id=payment_id)
    # Two logins typing the same name: the session each action records tells them apart.
    for name, log_id in (("alice", first), ("alice", second)):
        client = app.test_client()
        _login(client, name=name)
        page = client.get(f"/ops/callbacks/{log_id}")
        client.post("/ops/callbacks/replay", data={"csrf": _csrf(page.text), "id": str(log_id), "note": "restored"})
    review_id = settled_review(engine, create_payment(engine, status="Unknown"))[0]
    args = ["resolve", str(review_id), "--action", "close", "--note", "duplicate", "--actor", "alice"]
    assert review_cli.main(args, runtime) == 0

    with engine.connect() as conn:
        sessions = conn.execute(select(ops_session.c.id, ops_session.c.token_fingerprint).order_by("id")).all()
        rows = conn.execute(
            select(ops_action.c.actor, ops_action.c.via, ops_action.c.identity, ops_action.c.ops_session_id).order_by(
                ops_action.c.id
            )
        ).all()
    assert [r.actor for r in rows] == ["alice"] * 5  # what was typed, kept beside
    # Each replay is two rows: the reset, then what processing did; both vouched for by the session.
    assert [(r.identity or "").split(" ")[0] for r in rows] == ["console"] * 4 + ["os"]
    assert [s.token_fingerprint for s in sessions] == [fingerprint(OPS)] * 2
    for pair, session_row in zip((rows[0:2], rows[2:4]), sessions, strict=True):
        for row in pair:
            assert row.ops_session_id == session_row.id
            assert row.identity == f"console session {session_row.id} (operator, token {fingerprint(OPS)[:12]})"
    assert rows[4].via == "cli" and rows[4].ops_session_id is None
    assert rows[4].identity.startswith("os user ") and f"(uid {os.getuid()})" in rows[4].identity


# ------------------------------------------------------------------------------------------- a console for 3 a.m.


def test_money_is_in_major_units_with_the_currency_and_times_are_ages_with_utc_on_hover():
    from datetime import datetime

    from gateway.ops import humanize

    assert humanize.major(266400, "CNY") == "¥2,664.00"
    assert humanize.major(1200, "USD") == "$12.00"
    assert humanize.major(500, "JPY") == "JPY ¥500"  # zero-decimal: the code says which yen
    assert humanize.major(-500000, "CNY") == "-¥5,000.00"
    assert humanize.major(1250, "KWD") == "KWD 1.250"  # three decimals, no symbol here
    assert humanize.major(150, "chf") == "CHF 1.50"
    html = str(humanize.money_html(266400, "CNY"))
    assert html == '<span class="money" title="266400 minor units of CNY">¥2,664.00</span>'
    now = datetime(2026, 12, 3, 14, 30, 29, 123456)
    assert humanize.relative(datetime(2026, 12, 3, 14, 26, 0), now) == "4 min ago"
    assert humanize.relative(datetime(2026, 12, 3, 14, 33, 40), now) == "in 3 min"
    assert humanize.relative(datetime(2026, 12, 3, 11, 25, 0), now) == "3 h 5 min ago"
    assert humanize.relative(datetime(2026, 12, 1, 10, 0, 0), now) == "2 d 4 h ago"
    assert humanize.duration(272.4) == "4 min" and humanize.duration(42) == "42 s"
    stamp = str(humanize.time_html("2026-12-03T14:26:00.654321Z", now))
    assert stamp == '<time datetime="2026-12-03T14:26:00Z" title="2026-12-03 14:26:00 UTC">4 min ago</time>'


MICROSECONDS = re.compile(r"\d{2}:\d{2}:\d{2}\.\d{3,6}")


def _rejected_callback(engine, reference: str) -> int:
    """A delivery naming ``reference`` whose signature fails: stored, then rejected by processing (status 3)."""
    from payments.inbound.callbacks import process_callback, store_callback
    from tests.ops_support import GIVE_UP_AT_ONCE, providers
    from tests.support import sandbox_event, signed

    body, headers = signed(sandbox_event(reference))
    forged = {**headers, **{k: "0" * 64 for k in headers if "signature" in k.lower()}}
    log_id = store_callback(
        engine, provider="sandbox", body=body, headers=forged, remote_addr="127.0.0.1", index={"order_no": reference}
    )
    assert process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE).value == "rejected"
    return log_id


def _applied_callback(engine, payment_id: str, amount: int) -> int:
    from payments.inbound.callbacks import process_callback, store_callback
    from tests.ops_support import GIVE_UP_AT_ONCE, providers
    from tests.support import sandbox_event, signed

    body, headers = signed(sandbox_event(payment_id, amount=amount))
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    assert process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE).value == "applied"
    return log_id


def test_the_pages_show_order_numbers_major_units_and_ages_and_no_link_404s(sqlite):
    app = _app(sqlite)
    paid = create_payment(sqlite, payment_id="pay_console000000010", amount=266400, currency="CNY")
    log_id = given_up_callback(sqlite, "pay_console000000011", amount=1200)
    rejected = _rejected_callback(sqlite, "pay_nosuchpayment0001")
    _applied_callback(sqlite, paid, amount=266400)
    client = app.test_client()
    _login(client)
    listing = client.get("/ops/callbacks").text
    order_nos = re.findall(r'<td class="order-no">([^<]*)</td>', listing)
    assert "order-00000010" in order_nos and not any(o.startswith("pay_") for o in order_nos)
    assert not MICROSECONDS.search(listing) and re.search(r"<time datetime=\"[^\"]+Z\" title=\"[^\"]+ UTC\">", listing)
    # Every link on the list, the rejected row's included, opens a page.
    for href in set(re.findall(r'href="(/ops/[^"#]*)"', listing)):
        assert client.get(href.replace("&amp;", "&")).status_code == 200, href
    assert 'href="/ops/payments/pay_nosuchpayment0001"' not in listing
    gave_up = client.get(f"/ops/callbacks/{log_id}").text
    facts = re.search(r'<p id="callback-facts">(.*?)</p>', gave_up, re.S).group(1)
    assert "next retry" not in facts and "last retry" in facts
    assert client.get(f"/ops/callbacks/{rejected}").status_code == 200
    create_payment(sqlite, payment_id="pay_console000000011")
    client.post("/ops/callbacks/replay", data={"csrf": _csrf(gave_up), "id": str(log_id), "note": "late payment"})
    assert not MICROSECONDS.search(client.get(f"/ops/callbacks/{log_id}").text)  # the replay's own words too
    page = client.get(f"/ops/payments/{paid}").text
    assert '<span class="money" title="266400 minor units of CNY">¥2,664.00</span>' in page
    assert "CNY 266400" not in page and not MICROSECONDS.search(page)


def test_an_alert_links_to_its_subject_from_the_overview_and_its_own_page(sqlite):
    from payments.infra.schema import alert

    log_id = given_up_callback(sqlite, "pay_console000000012")
    review_id = review_for(sqlite, callback_log_id=log_id)
    client = _app(sqlite).test_client()
    _login(client)
    overview = client.get("/ops/").text
    with sqlite.connect() as conn:
        alert_id = conn.execute(select(alert.c.id).where(alert.c.rule == "callback_gave_up")).scalar_one()
    assert f'href="/ops/alerts/{alert_id}"' in overview
    assert f'href="/ops/reviews/{review_id}"' in overview  # the alert's row names its review
    page = client.get(f"/ops/alerts/{alert_id}")
    assert page.status_code == 200 and "callback_gave_up" in page.text
    subject = re.search(r'<td id="alert-subject">(.*?)</td>', page.text, re.S).group(1)
    assert f'href="/ops/reviews/{review_id}"' in subject
    assert client.get("/ops/alerts/999999").status_code == 404


def test_a_callback_page_lists_every_attempt_and_what_processing_said_each_time(sqlite):
    from payments.inbound.callbacks import process_callback, store_callback
    from payments.infra.backoff import RetryPolicy
    from payments.infra.schema import callback_attempt
    from tests.ops_support import providers
    from tests.support import sandbox_event, signed

    late = "pay_console000000020"
    body, headers = signed(sandbox_event(late))
    log_id = store_callback(sqlite, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    twice = RetryPolicy(max_retries=2, base_seconds=0.01, max_seconds=0.01)
    assert process_callback(sqlite, providers(), log_id, twice).value == "retry"
    assert process_callback(sqlite, providers(), log_id, twice).value == "gave_up"
    create_payment(sqlite, payment_id=late)
    client = _app(sqlite).test_client()
    _login(client, name="erin")
    page = client.get(f"/ops/callbacks/{log_id}")
    client.post(
        "/ops/callbacks/replay", data={"csrf": _csrf(page.text), "id": str(log_id), "note": "payment arrived late"}
    )
    page = client.get(f"/ops/callbacks/{log_id}").text
    table = re.search(r'<table id="attempts".*?</table>', page, re.S).group(0)
    rows = re.findall(r'<tr class="attempt-row outcome-([a-z_]+)">(.*?)</tr>', table, re.S)
    assert [outcome for outcome, _ in rows] == ["retry", "gave_up", "replayed", "applied"]
    said = [cells for _, cells in rows]
    assert "target_not_found" in said[0] and "gave up after 2 attempts" in said[1]
    assert "replay by erin (console)" in said[2] and "payment arrived late" in said[2]
    assert "replay by erin (console)" in said[3] and "applied: Pending -&gt; Succeeded" in said[3]
    with sqlite.connect() as conn:  # one row per attempt, no more
        assert conn.execute(select(callback_attempt.c.id).where(callback_attempt.c.callback_log_id == log_id)).all()
        assert len(conn.execute(select(callback_attempt)).all()) == 4


def test_a_page_refreshes_only_when_asked_and_only_through_the_consoles_own_script(app):
    client = app.test_client()
    _login(client)
    plain = client.get("/ops/callbacks?status=4")
    assert "data-refresh" not in plain.text and "ops.js" not in plain.text
    assert 'href="/ops/callbacks?status=4&amp;refresh=30"' in plain.text  # the toggle keeps the filter
    asked = client.get("/ops/callbacks?status=4&refresh=30")
    assert '<body data-refresh="30">' in asked.text and '<script src="/ops/static/ops.js" defer>' in asked.text
    assert '<a href="/ops/callbacks?status=4" id="refresh-off">stop</a>' in asked.text
    assert "<script>" not in asked.text  # no inline script: the CSP would refuse it anyway
    policy = asked.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "unsafe" not in policy
    assert '<body data-refresh="5">' in client.get("/ops/?refresh=1").text  # at most every 5 s
    assert "data-refresh" not in client.get("/ops/?refresh=soon").text
    script = client.get("/ops/static/ops.js").text
    assert "activeElement" in script and '"input"' in script  # the pause while a form is being filled
