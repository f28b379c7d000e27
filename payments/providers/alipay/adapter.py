"""Adapter for Alipay's openapi (当面付 QR-code payments): notifications, precreate, query, refund, close, bills.

Inbound: the asynchronous notify (``POST /callbacks/alipay``), form-encoded,
RSA2-signed by Alipay (``alipay_sign`` has the exact rules). We refuse ``RSA``
(SHA-1), a foreign ``app_id`` or (with ALIPAY_SELLER_ID) ``seller_id``, and a
``notify_time`` outside the window in which Alipay delivers (see
``NOTIFY_MAX_AGE_SECONDS``). ``notify_id`` is the event id: Alipay keeps it
across the retries of one notification. We answer exactly
``success`` once stored and verified; anything else (we send ``fail``) makes
Alipay retry, 8 times within 25 hours.

Outbound: ``alipay.trade.precreate`` is the charge (the answer carries the
``qr_code``; the order stays Pending until the buyer scans and pays),
``alipay.trade.query``, ``alipay.trade.refund``,
``alipay.trade.fastpay.refund.query``, ``alipay.trade.close`` and the bill
download (``alipay.data.dataservice.bill.downloadurl.query``). Every request is
RSA2-signed; every answer's ``sign`` must verify against one of
ALIPAY_PUBLIC_KEY_FILES before we act on it. Code 10000 is success; 40004 with
a business ``sub_code`` is Alipay refusing the request (``Failed(refusal=True)``:
definitive on a first send, Unknown on a re-send); 20000, 10003,
``ACQ.SYSTEM_ERROR``, an unsigned or badly signed answer, a timeout or a reset
are never Failed (invariant 5): Unknown or Pending, resolved by a query. Our
number on file with another amount is ``Mismatch``.

Our ``payment_id`` is ``out_trade_no`` and dedupes: a second precreate with the
same number returns the same order, never a second one; our ``refund_id`` is
``out_request_no`` and dedupes refunds the same way.
"""

from __future__ import annotations

import hmac
import json
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from typing import IO, Any

import requests
from cryptography.hazmat.primitives.asymmetric import rsa

from payments.errors import CallbackRejected, ConfigError, MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.infra.logs import scrub
from payments.providers.alipay import sign as sig
from payments.providers.alipay.bill import parse_trade_bill_zip, refund_reference
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
    SettlementTooLarge,
    Succeeded,
    Unknown,
    api_session,
)
from payments.states import PaymentStatus

PRODUCTION_GATEWAY = "https://openapi.alipay.com/gateway.do"
"""ALIPAY_GATEWAY_URL's default."""
CURRENCY = "CNY"
"""Domestic Alipay trades are in yuan; total_amount has no currency field."""
NOTIFY_RETRY_WINDOW_SECONDS = 25 * 3600
"""Alipay re-sends an unacknowledged notify 8 times within 25 hours (4m, 10m, 10m, 1h, 2h, 6h, 15h)."""
MAX_RESPONSE_CHARS = 2000
"""Raw answers are kept this long in provider_call.response (with the sign blanked)."""
DEFAULT_BILL_MAX_BYTES = 1 << 30
"""ALIPAY_BILL_MAX_BYTES's default: a day's trade-bill zip is tens of megabytes even for a large merchant."""

PRECREATE = "alipay.trade.precreate"
QUERY = "alipay.trade.query"
REFUND = "alipay.trade.refund"
REFUND_QUERY = "alipay.trade.fastpay.refund.query"
CLOSE = "alipay.trade.close"
BILL_URL = "alipay.data.dataservice.bill.downloadurl.query"

_CONFIG_CODES = frozenset({"20001", "40001", "40002", "40003", "40006"})
"""Gateway refusals caused by our own configuration (key, app id, permissions): fix and retry, not a decline."""
_CONFIG_SUB_CODES = frozenset({"ACQ.ACCESS_FORBIDDEN", "ACQ.PARTNER_ERROR", "ACQ.INVALID_PARAMETER"})
"""Business refusals that are ours to fix, not the buyer's: not definitive."""


class WrongMerchant(SignatureInvalid):
    """A notify signed by Alipay for another application (app_id) or another seller (seller_id): not ours to apply."""

    code = "wrong_merchant"


