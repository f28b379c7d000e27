"""``python -m compensator reverify --provider P [--since ISO-TIME]``: re-verify rejected callbacks after a key fix.

The work (which rows, what verifies, what stays refused for its source) is
``payments.inbound.reverify``; ``compensator.__main__`` parses the command.
"""

from __future__ import annotations

from datetime import datetime

from payments.inbound.reverify import Reverified, reverify
from payments.runtime import Runtime


def run(runtime: Runtime, provider: str, since: datetime | None = None, now: datetime | None = None) -> Reverified:
    """Re-verify ``provider``'s status-3 rows received at or after ``since``; move those that verify to status 0."""
    return reverify(runtime, provider, since, now)
