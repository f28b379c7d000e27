"""Signing of sandbox notifications (the same scheme as Stripe's webhooks).

Header ``Sandbox-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">``.
Several ``v1`` values may appear (secret rotation); one match is enough.
Pure functions, standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "Sandbox-Signature"
"""Name of the signature header."""
DEFAULT_TOLERANCE_SECONDS = 300
"""Signed timestamps older (or newer) than this are refused."""


class SignatureError(ValueError):
    """The header is missing, malformed, or matches no signature of the body."""


class TimestampError(SignatureError):
    """The signature is well-formed but its timestamp is outside the tolerance."""


def compute(secret: str, body: bytes, timestamp: int) -> str:
    """Hex HMAC-SHA256 of ``"<timestamp>.<body>"``."""
    message = str(int(timestamp)).encode() + b"." + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The header value for ``body`` signed now (or at ``timestamp``)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},v1={compute(secret, body, t)}"


def parse_header(header: str | None) -> tuple[int, list[str]]:
    """Split a header into its timestamp and its v1 signatures."""
    if not header:
        raise SignatureError("missing signature header")
    timestamp = None
    signatures = []
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise SignatureError("malformed signature header")
        if key == "t":
            if not (value.isascii() and value.isdigit()) or len(value) > 12:  # int() takes "²" or "١" too
                raise SignatureError("malformed signature timestamp")
            timestamp = int(value)
        elif key == "v1":
            signatures.append(value)
    if timestamp is None or not signatures:
        raise SignatureError("signature header lacks t or v1")
    return timestamp, signatures


def verify(
    secret: str,
    body: bytes,
    header: str | None,
    now: float | None = None,
    tolerance: int = DEFAULT_TOLERANCE_SECONDS,
) -> int:
    """Check ``header`` against ``body``; return the signed timestamp or raise SignatureError.

    The comparison is constant-time; the timestamp is checked only after a
    signature matched, so a forged header learns nothing about the clock.
    """
    timestamp, signatures = parse_header(header)
    expected = compute(secret, body, timestamp)
    # compare_digest raises TypeError on non-ASCII text (header bytes past 0x7f arrive as latin-1): no match.
    if not any(candidate.isascii() and hmac.compare_digest(expected, candidate) for candidate in signatures):
        raise SignatureError("no signature matches the body")
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise TimestampError(f"signature timestamp is {int(current - timestamp)} s from now (tolerance {tolerance} s)")
    return timestamp