class AlipayProvider(Provider):
    """Alipay's openapi gateway; the merchant number (out_trade_no / out_request_no) is the dedupe key."""

    name = "alipay"
    capabilities = Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True, payer_scans=True)
    """Alipay dedupes charges by out_trade_no and refunds by out_request_no, for the life of the trade (no key
    to expire, no idempotency-key header); a trade is looked up by out_trade_no."""
    callback_headers = ("Content-Type", "User-Agent")
    """The notify is verified from the body alone; these are kept for the record."""

    def __init__(
        self,
        app_id: str,
        private_key: rsa.RSAPrivateKey,
        public_keys: Sequence[rsa.RSAPublicKey],
        gateway_url: str = PRODUCTION_GATEWAY,
        *,
        notify_url: str = "",
        tolerance_seconds: int = 300,
        order_expire_seconds: int = 7200,
        seller_id: str = "",
        bill_max_bytes: int = DEFAULT_BILL_MAX_BYTES,
        cert_mode: sig.CertMode | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._app_id = app_id
        self._cert_mode = cert_mode
        self._seller_id = seller_id
        self._bill_max_bytes = bill_max_bytes
        self._private_key = private_key
        self._public_keys = tuple(public_keys)
        self._gateway_url = gateway_url
        self._notify_url = notify_url
        self._tolerance = tolerance_seconds
        self.order_expire_seconds = order_expire_seconds
        """ALIPAY_ORDER_EXPIRE_SECONDS: the trade's time_expire, counted from the payment's creation."""
        self._clock = clock
        self._local = threading.local()  # one requests.Session (connection pool) per thread

    # ----------------------------------------------------------------------------------------- inbound

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify one asynchronous notify (sign, sign_type, app_id, notify_time), then read it."""
        params, encoding = parse_form(body)
        return read_notify(
            params,
            encoding=encoding,
            keys=self._public_keys,
            app_id=self._app_id,
            seller_id=self._seller_id,
            now=now,
            tolerance_seconds=self._tolerance,
            provider=self.platform,
        )

    def peek_callback(self, body: bytes) -> dict[str, str | None]:
        """notify_id, trade_status, out_trade_no and trade_no read without verification; never raises."""
        try:
            params, _ = parse_form(body)
        except Exception:  # noqa: BLE001 - unverified input; anything goes wrong, we index nothing
            return {}
        values = {
            "provider_event_id": params.get("notify_id"),
            "event_type": params.get("trade_status"),
            "order_no": params.get("out_trade_no"),
            "payment_order_no": params.get("trade_no"),
        }
        limits = {"provider_event_id": 128, "event_type": 64, "order_no": 64, "payment_order_no": 128}
        return {k: v for k, v in values.items() if isinstance(v, str) and v and len(v) <= limits[k]}

    def ack(self) -> HttpAnswer:
        """Exactly ``success``: Alipay stops re-sending only on these seven characters."""
        return HttpAnswer("success", 200, "text/plain; charset=utf-8")

    def reject(self, error: CallbackRejected) -> HttpAnswer:
        """``fail``: anything but ``success`` makes Alipay retry (the row stays with status 3)."""
        return HttpAnswer("fail", error.http_status, "text/plain; charset=utf-8")

    # ----------------------------------------------------------------------------------------- outbound

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """alipay.trade.precreate: a QR code to show the buyer; Pending until paid (out_trade_no dedupes)."""
        if payment.currency != CURRENCY:
            return Failed("unsupported_currency", definitive=True)
        biz = {
            "out_trade_no": payment.payment_id,
            "total_amount": sig.minor_to_yuan(payment.amount_minor),
            "subject": payment.payment_id,
        }
        if payment.created_at is not None:
            # Absolute, so every re-send names the same moment. timeout_express would count from the trade's
            # creation, which for a precreate is when the buyer scans: a code scanned late stays payable late.
            biz["time_expire"] = alipay_time(self.order_expires_at(payment.created_at))
        else:
            biz["timeout_express"] = f"{max(1, self.order_expire_seconds // 60)}m"
        return self._call(PRECREATE, biz, timeout, lambda node: read_precreate(node, payment))

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """alipay.trade.query by out_trade_no. Until the buyer scans, Alipay says ACQ.TRADE_NOT_EXIST: NotFound."""
        reader = lambda node: read_trade_query(node, payment_id, expected)  # noqa: E731
        return self._call(QUERY, {"out_trade_no": payment_id}, timeout, reader)

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """alipay.trade.refund with out_request_no = our refund_id (it dedupes a re-send)."""
        biz = {
            "out_trade_no": request.payment_id,
            "refund_amount": sig.minor_to_yuan(request.amount_minor),
            "out_request_no": request.refund_id,
        }
        return self._call(REFUND, biz, timeout, lambda node: read_refund(node, request))

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """alipay.trade.fastpay.refund.query: Succeeded, or NotFound (safe to re-send with the same number)."""
        if expected is None or expected.refund_id != refund_id:
            # Alipay finds a refund under its trade: out_trade_no (our payment_id) comes with the request.
            return Unknown("refund_lookup_needs_the_payment")
        request = expected
        biz = {"out_trade_no": request.payment_id, "out_request_no": request.refund_id}
        return self._call(REFUND_QUERY, biz, timeout, lambda node: read_refund_query(node, request))

    def close(self, payment_id: str, timeout: float) -> QueryOutcome:
        """alipay.trade.close for an unpaid order past its expiry.

        Failed("TRADE_CLOSED"): closed, nothing can be paid any more: mark it
        Failed. NotFound: Alipay never made the trade (the QR code was not
        scanned); past the time_expire the precreate named it cannot
        be paid either. Unknown (incl. ACQ.TRADE_STATUS_ERROR: paid meanwhile):
        query before deciding.
        """
        return self._call(CLOSE, {"out_trade_no": payment_id}, timeout, lambda node: read_close(node, payment_id))

    def order_expires_at(self, created_at: datetime) -> datetime:
        """The trade's time_expire (naive UTC): ALIPAY_ORDER_EXPIRE_SECONDS after the payment's creation."""
        return created_at + timedelta(seconds=self.order_expire_seconds)

    def expire(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """alipay.trade.close past the expiry, then alipay.trade.query: what the trade is now decides.

        Paid meanwhile: Succeeded. Closed: Failed("TRADE_CLOSED"). Never made
        (the code was not scanned; close and query both say TRADE_NOT_EXIST):
        past its time_expire it cannot be paid any more, Failed("expired_unpaid").
        Anything unclear is Unknown, and the query job asks again.
        """
        closed = self.close(payment_id, timeout)
        found = self.query(payment_id, timeout, expected)
        if isinstance(found, NotFound) and isinstance(closed, NotFound):
            return Failed("expired_unpaid", definitive=True, raw=found.raw, evidence=found.evidence)
        if isinstance(found, Pending | NotFound):
            return closed if isinstance(closed, Unknown) else Unknown("close_not_confirmed", raw=found.raw)
        return found

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """The trade-bill zip for ``day`` (YYYY-MM-DD, Beijing) as Alipay serves it, streamed in chunks.

        The signed ``bill.downloadurl.query`` is made at once (ProviderUnavailable
        if Alipay has no bill to give); the zip is fetched as it is read, which
        the caller does at once: the URL is good for 30 seconds. A download
        that breaks off raises ProviderUnavailable mid-way. ``payments.providers.alipay.bill``
        reads the bytes. Past ALIPAY_BILL_MAX_BYTES the download stops with
        SettlementTooLarge (a ProviderUnavailable).
        """
        return self._bill_chunks(day, self._bill_url(day, timeout), timeout)

    def _bill_url(self, day: str, timeout: float) -> str:
        response, error, latency = self._exchange(BILL_URL, {"bill_type": "trade", "bill_date": day}, timeout)
        node, reason = self._verified(BILL_URL, response, error)
        if node is None:
            raise ProviderUnavailable(f"trade bill for {day}: {reason}")
        code = node.get("code")
        url = node.get("bill_download_url")
        if code != "10000" or not isinstance(url, str) or not url.startswith(("https://", "http://")):
            raise ProviderUnavailable(f"trade bill for {day}: code {code} {node.get('sub_code') or ''}".strip())
        return url

    def _bill_chunks(self, day: str, url: str, timeout: float) -> Iterator[bytes]:
        try:
            with self._session().get(url, timeout=(min(timeout, 3.0), timeout), stream=True) as download:
                if download.status_code != 200:
                    raise ProviderUnavailable(f"trade bill for {day}: download answered {download.status_code}")
                size = 0
                for chunk in download.iter_content(64 * 1024):
                    size += len(chunk)
                    if size > self._bill_max_bytes:
                        # Counted as it arrives: a Content-Length can be absent or wrong, and nothing is kept.
                        raise SettlementTooLarge(
                            f"trade bill for {day}: larger than ALIPAY_BILL_MAX_BYTES ({self._bill_max_bytes} bytes);"
                            " download stopped, nothing imported"
                        )
                    yield chunk
        except requests.RequestException as exc:
            raise ProviderUnavailable(f"trade bill for {day}: download failed ({type(exc).__name__})") from None

    def download_bill(self, day: str, timeout: float) -> IO[bytes]:
        """The trade bill zip for ``day``: ``settlement`` spooled to a temporary file (ProviderUnavailable passes)."""
        spool = tempfile.SpooledTemporaryFile(max_size=8 * 1024 * 1024)  # noqa: SIM115 - returned open
        try:
            for chunk in self.settlement(day, timeout):
                spool.write(chunk)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return spool

    def settlement_lines(self, day: str, timeout: float) -> Iterator[Any]:
        """The day's trade bill as AlipayBillLine objects, parsed as the file streams by."""
        with self.download_bill(day, timeout) as archive:
            yield from parse_trade_bill_zip(archive)

    # ----------------------------------------------------------------------------------------- HTTP

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = api_session(self._gateway_url)
        return session

    def signed_request(self, method: str, biz: Mapping[str, Any]) -> tuple[str, str]:
        """(URL with the signed common parameters, form body with biz_content), as the official SDKs send them."""
        common = {
            "app_id": self._app_id,
            "method": method,
            "format": "JSON",
            "charset": "utf-8",
            "sign_type": sig.SIGN_TYPE,
            "timestamp": sig.format_beijing(self._clock()),
            "version": "1.0",
        }
        if self._cert_mode is not None:
            common["app_cert_sn"] = self._cert_mode.app_cert_sn
            common["alipay_root_cert_sn"] = self._cert_mode.alipay_root_cert_sn
        if method == PRECREATE and self._notify_url:
            common["notify_url"] = self._notify_url
        app = {"biz_content": json.dumps(biz, ensure_ascii=False, separators=(",", ":"))}
        common["sign"] = sig.sign(self._private_key, sig.request_sign_content({**common, **app}))
        joiner = "&" if "?" in self._gateway_url else "?"
        return self._gateway_url + joiner + urllib.parse.urlencode(common), urllib.parse.urlencode(app)

    def _exchange(
        self, method: str, biz: Mapping[str, Any], timeout: float
    ) -> tuple[requests.Response | None, str | None, int]:
        """One signed POST: (response or None, network error name or None, latency ms). Never raises."""
        url, body = self.signed_request(method, biz)
        started = time.monotonic()
        try:
            response = self._session().post(
                url,
                data=body.encode("ascii"),
                headers={"Content-Type": "application/x-www-form-urlencoded;charset=utf-8"},
                timeout=(min(timeout, 3.0), timeout),
                allow_redirects=False,
            )
            _ = response.content  # read the body inside the timing and the try
            return response, None, _ms(started)
        except requests.Timeout:
            return None, "timeout", _ms(started)
        except requests.ConnectionError:
            return None, "connection_error", _ms(started)
        except requests.RequestException as exc:
            return None, type(exc).__name__, _ms(started)

    def _verified(
        self, method: str, response: requests.Response | None, error: str | None
    ) -> tuple[Mapping[str, Any] | None, str]:
        """The answer's node if its sign verifies, else (None, why)."""
        if response is None:
            return None, error or "no_response"
        if response.status_code != 200:
            return None, f"http_{response.status_code}"
        try:
            signed = sig.read_response(response.content.decode("utf-8"), method, self._public_keys)
        except (UnicodeDecodeError, ValueError):
            return None, "unparseable_response"
        if not signed.signed:
            # Alipay's SDK accepts an unsigned *failure*; we act on nothing we cannot verify.
            return None, "unsigned_response"
        if not signed.verified:
            return None, "response_signature_invalid"
        return signed.node, "verified"

    def _call(
        self, method: str, biz: Mapping[str, Any], timeout: float, reader: Callable[[Mapping[str, Any]], Any]
    ) -> Any:
        response, error, latency = self._exchange(method, biz, timeout)
        node, reason = self._verified(method, response, error)
        outcome = reader(node) if node is not None else Unknown(reason)
        return replace(outcome, evidence=_evidence(response, latency))


def validate(settings: Any) -> None:
    """When Alipay is enabled: its three settings present, its keys readable RSA of 2048+ bits, certificate
    mode whole (ALIPAY_APP_CERT_FILE with our key's certificate, ALIPAY_ROOT_CERT_FILE) or not used at all.

    Raises ConfigError naming the variable, the file and why; the start-up
    check (``payments.runtime.check_deployment``, through
    ``payments.providers.validate``) calls this; ``from_settings`` reads the
    keys the same way.
    """
    from payments.infra.settings import check_complete, enabled_providers

    check_complete(settings)
    if "alipay" in enabled_providers(settings):
        key = sig.load_private_key("ALIPAY_APP_PRIVATE_KEY_FILE", settings.alipay_app_private_key_file)
        sig.load_public_keys("ALIPAY_PUBLIC_KEY_FILES", settings.alipay_public_key_files)
        sig.cert_mode(
            settings.alipay_app_cert_file, settings.alipay_root_cert_file, settings.alipay_public_key_files, key
        )


def from_settings(settings: Any) -> AlipayProvider:
    """Build the adapter from Settings, reading and parsing the keys once; ConfigError naming the bad file."""
    if not settings.alipay_app_id:
        raise ConfigError("ALIPAY_APP_ID is required when the ALIPAY_* key files are set")
    private_key = sig.load_private_key("ALIPAY_APP_PRIVATE_KEY_FILE", settings.alipay_app_private_key_file)
    public_keys = sig.load_public_keys("ALIPAY_PUBLIC_KEY_FILES", settings.alipay_public_key_files)
    cert_mode = sig.cert_mode(
        settings.alipay_app_cert_file, settings.alipay_root_cert_file, settings.alipay_public_key_files, private_key
    )
    return AlipayProvider(
        settings.alipay_app_id,
        private_key,
        public_keys,
        settings.alipay_gateway_url,
        notify_url=settings.alipay_notify_url,
        tolerance_seconds=settings.callback_tolerance_seconds,
        order_expire_seconds=settings.alipay_order_expire_seconds,
        seller_id=settings.alipay_seller_id,
        bill_max_bytes=settings.alipay_bill_max_bytes,
        cert_mode=cert_mode,
    )


_BEIJING = timezone(timedelta(hours=8))


def alipay_time(moment: datetime) -> str:
    """A naive-UTC moment as Alipay writes times: ``yyyy-MM-dd HH:mm:ss``, Beijing time."""
    return moment.replace(tzinfo=UTC).astimezone(_BEIJING).strftime("%Y-%m-%d %H:%M:%S")


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _evidence(response: requests.Response | None, latency: int) -> Evidence:
    if response is None:
        return Evidence(latency_ms=latency)
    text = sig.strip_sign(response.content[: MAX_RESPONSE_CHARS * 2].decode("utf-8", "replace"))
    return Evidence(http_status=response.status_code, response=scrub(text)[:MAX_RESPONSE_CHARS], latency_ms=latency)


# --------------------------------------------------------------------------------------------- notify (pure)


def parse_form(body: bytes) -> tuple[dict[str, str], str]:
    """Decode a form-encoded notify in its declared ``charset`` (utf-8 or gbk): (params, Python encoding).

    MalformedCallback if it is not a form, repeats a key, or is empty.
    """
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        raise MalformedCallback("notify body must be URL-encoded ASCII") from None
    try:
        probe = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=True, encoding="latin-1")
        charset = (dict(probe).get("charset") or "utf-8").lower()
        if charset not in ("utf-8", "utf8", "gbk", "gb2312"):
            raise MalformedCallback(f"unsupported charset {charset[:16]!r}")
        encoding = "gbk" if charset in ("gbk", "gb2312") else "utf-8"
        pairs = urllib.parse.parse_qsl(
            text, keep_blank_values=True, strict_parsing=True, encoding=encoding, errors="strict", max_num_fields=200
        )
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, MalformedCallback):
            raise
        raise MalformedCallback("notify body is not a valid form") from None
    params: dict[str, str] = {}
    for key, value in pairs:
        if key in params:
            raise MalformedCallback(f"parameter {key[:32]!r} appears twice")
        params[key] = value
    if not params:
        raise MalformedCallback("notify body is empty")
    return params, encoding


