"""``python -m compensator review list|show|resolve``: the ops console's manual queue for scripts.

- ``review list [--status open|resolved|all] [--kind KIND] [--limit N] [--format text|json]``
- ``review show ID [--format text|json]``: the item and its evidence
- ``review resolve ID --action apply|adjust|close --note TEXT --actor NAME [--amount MINOR] [--currency CUR]``
- ``review apply ID --note TEXT --actor NAME`` and ``review close ID --note TEXT --actor NAME``: the same
  as ``resolve --action apply|close``
- ``review replay LOG_ID [LOG_ID …] --note TEXT --actor NAME``: callback rows (status 2, 3, 4) back to 0,
  then each processed at once, as the console's replay button does
- ``review request-adjustment ID --amount MINOR [--currency CUR] --note TEXT --actor NAME``: an adjustment
  over the payment's amount, asked of a second operator (nothing booked yet)
- ``review approve ID [--request OPS_ACTION_ID] --note TEXT --actor NAME``: another person approves it (booked,
  the review resolved); ``review decline ID …`` declines (or, for whoever asked, withdraws) it

The actions are ``payments.ops.actions``'s, the console's own, recorded in
``ops_action`` with ``via = cli`` and, as the identity, the operating-system
user running the command (``ops_actions.process_identity``). Exit status: 0
done, 1 refused or failed (for a replay: any row skipped or whose processing
did not succeed; the reason on stderr), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sqlalchemy.exc import IntegrityError

from payments.ops import actions as ops_actions
from payments.ops.actions import Actor, OpsRefused
from payments.runtime import Runtime, build_runtime, start_process


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m compensator review", description="the manual queue")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="items of the manual queue, newest first")
    listing.add_argument("--status", choices=("open", "resolved", "all"), default="open")
    listing.add_argument("--kind", help="only this kind (callback_gave_up, conflicting_report, …)")
    listing.add_argument("--limit", type=int, default=ops_actions.PAGE_SIZE)
    listing.add_argument("--format", choices=("text", "json"), default="text")
    show = sub.add_parser("show", help="one item with its evidence")
    show.add_argument("id", type=int)
    show.add_argument("--format", choices=("text", "json"), default="text")
    resolve = sub.add_parser("resolve", help="apply the provider's verdict, book an adjustment, or close")
    resolve.add_argument("id", type=int)
    resolve.add_argument("--action", choices=ops_actions.REVIEW_ACTIONS, required=True)
    resolve.add_argument("--note", required=True, help="why (recorded)")
    resolve.add_argument("--actor", required=True, help="who (recorded)")
    resolve.add_argument("--amount", type=int, help="adjust: signed minor units (positive: the provider holds more)")
    resolve.add_argument("--currency", help="adjust: the currency (default: the payment's)")
    resolve.add_argument("--format", choices=("text", "json"), default="text")
    for action in ("apply", "close"):
        short = sub.add_parser(action, help=f"the same as resolve ID --action {action}")
        short.add_argument("id", type=int)
        short.add_argument("--note", required=True, help="why (recorded)")
        short.add_argument("--actor", required=True, help="who (recorded)")
        short.add_argument("--format", choices=("text", "json"), default="text")
    ask = sub.add_parser("request-adjustment", help="an adjustment over the payment's amount, for another to approve")
    ask.add_argument("id", type=int)
    ask.add_argument("--amount", type=int, required=True, help="signed minor units (positive: the provider holds more)")
    ask.add_argument("--currency", help="the currency (default: the payment's)")
    for decision in ("approve", "decline"):
        answer = sub.add_parser(decision, help=f"{decision} the review's adjustment awaiting approval")
        answer.add_argument("id", type=int)
        answer.add_argument("--request", type=int, help="the ops_action id of the request (refused if another)")
    for command in (ask, *(sub.choices[d] for d in ("approve", "decline"))):
        command.add_argument("--note", required=True, help="why (recorded)")
        command.add_argument("--actor", required=True, help="who (recorded)")
        command.add_argument("--format", choices=("text", "json"), default="text")
    replay = sub.add_parser("replay", help="callback rows back to status 0, each processed at once (as the console)")
    replay.add_argument("ids", type=int, nargs="+", metavar="LOG_ID")
    replay.add_argument("--note", required=True, help="why (recorded)")
    replay.add_argument("--actor", required=True, help="who (recorded)")
    replay.add_argument("--format", choices=("text", "json"), default="text")
    return parser


def main(argv: list[str], runtime: Runtime | None = None) -> int:
    """Entry point (``runtime``: tests pass their own)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "list" and not 1 <= args.limit <= 500:
        parser.error("--limit must be between 1 and 500")
    if args.command in ("apply", "close"):
        args.action, args.amount, args.currency, args.command = args.command, None, None, "resolve"
    if args.command == "replay" and len(args.ids) > ops_actions.MAX_REPLAY:
        parser.error(f"{len(args.ids)} rows given; replay at most {ops_actions.MAX_REPLAY} at a time")
    if args.command == "resolve":
        if args.action == "adjust" and args.amount is None:
            parser.error("--action adjust needs --amount (signed minor units)")
        if args.action != "adjust" and (args.amount is not None or args.currency):
            parser.error("--amount and --currency go with --action adjust only")
    if args.command in ("resolve", "replay", *APPROVAL_COMMANDS):
        try:
            actor = Actor(args.actor, ops_actions.VIA_CLI)
            ops_actions.clean_note(args.note)
        except OpsRefused as exc:
            parser.error(str(exc))
    own = runtime is None
    runtime = runtime or build_runtime(start_process("compensator"), pool_size=2)
    try:
        if args.command == "list":
            return _list(runtime, args)
        if args.command == "show":
            return _show(runtime, args)
        if args.command == "replay":
            return _replay(runtime, args, actor)
        if args.command in APPROVAL_COMMANDS:
            return _approval(runtime, args, actor)
        return _resolve(runtime, args, actor)
    finally:
        if own:
            runtime.engine.dispose()


