"""A fake WeChat Pay API v3 platform: an outside party written from WeChat's documentation; imports nothing of paysync.

It behaves the way WeChat Pay's merchant API does for one direct merchant,
so paysync's adapter can be tested byte for byte without a network:

- **Checks our requests as WeChat does.** ``Authorization: WECHATPAY2-SHA256-RSA2048
  mchid="…",nonce_str="…",signature="…",timestamp="…",serial_no="…"``: the
  scheme, the merchant number, the merchant certificate serial, a timestamp
  within five minutes, an unused nonce, and SHA256withRSA over
  ``METHOD\\nPATH?QUERY\\nTIMESTAMP\\nNONCE\\nBODY\\n`` with the merchant's public
  key. Anything wrong is ``401 SIGN_ERROR``, unsigned (as WeChat's 4xx are).
  A missing User-Agent is ``400 INVALID_REQUEST``.
- **Wants to know which platform key we hold**: every API request must name
  one of its platform keys in ``Wechatpay-Serial`` (a certificate serial or a
  ``PUB_KEY_ID_…``), as the official SDKs send it; missing or unknown is
  ``400 PARAM_ERROR``.
- **Serves its platform certificates** at ``GET /v3/certificates``: every key
  whose id is a certificate serial, the PEM encrypted with AEAD_AES_256_GCM
  under the APIv3 key (associated data ``certificate``), the answer signed
  like any other. ``PUB_KEY_ID_…`` keys are not served (WeChat gives public
  keys out on the merchant platform only).
- **Signs its answers** (2xx) with the active platform key: ``Wechatpay-Timestamp``,
  ``-Nonce``, ``-Signature``, ``-Serial`` over ``TIMESTAMP\\nNONCE\\nBODY\\n``. A
  key id is a certificate serial or a ``PUB_KEY_ID_…``; several keys may be
  loaded and the active one switched (rotation).
- **Keeps orders and refunds.** Native orders (``code_url``), the same number
  with the same parameters answered with the same order, another parameter
  ``403 OUT_TRADE_NO_USED``, a paid one ``400 ORDERPAID``, a closed one
  ``400 ORDER_CLOSED``; query by out_trade_no; close; refunds (PROCESSING,
  then SUCCESS) and their query.
- **Sends notifications** to the order's or refund's notify_url: the
  transaction or refund encrypted with AEAD_AES_256_GCM under the APIv3 key,
  signed like an answer, retried until answered 200/204 (WeChat's schedule,
  scaled), optionally preceded by a ``WECHATPAY/SIGNTEST/`` probe.
- **Serves trade bills**: ``/v3/bill/tradebill`` → ``download_url`` +
  ``SHA1`` hash; the file is UTF-8 with a BOM, back-quoted fields, a summary.
- **Fault knobs** (seeded): SYSTEM_ERROR, FREQUENCY_LIMITED, 5xx, timeouts
  before or after the work is done, bad or missing answer signatures, and a
  ``script`` of faults for the next requests, in order.

Control surface (``/_fake/…``, this machine only): pay an order, set faults,
switch the signing key, read the state, reset.

``python -m sandbox.fakes.wechatpay --port N`` serves it (settings below, from
``WECHATPAY_FAKE_*``); ``--keygen DIR`` writes a matching set of keys and
prints the environment both sides need.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import functools
import hashlib
import json
import os
import random
import re
import secrets
import signal
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import requests
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.x509.oid import NameOID
from flask import Flask, Response, request

BEIJING = timezone(timedelta(hours=8))
SCHEME = "WECHATPAY2-SHA256-RSA2048"
WINDOW_SECONDS = 300
LOCAL = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
NOTIFY_SCHEDULE = (15, 15, 30, 180, 600, 1200, 1800, 1800, 1800, 3600, 10800, 10800, 10800, 21600, 21600)
"""WeChat's documented retry intervals (seconds) for notifications not answered 200/204."""
OUT_TRADE_NO = re.compile(r"[0-9A-Za-z_\-|*]{6,32}")
OUT_REFUND_NO = re.compile(r"[0-9A-Za-z_\-|*@]{1,64}")
FAULT_NAMES = ("SYSTEM_ERROR", "SYSTEMERROR", "FREQUENCY_LIMITED", "5xx", "timeout_before", "timeout_after")
"""What a ``script`` entry may name."""

TRADE_BILL_COLUMNS = (
    "交易时间,公众账号ID,商户号,特约商户号,设备号,微信订单号,商户订单号,用户标识,交易类型,交易状态,付款银行,货币种类,"
    "应结订单金额,代金券金额,微信退款单号,商户退款单号,退款金额,充值券退款金额,退款类型,退款状态,商品名称,商户数据包,"
    "手续费,费率,订单金额,申请退款金额,费率备注"
)
TRADE_BILL_SUMMARY = "总交易单数,应结订单总金额,退款总金额,充值券退款总金额,手续费总金额,订单总金额,申请退款总金额"


# --------------------------------------------------------------------------------------------- faults