def read_notify(
    fields: Mapping[str, str],
    *,
    encoding: str = "utf-8",
    keys: Sequence[rsa.RSAPublicKey],
    app_id: str,
    now: float,
    tolerance_seconds: int,
    provider: str = "alipay",
    seller_id: str = "",
) -> CallbackEvent:
    """Verify a decoded notify and read it into a CallbackEvent (pure); raise CallbackRejected if not genuine."""
    signature = fields.get("sign")
    if not signature:
        raise SignatureInvalid("sign is missing")
    sign_type = fields.get("sign_type")
    if sign_type != sig.SIGN_TYPE:
        # RSA is SHA-1: refused even when it verifies.
        raise SignatureInvalid(f"sign_type must be RSA2, got {str(sign_type)[:16]!r}")
    content = sig.notify_sign_content(fields).encode(encoding)
    if not sig.verify(keys, content, signature):
        raise SignatureInvalid("sign does not verify with any ALIPAY_PUBLIC_KEY_FILES key")
    # Alipay signs every merchant's notifies with the same key: only these two fields say the notify is ours.
    if not hmac.compare_digest(fields.get("app_id", "").encode(), app_id.encode()):
        raise WrongMerchant("app_id is not ours")
    if seller_id and not hmac.compare_digest(fields.get("seller_id", "").encode(), seller_id.encode()):
        raise WrongMerchant("seller_id is not ALIPAY_SELLER_ID")
    try:
        sent_at = sig.parse_beijing(fields.get("notify_time"))
    except ValueError:
        raise MalformedCallback("notify_time must be yyyy-MM-dd HH:mm:ss") from None
    age = now - sent_at
    if age > NOTIFY_RETRY_WINDOW_SECONDS + tolerance_seconds or age < -tolerance_seconds:
        raise TimestampOutOfTolerance(f"notify_time is {int(age)} s from now, outside Alipay's delivery window")
    return notify_event(fields, provider)


