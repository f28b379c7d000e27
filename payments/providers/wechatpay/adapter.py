"""Adapter for WeChat Pay API v3 (直连商户), Native payments: notifications, orders, queries, refunds, bills.

Inbound (``POST /callbacks/wechatpay``): the Wechatpay-* signature headers are
verified (``wechatpay_sign.verify``: five-minute window both ways, known
serials only, SIGNTEST probes refused), then ``resource`` is decrypted with
the APIv3 key. ``TRANSACTION.*`` carries a transaction: ``trade_state``
SUCCESS is Succeeded, CLOSED / PAYERROR / REVOKED are Failed. ``REFUND.*``
carries a refund: SUCCESS is Succeeded, CLOSED is Failed, ABNORMAL (the money
could not reach the payer's account: a person must re-route it) is Unknown.
The body's ``id`` is the event id. Accepted: 204, no body; refused: 4xx with
``{"code": "FAIL", "message": …}`` (WeChat then retries, up to 15 times).

Outbound: every request carries ``Authorization: WECHATPAY2-SHA256-RSA2048 …``
over the exact bytes sent, and ``Wechatpay-Serial`` naming the platform key
we hold (``request_serial``), as the official SDKs send it; every 2xx answer
must carry a valid platform signature, or it is Unknown (WeChat: "a
successful response without a signature should be considered forged"). A
4xx carries no signature (WeChat
signs only what passed its own check); its ``code`` is read as given, but a
4xx whose signature headers are present and wrong is Unknown.

Classification (invariant 5): SYSTEM_ERROR / SYSTEMERROR, FREQUENCY_LIMITED /
RATELIMIT_EXCEEDED, SERVICE_UNAVAILABLE, any 5xx, 429, 202, timeouts, resets
and unreadable answers are Unknown. A Native order answered ORDERPAID,
OUT_TRADE_NO_USED or ORDER_CLOSED already exists: we query it instead of
ever placing a second one. WeChat dedupes by our merchant number
(``out_trade_no`` = payment_id, ``out_refund_no`` = refund_id): the same
number with the same parameters gives back the same order, which is why the
order's ``time_expire`` is computed from the payment's creation time and
never from the clock at send time.

Platform certificates rotate: a notification or an answer signed under a
certificate serial we do not hold makes the adapter download
``/v3/certificates`` (each certificate sealed under the APIv3 key; the answer
verified with a key we hold or one it carries), keep what checks out for the
life of the process, and verify again; at most one download a minute
(``CERTIFICATE_FETCH_INTERVAL_SECONDS``), and never for a ``PUB_KEY_ID_…``,
which WeChat does not serve there. Public-key mode needs none of this.

A created order stays Pending (with its ``code_url``) until the payer scans
and pays; a notification or a query settles it. ``close_expired`` closes an
order past its expiry and confirms the close by query before anything is
marked Failed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from io import TextIOWrapper
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlencode, urlsplit

import requests
from cryptography.hazmat.primitives.asymmetric import rsa

from payments.errors import CallbackRejected, ConfigError, MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.infra.logs import scrub
from payments.infra.settings import Settings, env_name
from payments.providers.base import (
    AMOUNT_MISMATCH,
    CallbackEvent,
    Capabilities,
    ChargeRequest,
    Dedupe,
    Evidence,
    Failed,
    HttpAnswer,
    Mismatch,
    NotFound,
    Outcome,
    Pending,
    Provider,
    ProviderUnavailable,
    QueryOutcome,
    RefundRequest,
    Succeeded,
    Unknown,
    api_session,
)
from payments.providers.wechatpay import sign
from payments.providers.wechatpay.bill import BEIJING, BillLine, TradeBill
from payments.states import PaymentStatus

log = logging.getLogger("paysync.providers.wechatpay")

CURRENCY = "CNY"
"""The only currency of domestic Native payments."""
MAX_RESPONSE_CHARS = 2000
"""Raw answers are kept this long in provider_call.response."""
MAX_BILL_BYTES = 1 << 31
"""A downloaded bill larger than this is refused (it is spooled to a temporary file, never held in memory)."""
USER_AGENT = "paysync-wechatpay/1"
"""WeChat Pay refuses some APIv3 requests without a User-Agent."""

CERTIFICATES_PATH = "/v3/certificates"
"""Where WeChat Pay lists its platform certificates, each sealed under our APIv3 key."""
CERTIFICATE_FETCH_INTERVAL_SECONDS = 60.0
"""At most one /v3/certificates download per this long per process: anyone can send an unknown serial."""
CERTIFICATE_FETCH_TIMEOUT_SECONDS = 3.0
"""Timeout of that download; it can hold a notification's verification, and WeChat waits 5 s for an answer."""
MAX_CERTIFICATES = 20
"""Entries of a /v3/certificates answer read at most (WeChat lists two or three)."""
_HEX_SERIAL = re.compile(r"[0-9A-Fa-f]{1,64}", re.ASCII)
"""A platform certificate serial; PUB_KEY_ID_… public keys are never served by /v3/certificates."""
_OUT_NO = re.compile(r"[0-9A-Za-z_\-|*]{6,32}", re.ASCII)
"""out_trade_no: 6-32 characters of digits, letters and _-|*."""
_OUT_REFUND_NO = re.compile(r"[0-9A-Za-z_\-|*@]{1,64}", re.ASCII)
"""out_refund_no: 1-64 characters of digits, letters and _-|*@."""

