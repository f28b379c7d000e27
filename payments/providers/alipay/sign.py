"""Alipay openapi signing, verification and money/time conversions (pure; no I/O but reading key files).

The rules, from Alipay's documentation and its official SDKs (alipay-sdk-java-all
``AlipaySignature``, alipay-sdk-python-all ``SignatureUtils``/``DefaultAlipayClient``):

- **Request**: every parameter except ``sign`` (``sign_type`` included), empty
  values left out, sorted by key, joined ``k=v&…`` with the raw (not
  URL-encoded) values; RSA2 = SHA256withRSA (PKCS#1 v1.5), base64.
- **Asynchronous notify**: the same, but ``sign`` *and* ``sign_type`` are left
  out, over the URL-decoded values (``AlipaySignature.getSignCheckContentV1``).
  Some third-party Python SDKs keep empty values; that is wrong.
- **Response**: the signed content is the JSON text of the
  ``<method with _ for .>_response`` node (or ``error_response``) exactly as
  received, byte for byte; ``sign`` is its sibling at the top level. The Java
  SDK retries once with ``\\/`` unescaped to ``/``; so do we.

**Certificate mode** (公钥证书模式): every request also carries ``app_cert_sn``
and ``alipay_root_cert_sn`` (signed like any parameter), or Alipay answers
``isv.missing-app-cert-sn``. A certificate's SN is the MD5 (hex, 32 digits)
of its issuer's distinguished name as Java's ``X500Principal.getName()`` writes
it (RFC 2253: ``CN=…,OU=…,O=…,C=CN``) followed by its serial number in decimal
(``AntCertificationUtil.getCertSN``); the root SN is the SNs of the RSA-signed
certificates of the root chain file, in file order, joined by ``_`` (the SM2
and ECDSA roots are left out: ``getRootCertSN``).

``RSA`` (SHA-1) is refused everywhere. Amounts are yuan with at most two
decimals (``total_amount``); times are ``yyyy-MM-dd HH:mm:ss`` in Beijing time
(UTC+8, no daylight saving).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from payments.errors import ConfigError

SIGN_TYPE = "RSA2"
"""The only signature type we send or accept."""
MIN_KEY_BITS = 2048
"""RSA2 keys are 2048 bits; anything shorter is refused as weak."""
BEIJING = timezone(timedelta(hours=8), "Asia/Shanghai")
"""Alipay's clock: every timestamp it sends or expects is Beijing time without a zone."""
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_AMOUNT = re.compile(r"\d{1,11}(\.\d{1,2})?")
RSA_SIGNATURE_OIDS = "1.2.840.113549.1.1."
"""Signature algorithms of the root certificates whose SNs make alipay_root_cert_sn (sha1/sha256WithRSA, …)."""
_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


# --------------------------------------------------------------------------------------------- keys


