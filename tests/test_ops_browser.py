"""The ops console end to end in headless Chromium (Debian's ``chromium``, driven by Playwright; nothing downloaded).

An operator logs in, finds the given-up callback, replays it, resolves a
manual item by applying the provider's verdict, and sees the overview change.
The gateway runs on a real HTTP server over MariaDB. Screenshots of each step
go to ``var/test-artefacts/ops-browser/`` (the path is printed). Skips when
Chromium or Playwright is missing, except under CI=true, where it fails.
"""

from __future__ import annotations

import re
import shutil
import threading
from pathlib import Path

import pytest
from sqlalchemy import select
from werkzeug.serving import make_server

from gateway import create_app
from payments.inbound.callbacks import process_callback, store_callback
from payments.infra.schema import ops_action, payment
from tests.conftest import IN_CI
from tests.ops_support import GIVE_UP_AT_ONCE, given_up_callback, settled_review
from tests.ops_support import providers as ops_providers
from tests.support import ROOT, create_payment, free_port, make_settings, sandbox_event, signed

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTEFACTS = ROOT / "var" / "test-artefacts" / "ops-browser"

pytestmark = [pytest.mark.mariadb, pytest.mark.slow]
MICROSECONDS = re.compile(r"\d{2}:\d{2}:\d{2}\.\d{3,6}")


