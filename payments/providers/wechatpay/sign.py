"""WeChat Pay API v3 signatures and resource decryption: pure functions, no I/O.

Requests (merchant → WeChat Pay), "签名生成":

    Authorization: WECHATPAY2-SHA256-RSA2048 mchid="…",nonce_str="…",signature="…",timestamp="…",serial_no="…"
    signature = base64(SHA256withRSA(merchant private key,
                       "METHOD\\nURL path?query\\nTIMESTAMP\\nNONCE\\nBODY\\n"))

The body signed is the exact bytes sent (empty for GET); ``serial_no`` is the
merchant API certificate's serial.

Responses and notifications (WeChat Pay → merchant), "签名验证": headers
``Wechatpay-Timestamp``, ``Wechatpay-Nonce``, ``Wechatpay-Signature``,
``Wechatpay-Serial``; the message is ``"TIMESTAMP\\nNONCE\\nBODY\\n"``, verified
with the platform key named by the serial: a platform certificate serial
(hex, case-insensitive) or a ``PUB_KEY_ID_…`` platform public key id (exact).
Both schemes are in use, and during a switch both arrive. We refuse a
timestamp more than five minutes off in either direction, an unknown serial
(the adapter first looks a new certificate serial up at ``/v3/certificates``),
and WeChat's
``WECHATPAY/SIGNTEST/`` probe signatures, which exist to catch merchants who
do not verify.

Notification ``resource`` objects are AEAD_AES_256_GCM: the key is the
APIv3 key's 32 bytes, ``nonce`` and ``associated_data`` are used as the
UTF-8 strings given, and ``ciphertext`` is base64 of ciphertext + 16-byte tag.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

SCHEME = "WECHATPAY2-SHA256-RSA2048"
"""The Authorization scheme and the Wechatpay-Signature-Type of RSA signatures."""
TOLERANCE_SECONDS = 300
"""Largest accepted difference between a signed timestamp and our clock, either way."""
PROBE_PREFIX = "WECHATPAY/SIGNTEST/"
"""Signatures WeChat Pay sends on purpose to check that merchants verify."""
MIN_KEY_BITS = 2048
"""RSA keys shorter than this are refused (the scheme is RSA2048)."""

TIMESTAMP = "Wechatpay-Timestamp"
NONCE = "Wechatpay-Nonce"
SIGNATURE = "Wechatpay-Signature"
SERIAL = "Wechatpay-Serial"
SIGNATURE_TYPE = "Wechatpay-Signature-Type"
SIGNED_HEADERS = (TIMESTAMP, NONCE, SIGNATURE, SERIAL, SIGNATURE_TYPE)
"""Headers a notification's or a response's signature depends on."""

_TIMESTAMP = re.compile(r"[0-9]{1,12}", re.ASCII)


class VerifyError(ValueError):
    """A WeChat Pay signature or resource that does not check out; ``code`` says which rule it broke."""

    code = "invalid_signature"


class MissingHeader(VerifyError):
    """A signature header is absent or empty."""

    code = "missing_header"


class StaleTimestamp(VerifyError):
    """The signed timestamp is more than five minutes from our clock."""

    code = "stale_timestamp"


class UnknownSerial(VerifyError):
    """Wechatpay-Serial names no configured platform key."""

    code = "unknown_serial"


class ProbeSignature(VerifyError):
    """A ``WECHATPAY/SIGNTEST/`` probe: refused like any bad signature."""

    code = "probe_signature"


class BadSignature(VerifyError):
    """The signature is not base64 or does not verify with the named key."""

    code = "invalid_signature"


class UndecryptableResource(VerifyError):
    """The resource is not AEAD_AES_256_GCM under our APIv3 key (wrong key, tampered, not base64)."""

    code = "undecryptable_resource"


@dataclass(frozen=True)
class PlatformKey:
    """One platform verification key: its id, the RSA public key, and (certificates only) its validity."""

    key_id: str
    public_key: rsa.RSAPublicKey
    not_before: datetime | None = None
    not_after: datetime | None = None


class PlatformKeys:
    """The configured platform keys, looked up by Wechatpay-Serial (certificate serials case-insensitively)."""

    def __init__(self, keys: list[PlatformKey] | tuple[PlatformKey, ...]) -> None:
        self._by_id = {_normal_id(k.key_id): k for k in keys}

    def get(self, key_id: str) -> PlatformKey | None:
        """The key named ``key_id``, or None."""
        return self._by_id.get(_normal_id(key_id))

    def ids(self) -> tuple[str, ...]:
        """Every configured id, in configuration order."""
        return tuple(k.key_id for k in self._by_id.values())

    def all(self) -> tuple[PlatformKey, ...]:
        """Every key, in configuration order."""
        return tuple(self._by_id.values())


def _normal_id(key_id: str) -> str:
    key_id = key_id.strip()
    return key_id if key_id.startswith("PUB_KEY_ID_") else key_id.upper()


# --------------------------------------------------------------------------------------------- keys


def load_private_key(pem: bytes) -> rsa.RSAPrivateKey:
    """The merchant's RSA private key from PEM (PKCS#8 or PKCS#1); ValueError saying why not."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not an unencrypted PEM private key ({type(exc).__name__})") from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"not an RSA private key ({type(key).__name__})")
    if key.key_size < MIN_KEY_BITS:
        raise ValueError(f"RSA key has {key.key_size} bits, fewer than {MIN_KEY_BITS}")
    return key