UNKNOWN_CODES = frozenset(
    {"SYSTEM_ERROR", "SYSTEMERROR", "FREQUENCY_LIMITED", "RATELIMIT_EXCEEDED", "SERVICE_UNAVAILABLE", "BANKERROR"}
)
"""Codes that say nothing about whether the request took effect: Unknown, resolved by query."""
CONFIG_CODES = frozenset({"SIGN_ERROR", "NO_AUTH", "MCH_NOT_EXISTS", "APPID_MCHID_NOT_MATCH"})
"""Our configuration, not the payer: Failed but not definitive, retried once the configuration is fixed."""
ORDER_EXISTS_CODES = frozenset({"ORDERPAID", "OUT_TRADE_NO_USED", "ORDER_CLOSED"})
"""A Native order answered with these already exists under our number: query it, never order again."""
REFUND_RETRY_CODES = frozenset({"NOT_ENOUGH", "NOTENOUGH"})
"""The merchant's balance is short: the same refund may succeed later with the same number."""

TRADE_STATES = {
    "SUCCESS": PaymentStatus.SUCCEEDED,
    "REFUND": PaymentStatus.SUCCEEDED,  # paid, then (partly) refunded: the payment itself succeeded
    "NOTPAY": PaymentStatus.PENDING,
    "USERPAYING": PaymentStatus.PENDING,
    "ACCEPT": PaymentStatus.PENDING,
    "CLOSED": PaymentStatus.FAILED,
    "PAYERROR": PaymentStatus.FAILED,
    "REVOKED": PaymentStatus.FAILED,
}
"""trade_state → what it reports about the payment."""
REFUND_STATES = {
    "SUCCESS": PaymentStatus.SUCCEEDED,
    "PROCESSING": PaymentStatus.PENDING,
    "CLOSED": PaymentStatus.FAILED,
    "ABNORMAL": PaymentStatus.UNKNOWN,
}
"""refund_status → what it reports about the refund (ABNORMAL needs a person; it may still succeed)."""


# --------------------------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class WechatPayConfig:
    """Everything the adapter needs, with the keys already parsed (read once at start)."""

    mchid: str
    appid: str
    apiv3_key: bytes
    merchant_key: rsa.RSAPrivateKey
    merchant_serial: str
    platform_keys: sign.PlatformKeys
    api_base: str = "https://api.mch.weixin.qq.com"
    notify_url: str = ""
    order_expire_seconds: int = 7200


def load_config(settings: Settings) -> WechatPayConfig:
    """Read the WECHATPAY_* settings and their key files; ConfigError names the variable, the file and the reason."""
    missing = [
        env_name(n)
        for n in (
            "wechatpay_mchid",
            "wechatpay_appid",
            "wechatpay_apiv3_key",
            "wechatpay_merchant_private_key_file",
            "wechatpay_merchant_serial",
            "wechatpay_platform_keys",
            "wechatpay_notify_url",
        )
        if not getattr(settings, n)
    ]
    if missing:
        raise ConfigError(f"WeChat Pay is partly configured: {', '.join(missing)} missing")
    name = "WECHATPAY_MERCHANT_PRIVATE_KEY_FILE"
    path = settings.wechatpay_merchant_private_key_file
    try:
        merchant_key = sign.load_private_key(_read(name, path))
    except ValueError as exc:
        raise ConfigError(f"{name}: {path}: {exc}") from None
    keys = []
    for key_id, key_path in settings.wechatpay_platform_keys:
        try:
            keys.append(sign.load_platform_key(key_id, _read("WECHATPAY_PLATFORM_KEYS", key_path)))
        except ValueError as exc:
            raise ConfigError(f"WECHATPAY_PLATFORM_KEYS: {key_id}={key_path}: {exc}") from None
    return WechatPayConfig(
        mchid=settings.wechatpay_mchid,
        appid=settings.wechatpay_appid,
        apiv3_key=settings.wechatpay_apiv3_key.encode(),
        merchant_key=merchant_key,
        merchant_serial=settings.wechatpay_merchant_serial,
        platform_keys=sign.PlatformKeys(keys),
        api_base=settings.wechatpay_api_base.rstrip("/"),
        notify_url=settings.wechatpay_notify_url,
        order_expire_seconds=settings.wechatpay_order_expire_seconds,
    )


def validate(settings: Settings, now: datetime | None = None) -> None:
    """The production check: everything ``load_config`` refuses, plus platform certificates past their date.

    A PUB_KEY_ID_… public key does not expire; a certificate does, and one
    past its not-after date can no longer sign anything WeChat sends.
    """
    config = load_config(settings)
    now = now or datetime.now(UTC)
    paths = dict(settings.wechatpay_platform_keys)
    for key_id in config.platform_keys.ids():
        key = config.platform_keys.get(key_id)
        if key is not None and sign.expired(key, now):
            raise ConfigError(
                f"WECHATPAY_PLATFORM_KEYS: {key_id}={paths.get(key_id, '?')}: "
                f"certificate expired {key.not_after:%Y-%m-%d %H:%M} UTC"
            )


def _read(name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc.strerror or type(exc).__name__}") from None


# --------------------------------------------------------------------------------------------- errors