def _list(runtime: Runtime, args: argparse.Namespace) -> int:
    with runtime.engine.connect() as conn:
        rows, _ = ops_actions.list_reviews(
            conn, status=None if args.status == "all" else args.status, kind=args.kind, limit=args.limit
        )
    if args.format == "json":
        print(json.dumps(rows, indent=2, sort_keys=True, default=str))
        return 0
    if not rows:
        print(f"no {args.status if args.status != 'all' else ''} reviews".replace("  ", " "))
        return 0
    print(f"{'id':>6}  {'status':<8}  {'kind':<28}  {'subject':<40}  reason")
    for r in rows:
        print(f"{r['id']:>6}  {r['status']:<8}  {r['kind']:<28}  {(r['subject'] or ''):<40}  {r['reason'][:100]}")
    return 0


def _show(runtime: Runtime, args: argparse.Namespace) -> int:
    with runtime.engine.connect() as conn:
        item = ops_actions.review_detail(conn, args.id)
    if item is None:
        print(f"review: no manual review {args.id}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(item, indent=2, sort_keys=True, default=str))
        return 0
    print(describe(item))
    return 0


def describe(item: dict[str, Any]) -> str:
    """The text form of ``review show``: the item, then each kind of evidence, then its actions."""
    out = [f"review {item['id']}: {item['kind']} ({item['status']})", f"  subject  {item['subject'] or '-'}"]
    out.append(f"  reason   {item['reason']}")
    out.append(f"  opened   {item['created_at']}, seen {item['occurrences']}x, last {item['last_seen_at']}")
    if item["resolved_at"]:
        out.append(f"  resolved {item['resolved_at']} by {item['resolved_by']}: {item['resolution']}")
    for kind in ("payment", "refund"):
        row = item[kind]
        if row:
            ref = row["payment_id"] if kind == "payment" else row["refund_id"]
            out.append(
                f"  {kind:<8} {ref} {row['status']} {row['currency']} {row['amount_minor']} at {row['provider']}"
                f" (status from {row.get('status_source') or '-'})"
            )
    evidence = item["evidence"]
    out.append(f"  callbacks ({len(evidence['callbacks'])})")
    out += [
        f"    {c['id']}: {c['status']} {c['status_name']} {c['event_type'] or ''} {c['result'] or ''}"
        for c in evidence["callbacks"]
    ]
    for name in ("provider_calls", "queries"):
        out.append(f"  {name.replace('_', ' ')} ({len(evidence[name])})")
        out += [
            f"    {c['id']}: {c['operation']} {c['outcome'] or 'no answer'} {c['error_code'] or ''} {c['started_at']}"
            for c in evidence[name]
        ]
    out.append(f"  ledger events ({len(evidence['ledger_events'])})")
    out += [f"    {e['event_type']} {e['currency']} {e['amount']} ({e['source']})" for e in evidence["ledger_events"]]
    out.append(f"  reconciliation items ({len(evidence['reconciliation_items'])})")
    for i in evidence["reconciliation_items"]:
        line = i["settlement_line"]
        raw = f" line {line['line_no']}: {line['raw'][:80]}" if line else ""
        out.append(f"    {i['id']}: run {i['run_id']} {i['category']} provider {i['provider_status'] or '-'}{raw}")
    out.append(f"  actions ({len(item['actions'])})")
    out += [
        f"    {a['created_at']} {a['actor']} ({a['via']}; {a.get('identity') or 'identity not recorded'}) "
        f"{a['action']}: {a['reason']} -> {a['outcome']}"
        for a in item["actions"]
    ]
    return "\n".join(out)


def _resolve(runtime: Runtime, args: argparse.Namespace, actor: Actor) -> int:
    try:
        result = ops_actions.resolve(
            runtime.engine,
            runtime.providers,
            args.id,
            args.action,
            actor=actor,
            note=args.note,
            amount_minor=args.amount,
            currency=args.currency,
            timeout=runtime.settings.provider_timeout_seconds,
        )
    except OpsRefused as exc:
        print(f"review {args.id}: refused: {exc}", file=sys.stderr)
        return 1
    except IntegrityError:
        print(f"review {args.id}: refused: already adjusted (one adjustment per review)", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True, default=str))
    else:
        print(f"review {args.id}: {result.action}: {result.outcome} (ops_action {result.ops_action_id})")
    return 0