def load_platform_key(key_id: str, pem: bytes) -> PlatformKey:
    """A platform key from PEM: a certificate (its serial must be ``key_id``) or a public key (a PUB_KEY_ID_…).

    ValueError says what is wrong, for a start-up message.
    """
    if b"-----BEGIN CERTIFICATE-----" in pem:
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise ValueError(f"unreadable certificate ({exc})") from None
        if key_id.startswith("PUB_KEY_ID_"):
            raise ValueError(f"{key_id} names a platform public key, but the file is a certificate")
        try:
            wanted = int(key_id, 16)
        except ValueError:
            raise ValueError(f"{key_id!r} is not a hexadecimal certificate serial") from None
        if cert.serial_number != wanted:
            raise ValueError(f"certificate serial is {cert.serial_number:X}, not {key_id}")
        public_key = cert.public_key()
        not_before, not_after = cert.not_valid_before_utc, cert.not_valid_after_utc
    elif b"-----BEGIN PUBLIC KEY-----" in pem:
        try:
            public_key = serialization.load_pem_public_key(pem)
        except ValueError as exc:
            raise ValueError(f"unreadable public key ({exc})") from None
        not_before = not_after = None
    else:
        raise ValueError("neither a PEM certificate nor a PEM public key")
    if not isinstance(public_key, rsa.RSAPublicKey):
        raise ValueError(f"not an RSA key ({type(public_key).__name__})")
    if public_key.key_size < MIN_KEY_BITS:
        raise ValueError(f"RSA key has {public_key.key_size} bits, fewer than {MIN_KEY_BITS}")
    return PlatformKey(key_id, public_key, not_before, not_after)


# --------------------------------------------------------------------------------------------- requests


def request_message(method: str, path: str, timestamp: str, nonce: str, body: bytes) -> bytes:
    """The five-line string a request signature covers (``path`` is the URL without the host, with ``?query``)."""
    return b"\n".join([method.upper().encode(), path.encode(), timestamp.encode(), nonce.encode(), body]) + b"\n"


def new_nonce() -> str:
    """A 32-character random nonce_str."""
    return secrets.token_hex(16).upper()