@dataclass
class Faults:
    """Fault knobs; rates are probabilities in [0, 1]. All zero: a well-behaved platform."""

    system_error_rate: float = 0.0
    """Share of API requests answered 500 SYSTEM_ERROR before anything is done."""
    frequency_limited_rate: float = 0.0
    """Share answered 429 FREQUENCY_LIMITED before anything is done."""
    error_5xx_rate: float = 0.0
    """Share answered 503 SERVICE_UNAVAILABLE (an HTML-less gateway error) before anything is done."""
    timeout_before_rate: float = 0.0
    """Share held for hang_seconds and then answered 500, nothing done."""
    timeout_after_rate: float = 0.0
    """Share done and committed, whose answer is then held for hang_seconds."""
    bad_signature_rate: float = 0.0
    """Share of 2xx answers signed with a key nobody configured."""
    unsigned_rate: float = 0.0
    """Share of 2xx answers sent with no signature headers."""
    hang_seconds: float = 3.0
    refund_seconds: float = 0.2
    """A refund stays PROCESSING this long, then succeeds (and is notified)."""
    probe_notifications: bool = False
    """Send a WECHATPAY/SIGNTEST/ probe before each notification, as WeChat sometimes does."""
    duplicate_notification_rate: float = 0.0
    """Share of notifications delivered once more after their first success."""
    corrupt_bill: bool = False
    """Serve bill files that do not match their hash_value."""
    script: list[str] = field(default_factory=list)
    """Faults for the next API requests, one each, in order (FAULT_NAMES)."""
    seed: int | None = None

    @classmethod
    def parse(cls, raw: dict[str, Any] | str | None) -> Faults:
        """Validate knobs from JSON; ValueError names the bad one."""
        data = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
        if not isinstance(data, dict):
            raise ValueError("faults must be a JSON object")
        known = {f.name for f in fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"unknown fault knob {key!r}")
            if key.endswith("_rate") and not (isinstance(value, int | float) and 0 <= value <= 1):
                raise ValueError(f"{key} must be a number in [0, 1]")
            if key == "script" and not (isinstance(value, list) and all(v in FAULT_NAMES for v in value)):
                raise ValueError(f"script must be a list of {', '.join(FAULT_NAMES)}")
        return cls(**data)


# --------------------------------------------------------------------------------------------- model


@dataclass
class Order:
    """One Native order, as WeChat keeps it."""

    out_trade_no: str
    request: dict[str, Any]
    """The order request as received (what a re-send must match)."""
    code_url: str
    created_at: float
    notify_url: str
    total: int
    description: str
    trade_state: str = "NOTPAY"
    transaction_id: str | None = None
    success_time: float | None = None
    refunded: int = 0


@dataclass
class Refund:
    """One refund of an order."""

    out_refund_no: str
    refund_id: str
    out_trade_no: str
    amount: int
    total: int
    notify_url: str | None
    created_at: float
    status: str = "PROCESSING"
    success_time: float | None = None


@dataclass
class Delivery:
    """One notification on its way to a notify_url."""

    url: str
    body: bytes
    event_id: str
    event_type: str
    attempts: int = 0
    next_at: float = 0.0
    done: bool = False
    duplicated: bool = False
    answers: list[int | str] = field(default_factory=list)


@dataclass
class FakeConfig:
    """The merchant and the platform this fake plays."""

    mchid: str
    appid: str
    apiv3_key: bytes
    merchant_public_key: rsa.RSAPublicKey
    merchant_serial: str
    platform_keys: list[tuple[str, rsa.RSAPrivateKey]]
    """(key id, private key); the first signs until another is made active."""
    fee_rate: Decimal = Decimal("0.006")
    notify_max_attempts: int = len(NOTIFY_SCHEDULE) + 1
    notify_backoff_scale: float = 1.0
    """Multiplies NOTIFY_SCHEDULE (tests use a small scale)."""


# --------------------------------------------------------------------------------------------- signing


def rsa_sign(key: rsa.RSAPrivateKey, message: bytes) -> str:
    """base64(SHA256withRSA(message))."""
    return base64.b64encode(key.sign(message, padding.PKCS1v15(), hashes.SHA256())).decode()


def signature_headers(key_id: str, key: rsa.RSAPrivateKey, body: bytes, now: float) -> dict[str, str]:
    """The Wechatpay-* headers of a signed answer or notification."""
    timestamp, nonce = str(int(now)), secrets.token_hex(16)
    message = f"{timestamp}\n{nonce}\n".encode() + body + b"\n"
    return {
        "Wechatpay-Timestamp": timestamp,
        "Wechatpay-Nonce": nonce,
        "Wechatpay-Signature": rsa_sign(key, message),
        "Wechatpay-Serial": key_id,
    }