class WechatPayRejected(SignatureInvalid):
    """A notification refused for a signature rule; ``code`` names the rule (unknown_serial, probe_signature, …)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class WrongMerchant(MalformedCallback):
    """A genuine notification for another merchant number or APPID: not ours to apply."""

    code = "wrong_merchant"


# --------------------------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Reply:
    """One HTTP answer from WeChat Pay, read and checked (or the network error that replaced it)."""

    status: int | None
    """None when no answer arrived."""
    data: dict[str, Any] | None
    code: str | None
    """The error ``code`` of a non-2xx body."""
    problem: str | None
    """Why the answer cannot be trusted or read (network error, bad signature, unreadable body); None if fine."""
    evidence: Evidence


def read_reply(
    status: int | None,
    headers: Mapping[str, str],
    body: bytes,
    keys: sign.PlatformKeys,
    now: float,
    evidence: Evidence,
    network_error: str | None = None,
) -> Reply:
    """Check one answer's signature and read its JSON (pure)."""
    if status is None:
        return Reply(None, None, None, network_error or "no_response", evidence)
    problem = None
    signed = sign.header(headers, sign.SIGNATURE) is not None
    if 200 <= status < 300 or signed:
        try:
            sign.verify(headers, body, keys, now)
        except sign.VerifyError as exc:
            problem = f"response_{exc.code}"
    data = None
    if body:
        try:
            decoded = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            decoded = None
        if isinstance(decoded, dict):
            data = decoded
        elif 200 <= status < 300 and problem is None:
            problem = "unparseable_response"
    code = data.get("code") if data is not None and not 200 <= status < 300 else None
    code = code[:48] if isinstance(code, str) and code else None
    return Reply(status, data, code, problem, evidence)


def error_outcome(reply: Reply, *, retry_codes: frozenset[str] = frozenset()) -> Outcome:
    """What a non-success answer means for a charge or a refund (invariant 5: only a clear refusal is Failed).

    A 4xx with a code is WeChat refusing this request (``refusal``): placing
    a Native order or a refund declines nothing of the payer's, so on a
    re-send it says nothing about what the lost first request did.
    """
    label = f"http_{reply.status}" + (f":{reply.code}" if reply.code else "")
    raw = reply.data or {}
    if reply.problem:
        return Unknown(reply.problem, raw=raw)
    status = reply.status or 0
    if status >= 500 or status in (202, 408, 429) or reply.code in UNKNOWN_CODES:
        return Unknown(label, raw=raw)
    if status == 401 or reply.code in CONFIG_CODES or reply.code in retry_codes:
        return Failed(reply.code or label, definitive=False, raw=raw, refusal=True)
    if 400 <= status < 500 and reply.code:
        return Failed(reply.code, definitive=True, raw=raw, refusal=True)
    return Unknown(label, raw=raw)


def read_transaction(
    data: Mapping[str, Any], out_trade_no: str, mchid: str, expected: ChargeRequest | None = None
) -> Outcome:
    """A transaction object (query answer) as an outcome.

    Unknown if it is not about our order; Mismatch if it is our number with another amount or currency.
    """
    raw = dict(data)
    if data.get("out_trade_no") != out_trade_no or data.get("mchid") not in (None, mchid):
        return Unknown("answer_for_another_payment", raw=raw)
    reference = data.get("transaction_id")
    reference = reference if isinstance(reference, str) and 0 < len(reference) <= 128 else None
    amount = data.get("amount")
    if expected is not None and isinstance(amount, dict):
        total, currency = amount.get("total"), amount.get("currency") or CURRENCY
        if total != expected.amount_minor or currency != expected.currency:
            return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=reference, raw=raw)
    state = data.get("trade_state")
    report = TRADE_STATES.get(state) if isinstance(state, str) else None
    if report == PaymentStatus.SUCCEEDED:
        if reference is None or not isinstance(amount, dict):
            return Unknown("unparseable_response", raw=raw)
        return Succeeded(reference, raw=raw)
    if report == PaymentStatus.FAILED:
        return Failed(str(state), definitive=True, raw=raw, provider_transaction_id=reference)
    if report == PaymentStatus.PENDING:
        return Pending(reference, raw=raw)
    return Unknown("unknown_trade_state", raw=raw)


def read_refund(data: Mapping[str, Any], request: RefundRequest | None, out_refund_no: str) -> Outcome:
    """A refund object (refund or refund-query answer) as an outcome; Unknown if it is not our refund.

    Mismatch if it is our refund number for another amount or currency.
    """
    raw = dict(data)
    if data.get("out_refund_no") != out_refund_no:
        return Unknown("answer_for_another_refund", raw=raw)
    refund_id = data.get("refund_id")
    if not isinstance(refund_id, str) or not 0 < len(refund_id) <= 128:
        return Unknown("unparseable_response", raw=raw)
    amount = data.get("amount")
    if request is not None:
        refunded = amount.get("refund") if isinstance(amount, dict) else None
        currency = (amount.get("currency") if isinstance(amount, dict) else None) or CURRENCY
        if refunded != request.amount_minor or currency != request.currency:
            return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=refund_id, raw=raw)
    status = data.get("status")
    report = REFUND_STATES.get(status) if isinstance(status, str) else None
    if report == PaymentStatus.SUCCEEDED:
        return Succeeded(refund_id, raw=raw)
    if report == PaymentStatus.PENDING:
        return Pending(refund_id, raw=raw)
    if report == PaymentStatus.FAILED:
        return Failed(str(status), definitive=True, raw=raw, provider_transaction_id=refund_id)
    if report == PaymentStatus.UNKNOWN:
        return Unknown("refund_abnormal", raw=raw)
    return Unknown("unknown_refund_status", raw=raw)


