"""A fake Alipay openapi gateway: the protocol byte for byte, the money in memory.

An outside party: it imports nothing of paysync, and implements Alipay's
signing rules on its own from the documentation, so a mistake on one side is
caught by the other. What it does, as Alipay does:

- ``POST /gateway.do``: common parameters in the query string and/or the form
  body (the official SDKs put ``biz_content`` in the body), every request's
  RSA2 ``sign`` checked against the app's public keys over all parameters but
  ``sign``, sorted, empty ones left out. Answers are
  ``{"<method>_response": {...}, "sign": "..."}`` signed with the platform key
  over the node's exact JSON text.
- Methods: ``alipay.trade.precreate`` (the trade is not visible to a query
  until the buyer scans: ACQ.TRADE_NOT_EXIST, as on the real platform; a second
  precreate with the same out_trade_no returns the same QR code),
  ``alipay.trade.query``, ``alipay.trade.refund`` (out_request_no dedupes),
  ``alipay.trade.fastpay.refund.query``, ``alipay.trade.close``,
  ``alipay.data.dataservice.bill.downloadurl.query`` (a 30-second URL to a zip
  of two GBK CSV files with GBK file names).
- Asynchronous notifies (form-encoded, signed over all but sign/sign_type)
  POSTed to the precreate's ``notify_url`` (or ``--notify-url``) on payment,
  refund and close; re-sent until the answer is exactly ``success``, with the
  same ``notify_id``.
- Certificate mode (``app_cert_pem`` and ``root_cert_pem`` given): every
  request must carry ``app_cert_sn`` (of the app's certificate) and
  ``alipay_root_cert_sn`` (of the root chain), computed here from the
  certificates as the documentation describes (MD5 of issuer DN + decimal
  serial; the root chain's RSA-signed certificates joined by ``_``), else
  40001 ``isv.missing-app-cert-sn`` / ``isv.missing-alipay-root-cert-sn`` or
  40002 ``isv.invalid-…``; with ``platform_cert_pem`` answers carry
  ``alipay_cert_sn``.
- Fault knobs, seeded: 20000 (isp.unknow-error), 10003, 40004
  ACQ.SYSTEM_ERROR, timeout after commit, hang, a 502, a badly signed answer;
  notify duplicates and bad notify signatures. A script of faults can also be
  queued for the next calls (``POST /_fake/faults``).

The control surface ``/_fake/…`` answers only to this machine: ``scan``,
``pay``, ``faults``, ``requests``, ``notifications``, ``trades`` (all),
``trades/<no>``, ``reset``. A precreate's ``time_expire`` is kept: past it the
code takes no payment.

Run it: ``python -m sandbox.fakes.alipay --port 8200 --app-id 2021000000000001
--app-public-keys app_pub.pem --platform-private-key alipay_priv.pem
--notify-url http://127.0.0.1:8000/callbacks/alipay`` (or the FAKE_ALIPAY_*
environment variables of the same names).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import queue
import random
import re
import secrets
import signal
import threading
import time
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

BEIJING = timezone(timedelta(hours=8))
LOCAL = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
REQUEST_MAX_AGE_SECONDS = 30 * 60
"""How old a request's timestamp may be (Alipay's documents say requests expire in 30 minutes)."""
FAULTS = ("system_error", "processing", "acq_system_error", "timeout_after_commit", "hang", "http_502", "bad_sign")
"""Names of the per-call faults, for the script and for ``<name>_rate`` knobs."""
METHODS = (
    "alipay.trade.precreate",
    "alipay.trade.query",
    "alipay.trade.refund",
    "alipay.trade.fastpay.refund.query",
    "alipay.trade.close",
    "alipay.data.dataservice.bill.downloadurl.query",
)
_OUT_NO = re.compile(r"[A-Za-z0-9_]{1,64}")
_AMOUNT = re.compile(r"\d{1,9}(\.\d{1,2})?")
_PROTOCOL = ("app_id", "method", "charset", "sign_type", "sign", "timestamp", "version")
BILL_HEADER = (
    "支付宝交易号,商户订单号,业务类型,商品名称,创建时间,完成时间,门店编号,门店名称,操作员,终端号,对方账户,"
    "订单金额（元）,商家实收（元）,支付宝红包（元）,集分宝（元）,支付宝优惠（元）,商家优惠（元）,券核销金额（元）,"
    "券名称,商家红包消费金额（元）,卡消费金额（元）,退款批次号/请求号,服务费（元）,分润（元）,备注"
)
FEE_RATE = Decimal("0.006")
"""The service fee the fake's bill shows on each trade."""


# --------------------------------------------------------------------------------------------- signing (own copy)


def sign_string(params: Mapping[str, str], exclude: Iterable[str]) -> str:
    """Alipay's string to sign: sorted keys, empty values and ``exclude`` left out, ``k=v`` joined by ``&``."""
    skip = set(exclude)
    return "&".join(f"{k}={params[k]}" for k in sorted(params) if k not in skip and params[k])


def rsa2_sign(key: rsa.RSAPrivateKey, text: str) -> str:
    """SHA256withRSA over the UTF-8 text, base64."""
    return base64.b64encode(key.sign(text.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())).decode()