def _need(condition: bool, reason: str) -> None:
    if condition:
        return
    if IN_CI:
        pytest.fail(f"{reason} and CI=true", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def browser():
    _need(Path(CHROMIUM).exists(), f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright is not installed (pip install -r requirements-dev.txt)")
    with sync_playwright() as p:
        # --no-sandbox: CI containers run as root, where Chromium's sandbox cannot start.
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def console(mariadb):
    settings = make_settings(database_url=mariadb.url.render_as_string(hide_password=False))
    app = create_app(settings, engine=mariadb)
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        thread.join(10)


def test_an_operator_replays_a_given_up_callback_resolves_an_item_and_sees_the_overview_change(
    mariadb, console, browser
):
    late = "pay_browser0000000001"
    log_id = given_up_callback(mariadb, late)  # its payment row arrived after the callback gave up
    create_payment(mariadb, payment_id=late)
    unknown = create_payment(mariadb, status="Unknown")
    settled_review(mariadb, unknown, line_status="succeeded", category="resolved")
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    print(f"\nscreenshots: {ARTEFACTS}")
    page = browser.new_page()

    def shot(name: str) -> None:
        page.screenshot(path=str(ARTEFACTS / f"{name}.png"), full_page=True)

    page.goto(f"{console}/ops/")
    assert "/ops/login" in page.url
    page.fill("#name", "dana")
    page.fill("#token", "dev-ops-token")
    page.click("#login")
    page.wait_for_selector("#gave-up")
    assert page.inner_text("#gave-up").strip() == "1" and page.inner_text("#reviews-open").strip() == "2"
    assert "callback_gave_up" in page.inner_text("#alerts")
    shot("1-overview-before")

    page.click("text=Callbacks")
    page.select_option("#status", "4")
    page.click("#search-button")
    rows = page.locator("tr.callback-row")
    assert rows.count() == 1 and rows.first.get_attribute("data-id") == str(log_id)
    shot("2-given-up-callbacks")
    page.click(f"tr.callback-row a:text-is('{log_id}')")
    assert "gave_up" in page.inner_text("#callback-status")
    page.fill("#replay-note", "payment row arrived late; replaying")
    page.click("#replay")
    page.wait_for_selector(".flash.ok")
    assert "processed after replay" in page.inner_text(".flash.ok")
    assert "processed" in page.inner_text("#callback-status")
    shot("3-replayed")

    page.click("text=Manual queue")
    review_rows = page.locator("tr.review-row")
    assert review_rows.count() == 1  # the callback's review was resolved by the replay
    review_rows.first.locator("a").click()
    page.fill("#apply-form input[name=note]", "settlement file says it settled")
    page.click("#apply")
    page.wait_for_selector("#confirm-lines")  # apply shows what it will do and waits for a confirmation
    assert "settlement line" in page.inner_text("#confirm-lines")
    shot("4a-confirm-apply")
    page.click("#confirm")
    page.wait_for_selector(".flash.ok")
    assert "Unknown -> Succeeded" in page.inner_text(".flash.ok")
    assert page.inner_text("#review-status").strip() == "resolved"
    shot("4-review-resolved")

    page.click("text=Overview")
    page.wait_for_selector("#gave-up")
    assert page.inner_text("#gave-up").strip() == "0" and page.inner_text("#reviews-open").strip() == "0"
    assert page.inner_text("#alerts-open").strip() == "0"
    assert "dana" in page.inner_text(".actions-table")
    shot("5-overview-after")

    with mariadb.connect() as conn:
        statuses = dict(conn.execute(select(payment.c.payment_id, payment.c.status)).all())
        actors = conn.execute(select(ops_action.c.action, ops_action.c.actor).order_by(ops_action.c.id)).all()
    assert statuses == {late: "Succeeded", unknown: "Succeeded"}
    # A replay is two audit rows: the reset, then what processing did with it (ops_actions.replay_and_process).
    assert [tuple(a) for a in actors] == [("replay", "dana"), ("replay", "dana"), ("apply", "dana")]
    assert all((ARTEFACTS / f"{n}.png").stat().st_size > 0 for n in ("1-overview-before", "5-overview-after"))


SCREENSHOTS = ROOT / "bench" / "results" / "console"
"""The 1280 px screenshots of the closing note (committed): overview, callback, review, alert."""
WIDTH = 1280


def _wide_world(engine) -> dict[str, int]:
    """Rows whose pages are as wide as the console gets: long ids, long results, several currencies."""
    from payments.infra.schema import alert

    late = "pay_browserwide000000001"
    log_id = given_up_callback(engine, late, amount=266400)
    create_payment(engine, payment_id=late, amount=266400)
    unknown = create_payment(engine, status="Unknown", amount=500, currency="JPY")
    review_id, _ = settled_review(engine, unknown, line_status="succeeded", amount=500, currency="JPY")
    create_payment(engine, status="Unknown", amount=1200, currency="USD")
    # A delivery with long unbroken words (an event id, a reference), rejected: what stretches tables most.
    long_ref = "pay_" + "L" * 36
    body, headers = signed(sandbox_event(long_ref, event_id="evt_" + "W" * 120))
    log_id_long = store_callback(
        engine,
        provider="sandbox",
        body=body,
        headers={**headers, "Sandbox-Signature": "t=1,v1=" + "0" * 64},
        remote_addr="127.0.0.1",
        index={"order_no": long_ref, "provider_event_id": "evt_" + "W" * 120},
    )
    process_callback(engine, ops_providers(), log_id_long, GIVE_UP_AT_ONCE)
    with engine.connect() as conn:
        alert_id = conn.execute(select(alert.c.id).where(alert.c.rule == "callback_gave_up")).scalar_one()
    return {"callback": log_id, "review": review_id, "alert": alert_id}


def _login_page(browser, console):
    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
    page.goto(f"{console}/ops/login")
    page.fill("#name", "dana")
    page.fill("#token", "dev-ops-token")
    page.click("#login")
    page.wait_for_selector("#gave-up")
    return page


def test_the_overview_callback_review_and_alert_pages_fit_1280_px_with_humanized_money_and_times(
    mariadb, console, browser
):
    ids = _wide_world(mariadb)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = _login_page(browser, console)
    pages = {
        "overview": "/ops/",
        "callbacks": "/ops/callbacks",
        "callback": f"/ops/callbacks/{ids['callback']}",
        "review": f"/ops/reviews/{ids['review']}",
        "alert": f"/ops/alerts/{ids['alert']}",
    }
    widths = {}
    for name, path in pages.items():
        page.goto(f"{console}{path}")
        page.wait_for_load_state("load")
        widths[name] = page.evaluate("Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)")
        page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
        text = page.inner_text("main")
        assert not MICROSECONDS.search(text), f"{name}: a time with microseconds"
    print(f"\nscrollWidth at {WIDTH} px: {widths}; screenshots: {SCREENSHOTS}")
    assert all(width <= WIDTH for width in widths.values()), widths
    page.goto(f"{console}/ops/payments/pay_browserwide000000001")
    amount = page.locator("span.money").first
    assert amount.inner_text() == "¥2,664.00" and amount.get_attribute("title") == "266400 minor units of CNY"
    page.goto(f"{console}{pages['review']}")
    assert "JPY ¥500" in page.inner_text("main")
    stamp = page.locator("main time").first
    assert stamp.inner_text().endswith(("ago", "just now")) and stamp.get_attribute("title").endswith(" UTC")
    page.goto(f"{console}{pages['alert']}")
    page.click("#alert-subject a")  # an alert links to its subject: here the given-up callback's review
    assert "/ops/reviews/" in page.url


def test_a_page_asked_to_refresh_reloads_but_never_while_a_form_is_being_filled(mariadb, console, browser):
    given_up_callback(mariadb, "pay_browserrefresh0001")
    page = _login_page(browser, console)
    page.goto(f"{console}/ops/?refresh=5")
    assert page.get_attribute("body", "data-refresh") == "5"
    page.evaluate("window.__before_reload = true")
    # Reloaded by itself (wait_for_function would need eval, which the console's CSP refuses).
    page.wait_for_event("framenavigated", timeout=12_000)
    page.wait_for_selector("#gave-up")
    assert page.evaluate("window.__before_reload") is None
    assert "auto-refresh every 5 s" in page.inner_text("#refresh-toggle")

    page.goto(f"{console}/ops/callbacks?status=4&refresh=5")
    page.evaluate("window.__before_reload = true")
    page.fill("#replay-note", "half-written note")
    page.focus("#search-button")  # the field left, its text kept: still a form being filled
    page.wait_for_selector("body[data-refresh-paused='1']", timeout=12_000)
    assert page.evaluate("window.__before_reload") is True and page.input_value("#replay-note") == "half-written note"
    page.click("#refresh-off")
    assert page.get_attribute("body", "data-refresh") is None and "refresh=" not in page.url
