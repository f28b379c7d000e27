"""Object ids: ``<prefix>_<ULID>`` (``ch_…``, ``re_…``, ``evt_…``), sortable by creation time."""

from __future__ import annotations

import os
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_id(prefix: str) -> str:
    """A new object id: 48 bits of milliseconds, then 80 random bits, in Crockford base 32."""
    value = (int(time.time() * 1000) << 80) | int.from_bytes(os.urandom(10), "big")
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return f"{prefix}_{''.join(reversed(chars))}"
