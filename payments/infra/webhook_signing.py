"""Standard Webhooks signing and verification (symmetric ``v1``), as pure functions.

The scheme (https://www.standardwebhooks.com, spec "Signature scheme"):

- the secret is shown as ``whsec_<base64>``; the HMAC key is the decoded bytes;
- the signed content is ``"{webhook-id}.{webhook-timestamp}.{body}"`` (body byte
  for byte as sent);
- ``webhook-signature`` is a space-separated list of ``<version>,<base64>``
  entries; ``v1`` is base64(HMAC-SHA256(key, content)). Several entries let a
  sender sign with an old and a new secret during rotation; other versions
  (``v1a`` is ed25519) are skipped by a ``v1`` verifier;
- ``webhook-timestamp`` is integer unix seconds of the *attempt* (so a retry has
  a fresh timestamp); a receiver refuses timestamps outside a tolerance to stop
  replays, and dedupes on ``webhook-id``.

``verify`` is what a merchant's receiver runs; paysync's relay uses ``headers``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Mapping

from payments.errors import ConfigError, SignatureInvalid, TimestampOutOfTolerance

SECRET_PREFIX = "whsec_"  # noqa: S105 - a format marker, not a secret
"""How a symmetric Standard Webhooks secret is written."""
MIN_SECRET_BYTES = 24
"""The spec asks for at least 24 random bytes (and at most 64)."""
MAX_SECRET_BYTES = 64
DEFAULT_TOLERANCE_SECONDS = 300
"""How far a receiver lets webhook-timestamp drift from its clock (the reference libraries use 5 minutes)."""

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"


def decode_secret(secret: str, *, min_bytes: int = 1) -> bytes:
    """The HMAC key inside ``whsec_<base64>``; ConfigError if it is not that.

    Unpadded base64 is accepted (some dashboards strip the ``=``), anything
    else that is not base64 is refused rather than silently half-decoded.
    """
    if not secret.startswith(SECRET_PREFIX):
        raise ConfigError(f"a webhook secret must start with {SECRET_PREFIX!r}")
    encoded = secret[len(SECRET_PREFIX) :].strip()
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError("a webhook secret must be whsec_ followed by base64") from None
    if len(key) < min_bytes:
        raise ConfigError(f"a webhook secret must decode to at least {min_bytes} bytes, got {len(key)}")
    if len(key) > MAX_SECRET_BYTES:
        raise ConfigError(f"a webhook secret must decode to at most {MAX_SECRET_BYTES} bytes, got {len(key)}")
    return key


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The bare base64 ``v1`` signature of one message (no ``v1,`` prefix)."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    return base64.b64encode(hmac.new(key, content, hashlib.sha256).digest()).decode("ascii")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one message: ``v1,<base64>``."""
    if "." in msg_id:
        # The id is part of the '.'-delimited signed content; a dot would make it ambiguous.
        raise ValueError("a webhook id must not contain '.'")
    return f"v1,{signature(decode_secret(secret), msg_id, int(timestamp), body)}"


def headers(secret: str, msg_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for sending ``body`` now (or at ``timestamp``)."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return {ID_HEADER: msg_id, TIMESTAMP_HEADER: str(ts), SIGNATURE_HEADER: sign(secret, msg_id, ts, body)}


def verify(
    secrets: str | list[str],
    body: bytes,
    received: Mapping[str, str],
    *,
    tolerance_seconds: int = DEFAULT_TOLERANCE_SECONDS,
    now: float | None = None,
) -> str:
    """Check a received webhook; return its ``webhook-id`` (the key to dedupe on) or raise.

    ``secrets`` may list the current and the previous secret during a
    rotation. Raises SignatureInvalid for missing or malformed headers and
    for no matching ``v1`` signature, TimestampOutOfTolerance for a stale or
    future timestamp. Signatures are compared in constant time.
    """
    lowered = {k.lower(): v for k, v in received.items()}
    msg_id = lowered.get(ID_HEADER, "")
    raw_ts = lowered.get(TIMESTAMP_HEADER, "")
    raw_sigs = lowered.get(SIGNATURE_HEADER, "")
    if not (msg_id and raw_ts and raw_sigs):
        raise SignatureInvalid("missing webhook-id, webhook-timestamp or webhook-signature")
    if not raw_ts.isascii() or not raw_ts.isdigit():
        raise SignatureInvalid("webhook-timestamp is not integer unix seconds")
    timestamp = int(raw_ts)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_seconds:
        raise TimestampOutOfTolerance(f"webhook-timestamp is {int(current - timestamp)} s away from now")

    offered: list[bytes] = []
    for entry in raw_sigs.split(" "):
        version, _, encoded = entry.partition(",")
        if version != "v1" or not encoded:
            continue
        try:
            offered.append(base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError):
            continue
    keys = [decode_secret(s) for s in ([secrets] if isinstance(secrets, str) else secrets)]
    for key in keys:
        expected = base64.b64decode(signature(key, msg_id, timestamp, body))
        # hmac.compare_digest: the time taken must not tell an attacker how many bytes matched.
        if any(hmac.compare_digest(expected, candidate) for candidate in offered):
            return msg_id
    raise SignatureInvalid("no v1 signature matches")
