"""Local stand-ins for the alert channels' services, each checking requests the way the service does.

``FakeService(kind, …)`` is a real HTTP server on 127.0.0.1 playing DingTalk,
Feishu, WeCom, Slack, a Standard Webhooks receiver, a generic SMS gateway or
Aliyun's dysmsapi. It checks each request's format and, where the service
requires one, its signature, computed here independently of paysync's code
from the services' documentation, and answers in the service's own dialect:
accepted requests are kept in ``received``, refused ones' reasons in
``refused``. ``fail_with`` makes it answer an error; ``hang`` holds requests
until the event is set.

``smtp_server`` runs aiosmtpd (plain, STARTTLS or implicit TLS, with AUTH) and
``self_signed`` makes the certificate for it with ``cryptography``.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import hmac
import ipaddress
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, parse_qsl, quote_plus, urlsplit

TOKEN = "tok3n"
"""The credential every fake expects in its URL."""
ALIYUN_KEY_ID = "LTAI5tTestKeyId"
ALIYUN_SECRET = "aliyun-test-secret"


@dataclass
class Received:
    """One request a fake accepted."""

    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    data: Any = None
    params: dict[str, str] = field(default_factory=dict)


def _answer(handler: BaseHTTPRequestHandler, status: int, body: Any, content_type: str = "application/json") -> None:
    raw = (
        body if isinstance(body, bytes) else (json.dumps(body).encode() if not isinstance(body, str) else body.encode())
    )
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)


class Refused(Exception):
    """The fake refuses the request: (HTTP status, service-dialect body)."""

    def __init__(self, reason: str, status: int, body: Any) -> None:
        super().__init__(reason)
        self.status = status
        self.body = body


class FakeService:
    """One fake service; use as a context manager (the server stops on exit)."""

    PATHS = {
        "dingtalk": f"/robot/send?access_token={TOKEN}",
        "feishu": f"/open-apis/bot/v2/hook/{TOKEN}",
        "wecom": f"/cgi-bin/webhook/send?key={TOKEN}",
        "slack": f"/services/T000/B000/{TOKEN}",
        "webhook": "/paysync-alerts",
        "sms": "/v1/sms",
        "aliyun": "/",
    }

    def __init__(self, kind: str, secret: str = "", token: str = "", keywords: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.secret = secret
        self.token = token
        self.keywords = keywords
        """DingTalk and Feishu keyword security: a message must contain one of these (none set: no check)."""
        self.received: list[Received] = []
        self.refused: list[str] = []
        self.attempts = 0
        self.fail_with: tuple[int, Any] | None = None
        self.hang: threading.Event | None = None
        self.hanging = 0
        self._nonces: set[str] = set()
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                fake._handle(self)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        """The webhook (or endpoint) URL paysync is configured with."""
        return f"http://127.0.0.1:{self.server.server_address[1]}{self.PATHS[self.kind]}"

    def __enter__(self) -> FakeService:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self.hang is not None:
            self.hang.set()
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = handler.rfile.read(int(handler.headers.get("Content-Length", 0)))
        with self._lock:
            self.attempts += 1
        if self.hang is not None:
            with self._lock:
                self.hanging += 1
            self.hang.wait(30)
            with self._lock:
                self.hanging -= 1
        parts = urlsplit(handler.path)
        request = Received(
            path=parts.path,
            query={k: v[0] for k, v in parse_qs(parts.query).items()},
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=body,
        )
        try:
            if self.fail_with is not None:
                raise Refused("told to fail", *self.fail_with)
            ok = getattr(self, f"_check_{self.kind}")(request)
        except Refused as exc:
            with self._lock:
                self.refused.append(str(exc))
            _answer(handler, exc.status, exc.body, "text/plain" if isinstance(exc.body, str) else "application/json")
            return
        with self._lock:
            self.received.append(request)
        _answer(handler, 200, ok, "text/plain" if isinstance(ok, str) else "application/json")

    # --- shared checks ---------------------------------------------------------

    @staticmethod
    def _json(request: Received, refused: Refused) -> Any:
        if not request.headers.get("content-type", "").startswith("application/json"):
            raise refused
        try:
            request.data = json.loads(request.body)
        except ValueError:
            raise refused from None
        return request.data

    # --- DingTalk: sign = urlencode(base64(HMAC-SHA256(secret, "timestamp\nsecret"))) in the query ---------

    def _check_dingtalk(self, r: Received) -> Any:
        def no(reason: str, code: int = 310000) -> Refused:
            return Refused(reason, 200, {"errcode": code, "errmsg": reason})

        if r.path != "/robot/send" or r.query.get("access_token") != TOKEN:
            raise no("token is not exist", 300001)
        if self.secret:
            ts, sign = r.query.get("timestamp", ""), r.query.get("sign", "")
            if not ts.isdigit() or abs(time.time() * 1000 - int(ts)) > 3600 * 1000:
                raise no("invalid timestamp")
            mac = hmac.new(self.secret.encode(), f"{ts}\n{self.secret}".encode(), hashlib.sha256).digest()
            if not hmac.compare_digest(base64.b64encode(mac).decode(), sign):
                raise no("sign not match")
        data = self._json(r, no("param error", 300005))
        md = data.get("markdown") if isinstance(data, dict) else None
        if data.get("msgtype") != "markdown" or not isinstance(md, dict):
            raise no("msgtype not markdown", 40035)
        if not (isinstance(md.get("title"), str) and md["title"] and isinstance(md.get("text"), str) and md["text"]):
            raise no("markdown needs title and text", 40035)
        # Keyword security: "a message must contain at least one of these keywords" (the robot's content; the
        # title is accepted too, the docs not saying whether the markdown title counts).
        if self.keywords and not any(k in md["title"] or k in md["text"] for k in self.keywords):
            raise no("keywords not in content")
        # @-mentions ("at" beside the message): atMobiles and atUserIds are lists of strings, isAtAll a boolean; in
        # a markdown message a person is only notified if the text also names them as "@<mobile>" / "@<userId>".
        if "at" in data:
            at = data["at"]
            if not isinstance(at, dict) or set(at) - {"atMobiles", "atUserIds", "isAtAll"}:
                raise no("at must be {atMobiles, atUserIds, isAtAll}", 40035)
            named = [*at.get("atMobiles", []), *at.get("atUserIds", [])]
            if not all(isinstance(x, str) and x for x in named) or not isinstance(at.get("isAtAll", False), bool):
                raise no("atMobiles/atUserIds must be lists of strings, isAtAll a boolean", 40035)
            if any(f"@{x}" not in md["text"] for x in named):
                raise no("a mentioned person is not @-named in the markdown text", 40035)
            r.params["mentioned"] = ",".join(named) + (",@all" if at.get("isAtAll") else "")
        return {"errcode": 0, "errmsg": "ok"}

    # --- Feishu: sign = base64(HMAC-SHA256(key="timestamp\nsecret", msg="")) in the body --------------------

    def _check_feishu(self, r: Received) -> Any:
        def no(reason: str, code: int) -> Refused:
            return Refused(reason, 200, {"code": code, "msg": reason, "data": {}})

        if r.path != f"/open-apis/bot/v2/hook/{TOKEN}":
            raise no("incoming webhook access token invalid", 19001)
        if len(r.body) > 20 * 1024:
            raise no("Bad Request", 9499)
        data = self._json(r, no("Bad Request", 9499))
        if self.secret:
            ts, sign = str(data.get("timestamp", "")), data.get("sign", "")
            mac = hmac.new(f"{ts}\n{self.secret}".encode(), b"", hashlib.sha256).digest()
            fresh = ts.isdigit() and abs(time.time() - int(ts)) <= 3600
            if not fresh or not hmac.compare_digest(base64.b64encode(mac).decode(), str(sign)):
                raise no("sign match fail or timestamp is not within one hour from current time", 19021)
        card = data.get("card")
        try:
            assert data["msg_type"] == "interactive"
            assert isinstance(card["header"]["title"]["content"], str) and card["header"]["title"]["content"]
            assert card["header"]["title"]["tag"] == "plain_text"
            assert card["header"]["template"] in {"red", "orange", "blue", "green", "grey", "yellow"}
            assert all(e["tag"] == "div" and e["text"]["tag"] == "lark_md" for e in card["elements"])
        except (AssertionError, KeyError, TypeError):
            raise no("Bad Request", 9499) from None
        # Keyword security: one of the bot's keywords somewhere in the card's text (header or elements).
        texts = [card["header"]["title"]["content"], *(e["text"]["content"] for e in card["elements"])]
        if self.keywords and not any(k in t for k in self.keywords for t in texts):
            raise no("Key Words Not Found", 19024)
        # @-mentions in a card's lark_md are card-native: <at id=ou_…></at>, <at id=all></at> (the text message's
        # <at user_id="…"> form is not a card's and shows as literal text).
        body_text = " ".join(texts)
        if "<at user_id=" in body_text:
            raise no("a card mentions with <at id=…></at>, not user_id", 9499)
        r.params["mentioned"] = ",".join(re.findall(r"<at id=([A-Za-z0-9_]+)></at>", body_text))
        return {"code": 0, "msg": "success", "data": {}}

    # --- WeCom: markdown content at most 4096 bytes, key in the URL -----------------------------------------

    def _check_wecom(self, r: Received) -> Any:
        def no(reason: str, code: int) -> Refused:
            return Refused(reason, 200, {"errcode": code, "errmsg": reason})

        if r.path != "/cgi-bin/webhook/send" or r.query.get("key") != TOKEN:
            raise no("invalid webhook url", 93000)
        data = self._json(r, no("invalid json", 40000))
        if data.get("msgtype") == "text":
            # A text message: content at most 2048 bytes; mentioned_list (userids, "@all") and
            # mentioned_mobile_list (phone numbers, "@all") are lists of strings.
            text = data.get("text") or {}
            content = text.get("content")
            if not isinstance(content, str) or not content:
                raise no("missing text content", 40008)
            if len(content.encode("utf-8")) > 2048:
                raise no("content exceed max length", 40058)
            lists = [text.get("mentioned_list", []), text.get("mentioned_mobile_list", [])]
            if not all(isinstance(x, list) and all(isinstance(v, str) for v in x) for x in lists):
                raise no("mentioned_list and mentioned_mobile_list must be lists of strings", 40035)
            r.params["mentioned"] = ",".join([*lists[0], *lists[1]])
            return {"errcode": 0, "errmsg": "ok"}
        content = (data.get("markdown") or {}).get("content") if data.get("msgtype") == "markdown" else None
        if not isinstance(content, str) or not content:
            raise no("missing markdown content", 40008)
        if len(content.encode("utf-8")) > 4096:
            raise no("content exceed max length", 40058)
        # markdown mentions by <@userid> in the content only: the text message's mention lists do nothing here.
        if set(data["markdown"]) - {"content"} or set(data) - {"msgtype", "markdown"}:
            raise no("markdown takes only content (mention lists belong to a text message)", 40035)
        r.params["mentioned"] = ",".join(re.findall(r"<@([A-Za-z0-9_.@-]+)>", content))
        return {"errcode": 0, "errmsg": "ok"}

    # --- Slack incoming webhook: text + Block Kit, "ok" -------------------------------------------------------

    def _check_slack(self, r: Received) -> Any:
        if r.path != f"/services/T000/B000/{TOKEN}":
            raise Refused("no_service", 404, "no_service")
        data = self._json(r, Refused("invalid_payload", 400, "invalid_payload"))
        try:
            assert isinstance(data["text"], str) and data["text"]
            for block in data["blocks"]:
                if block["type"] == "header":
                    assert block["text"]["type"] == "plain_text" and len(block["text"]["text"]) <= 150
                elif block["type"] == "section":
                    texts = [block["text"]] if "text" in block else block["fields"]
                    assert 1 <= len(texts) <= 10
                    assert all(t["type"] == "mrkdwn" and isinstance(t["text"], str) for t in texts)
                else:
                    raise AssertionError(block["type"])
        except (AssertionError, KeyError, TypeError):
            raise Refused("invalid_blocks", 400, "invalid_blocks") from None
        return "ok"

    # --- Standard Webhooks: v1 = base64(HMAC-SHA256(key, "id.timestamp.body")) ------------------------------

    def _check_webhook(self, r: Received) -> Any:
        msg_id, ts = r.headers.get("webhook-id", ""), r.headers.get("webhook-timestamp", "")
        encoded = self.secret.removeprefix("whsec_")
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4))
        expected = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + r.body, hashlib.sha256).digest())
        offered = [s.partition(",")[2] for s in r.headers.get("webhook-signature", "").split() if s.startswith("v1,")]
        if not (msg_id and ts.isdigit() and abs(time.time() - int(ts)) < 300):
            raise Refused("missing or stale headers", 400, {"error": "headers"})
        if not any(hmac.compare_digest(expected.decode(), o) for o in offered):
            raise Refused("bad signature", 401, {"error": "signature"})
        data = self._json(r, Refused("not json", 400, {"error": "json"}))
        if not (isinstance(data, dict) and str(data.get("type", "")).startswith("alert.") and "data" in data):
            raise Refused("not an alert event", 400, {"error": "type"})
        return {"ok": True}

    # --- generic SMS gateway: whatever JSON the template makes, behind a bearer token ----------------------

    def _check_sms(self, r: Received) -> Any:
        if self.token and r.headers.get("authorization") != f"Bearer {self.token}":
            raise Refused("unauthorized", 401, {"error": "unauthorized"})
        self._json(r, Refused("not json", 400, {"error": "json"}))
        return {"status": "queued"}

    # --- Aliyun dysmsapi SendSms: RPC signature over the percent-encoded canonical query -------------------

    @staticmethod
    def aliyun_encode(value: str) -> str:
        """The docs' recipe: form-encode, then + → %20, * → %2A, %7E → ~."""
        return quote_plus(value, encoding="utf-8").replace("+", "%20").replace("*", "%2A").replace("%7E", "~")

    @classmethod
    def aliyun_signature(cls, method: str, params: dict[str, str], secret: str) -> str:
        """Signature as Aliyun's "signature method" page computes it."""
        query = "&".join(f"{cls.aliyun_encode(k)}={cls.aliyun_encode(v)}" for k, v in sorted(params.items()))
        to_sign = f"{method}&{cls.aliyun_encode('/')}&{cls.aliyun_encode(query)}"
        return base64.b64encode(hmac.new(f"{secret}&".encode(), to_sign.encode(), hashlib.sha1).digest()).decode()

    def _check_aliyun(self, r: Received) -> Any:
        def no(code: str, message: str, status: int = 400) -> Refused:
            return Refused(f"{code}: {message}", status, {"Code": code, "Message": message, "RequestId": "r-1"})

        if r.headers.get("content-type", "").split(";")[0] != "application/x-www-form-urlencoded":
            raise no("MissingParameter", "expected a form body")
        params = dict(parse_qsl(r.body.decode("ascii"), keep_blank_values=True, strict_parsing=True))
        r.params = params
        fixed = {
            "Action": "SendSms",
            "Version": "2017-05-25",
            "SignatureMethod": "HMAC-SHA1",
            "SignatureVersion": "1.0",
            "Format": "JSON",
            "RegionId": "cn-hangzhou",
        }
        for name, value in fixed.items():
            if params.get(name) != value:
                raise no("InvalidParameter", f"{name} must be {value}")
        for name in ("PhoneNumbers", "SignName", "TemplateCode", "SignatureNonce", "Timestamp", "Signature"):
            if not params.get(name):
                raise no("MissingParameter", name)
        if params.get("AccessKeyId") != ALIYUN_KEY_ID:
            raise no("InvalidAccessKeyId.NotFound", "Specified access key is not found.", 404)
        stamp = dt.datetime.strptime(params["Timestamp"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        if abs((dt.datetime.now(dt.UTC) - stamp).total_seconds()) > 900:
            raise no("InvalidTimeStamp.Expired", "Specified time stamp or date value is expired.")
        offered = params.pop("Signature")
        if not hmac.compare_digest(self.aliyun_signature("POST", params, ALIYUN_SECRET), offered):
            raise no("SignatureDoesNotMatch", "Specified signature is not matched with our calculation.")
        with self._lock:
            if params["SignatureNonce"] in self._nonces:
                raise no("SignatureNonceUsed", "Specified signature nonce was used already.")
            self._nonces.add(params["SignatureNonce"])
        json.loads(params.get("TemplateParam") or "{}")
        return {"Code": "OK", "Message": "OK", "BizId": "900619746936498440^0", "RequestId": "r-1"}


# --- SMTP ----------------------------------------------------------------------


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1 (cert.pem, key.pem in ``directory``)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@dataclass
class Mail:
    """One message the SMTP server took."""

    mail_from: str
    rcpt_tos: list[str]
    content: bytes
    tls: bool
    authenticated: bool


class Inbox:
    """aiosmtpd handler that keeps every message."""

    def __init__(self) -> None:
        self.mails: list[Mail] = []

    async def handle_DATA(self, server, session, envelope) -> str:  # noqa: N802, ANN001 - aiosmtpd's hook name
        self.mails.append(
            Mail(
                envelope.mail_from,
                list(envelope.rcpt_tos),
                envelope.original_content or envelope.content,
                session.ssl is not None or server.transport.get_extra_info("cipher") is not None,
                bool(session.authenticated),
            )
        )
        return "250 Message accepted for delivery"


@contextlib.contextmanager
def smtp_server(
    *, tls: str = "off", cert: tuple[Path, Path] | None = None, users: dict[str, str] | None = None
) -> Iterator[tuple[Inbox, int]]:
    """aiosmtpd on 127.0.0.1: ``tls`` off, starttls (required) or implicit; AUTH required when ``users`` given."""
    import ssl

    from aiosmtpd.controller import Controller
    from aiosmtpd.smtp import AuthResult, LoginPassword

    from tests.support import free_port

    inbox = Inbox()
    kwargs: dict[str, Any] = {}
    context = None
    if cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    if tls == "starttls":
        kwargs.update(tls_context=context, require_starttls=True)
    elif tls == "implicit":
        kwargs.update(ssl_context=context)
    if users is not None:

        def authenticator(_server, _session, _envelope, _mechanism, auth_data) -> AuthResult:  # noqa: ANN001
            ok = isinstance(auth_data, LoginPassword) and users.get(auth_data.login.decode()) == (
                auth_data.password.decode()
            )
            return AuthResult(success=ok, handled=False)

        kwargs.update(authenticator=authenticator, auth_required=True, auth_require_tls=tls != "off")
    port = free_port()
    controller = Controller(inbox, hostname="127.0.0.1", port=port, **kwargs)
    controller.start()
    try:
        yield inbox, port
    finally:
        controller.stop()
