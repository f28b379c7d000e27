"""The ops console: ``/ops/…``, server-rendered pages (Flask + Jinja, no build step) over ``payments.ops.actions``.

Who may do what:

- ``/ops/login`` takes an OPS_TOKEN (role ``operator``: reads and acts) or an
  OPS_READONLY_TOKEN (role ``readonly``: reads only) and a name recorded with
  every action. Every configured token is compared, in constant time. Failed
  logins are logged (address, never the token) and throttled per client
  address (LOGIN_FAILURES in LOGIN_WINDOW_SECONDS, then 429).
- The session is a signed cookie (``paysync_ops``, path ``/ops``): HttpOnly,
  SameSite=Strict, Secure when the request came over TLS (directly, or by
  X-Forwarded-Proto from a peer in TRUSTED_PROXIES), valid for
  SESSION_SECONDS. It names the token's role and a fingerprint of the token:
  a token removed from the settings ends its sessions at once.
- Each login is also a row in ``ops_session`` (``payments.ops.sessions``),
  named by a random id in the cookie: logout revokes the row, so a copy of
  the cookie is worthless from then on; no row, no session.
- The signing key is derived from the first OPS_TOKEN (HMAC, so the cookie
  reveals nothing of the token); the other listed tokens give the fallback
  keys, so rotating OPS_TOKEN ("new,old") keeps sessions. Production refuses
  a weak or development OPS_TOKEN, so the key is never a development one there.
- Every POST carries the session's CSRF token (form field ``csrf``), or gets
  400; a readonly session's POST gets 403.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Flask, abort, current_app, g, redirect, render_template, request, session, url_for
from flask.sessions import SecureCookieSession, SecureCookieSessionInterface
from itsdangerous import BadSignature
from werkzeug.exceptions import HTTPException

from gateway.ops import humanize
from payments.infra.settings import Settings
from payments.infra.sources import client_address, in_networks
from payments.ops import sessions as ops_sessions

log = logging.getLogger("paysync.gateway.ops")

bp = Blueprint("ops", __name__, url_prefix="/ops", template_folder="templates", static_folder="static")

ROLE_OPERATOR = "operator"
ROLE_READONLY = "readonly"
COOKIE_NAME = "paysync_ops"
SESSION_SECONDS = 12 * 3600
"""A console login lasts this long (then log in again)."""
LOGIN_FAILURES = 5
LOGIN_WINDOW_SECONDS = 300
"""More than LOGIN_FAILURES failed logins from one address within this window: 429 until they age out."""
_KEY_INFO = b"paysync ops console session key v1"
_FINGERPRINT_INFO = b"paysync ops console token fingerprint v1"


def derive_key(token: str) -> str:
    """The session signing key for one ops token: HMAC-SHA256, one-way, so a cookie tells nothing of the token."""
    return hmac.new(token.encode(), _KEY_INFO, hashlib.sha256).hexdigest()


def fingerprint(token: str) -> str:
    """What a session keeps of the token it was opened with: enough to notice the token was removed."""
    return hmac.new(token.encode(), _FINGERPRINT_INFO, hashlib.sha256).hexdigest()[:32]


def is_tls(settings: Settings) -> bool:
    """True when the request reached us over TLS, directly or through a trusted proxy that says so."""
    if request.is_secure:
        return True
    if settings.trusted_proxies and in_networks(request.remote_addr, settings.trusted_proxies):
        proto = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
        return proto == "https"
    return False


def client_addr(settings: Settings) -> str:
    """The client's address: the peer, or behind trusted proxies the rightmost X-Forwarded-For hop not ours."""
    client = client_address(request.remote_addr, request.headers.get("X-Forwarded-For"), settings.trusted_proxies)
    return client or ""


class OpsSessionInterface(SecureCookieSessionInterface):
    """Signed-cookie sessions for /ops only: no session (and no work) on any other route, such as callbacks."""

    digest_method = staticmethod(hashlib.sha256)
    salt = "paysync-ops-session"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def get_cookie_name(self, app: Flask) -> str:  # noqa: ARG002
        return COOKIE_NAME

    def get_cookie_path(self, app: Flask) -> str:  # noqa: ARG002
        return bp.url_prefix or "/ops"

    def get_cookie_httponly(self, app: Flask) -> bool:  # noqa: ARG002
        return True

    def get_cookie_samesite(self, app: Flask) -> str:  # noqa: ARG002
        return "Strict"

    def get_cookie_secure(self, app: Flask) -> bool:  # noqa: ARG002
        return is_tls(self.settings)

    def open_session(self, app: Flask, request: Any) -> SecureCookieSession | None:
        if not _is_ops_path(request.path):
            return self.null_session_class()
        serializer = self.get_signing_serializer(app)
        if serializer is None:
            return None
        value = request.cookies.get(COOKIE_NAME)
        if not value:
            return self.session_class()
        try:
            return self.session_class(serializer.loads(value, max_age=SESSION_SECONDS))
        except BadSignature:
            return self.session_class()


