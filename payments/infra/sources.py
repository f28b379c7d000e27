"""Source checks: is a remote address inside a list of allowed networks? Pure.

Used for provider notifications (``ALIPAY_SOURCE_CIDRS``, ``WECHATPAY_SOURCE_CIDRS``,
``STRIPE_SOURCE_CIDRS``: an empty list allows any source) and for ``/metrics``
(``METRICS_ALLOW_CIDRS``: an empty list allows none). The caller decides which
address to check (the peer's, or the client's named by a trusted proxy); this
module only answers the membership question, so it is tested without a request.
Settings hold the networks as normalised CIDR strings (``payments.infra.settings``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from functools import lru_cache

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=64)
def networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    """The parsed networks of a settings tuple (cached: settings are read once, checked on every request)."""
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def in_networks(remote_addr: str | None, cidrs: Sequence[str]) -> bool:
    """True when ``remote_addr`` lies in one of ``cidrs``; an unreadable address (None, garbage) lies in none.

    An IPv4-mapped IPv6 address (``::ffff:203.0.113.5``, what a dual-stack
    socket reports) is checked as the IPv4 address it carries.
    """
    if not remote_addr or not cidrs:
        return False
    try:
        address = ipaddress.ip_address(remote_addr.strip().split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == net.version and address in net for net in networks(tuple(cidrs)))


def source_allowed(remote_addr: str | None, cidrs: Sequence[str]) -> bool:
    """A provider's allow-list: True when none is configured, or ``remote_addr`` lies in it."""
    return not cidrs or in_networks(remote_addr, cidrs)


def client_address(peer: str | None, forwarded_for: str | None, trusted_proxies: Sequence[str]) -> str | None:
    """The client's address: the peer's, or, when the peer is a trusted proxy, the rightmost untrusted hop.

    ``X-Forwarded-For`` is a list each proxy appends to, so only the part our
    own proxies wrote can be believed: walking it from the right, every hop
    inside ``trusted_proxies`` is one of ours, and the first that is not is
    the client (anything left of it, the client may have written itself). A
    peer that is not a trusted proxy is the client, whatever it claims.
    """
    if not forwarded_for or not in_networks(peer, trusted_proxies):
        return peer
    hops = [h.strip() for h in forwarded_for.split(",") if h.strip()]
    for hop in reversed(hops):
        if not in_networks(hop, trusted_proxies):
            return hop[:64]
    return hops[0][:64] if hops else peer  # every hop is ours: the first one is as close to the client as we get
