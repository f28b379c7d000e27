"""``python -m compensator alerts …``: test a channel, and act on alerts as the console does.

- ``alerts test --channel NAME``: send a test notification through one
  channel, so an operator can check it (address, token, signature, TLS)
  before an incident depends on it. It uses the same settings and code as the
  notifier, touches no database, prints what happened on one line and exits 0
  if the channel took the notification, 1 if it did not (or is not configured).
- ``alerts list [--all] [--format text|json]``, ``alerts show ID``: open
  alerts; one alert with where each notification went and whether the channel
  took it, and the actions on it.
- ``alerts ack ID``, ``alerts silence ID --minutes N`` (0 lifts it),
  ``alerts assign ID --to NAME``, each with ``--note TEXT --actor NAME``:
  ``payments.ops.alert_actions``, recorded in ``ops_action`` (via cli) like the
  console's. ``--review`` takes a review id instead of an alert id. Exit
  status: 0 done, 1 refused, 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from payments.errors import NotificationFailed
from payments.escalation.notify import CHANNEL_NAMES, TEST, Notice
from payments.escalation.notify.channels import SPECS, build_channels
from payments.infra.settings import env_name
from payments.ops import actions as ops_actions
from payments.ops import alert_actions
from payments.ops.actions import Actor, OpsRefused
from payments.runtime import Runtime, build_runtime, start_process


def test_notice() -> Notice:
    """What a test notification says."""
    return Notice(
        kind=TEST,
        rule="alerts_test",
        severity="info",
        message="This is a test notification from paysync (python -m compensator alerts test). No alert is firing.",
        key="alerts_test",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compensator alerts", description="alert tools")
    sub = parser.add_subparsers(dest="command", required=True)
    test = sub.add_parser("test", help="send a test notification through one channel")
    test.add_argument("--channel", required=True, choices=CHANNEL_NAMES, help="the channel to test")
    listing = sub.add_parser("list", help="open alerts, newest first")
    listing.add_argument("--all", action="store_true", help="resolved ones too")
    listing.add_argument("--format", choices=("text", "json"), default="text")
    show = sub.add_parser("show", help="one alert, where its notifications went, and the actions on it")
    show.add_argument("id", type=int)
    show.add_argument("--format", choices=("text", "json"), default="text")
    for action, what in (
        ("ack", "acknowledge: no more reminders"),
        ("silence", "no notice until the silence ends"),
        ("assign", "who is on it"),
    ):
        one = sub.add_parser(action, help=what)
        one.add_argument("id", type=int, help="the alert's id (with --review: the review's)")
        one.add_argument("--review", action="store_true", help="ID is a manual review's: act on it and its alert")
        one.add_argument("--note", required=True, help="why (recorded)")
        one.add_argument("--actor", required=True, help="who (recorded)")
        one.add_argument("--format", choices=("text", "json"), default="text")
        if action == "silence":
            one.add_argument("--minutes", type=int, required=True, help="how long (0 lifts a silence)")
        if action == "assign":
            one.add_argument("--to", required=True, help="who takes it")
    return parser


def main(argv: list[str], runtime: Runtime | None = None) -> int:
    """Entry point of ``python -m compensator alerts …`` (``runtime``: tests pass their own)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command != "test":
        return _operate(parser, args, runtime)
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


def _operate(parser: argparse.ArgumentParser, args: argparse.Namespace, runtime: Runtime | None) -> int:
    actor = None
    if args.command in alert_actions.ALERT_ACTIONS:
        try:
            actor = Actor(args.actor, ops_actions.VIA_CLI)
            ops_actions.clean_note(args.note)
        except OpsRefused as exc:
            parser.error(str(exc))
    own = runtime is None
    runtime = runtime or build_runtime(start_process("compensator"), pool_size=2)
    try:
        if args.command == "list":
            with runtime.engine.connect() as conn:
                rows = alert_actions.list_alerts(conn, open_only=not args.all)
            if args.format == "json":
                print(json.dumps(rows, indent=2, sort_keys=True, default=str))
                return 0
            print(f"{'id':>6}  {'severity':<8}  {'status':<8}  {'rule':<28}  {'assignee':<12}  message")
            for r in rows:
                flags = ("acked " if r["acked_at"] else "") + ("silenced " if r["silenced_until"] else "")
                print(
                    f"{r['id']:>6}  {r['severity']:<8}  {r['status']:<8}  {r['rule']:<28}  "
                    f"{(r['assignee'] or '-'):<12}  {flags}{r['message'][:100]}"
                )
            return 0
        if args.command == "show":
            with runtime.engine.connect() as conn:
                item = alert_actions.alert_detail(conn, args.id)
            if item is None:
                print(f"alerts: no alert {args.id}", file=sys.stderr)
                return 1
            print(
                json.dumps(item, indent=2, sort_keys=True, default=str)
                if args.format == "json"
                else alert_actions.describe(item)
            )
            return 0
        target = {"review_id": args.id} if args.review else {"alert_id": args.id}
        try:
            result = alert_actions.act(
                runtime.engine,
                args.command,
                actor=actor,
                note=args.note,
                minutes=getattr(args, "minutes", None),
                assignee=getattr(args, "to", None),
                **target,
            )
        except OpsRefused as exc:
            print(f"alerts {args.command}: {exc}", file=sys.stderr)
            return 1
        if args.format == "json":
            print(json.dumps(result.as_dict(), indent=2, sort_keys=True, default=str))
        else:
            print(f"{result.subject}: {result.outcome} (ops_action {result.ops_action_id})")
        return 0
    finally:
        if own:
            runtime.engine.dispose()
