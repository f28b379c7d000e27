"""Bearer tokens: who may call what (source addresses: ``payments.infra.sources``)."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

from flask import request


def bearer_ok(tokens: Iterable[str]) -> bool:
    """True when the request's ``Authorization: Bearer`` matches one of ``tokens`` (rotation: any listed one)."""
    if isinstance(tokens, str):  # a bare string would be compared a character at a time
        raise TypeError("bearer_ok takes a tuple of tokens (the settings' rotation list), not a string")
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    # Constant-time, and every token compared, so neither a character nor a list position can be guessed.
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in tokens if token]
    return any(matches)