_NOTIFY_STATUSES = {
    "TRADE_SUCCESS": PaymentStatus.SUCCEEDED,
    "TRADE_FINISHED": PaymentStatus.SUCCEEDED,
    "WAIT_BUYER_PAY": PaymentStatus.PENDING,
    "TRADE_CLOSED": PaymentStatus.FAILED,
}


def notify_event(fields: Mapping[str, str], provider: str = "alipay") -> CallbackEvent:
    """The CallbackEvent of a verified notify (pure); MalformedCallback if a field is unusable.

    A refund makes Alipay send a notify too: ``out_biz_no`` names our refund,
    ``refund_fee`` is the *total* refunded so far, ``trade_status`` stays
    TRADE_SUCCESS (partial) or becomes TRADE_CLOSED (full). Since it carries no
    amount for the one refund, it is read as what it proves about the payment
    (it was paid) and the refund is confirmed by ``query_refund``.
    """
    if fields.get("notify_type") != "trade_status_sync":
        raise MalformedCallback(f"unsupported notify_type {str(fields.get('notify_type'))[:32]!r}")
    status = fields.get("trade_status")
    if status not in _NOTIFY_STATUSES:
        raise MalformedCallback(f"unknown trade_status {str(status)[:32]!r}")
    notify_id = _text(fields, "notify_id", 128)
    out_trade_no = _text(fields, "out_trade_no", 64)
    trade_no = _text(fields, "trade_no", 64, required=False)
    try:
        amount = sig.yuan_to_minor(fields.get("total_amount"))
        refunded = sig.yuan_to_minor(fields["refund_fee"]) if fields.get("refund_fee") else 0
    except ValueError as exc:
        raise MalformedCallback(str(exc)) from None
    if amount <= 0:
        raise MalformedCallback("total_amount must be greater than zero")
    refund = bool(refunded or fields.get("gmt_refund") or fields.get("out_biz_no"))
    report = _NOTIFY_STATUSES[status]
    failure_code = None
    if status == "TRADE_CLOSED":
        if refund or fields.get("gmt_payment"):
            # Closed after a (full) refund: the buyer paid; that is not a failed payment.
            report = PaymentStatus.SUCCEEDED
        else:
            failure_code = "TRADE_CLOSED"
    occurred = fields.get("gmt_payment") or fields.get("notify_time")
    try:
        occurred_at = int(sig.parse_beijing(occurred))
    except ValueError:
        occurred_at = None
    return CallbackEvent(
        provider=provider,
        event_id=notify_id,
        event_type=f"{status}.refund" if refund else status,
        target="payment",
        report=report,
        merchant_reference=out_trade_no,
        provider_reference=trade_no,
        amount_minor=amount,
        currency=CURRENCY,
        failure_code=failure_code,
        occurred_at=occurred_at,
    )


