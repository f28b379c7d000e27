"""Stripe webhook signatures (``Stripe-Signature``), verified as Stripe documents them (pure).

Header: ``Stripe-Signature: t=1492774577,v1=5257a8…,v1=…,v0=…`` — a timestamp
and one or more ``v1`` signatures (several while an endpoint secret is being
rolled: Stripe signs with every active secret). Each ``v1`` is the lower-case
hex HMAC-SHA256 of ``<t>.<raw body>`` keyed with the endpoint secret exactly as
shown in the Dashboard: the whole ``whsec_…`` string, prefix included, as
UTF-8 bytes (https://docs.stripe.com/webhooks#verify-manually; the official
libraries do ``hmac.new(secret.encode("utf-8"), …)``). Other schemes (``v0``
test signatures) are ignored.

The timestamp is refused only when it is older than the tolerance, exactly as
Stripe's own libraries do (``timestamp < now - tolerance``): a timestamp ahead
of our clock is accepted. A host whose clock runs behind Stripe's would
otherwise refuse every webhook, and Stripe would retry them for three days
into the same refusal. A replayed future-dated delivery gains nothing: events
are applied once per event id (``processed_event``). Every comparison is
constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

HEADER = "Stripe-Signature"
SCHEME = "v1"
DEFAULT_TOLERANCE_SECONDS = 300
"""Stripe's recommended tolerance: how old a signed timestamp may be."""
MAX_HEADER_LENGTH = 4096
"""A longer header is refused before any HMAC is computed."""
MAX_SIGNATURES = 8
"""More v1 signatures than this is not a rotation, it is an attempt to make us compute many HMACs."""

_TIMESTAMP = re.compile(r"[0-9]{1,12}", re.ASCII)
_HEX_SHA256 = re.compile(r"[0-9a-f]{64}", re.ASCII)


class SignatureError(ValueError):
    """The header is missing or malformed, or no listed secret produced any of its signatures."""


class TimestampError(SignatureError):
    """The signed timestamp is further from our clock than the tolerance, in either direction."""


@dataclass(frozen=True)
class SignatureHeader:
    """A parsed Stripe-Signature header."""

    timestamp: int
    timestamp_text: str
    """The ``t`` value exactly as sent: it is what was signed."""
    signatures: tuple[str, ...]


def parse_header(header: str | None) -> SignatureHeader:
    """Read ``t=…,v1=…[,v1=…]``; SignatureError if it is absent, malformed or carries no v1 signature."""
    if header is None or not header.strip():
        raise SignatureError(f"missing {HEADER} header")
    if len(header) > MAX_HEADER_LENGTH or not header.isascii():
        raise SignatureError(f"{HEADER} header is not a Stripe signature header")
    timestamps: list[str] = []
    signatures: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            raise SignatureError(f"{HEADER} header element without '='")
        if key == "t":
            timestamps.append(value)
        elif key == SCHEME:
            signatures.append(value)
    if len(timestamps) != 1 or not _TIMESTAMP.fullmatch(timestamps[0]):
        raise SignatureError(f"{HEADER} header needs exactly one numeric t=")
    if not signatures:
        raise SignatureError(f"{HEADER} header has no {SCHEME} signature")
    if len(signatures) > MAX_SIGNATURES:
        raise SignatureError(f"{HEADER} header has more than {MAX_SIGNATURES} {SCHEME} signatures")
    return SignatureHeader(int(timestamps[0]), timestamps[0], tuple(signatures))


def compute(secret: str, timestamp_text: str, body: bytes) -> str:
    """The v1 signature of ``body`` at ``timestamp_text`` under ``secret`` (the whole whsec_… string)."""
    return hmac.new(secret.encode("utf-8"), timestamp_text.encode("ascii") + b"." + body, hashlib.sha256).hexdigest()


def sign(secrets: Iterable[str], body: bytes, timestamp: int) -> str:
    """A Stripe-Signature header value signed with every secret in ``secrets`` (for tests and tools)."""
    text = str(int(timestamp))
    return ",".join([f"t={text}", *(f"{SCHEME}={compute(s, text, body)}" for s in secrets)])


def verify(
    secrets: Iterable[str],
    body: bytes,
    header: str | None,
    *,
    now: float,
    tolerance: int = DEFAULT_TOLERANCE_SECONDS,
) -> int:
    """Check ``header`` against ``body``; return the signed timestamp.

    Raises SignatureError if no listed secret made any of the v1 signatures
    (every secret is tried against every signature, without stopping early),
    and TimestampError if the timestamp is more than ``tolerance`` seconds
    before ``now`` (a future one passes, as in Stripe's libraries). The signature is checked first, so an unsigned
    header with a bad time is reported as unsigned.
    """
    parsed = parse_header(header)
    keys = [s for s in secrets if s]
    if not keys:
        raise SignatureError("no webhook secret configured")
    # Malformed entries are compared too (against a dummy) so timing says nothing about which was which.
    offered = [s if _HEX_SHA256.fullmatch(s) else "0" * 64 for s in parsed.signatures]
    matched = False
    for secret in keys:
        expected = compute(secret, parsed.timestamp_text, body)
        for candidate in offered:
            matched |= hmac.compare_digest(expected, candidate)
    if not matched:
        raise SignatureError("no signature matches the body under any configured secret")
    if parsed.timestamp < now - tolerance:
        raise TimestampError(f"signature timestamp is old: {int(now - parsed.timestamp)} s before now")
    return parsed.timestamp