def time_expire(created_at: datetime, expire_seconds: int) -> str:
    """The order's time_expire (RFC 3339, Beijing time) for a payment created at ``created_at`` (naive UTC)."""
    moment = created_at.replace(tzinfo=UTC, microsecond=0) + timedelta(seconds=expire_seconds)
    return moment.astimezone(BEIJING).isoformat()


def rfc3339_seconds(text: Any) -> int | None:
    """Unix seconds of an RFC 3339 time such as ``2024-05-01T10:00:00+08:00``, or None."""
    if not isinstance(text, str):
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return int(moment.timestamp()) if moment.tzinfo is not None else None


# --------------------------------------------------------------------------------------------- adapter


class WechatPayProvider(Provider):
    """WeChat Pay API v3, Native (QR code) payments, for one direct merchant number."""

    name = "wechatpay"
    capabilities = Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True, payer_scans=True)
    """WeChat dedupes on our number (out_trade_no, out_refund_no), not on an idempotency key, for the order's
    whole life: the same number never makes a second order. An order is looked up by out_trade_no."""
    callback_headers = (*sign.SIGNED_HEADERS, "Content-Type", "User-Agent")

    def __init__(self, config: WechatPayConfig) -> None:
        self.config = config
        self._local = threading.local()  # one requests.Session (connection pool) per thread
        self.clock = time.time
        """Seconds since the epoch; tests move it."""
        self._keys = config.platform_keys
        """Configured platform keys plus certificates learned from /v3/certificates (replaced, never mutated)."""
        self._fetched: dict[str, sign.PlatformKey] = {}
        self._fetch_lock = threading.Lock()
        self._last_fetch: float | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> WechatPayProvider:
        """The adapter for the WECHATPAY_* settings (keys read and parsed now); ConfigError if they are unusable."""
        return cls(load_config(settings))

    # ----------------------------------------------------------------------------------------- HTTP

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = api_session(self.config.api_base)
        return session

    def _headers(self, method: str, path: str, body: bytes) -> dict[str, str]:
        headers = {
            "Authorization": sign.authorization(
                mchid=self.config.mchid,
                serial_no=self.config.merchant_serial,
                private_key=self.config.merchant_key,
                method=method,
                path=path,
                body=body,
                timestamp=str(int(self.clock())),
                nonce=sign.new_nonce(),
            ),
            "Accept": "application/json",
            "User-Agent": USER_AGENT,
            # As the official SDKs send it: the platform key we hold (what WeChat encrypts for and, while a
            # merchant switches from certificates to a public key, signs its answer with).
            sign.SERIAL: self.request_serial(),
        }
        if body:
            headers["Content-Type"] = "application/json"
        return headers

    @property
    def platform_keys(self) -> sign.PlatformKeys:
        """The platform keys answers and notifications are verified with: configured, then learned."""
        return self._keys

    def request_serial(self) -> str:
        """Wechatpay-Serial of our requests: the first configured key not expired, else the newest learned one."""
        now = datetime.fromtimestamp(self.clock(), UTC)
        for key in self.config.platform_keys.all():
            if not sign.expired(key, now):
                return key.key_id
        learned = [k for k in self._fetched.values() if not sign.expired(k, now)]
        if learned:
            return max(learned, key=lambda k: k.not_after or now).key_id
        return self.config.platform_keys.ids()[0]

    def _exchange(
        self, method: str, path: str, payload: Mapping[str, Any] | None, timeout: float
    ) -> tuple[int | None, Mapping[str, str], bytes, Evidence, str | None]:
        """One signed exchange: (status, headers, body, evidence, network error); never raises."""
        # The signature covers these exact bytes, so they are sent as-is (requests' json= would re-serialise).
        body = b"" if payload is None else json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        started = time.monotonic()
        try:
            response = self._session().request(
                method,
                self.config.api_base + path,
                data=body or None,
                headers=self._headers(method, path, body),
                timeout=(min(timeout, 3.0), timeout),
                allow_redirects=False,
            )
            content = response.content  # read inside the timing and the try
        except requests.Timeout:
            return None, {}, b"", Evidence(latency_ms=_ms(started)), "timeout"
        except requests.ConnectionError:
            return None, {}, b"", Evidence(latency_ms=_ms(started)), "connection_error"
        except requests.RequestException as exc:
            return None, {}, b"", Evidence(latency_ms=_ms(started)), type(exc).__name__
        text = content[: MAX_RESPONSE_CHARS * 2].decode("utf-8", "replace")
        evidence = Evidence(response.status_code, scrub(text)[:MAX_RESPONSE_CHARS], _ms(started))
        return response.status_code, response.headers, content, evidence, None

    def _call(self, method: str, path: str, payload: Mapping[str, Any] | None, timeout: float) -> Reply:
        """One signed exchange with the API, its answer checked; never raises (network trouble is a Reply)."""
        status, headers, content, evidence, error = self._exchange(method, path, payload, timeout)
        reply = read_reply(status, headers, content, self.platform_keys, self.clock(), evidence, error)
        if reply.problem == "response_unknown_serial" and self.learn_serial(sign.header(headers, sign.SERIAL) or ""):
            reply = read_reply(status, headers, content, self.platform_keys, self.clock(), evidence, error)
        return reply

    # ----------------------------------------------------------------------------------------- platform certificates

    def learn_serial(self, serial: str) -> bool:
        """True once ``serial`` names a platform key we hold, after downloading /v3/certificates if need be.

        Only a certificate serial is looked up (public keys are not served
        there), at most once per CERTIFICATE_FETCH_INTERVAL_SECONDS: a forged
        notification can name any serial, and must not make us call WeChat
        each time. What the download brings is kept for the life of the process.
        """
        serial = serial.strip()
        if not _HEX_SERIAL.fullmatch(serial):
            return False
        with self._fetch_lock:
            if self._keys.get(serial) is not None:
                return True  # another thread learned it while we waited
            now = self.clock()
            if self._last_fetch is not None and now - self._last_fetch < CERTIFICATE_FETCH_INTERVAL_SECONDS:
                return False
            self._last_fetch = now
            learned = self._download_certificates()
            if learned:
                self._fetched.update({k.key_id.upper(): k for k in learned})
                configured = self.config.platform_keys
                extra = [k for k in self._fetched.values() if configured.get(k.key_id) is None]
                self._keys = sign.PlatformKeys([*configured.all(), *extra])
                log.info("learned WeChat Pay platform certificates %s", ", ".join(k.key_id for k in learned))
            return self._keys.get(serial) is not None

    def _download_certificates(self) -> list[sign.PlatformKey]:
        """GET /v3/certificates: the listed certificates that decrypt, match their serial and are valid now.

        The answer must verify with a key we hold or with one of the
        certificates it carries: those came sealed under our APIv3 key, which
        only WeChat and we know (the official SDKs trust a first download the
        same way). Anything wrong: nothing is learned, and the caller refuses.
        """
        status, headers, content, _, error = self._exchange(
            "GET", CERTIFICATES_PATH, None, CERTIFICATE_FETCH_TIMEOUT_SECONDS
        )
        if status != 200:
            log.warning("platform certificates not downloaded: %s", error or f"HTTP {status}")
            return []
        try:
            entries = json.loads(content).get("data")
        except (UnicodeDecodeError, ValueError, RecursionError, AttributeError):
            entries = None
        if not isinstance(entries, list):
            log.warning("platform certificates not downloaded: unreadable answer")
            return []
        now = datetime.fromtimestamp(self.clock(), UTC)
        candidates = []
        for entry in entries[:MAX_CERTIFICATES]:
            try:
                pem = sign.decrypt_resource(self.config.apiv3_key, entry["encrypt_certificate"])
                key = sign.load_platform_key(str(entry["serial_no"]), pem)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                log.warning("platform certificate entry refused: %s", str(exc)[:120])
                continue
            if sign.expired(key, now) or (key.not_before is not None and now < key.not_before):
                continue
            candidates.append(key)
        try:
            sign.verify(headers, content, sign.PlatformKeys([*self._keys.all(), *candidates]), self.clock())
        except sign.VerifyError as exc:
            log.warning("platform certificates not trusted: the answer's %s", exc.code)
            return []
        return candidates

    # ----------------------------------------------------------------------------------------- orders

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Place a Native order (POST /v3/pay/transactions/native): Pending with its code_url.

        ``idempotency_key`` is not used: WeChat dedupes on out_trade_no
        (our payment_id), and the body is the same on every re-send.
        """
        if payment.currency != CURRENCY:
            return Failed("currency_not_supported", definitive=True)
        if not _OUT_NO.fullmatch(payment.payment_id):
            return Failed("invalid_out_trade_no", definitive=True)
        body: dict[str, Any] = {
            "appid": self.config.appid,
            "mchid": self.config.mchid,
            "description": (payment.description or payment.payment_id)[:127],
            "out_trade_no": payment.payment_id,
            "notify_url": self.config.notify_url,
            "amount": {"total": payment.amount_minor, "currency": CURRENCY},
        }
        if payment.created_at is not None:
            body["time_expire"] = time_expire(payment.created_at, self.config.order_expire_seconds)
        reply = self._call("POST", "/v3/pay/transactions/native", body, timeout)
        if reply.status == 200 and reply.problem is None and reply.data is not None:
            code_url = reply.data.get("code_url")
            if isinstance(code_url, str) and code_url and len(code_url) <= 512:
                return Pending(None, raw=reply.data, evidence=reply.evidence, qr_code=code_url)
            return Unknown("unparseable_response", raw=reply.data, evidence=reply.evidence)
        if reply.problem is None and reply.code in ORDER_EXISTS_CODES:
            # The order exists already (a re-send, or paid meanwhile): look at it, never order twice.
            found = self.query(payment.payment_id, timeout, expected=payment)
            return _after(reply, found)
        return replace(error_outcome(reply), evidence=reply.evidence)

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """GET /v3/pay/transactions/out-trade-no/{out_trade_no}?mchid=…: the order, or NotFound."""
        if not _OUT_NO.fullmatch(payment_id):
            return NotFound()
        query = urlencode({"mchid": self.config.mchid})
        path = f"/v3/pay/transactions/out-trade-no/{quote(payment_id, safe='')}?{query}"
        reply = self._call("GET", path, None, timeout)
        if reply.problem is None and reply.status == 404 and reply.code in ("ORDER_NOT_EXIST", "ORDERNOTEXIST"):
            return NotFound(raw=reply.data or {}, evidence=reply.evidence)
        if reply.status == 200 and reply.problem is None and reply.data is not None:
            outcome = read_transaction(reply.data, payment_id, self.config.mchid, expected)
            return replace(outcome, evidence=reply.evidence)
        # A refused or failed query says nothing about the order: never a decline.
        return Unknown(_query_reason(reply), raw=reply.data or {}, evidence=reply.evidence)

    def close(self, payment_id: str, timeout: float) -> Unknown | None:
        """POST …/{out_trade_no}/close: None once WeChat took it (204), else Unknown saying why (it may be paid)."""
        path = f"/v3/pay/transactions/out-trade-no/{quote(payment_id, safe='')}/close"
        reply = self._call("POST", path, {"mchid": self.config.mchid}, timeout)
        if reply.status == 204 and reply.problem is None:
            return None
        return Unknown(_query_reason(reply, prefix="close"), raw=reply.data or {}, evidence=reply.evidence)

    def close_expired(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """Close an unpaid order past its expiry, then query it: Failed("CLOSED") only once the query says so.

        The query decides whatever the close answered: ORDERPAID means it is
        Succeeded, a lost close answer is resolved by what the order is now.
        """
        closed = self.close(payment_id, timeout)
        found = self.query(payment_id, timeout, expected)
        if closed is not None and isinstance(found, Unknown):
            return closed
        return found

    def order_expired(self, created_at: datetime, now: datetime) -> bool:
        """True once an order for a payment created at ``created_at`` (naive UTC) can no longer be paid."""
        return now >= created_at + timedelta(seconds=self.config.order_expire_seconds)

    def order_expires_at(self, created_at: datetime) -> datetime | None:
        """The order's time_expire (naive UTC): WECHATPAY_ORDER_EXPIRE_SECONDS after the payment's creation."""
        return created_at + timedelta(seconds=self.config.order_expire_seconds)

    def expire(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """WeChat's close, confirmed by query (``close_expired``)."""
        return self.close_expired(payment_id, timeout, expected)

    # ----------------------------------------------------------------------------------------- refunds

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """POST /v3/refund/domestic/refunds under out_refund_no = our refund_id (WeChat dedupes on it)."""
        if request.currency != CURRENCY:
            return Failed("currency_not_supported", definitive=True)
        if not _OUT_REFUND_NO.fullmatch(request.refund_id):
            return Failed("invalid_out_refund_no", definitive=True)
        total = request.payment_amount_minor
        if total is None:
            # amount.total (the order's amount) is required; ask the order rather than guess.
            order = self.query(request.payment_id, timeout)
            amount = order.raw.get("amount") if isinstance(order, Succeeded) else None
            total = amount.get("total") if isinstance(amount, dict) else None
            if not isinstance(total, int) or isinstance(total, bool):
                return Unknown("order_total_unknown", evidence=order.evidence)
        body: dict[str, Any] = {"out_refund_no": request.refund_id}
        if request.provider_transaction_id:
            body["transaction_id"] = request.provider_transaction_id
        else:
            body["out_trade_no"] = request.payment_id
        body["notify_url"] = self.config.notify_url
        body["amount"] = {"refund": request.amount_minor, "total": total, "currency": CURRENCY}
        reply = self._call("POST", "/v3/refund/domestic/refunds", body, timeout)
        if reply.status == 200 and reply.problem is None and reply.data is not None:
            return replace(read_refund(reply.data, request, request.refund_id), evidence=reply.evidence)
        return replace(error_outcome(reply, retry_codes=REFUND_RETRY_CODES), evidence=reply.evidence)

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """GET /v3/refund/domestic/refunds/{out_refund_no}: the refund, or NotFound (never accepted: re-send it)."""
        if not _OUT_REFUND_NO.fullmatch(refund_id):
            return NotFound()
        reply = self._call("GET", f"/v3/refund/domestic/refunds/{quote(refund_id, safe='')}", None, timeout)
        if reply.problem is None and reply.status == 404 and reply.code == "RESOURCE_NOT_EXISTS":
            return NotFound(raw=reply.data or {}, evidence=reply.evidence)
        if reply.status == 200 and reply.problem is None and reply.data is not None:
            return replace(read_refund(reply.data, expected, refund_id), evidence=reply.evidence)
        return Unknown(_query_reason(reply), raw=reply.data or {}, evidence=reply.evidence)

    # ----------------------------------------------------------------------------------------- bills

    def download_trade_bill(self, day: str, timeout: float) -> IO[bytes] | None:
        """The day's ALL trade bill, downloaded and checked against its hash: a binary file at offset 0.

        None when WeChat says there is no bill for the day (NO_STATEMENT_EXIST:
        no payment or refund happened). ProviderUnavailable otherwise (not
        generated yet, network trouble, a hash that does not match).
        """
        datetime.strptime(day, "%Y-%m-%d")  # ValueError for a malformed day, before any call
        query = urlencode({"bill_date": day, "bill_type": "ALL"})
        reply = self._call("GET", f"/v3/bill/tradebill?{query}", None, timeout)
        if reply.problem is None and reply.code == "NO_STATEMENT_EXIST":
            return None
        if reply.status != 200 or reply.problem is not None or reply.data is None:
            reason = reply.problem or reply.code or f"http_{reply.status}"
            raise ProviderUnavailable(f"trade bill for {day} not available: {reason}")
        hash_type, hash_value, url = (reply.data.get(k) for k in ("hash_type", "hash_value", "download_url"))
        if hash_type != "SHA1" or not isinstance(hash_value, str) or not isinstance(url, str):
            raise ProviderUnavailable(f"trade bill for {day}: unreadable answer (hash_type {str(hash_type)[:10]!r})")
        return self._download(url, hash_value, timeout)

    def _download(self, url: str, hash_value: str, timeout: float) -> IO[bytes]:
        api, target = urlsplit(self.config.api_base), urlsplit(url)
        # The download request carries our signature: never send it anywhere but the API host.
        if (target.scheme, target.netloc) != (api.scheme, api.netloc):
            raise ProviderUnavailable(f"download_url is not on {api.netloc}")
        path = target.path + (f"?{target.query}" if target.query else "")
        digest = hashlib.sha1()  # noqa: S324 - WeChat's hash_type; integrity, not security (the metadata is signed)
        spool = tempfile.SpooledTemporaryFile(max_size=8 << 20)  # noqa: SIM115 - returned to the caller
        try:
            with self._session().get(
                url,
                headers=self._headers("GET", path, b""),
                timeout=(min(timeout, 3.0), timeout),
                stream=True,
                allow_redirects=False,
            ) as response:
                if response.status_code != 200:
                    raise ProviderUnavailable(f"bill download answered HTTP {response.status_code}")
                size = 0
                for chunk in response.iter_content(64 * 1024):
                    size += len(chunk)
                    if size > MAX_BILL_BYTES:
                        raise ProviderUnavailable("bill larger than MAX_BILL_BYTES")
                    digest.update(chunk)
                    spool.write(chunk)
        except requests.RequestException as exc:
            spool.close()
            raise ProviderUnavailable(f"bill download failed: {type(exc).__name__}") from None
        except BaseException:
            spool.close()
            raise
        if not hmac.compare_digest(digest.hexdigest(), hash_value.strip().lower()):
            spool.close()
            raise ProviderUnavailable("bill does not match its hash_value: not used")
        spool.seek(0)
        return spool

    def settlement_lines(self, day: str, timeout: float) -> Iterator[BillLine]:
        """The day's bill lines, streaming from the verified download (summary checked, never yielded)."""
        spool = self.download_trade_bill(day, timeout)
        if spool is None:
            return iter(())
        return _lines_then_close(spool)

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """The day's ALL trade bill (``day`` in Beijing time) as WeChat Pay served it, in chunks.

        Downloaded and checked against its hash before the first byte is passed
        on (ProviderUnavailable otherwise, at once); no bytes at all when WeChat
        has no bill for the day. ``payments.providers.wechatpay.bill`` reads them.
        """
        spool = self.download_trade_bill(day, timeout)
        return iter(()) if spool is None else _chunks_then_close(spool)

    # ----------------------------------------------------------------------------------------- notifications

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify the Wechatpay-* headers, decrypt ``resource``, read the transaction or refund."""
        try:
            try:
                sign.verify(headers, body, self.platform_keys, now)
            except sign.UnknownSerial:
                # A rotated platform certificate is named before anyone lists it here: look it up, then decide.
                if not self.learn_serial(sign.header(headers, sign.SERIAL) or ""):
                    raise
                sign.verify(headers, body, self.platform_keys, now)
        except sign.StaleTimestamp as exc:
            raise TimestampOutOfTolerance(str(exc)) from None
        except sign.VerifyError as exc:
            raise WechatPayRejected(str(exc), exc.code) from None
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise MalformedCallback("body is not valid JSON") from None
        return self._read_notification(payload)

    def _read_notification(self, payload: Any) -> CallbackEvent:
        if not isinstance(payload, dict):
            raise MalformedCallback("notification must be a JSON object")
        event_id = _text(payload, "id", 128)
        event_type = _text(payload, "event_type", 64)
        resource = payload.get("resource")
        if not isinstance(resource, dict):
            raise MalformedCallback("resource must be a JSON object")
        try:
            plain = sign.decrypt_resource(self.config.apiv3_key, resource)
        except sign.UndecryptableResource as exc:
            raise WechatPayRejected(str(exc), exc.code) from None
        try:
            data = json.loads(plain)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise MalformedCallback("decrypted resource is not valid JSON") from None
        if not isinstance(data, dict):
            raise MalformedCallback("decrypted resource must be a JSON object")
        if data.get("mchid") != self.config.mchid:
            theirs = str(data.get("mchid"))[:32]
            raise WrongMerchant(f"notification for merchant {theirs!r}, we are {self.config.mchid}")
        if event_type.startswith("TRANSACTION."):
            return self._transaction_event(event_id, event_type, data)
        if event_type.startswith("REFUND."):
            return self._refund_event(event_id, event_type, data)
        raise MalformedCallback(f"unknown event_type {event_type[:64]!r}")

    def _transaction_event(self, event_id: str, event_type: str, data: Mapping[str, Any]) -> CallbackEvent:
        if data.get("appid") not in (None, self.config.appid):
            raise WrongMerchant(f"notification for APPID {str(data.get('appid'))[:32]!r}")
        state = data.get("trade_state")
        report = TRADE_STATES.get(state) if isinstance(state, str) else None
        if report is None:
            raise MalformedCallback(f"unknown trade_state {str(state)[:32]!r}")
        total, currency = _amount(data, "total")
        reference = _text(data, "out_trade_no", 40)
        return CallbackEvent(
            provider=self.platform,
            event_id=event_id,
            event_type=event_type,
            target="payment",
            report=report,
            merchant_reference=reference,
            provider_reference=_text(data, "transaction_id", 128, required=report == PaymentStatus.SUCCEEDED),
            amount_minor=total,
            currency=currency,
            failure_code=str(state) if report == PaymentStatus.FAILED else None,
            occurred_at=rfc3339_seconds(data.get("success_time")),
            payment_reference=reference,
        )

    def _refund_event(self, event_id: str, event_type: str, data: Mapping[str, Any]) -> CallbackEvent:
        status = data.get("refund_status")
        report = REFUND_STATES.get(status) if isinstance(status, str) else None
        if report is None:
            raise MalformedCallback(f"unknown refund_status {str(status)[:32]!r}")
        if event_type != f"REFUND.{status}":
            raise MalformedCallback(f"event_type {event_type} does not match refund_status {status}")
        refunded, currency = _amount(data, "refund")
        return CallbackEvent(
            provider=self.platform,
            event_id=event_id,
            event_type=event_type,
            target="refund",
            report=report,
            merchant_reference=_text(data, "out_refund_no", 40),
            provider_reference=_text(data, "refund_id", 128),
            amount_minor=refunded,
            currency=currency,
            failure_code=str(status) if report == PaymentStatus.FAILED else None,
            occurred_at=rfc3339_seconds(data.get("success_time")),
            payment_reference=_text(data, "out_trade_no", 40, required=False),
        )

    def peek_callback(self, body: bytes) -> dict[str, str | None]:
        """Event id and type; and our number from the resource when it decrypts (unverified: an index and a hint)."""
        values: dict[str, Any] = {}
        try:
            payload = json.loads(body)
            values.update(provider_event_id=payload.get("id"), event_type=payload.get("event_type"))
            data = json.loads(sign.decrypt_resource(self.config.apiv3_key, payload["resource"]))
            if "out_refund_no" in data:
                values.update(order_no=data.get("out_refund_no"), payment_order_no=data.get("refund_id"))
            else:
                values.update(order_no=data.get("out_trade_no"), payment_order_no=data.get("transaction_id"))
        except Exception:  # noqa: BLE001, S110 - unverified input; index what could be read, nothing more
            pass
        limits = {"provider_event_id": 128, "event_type": 64, "order_no": 64, "payment_order_no": 128}
        return {k: v for k, v in values.items() if isinstance(v, str) and 0 < len(v) <= limits[k]}

    def ack(self) -> HttpAnswer:
        """204, no body: what WeChat Pay takes as "received"."""
        return HttpAnswer("", 204, "text/plain")

    def reject(self, error: CallbackRejected) -> HttpAnswer:
        """4xx with ``{"code": "FAIL", "message": …}``: WeChat Pay will deliver again."""
        return HttpAnswer(
            json.dumps({"code": "FAIL", "message": f"{error.code}: {error}"[:200]}, ensure_ascii=False),
            error.http_status,
        )


# --------------------------------------------------------------------------------------------- helpers


def _chunks_then_close(spool: IO[bytes]) -> Iterator[bytes]:
    with spool:
        while chunk := spool.read(64 * 1024):
            yield chunk


def _lines_then_close(spool: IO[bytes]) -> Iterator[BillLine]:
    text = TextIOWrapper(spool, encoding="utf-8-sig", newline="")
    try:
        yield from TradeBill(text)
    finally:
        text.close()


def _after(first: Reply, found: QueryOutcome) -> QueryOutcome:
    """The query's outcome, its evidence saying which answer sent us to query."""
    evidence = found.evidence or Evidence()
    note = f"order answered {first.status} {first.code}; queried: {evidence.response or ''}"
    return replace(found, evidence=replace(evidence, response=note[:MAX_RESPONSE_CHARS]))


def _query_reason(reply: Reply, prefix: str = "query") -> str:
    if reply.problem:
        return reply.problem
    return f"{prefix}_http_{reply.status}" + (f":{reply.code}" if reply.code else "")


def _text(data: Mapping[str, Any], key: str, max_len: int, required: bool = True) -> Any:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise MalformedCallback(f"{key} must be a non-empty string of at most {max_len} characters")
    return value


def _amount(data: Mapping[str, Any], key: str) -> tuple[int, str]:
    amount = data.get("amount")
    if not isinstance(amount, dict):
        raise MalformedCallback("amount must be a JSON object")
    value = amount.get(key)
    # Fen, an integer: a float or a bool is never money here (invariant 7).
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise MalformedCallback(f"amount.{key} must be a positive integer in fen")
    currency = amount.get("currency", CURRENCY)
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha() or not currency.isupper():
        raise MalformedCallback("amount.currency must be an ISO 4217 code such as CNY")
    return value, currency


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