def _text(fields: Mapping[str, str], key: str, max_len: int, required: bool = True) -> Any:
    value = fields.get(key)
    if not value and not required:
        return None
    if not value or len(value) > max_len:
        raise MalformedCallback(f"{key} must be a non-empty string of at most {max_len} characters")
    return value


# --------------------------------------------------------------------------------------------- answers (pure)


def _common(node: Mapping[str, Any], *, call: bool) -> Outcome | None:
    """The outcome of an answer whose code is not 10000/40004, or None to let the caller read it.

    ``call``: a charge or refund (a configuration refusal is a not-definitive
    Failed refusal, retried once fixed); otherwise a query (Unknown).
    """
    code = node.get("code")
    sub_code = node.get("sub_code") if isinstance(node.get("sub_code"), str) else ""
    if code in ("10000", "40004") and sub_code != "ACQ.SYSTEM_ERROR":
        return None
    if code == "10003":
        return Pending(raw=node) if call else Unknown("10003_processing", raw=node)
    if code in _CONFIG_CODES:
        reason = f"{code}:{sub_code}"[:64]
        return Failed(reason, definitive=False, raw=node, refusal=True) if call else Unknown(reason, raw=node)
    return Unknown(f"{code}:{sub_code}"[:64] if isinstance(code, str) else "no_code", raw=node)


