"""What the chaos run checks once the system has converged: one Row per invariant, each with its figure.

The database is read with plain SQL on the table and column names of the
external contract (docs/design.md section 3), never through paysync's modules, so
the harness keeps working while their insides change. Rows that hold for
every provider live here; each mix adds the rows that need its provider's
own truth (``chaos_mix``).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import Engine, text

TERMINAL = frozenset({"Succeeded", "Failed"})
CALLBACK_WAITING = (0, 2)
"""payment_callback_log statuses that still have work: pending, failed (will be retried)."""
CALLBACK_REJECTED = 3


@dataclass
class Row:
    """One line of the table."""

    name: str
    expected: str
    figure: str
    ok: bool
    examples: list[str] = field(default_factory=list)
    """A few offending items, to start the investigation from."""
    section: str = "paysync"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


@dataclass
class Database:
    """What the database holds after the run, read once."""

    payments: dict[str, dict[str, Any]]
    """payment_id -> status, provider, provider_transaction_id, amount_minor, currency."""
    callbacks_by_status: dict[int, int]
    callbacks_by_event: dict[tuple[str, str], Counter]
    """(provider, provider_event_id) -> Counter of row statuses."""
    ledger_by_currency: dict[str, int]
    unbalanced_ledger_events: int
    ledger_events: dict[str, Counter]
    """payment_id -> Counter of ledger event types."""
    reviews: list[dict[str, Any]]
    outbox_unsent: dict[str, int]
    """event_type -> rows not done (pending or dead)."""
    deliveries_unsent: dict[str, int]
    """destination -> event_delivery rows not delivered."""
    receivables: dict[tuple[str, str], int] = field(default_factory=dict)
    """(provider account, currency) -> what the ledger says that provider holds for us."""


def read_database(engine: Engine) -> Database:
    """Read everything the rows need, in one connection."""
    with engine.connect() as conn:
        payments = {
            r.payment_id: dict(r._mapping)
            for r in conn.execute(
                text(
                    "SELECT payment_id, provider, status, provider_transaction_id, amount_minor, currency FROM payment"
                )
            )
        }
        by_status = dict(
            conn.execute(text("SELECT status, COUNT(*) FROM payment_callback_log GROUP BY status")).tuples().all()
        )
        by_event: dict[tuple[str, str], Counter] = defaultdict(Counter)
        for provider, event_id, status, n in conn.execute(
            text(
                "SELECT provider, provider_event_id, status, COUNT(*) FROM payment_callback_log"
                " WHERE provider_event_id IS NOT NULL GROUP BY provider, provider_event_id, status"
            )
        ):
            by_event[(provider, event_id)][int(status)] += n
        ledger = {
            c: int(s)
            for c, s in conn.execute(text("SELECT currency, SUM(amount_minor) FROM ledger_entry GROUP BY currency"))
        }
        unbalanced = conn.execute(
            text(
                "SELECT COUNT(*) FROM (SELECT ledger_event_id FROM ledger_entry"
                " GROUP BY ledger_event_id HAVING SUM(amount_minor) <> 0) AS u"
            )
        ).scalar_one()
        ledger_events: dict[str, Counter] = defaultdict(Counter)
        for payment_id, event_type, n in conn.execute(
            text(
                "SELECT payment_id, event_type, COUNT(*) FROM ledger_event"
                " WHERE payment_id IS NOT NULL GROUP BY payment_id, event_type"
            )
        ):
            ledger_events[payment_id][event_type] += n
        reviews = [
            dict(r._mapping)
            for r in conn.execute(
                text("SELECT id, kind, payment_id, refund_id, callback_log_id, reason, status FROM manual_review")
            )
        ]
        outbox = dict(
            conn.execute(text("SELECT event_type, COUNT(*) FROM outbox WHERE status <> 1 GROUP BY event_type"))
            .tuples()
            .all()
        )
        deliveries = dict(
            conn.execute(
                text("SELECT destination, COUNT(*) FROM event_delivery WHERE status <> 1 GROUP BY destination")
            )
            .tuples()
            .all()
        )
        receivables = {
            (account, currency): int(total)
            for account, currency, total in conn.execute(
                text(
                    "SELECT account, currency, SUM(amount_minor) FROM ledger_entry"
                    " WHERE account LIKE 'assets:provider:%' GROUP BY account, currency"
                )
            )
        }
    return Database(
        payments, by_status, by_event, ledger, unbalanced, ledger_events, reviews, outbox, deliveries, receivables
    )


def progress_sample(engine: Engine) -> dict[str, int]:
    """Payments by status and callbacks waiting, for the time series and the progress line."""
    with engine.connect() as conn:
        by_status = dict(conn.execute(text("SELECT status, COUNT(*) FROM payment GROUP BY status")).tuples().all())
        waiting = conn.execute(text("SELECT COUNT(*) FROM payment_callback_log WHERE status IN (0, 2)")).scalar_one()
        outbox = conn.execute(text("SELECT COUNT(*) FROM outbox WHERE status = 0")).scalar_one()
        refunds_open = conn.execute(
            text("SELECT COUNT(*) FROM refund WHERE status NOT IN ('Succeeded', 'Failed')")
        ).scalar_one()
    total = sum(by_status.values())
    terminal = sum(n for s, n in by_status.items() if s in TERMINAL)
    return {
        "payments": total,
        "terminal": terminal,
        "open": total - terminal,
        "unknown": by_status.get("Unknown", 0),
        "callbacks_waiting": waiting,
        "outbox_pending": outbox,
        "refunds_open": refunds_open,
    }


def examples(items: Any, limit: int = 5) -> list[str]:
    """The first few items, as strings."""
    return [str(i) for i in list(items)[:limit]]


def core_rows(db: Database, load: Any, explained: dict[int, str]) -> list[Row]:
    """Rows that hold for every provider: creation, replays, terminal states, callbacks, ledger, reviews, events."""
    rows = []
    wanted = len(load.requests)
    created = load.created
    missing_in_db = [pid for pid in created.values() if pid not in db.payments]
    not_created = [k for k in load.requests if k not in created]
    rows.append(
        Row(
            "payments created",
            f"all ({wanted})",
            str(len(created) - len(missing_in_db)),
            not not_created and not missing_in_db and len(set(created.values())) == len(created),
            examples(not_created + [f"answered but not in the database: {p}" for p in missing_in_db]),
        )
    )
    rows.append(
        Row(
            "merchant requests answered 500",
            "0",
            str(load.server_errors),
            load.server_errors == 0,
        )
    )
    ours = [db.payments[p] for p in created.values() if p in db.payments]
    open_ = [f"{p['payment_id']} {p['status']}" for p in ours if p["status"] not in TERMINAL]
    rows.append(Row("terminal", f"all ({len(ours)})", str(len(ours) - len(open_)), not open_, examples(open_)))
    replays = load.replays
    bad_replays = [r.key for r in replays if not (r.same and r.replayed_header)]
    rows.append(
        Row(
            "replays naming the same payment",
            f"all ({len(replays)})",
            str(len(replays) - len(bad_replays)),
            not bad_replays,
            examples(bad_replays),
        )
    )
    waiting = {s: db.callbacks_by_status.get(s, 0) for s in CALLBACK_WAITING}
    rows.append(
        Row(
            "callback rows left at status 0 or 2",
            "0",
            str(sum(waiting.values())),
            sum(waiting.values()) == 0,
            [f"status {s}: {n}" for s, n in waiting.items() if n],
        )
    )
    gave_up = db.callbacks_by_status.get(4, 0)
    rows.append(Row("callback rows given up (status 4)", "0", str(gave_up), gave_up == 0))
    balance = ", ".join(f"{c} {s}" for c, s in sorted(db.ledger_by_currency.items())) or "no entries"
    rows.append(
        Row(
            "ledger balanced per currency",
            "every currency 0",
            f"{balance}; unbalanced events {db.unbalanced_ledger_events}",
            all(s == 0 for s in db.ledger_by_currency.values()) and db.unbalanced_ledger_events == 0,
        )
    )
    twice = []
    for p in ours:
        counts = db.ledger_events.get(p["payment_id"], Counter())
        want = {"PaymentRequested": 1}
        if p["status"] == "Succeeded":
            want |= {"PaymentConfirmed": 1, "PaymentFailed": 0}
        elif p["status"] == "Failed":
            want |= {"PaymentFailed": 1, "PaymentConfirmed": 0}
        wrong = {k: counts.get(k, 0) for k, n in want.items() if counts.get(k, 0) != n}
        if wrong:
            twice.append(f"{p['payment_id']} {p['status']} {wrong}")
    rows.append(
        Row("payments whose ledger effects are not exactly once", "0", str(len(twice)), not twice, examples(twice))
    )
    unexplained = [
        f"#{r['id']} {r['kind']} {r['payment_id']}: {r['reason']}" for r in db.reviews if r["id"] not in explained
    ]
    rows.append(
        Row(
            "manual-review items, each explained",
            "every one explained",
            f"{len(db.reviews)} ({len(db.reviews) - len(unexplained)} explained)",
            not unexplained,
            examples(unexplained) + examples(f"#{i}: {why}" for i, why in explained.items()),
        )
    )
    unsent = sum(db.outbox_unsent.values())
    rows.append(
        Row(
            "outbox rows not sent (pending or dead)",
            "0",
            str(unsent),
            unsent == 0,
            [f"{k}: {n}" for k, n in db.outbox_unsent.items()],
        )
    )
    undelivered = sum(db.deliveries_unsent.values())
    rows.append(
        Row(
            "domain events not delivered to their destinations",
            "0",
            str(undelivered),
            undelivered == 0,
            [f"{k}: {n}" for k, n in db.deliveries_unsent.items()],
        )
    )
    return rows


CHAOS_ALERT_RULES = """\
# make chaos: the shipped rules (ops/alert_rules.toml) with windows short enough that alerts fire during the
# faults and clear within seconds of recovery, so the report can show each one resolved.
[defaults]
channels = []

