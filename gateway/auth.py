"""Bearer tokens and source addresses: who may call what."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from functools import lru_cache

from flask import request


def bearer_ok(tokens: Iterable[str]) -> bool:
    """True when the request's ``Authorization: Bearer`` matches one of ``tokens`` (rotation: any listed one)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    # Constant-time, and every token compared, so neither a character nor a list position can be guessed.
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in tokens if token]
    return any(matches)


@lru_cache(maxsize=64)
def _networks(cidrs: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def source_allowed(cidrs: tuple[str, ...]) -> bool:
    """True when the peer address (not a forwarded header, which anyone can write) is inside one of ``cidrs``."""
    try:
        address = ipaddress.ip_address(request.remote_addr or "")
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return any(address in network for network in _networks(cidrs))
