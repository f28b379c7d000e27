"""``gateway.callbacks.CallbackFastPath`` answers POST /callbacks/<provider> as the route's Flask view does.

Each request is sent twice, once through the app as gunicorn runs it (the fast
path first) and once to Flask's own WSGI callable behind it: same status, same
body, same content type, the same headers that matter, and one stored row each.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select
from werkzeug.test import EnvironBuilder, run_wsgi_app

from gateway import create_app
from gateway.callbacks import CallbackFastPath
from payments.infra.schema import payment_callback_log
from tests.support import create_payment, make_settings, sandbox_event, signed


@pytest.fixture
def app(engine):
    url = engine.url.render_as_string(hide_password=False)
    settings = make_settings(database_url=url, callback_process_inline=False)
    return create_app(settings, engine=engine)


def call(wsgi, path="/callbacks/sandbox", body=b"", headers=None, method="POST", content_length=None):
    environ = EnvironBuilder(path=path, method=method, data=body, headers=headers or {}).get_environ()
    if content_length is not None:
        environ["CONTENT_LENGTH"] = str(content_length)
    chunks, status, response_headers = run_wsgi_app(wsgi, environ, buffered=True)
    return int(status.split()[0]), b"".join(chunks), response_headers


def both(app, **request):
    """(fast path answer, Flask view answer) for the same request."""
    assert isinstance(app.wsgi_app, CallbackFastPath)
    return call(app.wsgi_app, **request), call(app.wsgi_app.flask_wsgi, **request)


def stored(engine):
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(payment_callback_log)).scalar()


def same(fast, flask):
    (s1, b1, h1), (s2, b2, h2) = fast, flask
    assert s1 == s2
    if h1["Content-Type"] == "application/json":
        assert json.loads(b1) == json.loads(b2)
    else:
        assert b1 == b2
    assert h1["Content-Type"] == h2["Content-Type"]
    assert int(h1["Content-Length"]) == len(b1)
    assert h1.get("Retry-After") == h2.get("Retry-After")
    assert h1["X-Request-Id"] and h2["X-Request-Id"]


def test_a_genuine_delivery_is_acknowledged_alike_and_stored_once_each(app, engine):
    body, headers = signed(sandbox_event(create_payment(engine)))
    fast, flask = both(app, body=body, headers=headers)
    same(fast, flask)
    assert fast[0] == 200
    assert stored(engine) == 2


@pytest.mark.parametrize(
    "case",
    [
        {"body": b'{"id": "evt_1"}', "headers": {"Content-Type": "application/json"}},  # no signature: 401
        {"path": "/callbacks/made-up", "body": b"{}"},  # unknown provider: 404
        {"path": "/callbacks/caf\u00e9", "body": b"{}"},  # named in UTF-8
        {"body": b"x" * 2_000_000, "headers": {"Content-Type": "application/json"}},  # over the limit: 413
        {"body": b"<a/>", "headers": {"Content-Type": "application/xml"}},  # 415
    ],
    ids=["unsigned", "unknown-provider", "unicode-name", "too-large", "wrong-type"],
)
def test_refusals_are_answered_alike(app, engine, case):
    fast, flask = both(app, **case)
    same(fast, flask)
    assert fast[0] >= 400


def test_a_request_cut_short_is_flasks_400_and_stores_nothing(app, engine):
    body, headers = signed(sandbox_event(create_payment(engine)))
    fast, flask = both(app, body=body, headers=headers, content_length=len(body) + 100)
    same(fast, flask)
    assert fast[0] == 400 and json.loads(fast[1])["error"]["code"] == "bad_request"
    assert stored(engine) == 0


def test_the_request_id_is_kept_when_sane_and_replaced_when_not(app, engine):
    body, headers = signed(sandbox_event(create_payment(engine)))
    _, _, given = call(app.wsgi_app, body=body, headers={**headers, "X-Request-Id": "req-abc.1"})
    assert given["X-Request-Id"] == "req-abc.1"
    _, _, odd = call(app.wsgi_app, body=body, headers={**headers, "X-Request-Id": "two words"})
    assert odd["X-Request-Id"] != "two words" and len(odd["X-Request-Id"]) == 32
    with engine.connect() as conn:
        query = select(payment_callback_log.c.request_id).order_by(payment_callback_log.c.id)
        ids = [r for (r,) in conn.execute(query)]
    assert ids == ["req-abc.1", odd["X-Request-Id"]], "the row carries the id the answer names"


def test_an_unexpected_error_is_logged_and_a_json_500(app, engine, monkeypatch, caplog):
    provider = app.extensions["paysync"]["providers"]["sandbox"]

    def broken(body):
        raise RuntimeError("boom")

    monkeypatch.setattr(provider, "peek_callback", broken)
    body, headers = signed(sandbox_event(create_payment(engine)))
    fast, flask = both(app, body=body, headers=headers)
    same(fast, flask)
    assert fast[0] == 500 and json.loads(fast[1])["error"]["code"] == "internal_error"
    assert [r for r in caplog.records if r.getMessage() == "unhandled error"]


def test_other_methods_and_paths_are_flasks(app):
    status, _, headers = call(app.wsgi_app, method="GET")
    assert status == 405 and "POST" in headers["Allow"]
    assert call(app.wsgi_app, path="/callbacks/")[0] == 404
    assert call(app.wsgi_app, path="/callbacks/sandbox/extra")[0] == 404
    assert call(app.wsgi_app, path="/healthz", method="GET")[0] == 200