[rules.callback_backlog]
threshold = 20
sustain_seconds = 5

[rules.callback_failure_rate]
threshold = 0.05
window_seconds = 20
min_sample = 5

[rules.compensation_success_rate]
threshold = 0.8
window_seconds = 30
min_sample = 5
sustain_seconds = 5

[rules.past_deadline]
threshold = 0

[rules.signature_failures]
threshold = 20
window_seconds = 20

[rules.provider_circuit_open]
"""
"""ALERT_RULES_FILE of a chaos run (written to its work directory)."""


def _alerts(engine: Engine) -> tuple[list[dict[str, Any]], set[str]]:
    """Every alert that fired, and the kinds of the manual reviews still open (their alerts stay open with them)."""
    with engine.connect() as conn:
        fired = [
            dict(r._mapping)
            for r in conn.execute(
                text("SELECT rule, dedupe_key, status, fired_at, resolved_at FROM alert WHERE fired_at IS NOT NULL")
            )
        ]
        reviewed = set(conn.execute(text("SELECT DISTINCT kind FROM manual_review WHERE status = 'open'")).scalars())
    return fired, reviewed


def alert_row(engine: Engine, wait_seconds: float = 90.0) -> Row:
    """The alerts that fired during the run, and whether each resolved (waiting for the last windows to pass).

    An alert raised with a manual review (callback_gave_up, conflicting_report, …) stays open while its
    review does: those reviews are the rows above, so their alerts are counted, not required to resolve.
    """
    deadline = time.monotonic() + wait_seconds
    while True:
        fired, reviewed = _alerts(engine)
        waiting = [a for a in fired if a["resolved_at"] is None and a["rule"] not in reviewed]
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    by_rule: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for a in fired:
        by_rule[a["rule"]][0] += 1
        by_rule[a["rule"]][1] += a["resolved_at"] is not None
    figure = ", ".join(f"{rule} {done}/{n} resolved" for rule, (n, done) in sorted(by_rule.items())) or "none fired"
    with_reviews = sum(1 for a in fired if a["resolved_at"] is None and a["rule"] in reviewed)
    if with_reviews:
        figure += f" ({with_reviews} open with their manual reviews)"
    return Row(
        "alerts that fired during the run",
        "each resolved",
        figure,
        not waiting,
        [f"{a['rule']} {a['dedupe_key']} fired {a['fired_at']}" for a in waiting][:5],
        "alerts",
    )