def rsa2_verify(keys: Sequence[rsa.RSAPublicKey], text: str, signature: str) -> bool:
    """True when one of ``keys`` made ``signature`` over the UTF-8 text."""
    try:
        raw = base64.b64decode(signature, validate=True)
    except ValueError:
        return False
    for key in keys:
        try:
            key.verify(raw, text.encode("utf-8"), padding.PKCS1v15(), hashes.SHA256())
            return True
        except InvalidSignature:
            continue
    return False


def beijing_now(clock: float | None = None) -> str:
    """Now (or ``clock``) as Alipay writes it: yyyy-MM-dd HH:mm:ss, Beijing time."""
    return (
        datetime.fromtimestamp(time.time() if clock is None else clock, UTC)
        .astimezone(BEIJING)
        .strftime("%Y-%m-%d %H:%M:%S")
    )


def _yuan(text: Any) -> Decimal | None:
    if not isinstance(text, str) or not _AMOUNT.fullmatch(text):
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if Decimal("0.01") <= value <= Decimal("100000000") else None


def _fmt(value: Decimal) -> str:
    return str(value.quantize(Decimal("0.01")))


_DN_NAMES = {"2.5.4.3": "CN", "2.5.4.11": "OU", "2.5.4.10": "O", "2.5.4.6": "C", "2.5.4.7": "L", "2.5.4.8": "ST"}
_RSA_SIGNED = {
    x509.SignatureAlgorithmOID.RSA_WITH_SHA1,
    x509.SignatureAlgorithmOID.RSA_WITH_SHA256,
    x509.SignatureAlgorithmOID.RSA_WITH_SHA384,
    x509.SignatureAlgorithmOID.RSA_WITH_SHA512,
}


def certificate_sn(cert: x509.Certificate) -> str:
    """Alipay's certificate SN: md5 of the issuer as ``CN=…,OU=…,O=…,C=…`` (last RDN first) + the decimal serial."""
    oid = lambda a: a.oid.dotted_string  # noqa: E731
    parts = [f"{_DN_NAMES.get(oid(a), oid(a))}={a.value}" for rdn in cert.issuer.rdns for a in rdn]
    return hashlib.md5((",".join(reversed(parts)) + str(cert.serial_number)).encode()).hexdigest()  # noqa: S324


def pem_certificates(pem: bytes) -> list[x509.Certificate]:
    """Every certificate of a PEM bundle, in order."""
    marker = b"-----END CERTIFICATE-----"
    return [x509.load_pem_x509_certificate(part + marker) for part in pem.split(marker) if b"BEGIN" in part]


def root_chain_sn(pem: bytes) -> str:
    """alipay_root_cert_sn of a root chain file: the SNs of its RSA-signed certificates joined by ``_``."""
    return "_".join(certificate_sn(c) for c in pem_certificates(pem) if c.signature_algorithm_oid in _RSA_SIGNED)


# --------------------------------------------------------------------------------------------- state


@dataclass
class Refund:
    """One refund of a trade, by out_request_no."""

    out_request_no: str
    amount: Decimal
    at: str


@dataclass
class Trade:
    """One order. ``status`` PRECREATED: a QR code exists, Alipay has no trade yet (not queryable)."""

    out_trade_no: str
    total_amount: Decimal
    subject: str
    qr_code: str
    notify_url: str | None
    status: str = "PRECREATED"
    trade_no: str | None = None
    created: str = field(default_factory=beijing_now)
    paid_at: str | None = None
    closed_unscanned: bool = False
    time_expire: str | None = None
    """The precreate's time_expire (Beijing, yyyy-MM-dd HH:mm:ss): past it the code takes no payment."""
    refunds: dict[str, Refund] = field(default_factory=dict)

    def expired(self) -> bool:
        """Past its time_expire (the strings compare in time order)."""
        return self.time_expire is not None and beijing_now() >= self.time_expire

    @property
    def refunded(self) -> Decimal:
        """Total refunded so far."""
        return sum((r.amount for r in self.refunds.values()), Decimal("0"))


@dataclass
class Faults:
    """Per-call fault rates (0..1), the hang length, notify faults and the seed."""

    rates: dict[str, float] = field(default_factory=dict)
    hang_seconds: float = 3.0
    notify_duplicate_rate: float = 0.0
    notify_bad_sign_rate: float = 0.0
    seed: int | None = None


def parse_faults(raw: Mapping[str, Any] | str | None) -> tuple[Faults, list[dict[str, str]]]:
    """Knobs ``{"system_error_rate": 0.1, …, "hang_seconds", "seed", "script": [{"fault", "method"?}]}``."""
    if raw in (None, ""):
        return Faults(), []
    data = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if not isinstance(data, dict):
        raise ValueError("faults must be a JSON object")
    faults = Faults()
    script: list[dict[str, str]] = []
    for key, value in data.items():
        if key == "script":
            if not isinstance(value, list):
                raise ValueError("script must be a list")
            for item in value:
                if not isinstance(item, dict) or item.get("fault") not in FAULTS:
                    raise ValueError(f"script entries are {{'fault': one of {FAULTS}, 'method': optional}}")
                script.append({"fault": item["fault"], "method": item.get("method") or ""})
        elif key == "seed":
            faults.seed = None if value is None else int(value)
        elif key == "hang_seconds":
            faults.hang_seconds = float(value)
        elif key in ("notify_duplicate_rate", "notify_bad_sign_rate"):
            setattr(faults, key, float(value))
        elif key.endswith("_rate") and key[:-5] in FAULTS:
            faults.rates[key[:-5]] = float(value)
        else:
            raise ValueError(f"unknown fault knob {key!r}")
    return faults, script


