"""``python -m compensator alerts test --channel NAME``: send a test notification through one channel.

So an operator can check a channel (address, token, signature, TLS) before an
incident depends on it. It uses the same settings and code as the notifier,
touches no database, prints what happened on one line and exits 0 if the
channel took the notification, 1 if it did not (or is not configured).
"""

from __future__ import annotations

import argparse
import sys
import time

from payments.errors import NotificationFailed
from payments.notify import CHANNEL_NAMES, TEST, Notice
from payments.notify.channels import SPECS, build_channels
from payments.settings import env_name, start_process


def test_notice() -> Notice:
    """What a test notification says."""
    return Notice(
        kind=TEST,
        rule="alerts_test",
        severity="info",
        message="This is a test notification from paysync (python -m compensator alerts test). No alert is firing.",
        key="alerts_test",
    )


def main(argv: list[str]) -> int:
    """Entry point of ``python -m compensator alerts …``."""
    parser = argparse.ArgumentParser(prog="python -m compensator alerts", description="alert channel tools")
    sub = parser.add_subparsers(dest="command", required=True)
    test = sub.add_parser("test", help="send a test notification through one channel")
    test.add_argument("--channel", required=True, choices=CHANNEL_NAMES, help="the channel to test")
    args = parser.parse_args(argv)
    settings = start_process("compensator", warn=False)
    channels = build_channels(settings)
    name = args.channel
    if name not in channels:
        needed = ", ".join(env_name(f) for f in SPECS[name].required)
        print(f"alerts test: {name}: not configured (set {needed})", file=sys.stderr)
        return 1
    channel = channels[name]
    started = time.monotonic()
    try:
        what = channel.send(test_notice())
    except NotificationFailed as exc:
        kind = "permanent" if exc.permanent else "transient"
        print(f"alerts test: {name}: FAILED ({kind}) after {time.monotonic() - started:.2f} s: {exc}", file=sys.stderr)
        return 1
    finally:
        for c in channels.values():
            c.close()
    print(f"alerts test: {name}: sent in {time.monotonic() - started:.2f} s: {what}")
    return 0
