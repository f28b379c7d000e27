"""Source checks for provider notifications: is a remote address inside a provider's allowed networks? Pure.

The gateway decides which address to check (the client's, honouring
``X-Forwarded-For`` only from trusted proxies); this module only answers the
membership question, so it can be tested without a request.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def source_allowed(remote_addr: str | None, networks: Sequence[Network]) -> bool:
    """True when no networks are configured, or ``remote_addr`` lies in one of them.

    An address that cannot be read (None, garbage) is outside every network.
    An IPv4-mapped IPv6 address (``::ffff:203.0.113.5``, what a dual-stack
    socket reports) is checked as the IPv4 address it carries.
    """
    if not networks:
        return True
    if not remote_addr:
        return False
    try:
        address = ipaddress.ip_address(remote_addr.strip().split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address.version == net.version and address in net for net in networks)
