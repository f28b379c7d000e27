"""Failpoints: named places where a test can make the process die as if the machine lost power.

Set ``FAILPOINTS=consumer.after_commit`` (comma-separated) and the process
SIGKILLs itself when it reaches ``hit("consumer.after_commit")``. Used by the
crash tests (a consumer killed after commit but before ack, a relay killed
after the provider charged but before the local commit); empty in production.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger("paysync.failpoints")

_armed: frozenset[str] = frozenset()


def arm(spec: str) -> None:
    """Arm the failpoints named in ``spec`` (the FAILPOINTS setting)."""
    global _armed
    _armed = frozenset(name.strip() for name in spec.split(",") if name.strip())
    if _armed:
        log.warning("failpoints armed: %s", ", ".join(sorted(_armed)))


def hit(name: str) -> None:
    """Die here, now, with SIGKILL, if ``name`` is armed; otherwise do nothing."""
    if name in _armed:
        log.warning("failpoint %s: SIGKILL", name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)