def encrypt_resource(apiv3_key: bytes, plaintext: bytes, associated_data: str, original_type: str) -> dict[str, str]:
    """An AEAD_AES_256_GCM resource object, as notifications carry."""
    nonce = "".join(random.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", k=12))  # noqa: S311
    sealed = AESGCM(apiv3_key).encrypt(nonce.encode(), plaintext, associated_data.encode())
    return {
        "original_type": original_type,
        "algorithm": "AEAD_AES_256_GCM",
        "ciphertext": base64.b64encode(sealed).decode(),
        "associated_data": associated_data,
        "nonce": nonce,
    }


_AUTH_PARAM = re.compile(r'\s*([a-z_]+)="([^"]*)"\s*')


def parse_authorization(value: str | None) -> dict[str, str] | None:
    """The parameters of a WECHATPAY2-SHA256-RSA2048 Authorization header, or None if it is not one."""
    if not value or not value.startswith(SCHEME + " "):
        return None
    params: dict[str, str] = {}
    for part in value[len(SCHEME) + 1 :].split(","):
        match = _AUTH_PARAM.fullmatch(part)
        if match is None:
            return None
        params[match.group(1)] = match.group(2)
    return params


def rfc3339(ts: float) -> str:
    """Beijing-time RFC 3339, as WeChat writes times."""
    return datetime.fromtimestamp(ts, BEIJING).replace(microsecond=0).isoformat()


def yuan(fen: int) -> str:
    """Fen as a yuan string with two decimals."""
    return f"{Decimal(fen) / 100:.2f}"


# --------------------------------------------------------------------------------------------- the platform


class FakeWechatPay:
    """The platform's state and behaviour; ``app()`` is its HTTP surface."""

    def __init__(self, config: FakeConfig, faults: Faults | None = None) -> None:
        self.config = config
        self.lock = threading.RLock()
        self.clock = time.time
        """Seconds since the epoch; tests move it."""
        self.faults = faults or Faults()
        self.rng = random.Random(self.faults.seed)  # noqa: S311 - fault dice, not cryptography
        self.orders: dict[str, Order] = {}
        self.refunds: dict[str, Refund] = {}
        self.deliveries: list[Delivery] = []
        self.auth_log: deque[dict[str, Any]] = deque(maxlen=10_000)
        """Every API request's Authorization check: {"path", "ok", "reason"}."""
        self.order_requests: dict[str, int] = {}
        """Native order requests received per out_trade_no (a re-send counts)."""
        self.bills: dict[str, bytes] = {}
        self._nonces: dict[str, float] = {}
        self._certificates: dict[str, bytes] = {}
        self.active_key = config.platform_keys[0][0]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the notification sender thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._send_loop, name="fake-wechatpay-notify", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the sender (deliveries in progress finish)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)

    def reset(self) -> None:
        """Forget everything; no faults."""
        with self.lock:
            self.orders.clear()
            self.refunds.clear()
            self.deliveries.clear()
            self.auth_log.clear()
            self.order_requests.clear()
            self.bills.clear()
            self._nonces.clear()
            self.set_faults(Faults())
            self.active_key = self.config.platform_keys[0][0]

    def set_faults(self, faults: Faults) -> None:
        """Replace the knobs (and re-seed the dice)."""
        with self.lock:
            self.faults = faults
            self.rng = random.Random(faults.seed)  # noqa: S311

    @functools.cached_property
    def _stray_key(self) -> rsa.RSAPrivateKey:
        """A key nobody configured, for bad_signature_rate (made on first use: RSA keys are slow to make)."""
        return rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def key(self, key_id: str) -> rsa.RSAPrivateKey:
        """The platform private key ``key_id``; KeyError if not loaded."""
        for known, key in self.config.platform_keys:
            if known == key_id:
                return key
        raise KeyError(key_id)

    # ----------------------------------------------------------------------------------------- HTTP plumbing

    def _answer(self, status: int, payload: Any = None, *, signed: bool = True) -> Response:
        body = b"" if payload is None else json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        headers = {"Request-ID": uuid.uuid4().hex}
        if signed and 200 <= status < 300:
            with self.lock:
                bad, unsigned = self._roll("bad_signature_rate"), self._roll("unsigned_rate")
            key = self._stray_key if bad else self.key(self.active_key)
            if not unsigned:
                headers.update(signature_headers(self.active_key, key, body, self.clock()))
        response = Response(body, status, headers=headers)
        if body:
            response.content_type = "application/json"
        return response

    def _error(self, status: int, code: str, message: str) -> Response:
        # WeChat's 4xx/5xx carry no Wechatpay-* headers (what was observed of the real API).
        return self._answer(status, {"code": code, "message": message}, signed=False)

    def _roll(self, knob: str) -> bool:
        rate = getattr(self.faults, knob)
        draw = self.rng.random()
        return draw < rate

    def _authenticate(self) -> Response | None:
        """WeChat's request checks, in its order; an error answer, or None when the request may proceed."""
        path = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI") or request.full_path.rstrip("?")
        reason = self._auth_problem(path)
        if reason is None and not self._serial_known():
            reason = "Wechatpay-Serial"
        serial = request.headers.get("Wechatpay-Serial")
        with self.lock:
            self.auth_log.append(
                {"path": path, "method": request.method, "ok": reason is None, "reason": reason, "serial": serial}
            )
        if reason is None:
            return None
        if reason == "Wechatpay-Serial":
            return self._error(400, "PARAM_ERROR", "Wechatpay-Serial 缺失或不是平台证书序列号/微信支付公钥ID")
        if reason == "no user agent":
            return self._error(400, "INVALID_REQUEST", "Http头缺少Accept或User-Agent")
        return self._error(401, "SIGN_ERROR", reason)

    def _serial_known(self) -> bool:
        """WeChat's check of Wechatpay-Serial: it names one of the platform's keys (serials in any case)."""
        serial = (request.headers.get("Wechatpay-Serial") or "").strip()
        ids = [k for k, _ in self.config.platform_keys]
        return serial in ids or serial.upper() in {k.upper() for k in ids if not k.startswith("PUB_KEY_ID_")}

    def certificate_pem(self, key_id: str) -> bytes:
        """The platform certificate of a certificate-serial key (made once, self-signed as the keygen's are)."""
        with self.lock:
            if key_id not in self._certificates:
                self._certificates[key_id] = certificate(self.key(key_id), int(key_id, 16), "Tenpay.com Root CA")
            return self._certificates[key_id]

    def _certificates_answer(self) -> Response:
        data = []
        for key_id, _ in self.config.platform_keys:
            if key_id.startswith("PUB_KEY_ID_"):
                continue
            pem = self.certificate_pem(key_id)
            cert = x509.load_pem_x509_certificate(pem)
            sealed = encrypt_resource(self.config.apiv3_key, pem, "certificate", "certificate")
            sealed.pop("original_type")
            data.append(
                {
                    "serial_no": key_id,
                    "effective_time": rfc3339(cert.not_valid_before_utc.timestamp()),
                    "expire_time": rfc3339(cert.not_valid_after_utc.timestamp()),
                    "encrypt_certificate": sealed,
                }
            )
        return self._answer(200, {"data": data})

    def _auth_problem(self, path: str) -> str | None:
        if not request.headers.get("User-Agent"):
            return "no user agent"
        params = parse_authorization(request.headers.get("Authorization"))
        if params is None:
            return "Http头Authorization值格式错误"
        if set(params) != {"mchid", "nonce_str", "signature", "timestamp", "serial_no"}:
            return "Authorization parameters incomplete"
        if params["mchid"] != self.config.mchid:
            return "商户号不存在"
        if params["serial_no"].upper() != self.config.merchant_serial.upper():
            return "商户证书序列号有误"
        try:
            timestamp = int(params["timestamp"])
        except ValueError:
            return "timestamp format"
        now = self.clock()
        if abs(now - timestamp) > WINDOW_SECONDS:
            return "Http头Authorization中的timestamp与发起请求的时间不得超过5分钟"
        message = b"\n".join(
            [request.method.encode(), path.encode(), params["timestamp"].encode(), params["nonce_str"].encode()]
        )
        message += b"\n" + request.get_data() + b"\n"
        try:
            self.config.merchant_public_key.verify(
                base64.b64decode(params["signature"], validate=True), message, padding.PKCS1v15(), hashes.SHA256()
            )
        except (InvalidSignature, binascii.Error, ValueError):
            return "签名错误"
        with self.lock:
            for nonce, seen in list(self._nonces.items()):
                if now - seen > WINDOW_SECONDS:
                    del self._nonces[nonce]
            if params["nonce_str"] in self._nonces:
                return "nonce_str reused"
            self._nonces[params["nonce_str"]] = now
        return None

    def _fault_before(self) -> tuple[Response | None, bool]:
        """A fault answer to give instead of doing the work, and whether to hang after doing it."""
        with self.lock:
            scripted = self.faults.script.pop(0) if self.faults.script else None
            draws = {
                name: self._roll(name)
                for name in (
                    "system_error_rate",
                    "frequency_limited_rate",
                    "error_5xx_rate",
                    "timeout_before_rate",
                    "timeout_after_rate",
                )
            }
            hang = self.faults.hang_seconds
        if scripted in ("SYSTEM_ERROR", "SYSTEMERROR") or (scripted is None and draws["system_error_rate"]):
            code = scripted if scripted == "SYSTEMERROR" else "SYSTEM_ERROR"
            return self._error(500, code, "系统异常，请稍后重试"), False
        if scripted == "FREQUENCY_LIMITED" or (scripted is None and draws["frequency_limited_rate"]):
            return self._error(429, "FREQUENCY_LIMITED", "频率超限"), False
        if scripted == "5xx" or (scripted is None and draws["error_5xx_rate"]):
            return Response("", 503), False
        if scripted == "timeout_before" or (scripted is None and draws["timeout_before_rate"]):
            time.sleep(hang)
            return self._error(500, "SYSTEM_ERROR", "系统超时"), False
        return None, scripted == "timeout_after" or (scripted is None and draws["timeout_after_rate"])

    def _json_body(self) -> dict[str, Any] | Response:
        try:
            data = json.loads(request.get_data() or b"null")
        except ValueError:
            return self._error(400, "PARAM_ERROR", "请求体不是合法的JSON")
        if not isinstance(data, dict):
            return self._error(400, "PARAM_ERROR", "请求体必须是JSON对象")
        return data

    # ----------------------------------------------------------------------------------------- API

    def app(self) -> Flask:
        """The Flask app of the platform's API and control surface."""
        app = Flask("fake_wechatpay")
        app.json.ensure_ascii = False  # type: ignore[attr-defined]

        def api(rule: str, methods: list[str]):  # noqa: ANN202
            def wrap(handler):  # noqa: ANN001, ANN202
                def view(**kwargs: Any) -> Response:
                    refused = self._authenticate()
                    if refused is not None:
                        return refused
                    fault, hang_after = self._fault_before()
                    if fault is not None:
                        return fault
                    answer = handler(**kwargs)
                    if hang_after:
                        time.sleep(self.faults.hang_seconds)
                    return answer

                view.__name__ = handler.__name__
                app.add_url_rule(rule, view_func=view, methods=methods)
                return handler

            return wrap

        @api("/v3/pay/transactions/native", ["POST"])
        def native() -> Response:
            return self._native()

        @api("/v3/pay/transactions/out-trade-no/<out_trade_no>", ["GET"])
        def query(out_trade_no: str) -> Response:
            return self._query(out_trade_no)

        @api("/v3/pay/transactions/out-trade-no/<out_trade_no>/close", ["POST"])
        def close(out_trade_no: str) -> Response:
            return self._close(out_trade_no)

        @api("/v3/refund/domestic/refunds", ["POST"])
        def refund() -> Response:
            return self._refund()

        @api("/v3/refund/domestic/refunds/<out_refund_no>", ["GET"])
        def refund_query(out_refund_no: str) -> Response:
            return self._refund_query(out_refund_no)

        @api("/v3/certificates", ["GET"])
        def certificates() -> Response:
            return self._certificates_answer()

        @api("/v3/bill/tradebill", ["GET"])
        def tradebill() -> Response:
            return self._tradebill()

        @app.get("/v3/billdownload/file")
        def billdownload() -> Response:
            refused = self._authenticate()
            if refused is not None:
                return refused
            data = self.bills.get(request.args.get("token", ""))
            if data is None:
                return self._error(404, "RESOURCE_NOT_EXISTS", "账单不存在或已过期")
            if self.faults.corrupt_bill:
                data = data.replace(b"SUCCESS", b"SUCCESs", 1) + b"\r\n"
            return Response(data, 200, content_type="text/plain; charset=utf-8")  # not signed: the hash is

        self._control(app)
        return app

    def _native(self) -> Response:
        data = self._json_body()
        if isinstance(data, Response):
            return data
        if data.get("mchid") != self.config.mchid:
            return self._error(400, "MCH_NOT_EXISTS", "商户号不存在")
        if data.get("appid") != self.config.appid:
            return self._error(400, "APPID_MCHID_NOT_MATCH", "AppID和mch_id不匹配")
        out_trade_no, description = data.get("out_trade_no"), data.get("description")
        amount, notify_url = data.get("amount"), data.get("notify_url")
        if not isinstance(out_trade_no, str) or not OUT_TRADE_NO.fullmatch(out_trade_no):
            return self._error(400, "PARAM_ERROR", "out_trade_no 格式错误")
        if not isinstance(description, str) or not 0 < len(description) <= 127:
            return self._error(400, "PARAM_ERROR", "description 格式错误")
        if not isinstance(notify_url, str) or not notify_url.startswith(("http://", "https://")):
            return self._error(400, "PARAM_ERROR", "notify_url 格式错误")
        total = amount.get("total") if isinstance(amount, dict) else None
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0:
            return self._error(400, "PARAM_ERROR", "amount.total 必须是正整数（分）")
        if amount.get("currency", "CNY") != "CNY":
            return self._error(400, "PARAM_ERROR", "amount.currency 只支持 CNY")
        with self.lock:
            self.order_requests[out_trade_no] = self.order_requests.get(out_trade_no, 0) + 1
            order = self.orders.get(out_trade_no)
            if order is not None:
                if order.trade_state in ("SUCCESS", "REFUND"):
                    return self._error(400, "ORDERPAID", "该订单已支付")
                if order.trade_state == "CLOSED":
                    return self._error(400, "ORDER_CLOSED", "订单已关闭")
                if order.request != data:
                    return self._error(403, "OUT_TRADE_NO_USED", "商户订单号重复")
                return self._answer(200, {"code_url": order.code_url})
            order = Order(
                out_trade_no=out_trade_no,
                request=data,
                code_url=f"weixin://wxpay/bizpayurl?pr={secrets.token_urlsafe(7)}",
                created_at=self.clock(),
                notify_url=notify_url,
                total=total,
                description=description,
            )
            self.orders[out_trade_no] = order
            return self._answer(200, {"code_url": order.code_url})

    def transaction(self, order: Order) -> dict[str, Any]:
        """An order as the query answer and the notification resource show it."""
        paid = order.trade_state in ("SUCCESS", "REFUND")
        body: dict[str, Any] = {
            "appid": self.config.appid,
            "mchid": self.config.mchid,
            "out_trade_no": order.out_trade_no,
            "trade_type": "NATIVE",
            "trade_state": order.trade_state,
            "trade_state_desc": {
                "NOTPAY": "未支付",
                "SUCCESS": "支付成功",
                "REFUND": "转入退款",
                "CLOSED": "已关闭",
                "PAYERROR": "支付失败",
            }.get(order.trade_state, order.trade_state),
            "attach": "",
            "amount": {"total": order.total, "currency": "CNY"},
        }
        if paid:
            body.update(
                transaction_id=order.transaction_id,
                bank_type="OTHERS",
                success_time=rfc3339(order.success_time or self.clock()),
                payer={"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
            )
            body["amount"].update(payer_total=order.total, payer_currency="CNY")
        return body

    def _query(self, out_trade_no: str) -> Response:
        if request.args.get("mchid") != self.config.mchid:
            return self._error(400, "PARAM_ERROR", "mchid 与请求商户号不一致")
        with self.lock:
            order = self.orders.get(out_trade_no)
            if order is None:
                return self._error(404, "ORDER_NOT_EXIST", "订单不存在")
            return self._answer(200, self.transaction(order))

    def _close(self, out_trade_no: str) -> Response:
        data = self._json_body()
        if isinstance(data, Response):
            return data
        if data.get("mchid") != self.config.mchid:
            return self._error(400, "PARAM_ERROR", "mchid 与请求商户号不一致")
        with self.lock:
            order = self.orders.get(out_trade_no)
            if order is None:
                return self._error(404, "ORDER_NOT_EXIST", "订单不存在")
            if order.trade_state in ("SUCCESS", "REFUND"):
                return self._error(400, "ORDERPAID", "订单已支付，不能关闭")
            order.trade_state = "CLOSED"
            return self._answer(204)

    def _refund(self) -> Response:
        data = self._json_body()
        if isinstance(data, Response):
            return data
        out_refund_no, amount = data.get("out_refund_no"), data.get("amount")
        if not isinstance(out_refund_no, str) or not OUT_REFUND_NO.fullmatch(out_refund_no):
            return self._error(400, "PARAM_ERROR", "out_refund_no 格式错误")
        if not isinstance(amount, dict) or amount.get("currency") != "CNY":
            return self._error(400, "PARAM_ERROR", "amount.currency 必填，且只支持 CNY")
        refund, total = amount.get("refund"), amount.get("total")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (refund, total)):
            return self._error(400, "PARAM_ERROR", "amount.refund 和 amount.total 必须是正整数（分）")
        with self.lock:
            order = self._order_for_refund(data)
            if order is None or order.trade_state not in ("SUCCESS", "REFUND"):
                return self._error(404, "RESOURCE_NOT_EXISTS", "订单不存在或未支付")
            if total != order.total:
                return self._error(400, "INVALID_REQUEST", "您的请求参数与订单信息不一致")
            existing = self.refunds.get(out_refund_no)
            if existing is not None:
                if existing.amount != refund or existing.out_trade_no != order.out_trade_no:
                    return self._error(400, "INVALID_REQUEST", "退款金额与之前请求不一致")
                return self._answer(200, self.refund_object(existing))
            if refund > order.total - order.refunded:
                return self._error(400, "INVALID_REQUEST", "申请退款金额超过订单可退金额")
            item = Refund(
                out_refund_no=out_refund_no,
                refund_id=f"50{secrets.randbelow(10**26):026d}",
                out_trade_no=order.out_trade_no,
                amount=refund,
                total=order.total,
                notify_url=data.get("notify_url") if isinstance(data.get("notify_url"), str) else None,
                created_at=self.clock(),
            )
            self.refunds[out_refund_no] = item
            order.refunded += refund
            order.trade_state = "REFUND"
            delay = self.faults.refund_seconds
            answer = self._answer(200, self.refund_object(item))
        threading.Timer(delay, self.finish_refund, args=(out_refund_no,)).start()
        return answer

    def _order_for_refund(self, data: dict[str, Any]) -> Order | None:
        if isinstance(data.get("out_trade_no"), str):
            return self.orders.get(data["out_trade_no"])
        for order in self.orders.values():
            if order.transaction_id is not None and order.transaction_id == data.get("transaction_id"):
                return order
        return None

    def refund_object(self, item: Refund) -> dict[str, Any]:
        """A refund as the refund answers show it."""
        order = self.orders[item.out_trade_no]
        body: dict[str, Any] = {
            "refund_id": item.refund_id,
            "out_refund_no": item.out_refund_no,
            "transaction_id": order.transaction_id,
            "out_trade_no": item.out_trade_no,
            "channel": "ORIGINAL",
            "user_received_account": "支付用户零钱",
            "create_time": rfc3339(item.created_at),
            "status": item.status,
            "funds_account": "AVAILABLE",
            "amount": {
                "total": item.total,
                "refund": item.amount,
                "payer_total": item.total,
                "payer_refund": item.amount,
                "settlement_refund": item.amount,
                "settlement_total": item.total,
                "discount_refund": 0,
                "currency": "CNY",
            },
        }
        if item.success_time is not None:
            body["success_time"] = rfc3339(item.success_time)
        return body

    def finish_refund(self, out_refund_no: str, status: str = "SUCCESS") -> None:
        """Complete a PROCESSING refund (SUCCESS, CLOSED or ABNORMAL) and notify it."""
        with self.lock:
            item = self.refunds.get(out_refund_no)
            if item is None or item.status != "PROCESSING":
                return
            item.status = status
            if status == "SUCCESS":
                item.success_time = self.clock()
            if item.notify_url:
                order = self.orders[item.out_trade_no]
                resource = {
                    "mchid": self.config.mchid,
                    "out_trade_no": item.out_trade_no,
                    "transaction_id": order.transaction_id,
                    "out_refund_no": item.out_refund_no,
                    "refund_id": item.refund_id,
                    "refund_status": status,
                    "user_received_account": "支付用户零钱",
                    "amount": {"total": item.total, "refund": item.amount, "payer_total": item.total},
                }
                resource["amount"]["payer_refund"] = item.amount
                if item.success_time is not None:
                    resource["success_time"] = rfc3339(item.success_time)
                summary = {"SUCCESS": "退款成功", "CLOSED": "退款关闭", "ABNORMAL": "退款异常"}[status]
                self.enqueue(item.notify_url, f"REFUND.{status}", summary, resource, "refund")

    def _refund_query(self, out_refund_no: str) -> Response:
        with self.lock:
            item = self.refunds.get(out_refund_no)
            if item is None:
                return self._error(404, "RESOURCE_NOT_EXISTS", "退款单不存在")
            return self._answer(200, self.refund_object(item))

    # ----------------------------------------------------------------------------------------- bills

    def _tradebill(self) -> Response:
        day = request.args.get("bill_date", "")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", day):
            return self._error(400, "PARAM_ERROR", "bill_date 格式错误")
        if request.args.get("bill_type", "ALL") != "ALL":
            return self._error(400, "PARAM_ERROR", "this fake serves bill_type ALL only")
        data = self.trade_bill(day)
        if data is None:
            return self._error(400, "NO_STATEMENT_EXIST", "账单文件不存在")
        token = secrets.token_urlsafe(24)
        with self.lock:
            self.bills[token] = data
        return self._answer(
            200,
            {
                "hash_type": "SHA1",
                "hash_value": hashlib.sha1(data).hexdigest(),  # noqa: S324 - WeChat's bill hash
                "download_url": f"{request.host_url}v3/billdownload/file?token={token}",
            },
        )

    def trade_bill(self, day: str) -> bytes | None:
        """The ALL trade bill of a Beijing day (payments by success time, refunds by creation), or None if empty."""
        start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=BEIJING).timestamp()
        end = start + 86400
        rows: list[list[str]] = []
        settled = refunded = asked = ordered = 0
        fees = Decimal(0)
        rate = self.config.fee_rate
        with self.lock:
            for order in self.orders.values():
                if order.success_time is None or not start <= order.success_time < end:
                    continue
                fee = Decimal(order.total) / 100 * rate
                fees += fee
                settled += order.total
                ordered += order.total
                rows.append(self._bill_row(order, order.success_time, "SUCCESS", fee, None))
            for item in self.refunds.values():
                if not start <= item.created_at < end:
                    continue
                order = self.orders[item.out_trade_no]
                fee = -(Decimal(item.amount) / 100 * rate)
                fees += fee
                refunded += item.amount
                asked += item.amount
                rows.append(self._bill_row(order, item.created_at, "REFUND", fee, item))
        if not rows:
            return None
        lines = [TRADE_BILL_COLUMNS]
        lines += ["`" + ",`".join(row) for row in rows]
        lines.append(TRADE_BILL_SUMMARY)
        totals = [str(len(rows)), yuan(settled), yuan(refunded), "0.00", f"{fees:.5f}", yuan(ordered), yuan(asked)]
        lines.append("`" + ",`".join(totals))
        return ("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8")

    def _bill_row(self, order: Order, ts: float, state: str, fee: Decimal, refund: Refund | None) -> list[str]:
        when = datetime.fromtimestamp(ts, BEIJING).strftime("%Y-%m-%d %H:%M:%S")
        is_refund = refund is not None
        return [
            when,
            self.config.appid,
            self.config.mchid,
            "0",
            "",
            order.transaction_id or "",
            order.out_trade_no,
            "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o",
            "NATIVE",
            state,
            "OTHERS",
            "CNY",
            "0.00" if is_refund else yuan(order.total),
            "0.00",
            refund.refund_id if refund else "0",
            refund.out_refund_no if refund else "0",
            yuan(refund.amount) if refund else "0.00",
            "0.00",
            "ORIGINAL" if is_refund else "",
            refund.status if refund else "",
            order.description,
            "",
            f"{fee:.5f}",
            f"{self.config.fee_rate * 100:.2f}%",
            "0.00" if is_refund else yuan(order.total),
            yuan(refund.amount) if refund else "0.00",
            "",
        ]

    # ----------------------------------------------------------------------------------------- payer and notifications

    def pay(self, out_trade_no: str, *, notify: bool = True) -> Order:
        """The payer scans the code and pays: SUCCESS, a transaction id, a TRANSACTION.SUCCESS notification."""
        with self.lock:
            order = self.orders[out_trade_no]
            if order.trade_state != "NOTPAY":
                raise ValueError(f"order {out_trade_no} is {order.trade_state}")
            order.trade_state = "SUCCESS"
            order.transaction_id = f"42{secrets.randbelow(10**26):026d}"
            order.success_time = self.clock()
            if notify:
                self.notify_transaction(order)
            return order

    def notify_transaction(self, order: Order) -> Delivery:
        """Queue a TRANSACTION.SUCCESS notification for ``order`` (again, if asked: a WeChat retry is the same id)."""
        with self.lock:
            resource = self.transaction(order)
            return self.enqueue(order.notify_url, "TRANSACTION.SUCCESS", "支付成功", resource, "transaction")

    def notification_body(self, event_type: str, summary: str, resource: dict[str, Any], original_type: str) -> bytes:
        """A notification body: id, times, and the encrypted resource."""
        plaintext = json.dumps(resource, ensure_ascii=False, separators=(",", ":")).encode()
        body = {
            "id": str(uuid.uuid4()),
            "create_time": rfc3339(self.clock()),
            "resource_type": "encrypt-resource",
            "event_type": event_type,
            "summary": summary,
            "resource": encrypt_resource(self.config.apiv3_key, plaintext, original_type, original_type),
        }
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()

    def enqueue(
        self, url: str, event_type: str, summary: str, resource: dict[str, Any], original_type: str
    ) -> Delivery:
        """Queue one notification for delivery (the sender thread signs and posts it)."""
        body = self.notification_body(event_type, summary, resource, original_type)
        delivery = Delivery(url, body, json.loads(body)["id"], event_type, next_at=self.clock())
        with self.lock:
            self.deliveries.append(delivery)
        self._wake.set()
        return delivery

    def signed_notification(self, body: bytes, key_id: str | None = None, probe: bool = False) -> dict[str, str]:
        """The headers of one delivery attempt of ``body`` (a SIGNTEST probe when ``probe``)."""
        key_id = key_id or self.active_key
        headers = signature_headers(key_id, self.key(key_id), body, self.clock())
        if probe:
            headers["Wechatpay-Signature"] = "WECHATPAY/SIGNTEST/" + headers["Wechatpay-Signature"][19:]
        headers.update(
            {
                "Wechatpay-Signature-Type": SCHEME,
                "Content-Type": "application/json",
                "User-Agent": "Mozilla/4.0",
            }
        )
        return headers

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            now = self.clock()
            with self.lock:
                due = [d for d in self.deliveries if not d.done and d.next_at <= now]
                waiting = [d.next_at for d in self.deliveries if not d.done and d.next_at > now]
            for delivery in due:
                self._attempt(delivery)
            self._wake.wait(min([*waiting, now + 1.0]) - now if waiting else 1.0)
            self._wake.clear()

    def _attempt(self, delivery: Delivery) -> None:
        with self.lock:
            probe = self.faults.probe_notifications and delivery.attempts == 0
            duplicate = self._roll("duplicate_notification_rate")
        if probe:
            self._post(delivery, self.signed_notification(delivery.body, probe=True))
        answer = self._post(delivery, self.signed_notification(delivery.body))
        with self.lock:
            delivery.attempts += 1
            delivery.answers.append(answer)
            if answer in (200, 204):
                if duplicate and not delivery.duplicated:
                    delivery.duplicated = True
                    delivery.next_at = self.clock()
                    return
                delivery.done = True
            elif delivery.attempts >= self.config.notify_max_attempts:
                delivery.done = True
            else:
                step = NOTIFY_SCHEDULE[min(delivery.attempts - 1, len(NOTIFY_SCHEDULE) - 1)]
                delivery.next_at = self.clock() + step * self.config.notify_backoff_scale

    def _post(self, delivery: Delivery, headers: dict[str, str]) -> int | str:
        try:
            return requests.post(delivery.url, data=delivery.body, headers=headers, timeout=5).status_code
        except requests.RequestException as exc:
            return type(exc).__name__

    # ----------------------------------------------------------------------------------------- control surface

    def state(self) -> dict[str, Any]:
        """Everything the platform holds, as JSON-ready data."""
        with self.lock:
            return {
                "orders": {k: {**asdict(o), "request": o.request} for k, o in self.orders.items()},
                "refunds": {k: asdict(r) for k, r in self.refunds.items()},
                "order_requests": dict(self.order_requests),
                "deliveries": [
                    {**asdict(d), "body": d.body.decode()}
                    for d in self.deliveries  # bodies are ciphertext already
                ],
                "auth": {
                    "ok": sum(1 for a in self.auth_log if a["ok"]),
                    "refused": [a for a in self.auth_log if not a["ok"]],
                },
                "active_key": self.active_key,
            }

    def _control(self, app: Flask) -> None:
        def local() -> Response | None:
            if request.remote_addr not in LOCAL:
                return Response('{"error": "control surface answers this machine only"}', 403)
            return None

        @app.post("/_fake/orders/<out_trade_no>/pay")
        def pay(out_trade_no: str) -> Any:
            refused = local()
            if refused is not None:
                return refused
            try:
                order = self.pay(out_trade_no, notify=bool((request.get_json(silent=True) or {}).get("notify", True)))
            except (KeyError, ValueError) as exc:
                return {"error": str(exc)}, 409
            return self.transaction(order)

        @app.post("/_fake/refunds/<out_refund_no>/finish")
        def finish(out_refund_no: str) -> Any:
            refused = local()
            if refused is not None:
                return refused
            self.finish_refund(out_refund_no, (request.get_json(silent=True) or {}).get("status", "SUCCESS"))
            return self.refund_object(self.refunds[out_refund_no])

        @app.route("/_fake/faults", methods=["GET", "POST"])
        def faults() -> Any:
            refused = local()
            if refused is not None:
                return refused
            if request.method == "POST":
                try:
                    self.set_faults(Faults.parse(request.get_json(silent=True) or {}))
                except (TypeError, ValueError) as exc:
                    return {"error": str(exc)}, 400
            return asdict(self.faults)

        @app.post("/_fake/keys/active")
        def active_key() -> Any:
            refused = local()
            if refused is not None:
                return refused
            key_id = (request.get_json(silent=True) or {}).get("key_id")
            try:
                self.key(str(key_id))
            except KeyError:
                return {"error": f"no platform key {key_id!r}"}, 400
            self.active_key = str(key_id)
            return {"active_key": self.active_key}

        @app.get("/_fake/state")
        def state() -> Any:
            refused = local()
            return refused if refused is not None else self.state()

        @app.post("/_fake/reset")
        def reset() -> Any:
            refused = local()
            if refused is not None:
                return refused
            self.reset()
            return {"reset": True}