def _sub(node: Mapping[str, Any]) -> str:
    value = node.get("sub_code")
    return value[:64] if isinstance(value, str) and value else "40004"


def _ours(node: Mapping[str, Any], key: str, expected: str) -> bool:
    return node.get(key) in (None, expected)


def read_precreate(node: Mapping[str, Any], payment: ChargeRequest) -> Outcome:
    """Read a verified alipay.trade.precreate answer.

    A precreate only opens an order, so a 40004 is Alipay refusing the
    request (``refusal``), never a declined payment: final on a first send,
    but on a re-send (e.g. ACQ.TRADE_HAS_CLOSE for the order the lost first
    send opened, which may have been paid and refunded since) it says nothing
    about that order, and a query decides.
    """
    early = _common(node, call=True)
    if early is not None:
        return early
    if node.get("code") == "40004":
        sub = _sub(node)
        if sub == "ACQ.TRADE_HAS_SUCCESS":
            return Unknown("trade_has_success", raw=node)  # paid already: the query says by whom and how much
        if sub == "ACQ.CONTEXT_INCONSISTENT":
            # Our number is on file with other details (amount, subject): not our charge to apply.
            trade_no = node.get("trade_no") if isinstance(node.get("trade_no"), str) else None
            return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=trade_no or None, raw=node)
        return Failed(sub, definitive=sub not in _CONFIG_SUB_CODES, raw=node, refusal=True)
    qr_code = node.get("qr_code")
    if node.get("out_trade_no") != payment.payment_id:
        return Unknown("answer_for_another_payment", raw=node)
    if not isinstance(qr_code, str) or not qr_code or len(qr_code) > 512:
        return Unknown("no_qr_code", raw=node)
    return Pending(raw=node, qr_code=qr_code)