class FakeAlipay:
    """The platform: trades, refunds, notifications, faults, and the WSGI app over them."""

    def __init__(
        self,
        app_id: str,
        app_public_keys: Sequence[rsa.RSAPublicKey],
        platform_key: rsa.RSAPrivateKey,
        *,
        notify_url: str | None = None,
        faults: Mapping[str, Any] | str | None = None,
        retry_delays: Sequence[float] = (0.5, 1.0, 2.0, 4.0),
        pid: str = "2088000000000001",
        app_cert_pem: bytes | None = None,
        root_cert_pem: bytes | None = None,
        platform_cert_pem: bytes | None = None,
    ) -> None:
        self.app_id = app_id
        self.app_cert_sn = certificate_sn(pem_certificates(app_cert_pem)[0]) if app_cert_pem else None
        """Certificate mode: the app_cert_sn every request must carry (None: public-key mode)."""
        self.root_cert_sn = root_chain_sn(root_cert_pem) if root_cert_pem else None
        self.platform_cert_sn = certificate_sn(pem_certificates(platform_cert_pem)[0]) if platform_cert_pem else None
        self.app_public_keys = list(app_public_keys)
        self.platform_key = platform_key
        self.notify_url = notify_url
        self.retry_delays = tuple(retry_delays)
        self.pid = pid
        self.lock = threading.RLock()
        self.trades: dict[str, Trade] = {}
        self.requests: list[dict[str, Any]] = []
        self.notifications: list[dict[str, Any]] = []
        self.bills: dict[str, tuple[float, bytes]] = {}
        self.faults, self.script = parse_faults(faults)
        self.rng = random.Random(self.faults.seed)  # noqa: S311 - simulation, not security
        self._outbox: queue.Queue[tuple[float, dict[str, Any]] | None] = queue.Queue()
        self._stop = threading.Event()
        self._postman = threading.Thread(target=self._deliver_loop, name="fake-alipay-notify", daemon=True)
        self._postman.start()

    # ----------------------------------------------------------------------------------------- WSGI

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        try:
            if request.path == "/gateway.do" and request.method == "POST":
                response = self.gateway(request)
            elif request.path.startswith("/_fake/bills/") and request.method == "GET":
                response = self.bill_file(request.path.rsplit("/", 1)[-1])
            elif request.path.startswith("/_fake/"):
                if request.remote_addr not in LOCAL:
                    response = Response("forbidden", 403)
                else:
                    response = self.control(request)
            else:
                response = Response("not found", 404)
        except Exception as exc:  # noqa: BLE001 - a fake platform answers 500, as a real one might
            response = Response(f"internal error: {type(exc).__name__}", 500)
        return response(environ, start_response)

    def close(self) -> None:
        """Stop the notification thread."""
        self._stop.set()
        self._outbox.put(None)

    # ----------------------------------------------------------------------------------------- openapi

    def gateway(self, request: Request) -> Response:
        """One openapi call: check the protocol and the signature, roll the faults, run the method."""
        params: dict[str, str] = {}
        for source in (request.args, request.form):
            for key, values in source.lists():
                if key in params or len(values) != 1:
                    return self._answer("error_response", self._err("40002", "isv.invalid-parameter", "重复参数"))
                params[key] = values[0]
        method = params.get("method", "")
        node_name = method.replace(".", "_") + "_response" if method in METHODS else "error_response"
        entry: dict[str, Any] = {"method": method, "verified": False, "params": params, "answer": None}
        with self.lock:
            self.requests.append(entry)
        refusal = self._check_protocol(params, method)
        if refusal is not None:
            entry["answer"] = refusal
            return self._answer(node_name, refusal)
        entry["verified"] = True
        try:
            biz = json.loads(params.get("biz_content") or "{}")
        except ValueError:
            biz = None
        if not isinstance(biz, dict):
            node = self._err("40002", "isv.invalid-parameter", "biz_content 不是 JSON 对象")
            entry["answer"] = node
            return self._answer(node_name, node)
        entry["biz"] = biz
        fault = self._draw_fault(method)
        entry["fault"] = fault
        if fault == "http_502":
            return Response("<html><body>502 Bad Gateway</body></html>", 502, content_type="text/html")
        if fault == "hang":
            time.sleep(self.faults.hang_seconds)
            return self._answer(node_name, self._err("20000", "isp.unknow-error", "服务暂不可用"))
        if fault == "system_error":
            return self._answer(node_name, self._err("20000", "isp.unknow-error", "服务暂不可用（业务系统不可用）"))
        if fault == "processing":
            return self._answer(node_name, {"code": "10003", "msg": "业务处理中"})
        if fault == "acq_system_error":
            return self._answer(node_name, self._err("40004", "ACQ.SYSTEM_ERROR", "系统错误"))
        handler = {
            "alipay.trade.precreate": self._precreate,
            "alipay.trade.query": self._query,
            "alipay.trade.refund": self._refund,
            "alipay.trade.fastpay.refund.query": self._refund_query,
            "alipay.trade.close": self._close,
            "alipay.data.dataservice.bill.downloadurl.query": lambda b, p: self._bill_url(b, request.host_url),
        }[method]
        with self.lock:
            node = handler(biz, params)
        entry["answer"] = node
        if fault == "timeout_after_commit":
            time.sleep(self.faults.hang_seconds)  # done and committed; the caller gives up first
        return self._answer(node_name, node, bad_sign=fault == "bad_sign")

    def _check_protocol(self, params: Mapping[str, str], method: str) -> dict[str, str] | None:
        if not method:
            return self._err("40001", "isv.missing-method", "缺少方法名参数")
        if not params.get("sign"):
            return self._err("40001", "isv.missing-signature", "缺少签名参数")
        for key in ("app_id", "timestamp", "version", "sign_type"):
            if not params.get(key):
                return self._err("40001", f"isv.missing-{key.replace('_', '-')}", f"缺少{key}参数")
        if params["sign_type"] != "RSA2":
            return self._err("40002", "isv.invalid-signature-type", "不支持的签名类型（只收 RSA2）")
        if params["app_id"] != self.app_id:
            return self._err("40002", "isv.invalid-app-id", "无效的AppID参数")
        if method not in METHODS:
            return self._err("40002", "isv.invalid-method", "不存在的方法名")
        if params.get("charset", "utf-8").lower() not in ("utf-8", "utf8"):
            return self._err("40002", "isv.invalid-charset", "字符集错误")
        for key, wanted in (("app_cert_sn", self.app_cert_sn), ("alipay_root_cert_sn", self.root_cert_sn)):
            if wanted is None:
                continue
            name = key.replace("_", "-")
            if not params.get(key):
                return self._err("40001", f"isv.missing-{name}", f"缺少{key}参数")
            if params[key] != wanted:
                return self._err("40002", f"isv.invalid-{name}", f"{key}无效")
        try:
            sent = datetime.strptime(params["timestamp"], "%Y-%m-%d %H:%M:%S").replace(tzinfo=BEIJING)
        except ValueError:
            return self._err("40002", "isv.invalid-timestamp", "非法的时间戳参数")
        if abs(time.time() - sent.timestamp()) > REQUEST_MAX_AGE_SECONDS:
            return self._err("40002", "isv.invalid-timestamp", "时间戳超过有效期")
        if not rsa2_verify(self.app_public_keys, sign_string(params, ["sign"]), params["sign"]):
            return self._err("40002", "isv.invalid-signature", "验签出错")
        return None

    def _draw_fault(self, method: str) -> str | None:
        with self.lock:
            for i, item in enumerate(self.script):
                if not item["method"] or item["method"] == method:
                    return self.script.pop(i)["fault"]
            draws = {name: self.rng.random() for name in FAULTS}  # always every draw: seeded runs stay aligned
        for name in FAULTS:
            if draws[name] < self.faults.rates.get(name, 0.0):
                return name
        return None

    def _err(self, code: str, sub_code: str, sub_msg: str) -> dict[str, str]:
        msg = {"20000": "Service Currently Unavailable", "40001": "Missing Required Arguments"}.get(code)
        msg = msg or {"40002": "Invalid Arguments", "40004": "Business Failed"}.get(code, "Failed")
        return {"code": code, "msg": msg, "sub_code": sub_code, "sub_msg": sub_msg}

    def _answer(self, node_name: str, node: Mapping[str, Any], *, bad_sign: bool = False) -> Response:
        text = json.dumps(node, ensure_ascii=False, separators=(",", ":"))
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if bad_sign else self.platform_key
        cert_sn = f'"alipay_cert_sn":"{self.platform_cert_sn}",' if self.platform_cert_sn else ""
        body = f'{{"{node_name}":{text},{cert_sn}"sign":"{rsa2_sign(key, text)}"}}'
        return Response(body.encode("utf-8"), 200, content_type="text/html;charset=utf-8")

    # ----------------------------------------------------------------------------------------- methods

    def _precreate(self, biz: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
        out_trade_no = biz.get("out_trade_no")
        amount = _yuan(biz.get("total_amount"))
        subject = biz.get("subject")
        if not isinstance(out_trade_no, str) or not _OUT_NO.fullmatch(out_trade_no):
            return self._err("40004", "ACQ.INVALID_PARAMETER", "out_trade_no 无效")
        if amount is None:
            return self._err("40004", "ACQ.INVALID_PARAMETER", "total_amount 无效")
        if not isinstance(subject, str) or not subject:
            return self._err("40004", "ACQ.INVALID_PARAMETER", "subject 必填")
        trade = self.trades.get(out_trade_no)
        if trade is not None:
            if trade.status in ("TRADE_SUCCESS", "TRADE_FINISHED"):
                return self._err("40004", "ACQ.TRADE_HAS_SUCCESS", "交易已被支付")
            if trade.status == "TRADE_CLOSED" or trade.closed_unscanned:
                return self._err("40004", "ACQ.TRADE_HAS_CLOSE", "交易已经关闭")
            if trade.total_amount != amount or trade.subject != subject:
                return self._err("40004", "ACQ.CONTEXT_INCONSISTENT", "交易信息被篡改")
        else:
            trade = Trade(
                out_trade_no,
                amount,
                subject,
                qr_code=f"https://qr.alipay.com/bax{secrets.token_hex(10)}",
                notify_url=params.get("notify_url") or self.notify_url,
                time_expire=biz.get("time_expire") if isinstance(biz.get("time_expire"), str) else None,
            )
            self.trades[out_trade_no] = trade
        return {"code": "10000", "msg": "Success", "out_trade_no": out_trade_no, "qr_code": trade.qr_code}

    def _visible(self, biz: Mapping[str, Any]) -> Trade | None:
        trade = self.trades.get(str(biz.get("out_trade_no") or ""))
        if trade is None and biz.get("trade_no"):
            trade = next((t for t in self.trades.values() if t.trade_no == biz["trade_no"]), None)
        return trade if trade is not None and trade.trade_no is not None else None

    def _query(self, biz: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
        trade = self._visible(biz)
        if trade is None:
            return self._err("40004", "ACQ.TRADE_NOT_EXIST", "交易不存在")
        node: dict[str, Any] = {
            "code": "10000",
            "msg": "Success",
            "trade_no": trade.trade_no,
            "out_trade_no": trade.out_trade_no,
            "buyer_logon_id": "159****5620",
            "trade_status": trade.status,
            "total_amount": _fmt(trade.total_amount),
        }
        if trade.paid_at:
            node.update(
                buyer_pay_amount=_fmt(trade.total_amount),
                receipt_amount=_fmt(trade.total_amount),
                send_pay_date=trade.paid_at,
            )
        else:
            node.update(buyer_pay_amount="0.00", receipt_amount="0.00")
        return node

    def _refund(self, biz: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
        trade = self._visible(biz)
        if trade is None:
            return self._err("40004", "ACQ.TRADE_NOT_EXIST", "交易不存在")
        amount = _yuan(biz.get("refund_amount"))
        if amount is None:
            return self._err("40004", "ACQ.INVALID_PARAMETER", "refund_amount 无效")
        out_request_no = str(biz.get("out_request_no") or trade.out_trade_no)
        existing = trade.refunds.get(out_request_no)
        if existing is not None:
            if existing.amount != amount:
                return self._err("40004", "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL", "退款金额与原请求不一致")
            return self._refund_node(trade, fund_change="N")
        if trade.status != "TRADE_SUCCESS":
            return self._err("40004", "ACQ.TRADE_STATUS_ERROR", "交易状态不合法")
        if trade.refunded + amount > trade.total_amount:
            return self._err("40004", "ACQ.REFUND_AMT_NOT_EQUAL_TOTAL", "退款金额超限")
        trade.refunds[out_request_no] = Refund(out_request_no, amount, beijing_now())
        if trade.refunded == trade.total_amount:
            trade.status = "TRADE_CLOSED"
        self._notify(trade, out_biz_no=out_request_no)
        return self._refund_node(trade, fund_change="Y")

    def _refund_node(self, trade: Trade, *, fund_change: str) -> dict[str, Any]:
        return {
            "code": "10000",
            "msg": "Success",
            "trade_no": trade.trade_no,
            "out_trade_no": trade.out_trade_no,
            "buyer_logon_id": "159****5620",
            "fund_change": fund_change,
            "refund_fee": _fmt(trade.refunded),
        }

    def _refund_query(self, biz: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
        trade = self._visible(biz)
        if trade is None:
            return self._err("40004", "ACQ.TRADE_NOT_EXIST", "交易不存在")
        refund = trade.refunds.get(str(biz.get("out_request_no") or ""))
        node: dict[str, Any] = {"code": "10000", "msg": "Success", "trade_no": trade.trade_no}
        node["out_trade_no"] = trade.out_trade_no
        if refund is not None:
            node.update(
                out_request_no=refund.out_request_no,
                total_amount=_fmt(trade.total_amount),
                refund_amount=_fmt(refund.amount),
                refund_status="REFUND_SUCCESS",
                gmt_refund_pay=refund.at,
            )
        return node

    def _close(self, biz: Mapping[str, Any], params: Mapping[str, str]) -> dict[str, Any]:
        trade = self.trades.get(str(biz.get("out_trade_no") or ""))
        if trade is None or trade.trade_no is None:
            if trade is not None:
                trade.closed_unscanned = True  # the QR code will not take a payment any more
            return self._err("40004", "ACQ.TRADE_NOT_EXIST", "交易不存在")
        if trade.status != "WAIT_BUYER_PAY":
            return self._err("40004", "ACQ.TRADE_STATUS_ERROR", "交易状态不合法")
        trade.status = "TRADE_CLOSED"
        self._notify(trade)
        return {"code": "10000", "msg": "Success", "trade_no": trade.trade_no, "out_trade_no": trade.out_trade_no}

    def _bill_url(self, biz: Mapping[str, Any], host_url: str) -> dict[str, Any]:
        if biz.get("bill_type") != "trade":
            return self._err("40004", "isp.bill_type_not_support", "账单类型不支持")
        day = biz.get("bill_date")
        try:
            datetime.strptime(str(day), "%Y-%m-%d")
        except ValueError:
            return self._err("40004", "isp.bill_date_error", "账单日期格式错误")
        token = secrets.token_hex(12)
        self.bills[token] = (time.monotonic() + 30, self.bill_zip(str(day)))
        return {"code": "10000", "msg": "Success", "bill_download_url": f"{host_url}_fake/bills/{token}"}

    def bill_file(self, token: str) -> Response:
        """The zip behind a bill_download_url, for 30 seconds."""
        with self.lock:
            expires, data = self.bills.get(token, (0.0, b""))
        if time.monotonic() > expires:
            return Response("expired", 404)
        return Response(data, 200, content_type="application/zip")

    # ----------------------------------------------------------------------------------------- bills

    def bill_lines(self, day: str) -> list[list[str]]:
        """The day's 业务明细 rows (Beijing date of completion), as the published layout has them."""
        rows = []
        with self.lock:
            trades = list(self.trades.values())
        for t in trades:
            if t.paid_at and t.paid_at.startswith(day):
                fee = (t.total_amount * FEE_RATE).quantize(Decimal("0.01"))
                rows.append(self._bill_row(t, "交易", t.paid_at, t.total_amount, t.total_amount, "", -fee))
            for r in t.refunds.values():
                if r.at.startswith(day):
                    fee = (r.amount * FEE_RATE).quantize(Decimal("0.01"))
                    rows.append(self._bill_row(t, "退款", r.at, t.total_amount, -r.amount, r.out_request_no, fee))
        return rows

    def _bill_row(
        self, t: Trade, kind: str, at: str, order: Decimal, net: Decimal, request_no: str, fee: Decimal
    ) -> list[str]:
        zero = "0.00"
        return [
            t.trade_no or "",
            t.out_trade_no,
            kind,
            t.subject,
            t.created,
            at,
            "",
            "",
            "",
            "",
            "159****5620",
            _fmt(order),
            _fmt(net),
            zero,
            zero,
            zero,
            zero,
            zero,
            "",
            zero,
            zero,
            request_no,
            _fmt(fee),
            zero,
            "",
        ]

    def bill_zip(self, day: str) -> bytes:
        """The trade bill zip: detail and summary CSV in GBK, file names GBK without the UTF-8 flag."""
        rows = self.bill_lines(day)
        compact = day.replace("-", "")
        start = f"{day[:4]}年{day[5:7]}月{day[8:10]}日 00:00:00"
        trades = [r for r in rows if r[2] == "交易"]
        refunds = [r for r in rows if r[2] == "退款"]
        out = io.StringIO()
        out.write("#支付宝业务明细查询\r\n")
        out.write(f"#账号：[{self.pid}0156]\r\n")
        out.write(f"#起始日期：[{start}]   终止日期：[{start}]\r\n")
        out.write("#-----------------------------------------业务明细列表----------------------------------------\r\n")
        out.write(BILL_HEADER + "\r\n")
        writer = csv.writer(out, lineterminator="\r\n")
        for row in rows:
            writer.writerow([f"{cell}\t" for cell in row])
        out.write("#-----------------------------------------业务明细列表结束------------------------------------\r\n")
        net_trades = sum((Decimal(r[12]) for r in trades), Decimal("0"))
        net_refunds = sum((Decimal(r[12]) for r in refunds), Decimal("0"))
        out.write(f"#交易合计：{len(trades)}笔，商家实收共：{_fmt(net_trades)}元，商家优惠共：0.00元\r\n")
        out.write(f"#退款合计：{len(refunds)}笔，商家实收退款共：{_fmt(net_refunds)}元，商家优惠退款共：0.00元\r\n")
        exported = datetime.now(BEIJING).strftime("%Y年%m月%d日 %H:%M:%S")
        out.write(f"#导出时间：[{exported}]\r\n")
        summary = (
            "#支付宝业务汇总查询\r\n"
            "#-----------------------------------------业务汇总列表----------------------------------------\r\n"
            "门店编号,门店名称,交易订单总笔数,退款订单总笔数,订单金额（元）,商家实收（元）\r\n"
            f"合计,,{len(trades)},{len(refunds)},{_fmt(net_trades)},{_fmt(net_trades + net_refunds)}\r\n"
            "#-----------------------------------------业务汇总列表结束------------------------------------\r\n"
        )
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, text in (
                (f"{self.pid}0156_{compact}_业务明细.csv", out.getvalue()),
                (f"{self.pid}0156_{compact}_业务明细(汇总).csv", summary),
            ):
                archive.writestr(_GbkName(name), text.encode("gbk"))
        return buffer.getvalue()

    # ----------------------------------------------------------------------------------------- control

    def control(self, request: Request) -> Response:
        """The /_fake/… surface for tests and chaos runs."""
        path = request.path[len("/_fake/") :]
        data = request.get_json(silent=True) or {}
        with self.lock:
            if path in ("scan", "pay"):
                trade = self.trades.get(str(data.get("out_trade_no")))
                if trade is None or trade.closed_unscanned or trade.status not in ("PRECREATED", "WAIT_BUYER_PAY"):
                    return _json({"error": "no payable trade with that out_trade_no"}, 404)
                if trade.expired():
                    return _json({"error": "订单已超时，不能付款 (past time_expire)"}, 409)
                if trade.trade_no is None:
                    serial = f"{self.rng.getrandbits(53):016d}"[-16:]
                    trade.trade_no = datetime.now(BEIJING).strftime("%Y%m%d") + "2200" + serial
                    trade.status = "WAIT_BUYER_PAY"
                if path == "pay":
                    trade.status = "TRADE_SUCCESS"
                    trade.paid_at = beijing_now()
                    self._notify(trade)
                return _json(self._trade_json(trade))
            if path == "faults":
                try:
                    self.faults, self.script = parse_faults(data)
                except (ValueError, TypeError) as exc:
                    return _json({"error": str(exc)}, 400)
                self.rng = random.Random(self.faults.seed)  # noqa: S311
                return _json({"ok": True})
            if path == "requests":
                return _json(self.requests)
            if path == "notifications":
                return _json(self.notifications)
            if path == "trades":
                return _json({no: self._trade_json(t) for no, t in self.trades.items()})
            if path.startswith("trades/"):
                trade = self.trades.get(path[len("trades/") :])
                return _json(self._trade_json(trade)) if trade else _json({"error": "no such trade"}, 404)
            if path == "reset":
                self.trades.clear()
                self.requests.clear()
                self.notifications.clear()
                self.faults, self.script = Faults(), []
                return _json({"ok": True})
        return _json({"error": "no such control"}, 404)

    def _trade_json(self, trade: Trade) -> dict[str, Any]:
        return {
            "out_trade_no": trade.out_trade_no,
            "trade_no": trade.trade_no,
            "status": trade.status,
            "total_amount": _fmt(trade.total_amount),
            "qr_code": trade.qr_code,
            "refunds": {k: _fmt(v.amount) for k, v in trade.refunds.items()},
            "closed_unscanned": trade.closed_unscanned,
            "time_expire": trade.time_expire,
        }

    # ----------------------------------------------------------------------------------------- notifications

    def notify_params(self, trade: Trade, *, out_biz_no: str | None = None) -> dict[str, str]:
        """The fields of a trade_status_sync notify for the trade's current state (unsigned)."""
        params = {
            "notify_type": "trade_status_sync",
            "notify_id": secrets.token_hex(17),
            "app_id": self.app_id,
            "auth_app_id": self.app_id,
            "charset": "utf-8",
            "version": "1.0",
            "sign_type": "RSA2",
            "trade_no": trade.trade_no or "",
            "out_trade_no": trade.out_trade_no,
            "buyer_id": "2088102122524333",
            "buyer_logon_id": "159****5620",
            "seller_id": self.pid,
            "trade_status": trade.status,
            "total_amount": _fmt(trade.total_amount),
            "subject": trade.subject,
            "gmt_create": trade.created,
        }
        if trade.paid_at:
            params.update(
                receipt_amount=_fmt(trade.total_amount),
                buyer_pay_amount=_fmt(trade.total_amount),
                invoice_amount=_fmt(trade.total_amount),
                point_amount="0.00",
                gmt_payment=trade.paid_at,
            )
        if out_biz_no:
            params.update(out_biz_no=out_biz_no, refund_fee=_fmt(trade.refunded), gmt_refund=beijing_now())
        if trade.status == "TRADE_CLOSED":
            params["gmt_close"] = beijing_now()
        return params

    def signed_notify(self, params: Mapping[str, str], *, key: rsa.RSAPrivateKey | None = None) -> bytes:
        """The form body of one delivery: notify_time now, signed over all but sign and sign_type."""
        fields = {**params, "notify_time": beijing_now()}
        fields["sign"] = rsa2_sign(key or self.platform_key, sign_string(fields, ["sign", "sign_type"]))
        return urllib.parse.urlencode(fields).encode("ascii")

    def _notify(self, trade: Trade, *, out_biz_no: str | None = None) -> None:
        url = trade.notify_url or self.notify_url
        if not url:
            return
        record = {"url": url, "params": self.notify_params(trade, out_biz_no=out_biz_no), "attempts": []}
        self.notifications.append(record)
        self._outbox.put((time.monotonic(), record))
        if self.rng.random() < self.faults.notify_duplicate_rate:
            self.notifications.append({**record, "attempts": [], "duplicate": True})
            self._outbox.put((time.monotonic() + 0.2, self.notifications[-1]))

    def _deliver_loop(self) -> None:
        waiting: list[tuple[float, dict[str, Any]]] = []
        while not self._stop.is_set():
            timeout = max(0.0, min(at for at, _ in waiting) - time.monotonic()) if waiting else None
            try:
                item = self._outbox.get(timeout=timeout)
                if item is None:
                    return
                waiting.append(item)
            except queue.Empty:
                pass
            now = time.monotonic()
            due = [w for w in waiting if w[0] <= now]
            waiting = [w for w in waiting if w[0] > now]
            for _, record in due:
                if not self._deliver(record):
                    attempt = len(record["attempts"])
                    if attempt <= len(self.retry_delays):
                        waiting.append((time.monotonic() + self.retry_delays[attempt - 1], record))

    def _deliver(self, record: dict[str, Any]) -> bool:
        bad = self.rng.random() < self.faults.notify_bad_sign_rate
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if bad else None
        body = self.signed_notify(record["params"], key=key)
        request = urllib.request.Request(  # noqa: S310 - the notify_url it was given, http(s) only
            record["url"], data=body, headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - the configured URL
                text = answer.read(64).decode("utf-8", "replace")
                status = answer.status
        except Exception as exc:  # noqa: BLE001 - any failure is a failed attempt, as on the real platform
            text, status = type(exc).__name__, None
        record["attempts"].append({"status": status, "answer": text, "bad_sign": bad})
        return text == "success"


class _GbkName(zipfile.ZipInfo):
    """A zip member named in GBK bytes without the UTF-8 flag, as Alipay's bill zips are."""

    def __init__(self, name: str) -> None:
        super().__init__(name, date_time=time.localtime()[:6])
        self.compress_type = zipfile.ZIP_DEFLATED
        self._gbk = name.encode("gbk")

    def _encodeFilenameFlags(self) -> tuple[bytes, int]:  # noqa: N802 - zipfile's own hook
        return self._gbk, self.flag_bits & ~0x800


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data, ensure_ascii=False, default=str), status, content_type="application/json")


# --------------------------------------------------------------------------------------------- serving


def load_private(path: str) -> rsa.RSAPrivateKey:
    """An RSA private key from a PEM file."""
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path} is not an RSA private key")
    return key


def load_public(paths: Iterable[str]) -> list[rsa.RSAPublicKey]:
    """RSA public keys from PEM files."""
    keys = []
    for path in paths:
        key = serialization.load_pem_public_key(Path(path).read_bytes())
        if not isinstance(key, rsa.RSAPublicKey):
            raise ValueError(f"{path} is not an RSA public key")
        keys.append(key)
    return keys


def serve(fake: FakeAlipay, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, threading.Thread]:
    """Start a threaded HTTP server for ``fake`` (port 0 picks one); returns (server, thread)."""
    server = make_server(host, port, fake, threaded=True)
    thread = threading.Thread(target=server.serve_forever, name="fake-alipay", daemon=True)
    thread.start()
    return server, thread


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sandbox.fakes.alipay``: serve the fake until interrupted."""
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m sandbox.fakes.alipay", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=env("FAKE_ALIPAY_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=int(env("FAKE_ALIPAY_PORT", "8200")))
    parser.add_argument("--app-id", default=env("FAKE_ALIPAY_APP_ID"), required=not env("FAKE_ALIPAY_APP_ID"))
    parser.add_argument("--app-public-keys", default=env("FAKE_ALIPAY_APP_PUBLIC_KEYS", ""), help="comma-separated")
    parser.add_argument("--platform-private-key", default=env("FAKE_ALIPAY_PRIVATE_KEY", ""))
    parser.add_argument("--notify-url", default=env("FAKE_ALIPAY_NOTIFY_URL"))
    parser.add_argument("--app-cert", default=env("FAKE_ALIPAY_APP_CERT", ""), help="certificate mode: app cert")
    parser.add_argument("--root-cert", default=env("FAKE_ALIPAY_ROOT_CERT", ""), help="certificate mode: root chain")
    parser.add_argument("--platform-cert", default=env("FAKE_ALIPAY_PLATFORM_CERT", ""), help="alipay_cert_sn's cert")
    parser.add_argument("--faults", default=env("FAKE_ALIPAY_FAULTS", ""), help="JSON object of fault knobs")
    parser.add_argument("--seed", type=int, default=int(env("FAKE_ALIPAY_SEED", "0")) or None)
    args = parser.parse_args(argv)
    if not args.app_public_keys or not args.platform_private_key:
        parser.error("--app-public-keys and --platform-private-key are required (PEM files)")
    faults = json.loads(args.faults) if args.faults else {}
    if args.seed is not None:
        faults.setdefault("seed", args.seed)
    fake = FakeAlipay(
        args.app_id,
        load_public(p.strip() for p in args.app_public_keys.split(",") if p.strip()),
        load_private(args.platform_private_key),
        notify_url=args.notify_url,
        faults=faults,
        app_cert_pem=Path(args.app_cert).read_bytes() if args.app_cert else None,
        root_cert_pem=Path(args.root_cert).read_bytes() if args.root_cert else None,
        platform_cert_pem=Path(args.platform_cert).read_bytes() if args.platform_cert else None,
    )
    if (fake.app_cert_sn is None) != (fake.root_cert_sn is None):
        parser.error("certificate mode needs both --app-cert and --root-cert")
    server = make_server(args.host, args.port, fake, threaded=True)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"fake alipay gateway on http://{args.host}:{server.server_port}/gateway.do", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        fake.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