def load_private_key(env_name: str, path: str) -> rsa.RSAPrivateKey:
    """Read our RSA application private key (PEM, PKCS#8 or PKCS#1); ConfigError naming the file and why."""
    data = _read(env_name, path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{env_name}: {path} is not an unencrypted PEM private key ({_why(exc)})") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigError(f"{env_name}: {path} is not an RSA key (RSA2 needs RSA)")
    if key.key_size < MIN_KEY_BITS:
        raise ConfigError(f"{env_name}: {path} is a {key.key_size}-bit key; RSA2 needs at least {MIN_KEY_BITS}")
    return key


def load_public_keys(env_name: str, paths: Sequence[str]) -> tuple[rsa.RSAPublicKey, ...]:
    """Read every Alipay public key (PEM public key or X.509 certificate); ConfigError naming the bad file."""
    if not paths:
        raise ConfigError(f"{env_name} must name at least one PEM file")
    keys = []
    for path in paths:
        data = _read(env_name, path)
        try:
            if b"BEGIN CERTIFICATE" in data:
                key = _leaf(read_certificates(env_name, path)).public_key()
            else:
                key = serialization.load_pem_public_key(data)
        except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
            raise ConfigError(f"{env_name}: {path} is not a PEM public key or certificate ({_why(exc)})") from None
        if not isinstance(key, rsa.RSAPublicKey):
            raise ConfigError(f"{env_name}: {path} is not an RSA public key")
        if key.key_size < MIN_KEY_BITS:
            raise ConfigError(f"{env_name}: {path} is a {key.key_size}-bit key; RSA2 needs at least {MIN_KEY_BITS}")
        keys.append(key)
    return tuple(keys)


def has_certificate(env_name: str, paths: Sequence[str]) -> str | None:
    """The first of ``paths`` that holds a PEM certificate (certificate mode's Alipay certificate), or None."""
    return next((path for path in paths if b"BEGIN CERTIFICATE" in _read(env_name, path)), None)


def cert_sn(cert: x509.Certificate) -> str:
    """A certificate's SN as Alipay's SDKs compute it: MD5 hex of the RFC 2253 issuer and the decimal serial."""
    # rfc4514_string() is RFC 2253's order (CN first) and escaping, i.e. what Java's getName() returns.
    text = cert.issuer.rfc4514_string() + str(cert.serial_number)
    return hashlib.md5(text.encode("utf-8")).hexdigest()  # noqa: S324 - Alipay's identifier, not a security hash


def root_cert_sn(certs: Sequence[x509.Certificate]) -> str:
    """alipay_root_cert_sn: the SNs of the RSA-signed certificates of the root chain, in order, joined by ``_``."""
    return "_".join(cert_sn(c) for c in certs if c.signature_algorithm_oid.dotted_string.startswith(RSA_SIGNATURE_OIDS))


def read_certificates(env_name: str, path: str) -> list[x509.Certificate]:
    """Every PEM certificate of a file, in order; ConfigError naming the file if there is none or one is unreadable."""
    data = _read(env_name, path)
    blocks = _PEM_CERT.findall(data)
    if not blocks:
        raise ConfigError(f"{env_name}: {path} holds no PEM certificate")
    try:
        return [x509.load_pem_x509_certificate(block) for block in blocks]
    except ValueError as exc:
        raise ConfigError(f"{env_name}: {path} has an unreadable certificate ({_why(exc)})") from None


@dataclass(frozen=True)
class CertMode:
    """What certificate mode adds to every request."""

    app_cert_sn: str
    alipay_root_cert_sn: str


def load_cert_mode(app_cert_path: str, root_cert_path: str, private_key: rsa.RSAPrivateKey) -> CertMode:
    """The two SNs of certificate mode from our app certificate and Alipay's root chain; ConfigError saying why not.

    Our certificate must hold our private key's public half: Alipay verifies
    each request with the key of the certificate ``app_cert_sn`` names.
    """
    app_cert = read_certificates("ALIPAY_APP_CERT_FILE", app_cert_path)[0]
    public = app_cert.public_key()
    if not isinstance(public, rsa.RSAPublicKey) or public.public_numbers() != private_key.public_key().public_numbers():
        raise ConfigError(
            f"ALIPAY_APP_CERT_FILE: {app_cert_path} is not the certificate of ALIPAY_APP_PRIVATE_KEY_FILE's key"
        )
    root_sn = root_cert_sn(read_certificates("ALIPAY_ROOT_CERT_FILE", root_cert_path))
    if not root_sn:
        raise ConfigError(f"ALIPAY_ROOT_CERT_FILE: {root_cert_path} holds no RSA-signed root certificate")
    return CertMode(cert_sn(app_cert), root_sn)


def cert_mode(
    app_cert_file: str, root_cert_file: str, public_key_files: Sequence[str], private_key: rsa.RSAPrivateKey
) -> CertMode | None:
    """Certificate mode when ALIPAY_APP_CERT_FILE and ALIPAY_ROOT_CERT_FILE are both set; None for key mode.

    ConfigError for a half configuration, and for an Alipay certificate in
    ALIPAY_PUBLIC_KEY_FILES without the two: an application in certificate
    mode whose requests lack the two SNs is refused by Alipay on every call.
    """
    if not app_cert_file and not root_cert_file:
        found = has_certificate("ALIPAY_PUBLIC_KEY_FILES", public_key_files)
        if found is not None:
            raise ConfigError(
                f"ALIPAY_PUBLIC_KEY_FILES: {found} is a certificate: certificate mode also needs ALIPAY_APP_CERT_FILE"
                " and ALIPAY_ROOT_CERT_FILE (Alipay refuses its requests without app_cert_sn and"
                " alipay_root_cert_sn); in public-key mode give Alipay's public key instead"
            )
        return None
    if not app_cert_file or not root_cert_file:
        missing = "ALIPAY_APP_CERT_FILE" if not app_cert_file else "ALIPAY_ROOT_CERT_FILE"
        raise ConfigError(
            f"certificate mode needs ALIPAY_APP_CERT_FILE and ALIPAY_ROOT_CERT_FILE: {missing} is not set"
        )
    return load_cert_mode(app_cert_file, root_cert_file, private_key)


def _leaf(certs: Sequence[x509.Certificate]) -> x509.Certificate:
    """The certificate of a bundle that issued none of the others: alipayCertPublicKey_RSA2.crt carries its CA too."""
    issued = [c for c in certs if not any(o is not c and o.issuer == c.subject for o in certs)]
    return issued[0] if issued else certs[0]


def _read(env_name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{env_name}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None


def _why(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120] or type(exc).__name__


# --------------------------------------------------------------------------------------------- strings to sign


def request_sign_content(params: Mapping[str, str]) -> str:
    """The string an openapi request signs: all but ``sign``, non-empty, sorted, ``k=v&…``."""
    return "&".join(f"{k}={params[k]}" for k in sorted(params) if k != "sign" and params[k] != "")


def notify_sign_content(params: Mapping[str, str]) -> str:
    """The string an asynchronous notify signs: all but ``sign`` and ``sign_type``, non-empty, sorted."""
    return "&".join(f"{k}={params[k]}" for k in sorted(params) if k not in ("sign", "sign_type") and params[k] != "")


def sign(key: rsa.RSAPrivateKey, content: str, charset: str = "utf-8") -> str:
    """RSA2 (SHA256withRSA, PKCS#1 v1.5) over ``content`` in ``charset``, base64."""
    signature = key.sign(content.encode(charset), padding.PKCS1v15(), hashes.SHA256())
    return base64.b64encode(signature).decode("ascii")


def verify(keys: Iterable[rsa.RSAPublicKey], content: bytes, signature_b64: str) -> bool:
    """True when any of ``keys`` (rotation: old and new during the overlap) signed ``content``."""
    try:
        signature = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    for key in keys:
        try:
            key.verify(signature, content, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            continue
        return True
    return False


# --------------------------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class SignedNode:
    """One openapi answer: the decoded ``*_response`` node, its exact text, and whether its sign verified."""

    name: str
    """``alipay_trade_query_response`` or ``error_response``."""
    node: Mapping[str, object]
    text: str
    signed: bool
    """A ``sign`` was present."""
    verified: bool
    """The ``sign`` verified against one of Alipay's keys."""


def response_node_name(method: str) -> str:
    """``alipay.trade.query`` → ``alipay_trade_query_response``."""
    return method.replace(".", "_") + "_response"


def read_response(text: str, method: str, keys: Sequence[rsa.RSAPublicKey]) -> SignedNode:
    """Find the method's node in an openapi answer and check its sign; ValueError if the shape is wrong."""
    spans = top_level_spans(text)
    name = response_node_name(method)
    if name not in spans:
        name = "error_response"
        if name not in spans:
            raise ValueError(f"no {response_node_name(method)} in the answer")
    start, end, node = spans[name]
    if not isinstance(node, dict):
        raise ValueError(f"{name} is not a JSON object")
    node_text = text[start:end]
    signature = spans.get("sign", (0, 0, None))[2]
    signed = isinstance(signature, str) and signature != ""
    verified = False
    if signed:
        verified = verify(keys, node_text.encode("utf-8"), signature)
        if not verified and "\\/" in node_text:
            verified = verify(keys, node_text.replace("\\/", "/").encode("utf-8"), signature)
    return SignedNode(name, node, node_text, signed, verified)


_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def top_level_spans(text: str) -> dict[str, tuple[int, int, object]]:
    """Each key of a top-level JSON object with (start, end, value) of its value's exact text."""
    pos = _skip(text, 0)
    if text[pos : pos + 1] != "{":
        raise ValueError("the answer is not a JSON object")
    pos = _skip(text, pos + 1)
    spans: dict[str, tuple[int, int, object]] = {}
    if text[pos : pos + 1] == "}":
        return spans
    try:
        while True:
            if text[pos : pos + 1] != '"':
                raise ValueError("expected a key")
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip(text, pos)
            if text[pos : pos + 1] != ":":
                raise ValueError("expected ':'")
            start = _skip(text, pos + 1)
            value, end = _DECODER.raw_decode(text, start)
            if key in spans:
                raise ValueError(f"duplicate key {str(key)[:40]!r}")
            spans[key] = (start, end, value)
            pos = _skip(text, end)
            if text[pos : pos + 1] == ",":
                pos = _skip(text, pos + 1)
                continue
            if text[pos : pos + 1] == "}":
                break
            raise ValueError("expected ',' or '}'")
    except RecursionError:  # absurdly deep nesting is not an answer
        raise ValueError("nesting too deep") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from None
    if _skip(text, pos + 1) != len(text):
        raise ValueError("text after the JSON object")
    return spans


def _skip(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


def strip_sign(text: str) -> str:
    """The answer with its ``sign`` value blanked, for evidence rows (no raw signatures at rest)."""
    return re.sub(r'("sign"\s*:\s*")[^"]*(")', r"\1…\2", text)


# --------------------------------------------------------------------------------------------- money and time


def yuan_to_minor(text: object) -> int:
    """``"12.30"`` → 1230 (fen), exactly, with Decimal; ValueError for anything else (negatives included)."""
    if not isinstance(text, str) or not _AMOUNT.fullmatch(text):
        raise ValueError(f"not a yuan amount with at most two decimals: {str(text)[:32]!r}")
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValueError(f"not a decimal: {text[:32]!r}") from None
    return int(value * 100)


def minor_to_yuan(amount_minor: int) -> str:
    """1230 → ``"12.30"``: the fixed two-decimal form Alipay expects."""
    if isinstance(amount_minor, bool) or not isinstance(amount_minor, int) or amount_minor < 0:
        raise ValueError("amount must be a non-negative integer of minor units")
    return str((Decimal(amount_minor) / 100).quantize(Decimal("0.01")))


def parse_beijing(text: object) -> float:
    """``"2024-01-15 10:30:00"`` (Beijing time) → unix seconds; ValueError if not that format."""
    if not isinstance(text, str) or len(text) != 19:
        raise ValueError(f"not a yyyy-MM-dd HH:mm:ss time: {str(text)[:32]!r}")
    return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=BEIJING).timestamp()


def format_beijing(unix_seconds: float) -> str:
    """Unix seconds → ``yyyy-MM-dd HH:mm:ss`` in Beijing time (the openapi ``timestamp``)."""
    return datetime.fromtimestamp(unix_seconds, UTC).astimezone(BEIJING).strftime(TIME_FORMAT)