def _paid(node: Mapping[str, Any]) -> bool:
    """A closed trade that was paid first (then refunded in full), by the query's own fields."""
    if node.get("send_pay_date"):
        return True
    for key in ("buyer_pay_amount", "receipt_amount"):
        try:
            if sig.yuan_to_minor(node.get(key)) > 0:
                return True
        except ValueError:
            continue
    return False


def read_trade_query(node: Mapping[str, Any], payment_id: str, expected: ChargeRequest | None) -> QueryOutcome:
    """Read a verified alipay.trade.query answer."""
    early = _common(node, call=False)
    if early is not None:
        return early
    if node.get("code") == "40004":
        if _sub(node) == "ACQ.TRADE_NOT_EXIST":
            return NotFound(raw=node)
        return Unknown(f"query_refused:{_sub(node)}"[:64], raw=node)
    if node.get("out_trade_no") != payment_id:
        return Unknown("answer_for_another_payment", raw=node)
    trade_no = node.get("trade_no")
    if not isinstance(trade_no, str) or not trade_no or len(trade_no) > 64:
        return Unknown("no_trade_no", raw=node)
    status = node.get("trade_status")
    if status == "WAIT_BUYER_PAY":
        return Pending(trade_no, raw=node)
    if status not in ("TRADE_SUCCESS", "TRADE_FINISHED", "TRADE_CLOSED"):
        return Unknown(f"trade_status:{str(status)[:32]}", raw=node)
    try:
        amount = sig.yuan_to_minor(node.get("total_amount"))
    except ValueError:
        return Unknown("unreadable_total_amount", raw=node)
    if expected is not None and (amount != expected.amount_minor or expected.currency != CURRENCY):
        return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=trade_no, raw=node)
    if status == "TRADE_CLOSED" and not _paid(node):
        return Failed("TRADE_CLOSED", definitive=True, raw=node, provider_transaction_id=trade_no)
    return Succeeded(trade_no, raw=node)