def authorization(
    *,
    mchid: str,
    serial_no: str,
    private_key: rsa.RSAPrivateKey,
    method: str,
    path: str,
    body: bytes,
    timestamp: str,
    nonce: str,
) -> str:
    """The Authorization header value of one request."""
    signature = private_key.sign(
        request_message(method, path, timestamp, nonce, body), padding.PKCS1v15(), hashes.SHA256()
    )
    encoded = base64.b64encode(signature).decode()
    return (
        f'{SCHEME} mchid="{mchid}",nonce_str="{nonce}",signature="{encoded}",'
        f'timestamp="{timestamp}",serial_no="{serial_no}"'
    )


# --------------------------------------------------------------------------------------------- verification


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A header by name, whatever its case."""
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def verify(headers: Mapping[str, str], body: bytes, keys: PlatformKeys, now: float) -> str:
    """Verify a notification's or a response's signature headers over ``body``; return the key id used.

    Raises a VerifyError subclass naming the broken rule. The order matters
    only for the reason recorded: a probe is named as a probe, a stale
    timestamp as stale, before any key is consulted.
    """
    values = {}
    for name in (TIMESTAMP, NONCE, SIGNATURE, SERIAL):
        value = header(headers, name)
        if value is None or not value.strip():
            raise MissingHeader(f"{name} header missing")
        values[name] = value.strip()
    signature_type = header(headers, SIGNATURE_TYPE)
    if signature_type is not None and signature_type.strip() != SCHEME:
        raise BadSignature(f"unsupported {SIGNATURE_TYPE} {signature_type.strip()[:40]!r}")
    if values[SIGNATURE].startswith(PROBE_PREFIX):
        raise ProbeSignature("WECHATPAY/SIGNTEST/ probe signature")
    timestamp = values[TIMESTAMP]
    if not _TIMESTAMP.fullmatch(timestamp):
        raise BadSignature(f"{TIMESTAMP} is not a unix timestamp")
    if abs(now - int(timestamp)) > TOLERANCE_SECONDS:
        raise StaleTimestamp(f"{TIMESTAMP} {timestamp} is more than {TOLERANCE_SECONDS} s from our clock")
    key = keys.get(values[SERIAL])
    if key is None:
        raise UnknownSerial(f"{SERIAL} {values[SERIAL][:64]!r} is not a configured platform key")
    try:
        signature = base64.b64decode(values[SIGNATURE], validate=True)
    except (binascii.Error, ValueError):
        raise BadSignature(f"{SIGNATURE} is not base64") from None
    message = timestamp.encode() + b"\n" + values[NONCE].encode() + b"\n" + body + b"\n"
    try:
        key.public_key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
    except InvalidSignature:
        raise BadSignature(f"signature does not verify with platform key {key.key_id}") from None
    return key.key_id


def decrypt_resource(apiv3_key: bytes, resource: Mapping[str, object]) -> bytes:
    """The plaintext of an AEAD_AES_256_GCM ``resource``; UndecryptableResource if it is not ours or not intact."""
    algorithm = resource.get("algorithm")
    if algorithm != "AEAD_AES_256_GCM":
        raise UndecryptableResource(f"unsupported resource algorithm {str(algorithm)[:40]!r}")
    ciphertext, nonce = resource.get("ciphertext"), resource.get("nonce")
    associated = resource.get("associated_data") or ""
    if not isinstance(ciphertext, str) or not isinstance(nonce, str) or not nonce or not isinstance(associated, str):
        raise UndecryptableResource("resource needs string ciphertext, nonce and associated_data")
    try:
        raw = base64.b64decode(ciphertext, validate=True)
        return AESGCM(apiv3_key).decrypt(nonce.encode(), raw, associated.encode() or None)
    except (binascii.Error, ValueError, InvalidTag):
        raise UndecryptableResource("resource does not decrypt with the APIv3 key") from None


def expired(key: PlatformKey, now: datetime | None = None) -> bool:
    """True for a certificate past its not-after date (public keys do not expire)."""
    now = now or datetime.now(UTC)
    return key.not_after is not None and now > key.not_after