def _is_ops_path(path: str) -> bool:
    prefix = bp.url_prefix or "/ops"
    return path == prefix or path.startswith(prefix + "/")


@bp.record_once
def _configure(state: Any) -> None:
    """Give the app its session signing keys and the /ops-only session interface."""
    app = state.app
    settings: Settings = app.extensions["paysync"]["settings"]
    tokens = [t for t in settings.ops_token if t]
    if tokens:
        app.secret_key = derive_key(tokens[0])
        app.config["SECRET_KEY_FALLBACKS"] = [derive_key(t) for t in tokens[1:]]
    else:
        # No OPS_TOKEN (production refuses to start without one): a random key, and no one can log in.
        app.secret_key = secrets.token_hex(32)
    app.session_interface = OpsSessionInterface(settings)


class LoginThrottle:
    """Failed logins per client address in a sliding window (per gateway worker: a brake, not a wall)."""

    def __init__(self, limit: int = LOGIN_FAILURES, window: float = LOGIN_WINDOW_SECONDS, max_keys: int = 10_000):
        self.limit, self.window, self.max_keys = limit, window, max_keys
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, addr: str, now: float) -> deque[float]:
        times = self._failures.setdefault(addr, deque())
        while times and times[0] <= now - self.window:
            times.popleft()
        return times

    def blocked_for(self, addr: str, now: float | None = None) -> float:
        """Seconds until ``addr`` may try again (0: now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            times = self._recent(addr, now)
            return times[0] + self.window - now if len(times) >= self.limit else 0.0

    def failed(self, addr: str, now: float | None = None) -> None:
        """Count one failed login from ``addr``."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if len(self._failures) >= self.max_keys:
                # Bounded memory under a spray from many addresses: forget the quiet ones first.
                for key in [k for k, v in self._failures.items() if not v or v[-1] <= now - self.window]:
                    del self._failures[key]
                if len(self._failures) >= self.max_keys:
                    self._failures.clear()
            self._recent(addr, now).append(now)

    def succeeded(self, addr: str) -> None:
        """A good login clears the address's count."""
        with self._lock:
            self._failures.pop(addr, None)


throttle = LoginThrottle()


def match_token(given: str, settings: Settings) -> tuple[str, str] | None:
    """(role, token fingerprint) of ``given``, or None; every configured token is compared, in constant time."""
    candidates = [(ROLE_OPERATOR, t) for t in settings.ops_token if t]
    candidates += [(ROLE_READONLY, t) for t in settings.ops_readonly_token if t]
    found = None
    for role, token in candidates:
        if hmac.compare_digest(given.encode(), token.encode()) and found is None:
            found = (role, fingerprint(token))
    return found


def _tokens_of(role: str, settings: Settings) -> Iterable[str]:
    return settings.ops_token if role == ROLE_OPERATOR else settings.ops_readonly_token


def current_user() -> dict[str, Any] | None:
    """The logged-in session's role, actor and identity, if its token is still configured and its row is live.

    The row (``payments.ops.sessions``) is what logout revokes: a signed cookie
    without a live row, a copy kept after logout say, is no session.
    """
    role, actor, tk, sid = session.get("role"), session.get("actor"), session.get("tk"), session.get("sid")
    if role not in (ROLE_OPERATOR, ROLE_READONLY) or not actor or not tk or not isinstance(sid, str):
        return None
    paysync = current_app.extensions["paysync"]
    valid = [hmac.compare_digest(tk, fingerprint(t)) for t in _tokens_of(role, paysync["settings"]) if t]
    if not any(valid):
        return None
    live = ops_sessions.find_session(paysync["engine"], sid)
    if live is None or live.role != role or not hmac.compare_digest(live.token_fingerprint, tk):
        return None
    return {"role": role, "actor": live.actor, "identity": live.identity, "session_id": live.id}