def read_refund(node: Mapping[str, Any], request: RefundRequest) -> Outcome:
    """Read a verified alipay.trade.refund answer. fund_change N (a repeat, or not moved yet) → Unknown → query."""
    early = _common(node, call=True)
    if early is not None:
        return early
    if node.get("code") == "40004":
        # Alipay refuses the refund request; on a re-send that says nothing about the lost first one.
        sub = _sub(node)
        if sub == "ACQ.SELLER_BALANCE_NOT_ENOUGH":
            # Top the account up and send the same number again.
            return Failed(sub, definitive=False, raw=node, refusal=True)
        return Failed(sub, definitive=sub not in _CONFIG_SUB_CODES, raw=node, refusal=True)
    if not _ours(node, "out_trade_no", request.payment_id):
        return Unknown("answer_for_another_payment", raw=node)
    trade_no = node.get("trade_no")
    if not isinstance(trade_no, str) or not trade_no:
        return Unknown("no_trade_no", raw=node)
    if node.get("fund_change") == "Y":
        return Succeeded(refund_reference(trade_no, request.refund_id), raw=node)
    return Unknown("fund_change_not_y", raw=node)


def read_refund_query(node: Mapping[str, Any], request: RefundRequest) -> QueryOutcome:
    """Read a verified alipay.trade.fastpay.refund.query answer (Alipay: data present and status empty or
    REFUND_SUCCESS means refunded; nothing found means not refunded, re-send with the same out_request_no)."""
    early = _common(node, call=False)
    if early is not None:
        return early
    if node.get("code") == "40004":
        if _sub(node) == "ACQ.TRADE_NOT_EXIST":
            return NotFound(raw=node)
        return Unknown(f"query_refused:{_sub(node)}"[:64], raw=node)
    if not node.get("refund_amount"):
        return NotFound(raw=node)
    if not _ours(node, "out_request_no", request.refund_id) or not _ours(node, "out_trade_no", request.payment_id):
        return Unknown("answer_for_another_refund", raw=node)
    try:
        amount = sig.yuan_to_minor(node.get("refund_amount"))
    except ValueError:
        return Unknown("unreadable_refund_amount", raw=node)
    trade_no = node.get("trade_no")
    reference = refund_reference(trade_no, request.refund_id) if isinstance(trade_no, str) and trade_no else None
    if amount != request.amount_minor:
        return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=reference, raw=node)
    if node.get("refund_status") in (None, "", "REFUND_SUCCESS"):
        return Succeeded(reference or request.refund_id, raw=node)
    return Pending(reference, raw=node)


def read_close(node: Mapping[str, Any], payment_id: str) -> QueryOutcome:
    """Read a verified alipay.trade.close answer (see AlipayProvider.close)."""
    early = _common(node, call=False)
    if early is not None:
        return early
    if node.get("code") == "40004":
        if _sub(node) == "ACQ.TRADE_NOT_EXIST":
            return NotFound(raw=node)
        return Unknown(f"close_refused:{_sub(node)}"[:64], raw=node)
    if not _ours(node, "out_trade_no", payment_id):
        return Unknown("answer_for_another_payment", raw=node)
    trade_no = node.get("trade_no") if isinstance(node.get("trade_no"), str) else None
    return Failed("TRADE_CLOSED", definitive=True, raw=node, provider_transaction_id=trade_no or None)