APPROVAL_COMMANDS = ("request-adjustment", "approve", "decline")
"""An adjustment over the payment's amount: asked by one person, approved or declined by another (ops_actions)."""


def _approval(runtime: Runtime, args: argparse.Namespace, actor: Actor) -> int:
    try:
        if args.command == "request-adjustment":
            result = ops_actions.request_adjustment(
                runtime.engine, args.id, amount_minor=args.amount, currency=args.currency, actor=actor, note=args.note
            )
        else:
            act = ops_actions.approve_adjustment if args.command == "approve" else ops_actions.decline_adjustment
            result = act(runtime.engine, args.id, actor=actor, note=args.note, request_id=args.request)
    except OpsRefused as exc:
        print(f"review {args.id}: refused: {exc}", file=sys.stderr)
        return 1
    except IntegrityError:
        print(f"review {args.id}: refused: already adjusted (one adjustment per review)", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps(result.as_dict(), indent=2, sort_keys=True, default=str))
    else:
        print(f"review {args.id}: {args.command}: {result.outcome} (ops_action {result.ops_action_id})")
    return 0


def _replay(runtime: Runtime, args: argparse.Namespace, actor: Actor) -> int:
    try:
        results = ops_actions.replay_and_process(
            runtime.engine, runtime.providers, runtime.callback_policy, args.ids, actor=actor, note=args.note
        )
    except OpsRefused as exc:
        print(f"replay: refused: {exc}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(json.dumps([r.as_dict() for r in results], indent=2, sort_keys=True, default=str))
    for r in results:
        if args.format == "text" or not r.ok:
            print(f"{r.subject}: {r.outcome}", file=sys.stdout if r.ok else sys.stderr)
    return 0 if all(r.ok for r in results) else 1