def csrf_token() -> str:
    """This session's CSRF token (made on first use)."""
    if "csrf" not in session:
        session["csrf"] = secrets.token_urlsafe(32)
    return session["csrf"]


def _csrf_ok() -> bool:
    expected = session.get("csrf")
    given = request.form.get("csrf") or request.headers.get("X-CSRF-Token") or ""
    return bool(expected) and hmac.compare_digest(given.encode(), str(expected).encode())


def safe_next(target: str | None) -> str:
    """A redirect target after login: a path under /ops on this site, never another host."""
    if not target:
        return url_for("ops.overview")
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not _is_ops_path(parts.path) or target.startswith("//"):
        return url_for("ops.overview")
    return target


PUBLIC_ENDPOINTS = ("ops.login", "ops.static")


@bp.before_request
def _guard() -> Any:
    """Login, CSRF and role checks for every /ops route."""
    g.ops_user = current_user()
    public = request.endpoint in PUBLIC_ENDPOINTS
    if g.ops_user is None and not public:
        if request.method == "GET":
            return redirect(url_for("ops.login", next=request.full_path.rstrip("?")))
        abort(401, description="log in first")
    if request.method == "POST" and not _csrf_ok():
        abort(400, description="missing or wrong CSRF token: reload the page and try again")
    if public:
        return None
    if request.method == "POST" and request.endpoint != "ops.logout" and g.ops_user["role"] != ROLE_OPERATOR:
        abort(403, description="this login may only read")
    return None


@bp.after_request
def _headers(response: Any) -> Any:
    """Pages that hold payment data: never cached, never framed, no inline script, forms post only here.

    The one script allowed is the console's own file (``static/ops.js``,
    auto-refresh): ``script-src 'self'``, so nothing injected into a page runs.
    """
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Content-Security-Policy"] = (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; "
        "base-uri 'none'"
    )
    return response


REFRESH_CHOICES = (10, 30, 60, 300)
"""What the header's auto-refresh toggle offers, in seconds; ``?refresh=N`` takes any N from 5 to 3600."""


def refresh_seconds() -> int:
    """This page's auto-refresh period from ``?refresh=N`` (GET pages only; 0: off)."""
    if request.method != "GET":
        return 0
    raw = request.args.get("refresh", "")
    return min(max(int(raw), 5), 3600) if raw.isdigit() and int(raw) > 0 else 0


def _refresh_url(seconds: int) -> str | None:
    """This page with auto-refresh set to ``seconds`` (0: off), its other query arguments kept."""
    if request.method != "GET" or not request.endpoint or request.endpoint in PUBLIC_ENDPOINTS:
        return None
    args = {k: v for k, v in request.args.items() if k != "refresh"}
    if seconds:
        args["refresh"] = str(seconds)
    return url_for(request.endpoint, **(request.view_args or {}), **args)


@bp.context_processor
def _template_globals() -> dict[str, Any]:
    user = getattr(g, "ops_user", None)
    return {
        "csrf_token": csrf_token,
        "user": user,
        "can_act": bool(user and user["role"] == ROLE_OPERATOR),
        "refresh": refresh_seconds(),
        "refresh_url": _refresh_url,
        "refresh_choices": REFRESH_CHOICES,
    }


@bp.app_template_filter("money")
def _money_filter(amount_minor: Any, currency: str | None) -> Any:
    """``{{ p.amount_minor|money(p.currency) }}``: ``¥2,664.00``, minor units on hover (``humanize``)."""
    return humanize.money_html(amount_minor, currency)


@bp.app_template_filter("amounts")
def _amounts_filter(amounts: Any) -> Any:
    """``{{ {"CNY": 266400}|amounts }}``: amounts by currency (``humanize``)."""
    return humanize.amounts_html(amounts)


@bp.app_template_filter("duration")
def _duration_filter(seconds: Any) -> str:
    """``{{ 272|duration }}``: ``4 min`` (``humanize``)."""
    return humanize.duration(float(seconds or 0))


@bp.app_template_filter("ago")
def _ago_filter(value: Any, empty: str = "–") -> Any:
    """``{{ row.create_time|ago }}``: ``4 min ago``, the UTC time on hover (``humanize``)."""
    return humanize.time_html(value, empty=empty)


@bp.errorhandler(HTTPException)
def _error(exc: HTTPException) -> Any:
    return render_template("ops/error.html", error=exc), exc.code or 500


from gateway.ops import views  # noqa: E402, F401  (the routes register themselves on bp)