# --------------------------------------------------------------------------------------------- keys and process


def load_public_key(pem: bytes) -> rsa.RSAPublicKey:
    """An RSA public key from a PEM public key or certificate."""
    key = (
        x509.load_pem_x509_certificate(pem).public_key()
        if b"BEGIN CERTIFICATE" in pem
        else serialization.load_pem_public_key(pem)
    )
    if not isinstance(key, rsa.RSAPublicKey):
        raise ValueError("not an RSA key")
    return key


def load_private(pem: bytes) -> rsa.RSAPrivateKey:
    """An RSA private key from PEM."""
    key = serialization.load_pem_private_key(pem, password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError("not an RSA private key")
    return key


def certificate(key: rsa.RSAPrivateKey, serial: int, common_name: str, days: int = 365) -> bytes:
    """A self-signed PEM certificate for ``key`` with the given serial number."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def keygen(directory: Path) -> dict[str, str]:
    """Write a merchant key and certificate and two platform keys (certificate serial, PUB_KEY_ID) to ``directory``.

    Returns the environment of both sides (paysync's WECHATPAY_* and this
    fake's WECHATPAY_FAKE_*), which ``--keygen`` prints.
    """
    directory.mkdir(parents=True, exist_ok=True)

    def new_key(name: str) -> rsa.RSAPrivateKey:
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        (directory / f"{name}_key.pem").write_bytes(pem)
        return key

    merchant = new_key("merchant")
    merchant_serial = secrets.randbits(150) | (1 << 149)
    (directory / "merchant_cert.pem").write_bytes(certificate(merchant, merchant_serial, "paysync merchant"))
    platform_a = new_key("platform_cert")
    serial_a = secrets.randbits(150) | (1 << 149)
    (directory / "platform_cert.pem").write_bytes(certificate(platform_a, serial_a, "Tenpay.com Root CA"))
    platform_b = new_key("platform_pubkey")
    pub_id = f"PUB_KEY_ID_{secrets.randbelow(10**20):020d}"
    (directory / "platform_pub.pem").write_bytes(
        platform_b.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    mchid, appid, apiv3 = "1900000109", "wxd678efh567hg6787", secrets.token_hex(16)
    serial_hex = f"{serial_a:X}"
    return {
        "WECHATPAY_MCHID": mchid,
        "WECHATPAY_APPID": appid,
        "WECHATPAY_APIV3_KEY": apiv3,
        "WECHATPAY_MERCHANT_PRIVATE_KEY_FILE": str(directory / "merchant_key.pem"),
        "WECHATPAY_MERCHANT_SERIAL": f"{merchant_serial:X}",
        "WECHATPAY_PLATFORM_KEYS": (
            f"{serial_hex}={directory / 'platform_cert.pem'},{pub_id}={directory / 'platform_pub.pem'}"
        ),
        "WECHATPAY_FAKE_MCHID": mchid,
        "WECHATPAY_FAKE_APPID": appid,
        "WECHATPAY_FAKE_APIV3_KEY": apiv3,
        "WECHATPAY_FAKE_MERCHANT_PUBLIC_KEY_FILE": str(directory / "merchant_cert.pem"),
        "WECHATPAY_FAKE_MERCHANT_SERIAL": f"{merchant_serial:X}",
        "WECHATPAY_FAKE_PLATFORM_KEYS": (
            f"{serial_hex}={directory / 'platform_cert_key.pem'},{pub_id}={directory / 'platform_pubkey_key.pem'}"
        ),
    }


def config_from_env(environ: dict[str, str]) -> tuple[FakeConfig, Faults]:
    """The fake's configuration from WECHATPAY_FAKE_* variables; ValueError naming the bad one."""

    def need(name: str) -> str:
        value = environ.get(name, "").strip()
        if not value:
            raise ValueError(f"{name} is required")
        return value

    platform = []
    for item in need("WECHATPAY_FAKE_PLATFORM_KEYS").split(","):
        key_id, _, path = (s.strip() for s in item.partition("="))
        platform.append((key_id, load_private(Path(path).read_bytes())))
    apiv3 = need("WECHATPAY_FAKE_APIV3_KEY").encode()
    if len(apiv3) != 32:
        raise ValueError("WECHATPAY_FAKE_APIV3_KEY must be 32 characters")
    faults = Faults.parse(environ.get("WECHATPAY_FAKE_FAULTS", ""))
    if environ.get("WECHATPAY_FAKE_SEED", "").strip():
        faults.seed = int(environ["WECHATPAY_FAKE_SEED"])
    config = FakeConfig(
        mchid=need("WECHATPAY_FAKE_MCHID"),
        appid=need("WECHATPAY_FAKE_APPID"),
        apiv3_key=apiv3,
        merchant_public_key=load_public_key(Path(need("WECHATPAY_FAKE_MERCHANT_PUBLIC_KEY_FILE")).read_bytes()),
        merchant_serial=need("WECHATPAY_FAKE_MERCHANT_SERIAL"),
        platform_keys=platform,
        notify_max_attempts=int(environ.get("WECHATPAY_FAKE_NOTIFY_MAX_ATTEMPTS", len(NOTIFY_SCHEDULE) + 1)),
        notify_backoff_scale=float(environ.get("WECHATPAY_FAKE_NOTIFY_BACKOFF_SCALE", "1")),
    )
    return config, faults


def main(argv: list[str] | None = None) -> int:
    """``python -m sandbox.fakes.wechatpay --port N`` (or ``--keygen DIR``)."""
    parser = argparse.ArgumentParser(prog="python -m sandbox.fakes.wechatpay", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--host", default=os.environ.get("WECHATPAY_FAKE_HOST", "127.0.0.1"))
    parser.add_argument("--keygen", metavar="DIR", help="write a matching key set to DIR and print the environment")
    args = parser.parse_args(argv)
    if args.keygen:
        for name, value in keygen(Path(args.keygen)).items():
            print(f"{name}={value}")
        return 0
    try:
        config, faults = config_from_env(dict(os.environ))
    except (OSError, ValueError) as exc:
        print(f"fake wechatpay: {exc}", file=sys.stderr)
        return 2
    from werkzeug.serving import make_server

    platform = FakeWechatPay(config, faults)
    server = make_server(args.host, args.port, platform.app(), threaded=True)
    platform.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"fake wechatpay listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        platform.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
