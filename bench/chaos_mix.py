"""The mix: each capability under test brings its platform, its load and its invariants to the chaos run.

A ``Mix`` is one provider (or one capability) in the run. It

- starts the fake platform it talks to (``start``), under the same restart
  loop as paysync's processes, and gives paysync the settings to reach it
  (``paysync_env``);
- contributes its share of the payments (``payments``);
- says when its side has nothing left in flight (``quiet``), so the run
  knows it converged;
- checks the converged system through paysync's own commands
  (``after_convergence``): the sandbox mix reconciles the day's settlement
  file and verifies the ledger's seal chain;
- adds the invariant rows that need its platform's own truth (``rows``) and
  explains the manual-review items it expects (``explain_review``).

Today there is one: ``SandboxMix``. Each real provider's fake platform is
meant to be a further mix, added in ``build_mixes`` in ``bench/chaos.py``.
Refunds are not a mix but something every mix can take part in: a mix with
``refunds = True`` gets a ``chaos_refunds.RefundLoad`` over its payments, and
its ``refund_truth`` (the platform's refunds) feeds the refund rows.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import requests
from chaos_invariants import CALLBACK_REJECTED, Database, Row, examples
from chaos_load import PaymentRequest
from chaos_stack import Supervised, free_port, port_open, wait_for

Command = Callable[[list[str]], subprocess.CompletedProcess]
"""Runs a paysync command (``["python", "-m", "compensator", …]``) with the run's paysync settings."""

CURRENCIES = ("CNY", "CNY", "CNY", "USD", "EUR", "JPY")
UNEXPLAINED = ("amount_mismatch", "status_mismatch", "provider_only", "local_only", "unreadable")
"""Reconciliation categories a person must look at (docs/flows/reconciliation.md), as the run's JSON names them."""
"""Several currencies, so "balanced per currency" means something; CNY most often."""


@dataclass
class RunContext:
    """What a mix needs from the run."""

    run_id: str
    seed: int
    work_dir: Path
    log_dir: Path
    gateway_url: str
    base_env: dict[str, str]
    """The environment every process of the run gets (PATH, PYTHONPATH, PAYSYNC_ENV, …)."""


class Mix:
    """One capability in the run (see the module docstring). Subclasses override what they need."""

    name = "mix"
    provider = ""
    refunds = False
    """Partial refunds of a share of this mix's Succeeded payments run beside its load (``chaos_refunds``)."""

    def paysync_env(self) -> dict[str, str]:
        """Settings paysync's processes need to talk to this mix's platform."""
        return {}

    def start(self, ctx: RunContext) -> list[Supervised]:
        """Start the platform's processes; return them (the run stops them)."""
        return []

    def payments(self, ctx: RunContext, count: int, replay_share: float) -> list[PaymentRequest]:
        """This mix's share of the load."""
        return []

    def quiet(self) -> bool:
        """True when the platform has nothing left in flight (no pending webhook, no processing charge)."""
        return True

    def after_convergence(self, command: Command) -> None:
        """Check the converged system through paysync's commands, before the database is read for the table."""

    def observe(self) -> None:
        """Read the platform's truth once, after convergence."""

    def rows(self, db: Database, created: dict[str, str]) -> list[Row]:
        """Invariant rows that need this platform's truth. ``created`` is key -> payment_id for this mix."""
        return []

    def explain_review(self, review: dict[str, Any], db: Database) -> str | None:
        """Why a manual-review item is expected under this mix's faults, or None if it is not."""
        return None

    def refund_truth(self) -> dict[str, list[dict[str, Any]]] | None:
        """The platform's refunds by our refund number (``id``, ``status`` succeeded|failed|processing,
        ``amount``, ``charge``: the charge's id), read by ``observe``; None when the platform cannot say."""
        return None

    def secrets(self) -> list[str]:
        """Values that must never appear in a log."""
        return []

    def summary(self) -> dict[str, Any]:
        """Figures about the faults the platform actually made, for the report."""
        return {}


DEFAULT_SANDBOX_FAULTS: dict[str, Any] = {
    "decline_rate": 0.08,
    "error_5xx_rate": 0.05,
    "timeout_after_commit_rate": 0.03,
    "hang_seconds": 2.5,
    "processing_rate": 0.05,
    "processing_seconds": 2.0,
    "latency_ms": 5,
    "drop_rate": 0.05,
    "duplicate_rate": 0.05,
    "delay_rate": 0.05,
    "delay_seconds": 3.0,
    "reorder_rate": 0.05,
    "bad_signature_rate": 0.05,
}
"""Every fault the sandbox can make, at rates that hit each one often in 10,000 payments."""


@dataclass
class SandboxMix(Mix):
    """Charges through the sandbox platform, with every fault it can make switched on."""

    faults: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_SANDBOX_FAULTS))
    webhook_secret: str = "whsec_chaos_sandbox_webhook_secret_0123456789"
    api_key: str = "sk_test_chaos_sandbox_api_key_0123456789"
    name: str = "sandbox"
    provider: str = "sandbox"
    refunds: bool = True
    port: int = field(default_factory=free_port)
    truth: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    started_day: str = field(default_factory=lambda: datetime.now(UTC).date().isoformat())
    reconciliations: list[dict[str, Any]] = field(default_factory=list)
    """``reconcile --format json`` of each day of the run (or {"date", "error"} when the command failed)."""
    chain: dict[str, Any] = field(default_factory=dict)
    """``verify-ledger --format json`` after the reconciliation."""

    @property
    def url(self) -> str:
        """The platform's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def paysync_env(self) -> dict[str, str]:
        """Where the sandbox is, its webhook secret, and the API key its /v1 asks for."""
        return {
            "SANDBOX_API_URL": self.url,
            "SANDBOX_WEBHOOK_SECRET": self.webhook_secret,
            "SANDBOX_API_KEY": self.api_key,
        }

    def start(self, ctx: RunContext) -> list[Supervised]:
        """``python -m sandbox`` with its own state file, faults on, webhooks to the gateway."""
        env = {
            **ctx.base_env,
            "SANDBOX_PORT": str(self.port),
            "SANDBOX_HOST": "127.0.0.1",
            "SANDBOX_DB_PATH": str(ctx.work_dir / "sandbox.db"),
            "SANDBOX_CALLBACK_URL": f"{ctx.gateway_url}/callbacks/sandbox",
            "SANDBOX_WEBHOOK_SECRET": self.webhook_secret,
            "SANDBOX_API_KEY": self.api_key,
            "SANDBOX_FAULTS": json.dumps({**self.faults, "seed": ctx.seed}),
            "SANDBOX_SEED": str(ctx.seed),
            # Long enough to outlast a database restart: 0.5 s doubling, ten attempts (~4 minutes).
            "SANDBOX_WEBHOOK_MAX_ATTEMPTS": "10",
            "SANDBOX_WEBHOOK_BACKOFF_SECONDS": "0.5",
        }
        self.started_day = datetime.now(UTC).date().isoformat()
        proc = Supervised("sandbox", "sandbox", env, ctx.log_dir)
        proc.start()
        wait_for(lambda: port_open(self.port), 60, "sandbox platform")
        return [proc]

    def payments(self, ctx: RunContext, count: int, replay_share: float) -> list[PaymentRequest]:
        """``count`` payments with amounts and currencies drawn from the seed; a share marked for replay."""
        rng = random.Random(f"{ctx.seed}:{self.name}")
        items = []
        for n in range(count):
            body = {
                "order_no": f"chaos-{ctx.run_id}-{self.name}-{n}",
                "amount": rng.randint(1, 500_000),
                "currency": rng.choice(CURRENCIES),
                "provider": self.provider,
                "description": f"chaos run {ctx.run_id} #{n}",
            }
            key = f"chaos-{ctx.run_id}-{self.name}-{n}"
            items.append(PaymentRequest(key, body, self.name, replay=rng.random() < replay_share))
        return items

    def _get(self, path: str) -> dict[str, Any]:
        response = requests.get(f"{self.url}{path}", timeout=120)
        response.raise_for_status()
        return response.json()

    def quiet(self) -> bool:
        """No webhook event still pending and no charge or refund still processing."""
        try:
            events = self._get("/_sandbox/deliveries")["events"]
            truth = self._get("/_sandbox/truth")
        except requests.RequestException:
            return False
        pending = any(e["status"] == "pending" for e in events)
        processing = any(c["status"] == "processing" for c in truth["charges"] + truth.get("refunds", []))
        return not pending and not processing

    def days(self) -> list[str]:
        """The UTC days the run's charges can be filed under: from the day it started to today."""
        day, today = datetime.fromisoformat(self.started_day).date(), datetime.now(UTC).date()
        days = []
        while day <= today:
            days.append(day.isoformat())
            day += timedelta(days=1)
        return days

    def after_convergence(self, command: Command) -> None:
        """Reconcile each day's sandbox settlement file, seal what that booked, then verify the ledger chain."""
        self.reconciliations = []
        for day in self.days():
            done = command(["python", "-m", "compensator", "reconcile", "--provider", self.provider, "--date", day,
                            "--format", "json"])  # fmt: skip
            try:
                self.reconciliations.append(json.loads(done.stdout))
            except ValueError:
                self.reconciliations.append({"date": day, "error": (done.stderr or done.stdout)[-500:]})
        sealed = command(["python", "-m", "compensator", "seal_ledger", "--once"])
        verified = command(["python", "-m", "compensator", "verify-ledger", "--format", "json"])
        try:
            self.chain = json.loads(verified.stdout)
        except ValueError:
            self.chain = {"ok": False, "error": (sealed.stderr + verified.stderr)[-500:]}

    def observe(self) -> None:
        """The platform's truth and its delivery log."""
        for attempt in range(5):
            try:
                self.truth = self._get("/_sandbox/truth")
                self.events = self._get("/_sandbox/deliveries")["events"]
                return
            except requests.RequestException:
                time.sleep(2 * (attempt + 1))
        raise RuntimeError("the sandbox's /_sandbox/truth and /_sandbox/deliveries did not answer")

    def rows(self, db: Database, created: dict[str, str]) -> list[Row]:
        """Truth, double charges, transaction ids, acknowledged deliveries."""
        charges: dict[str, list[dict[str, Any]]] = {}
        for c in self.truth.get("charges", []):
            charges.setdefault(c["merchant_transaction_id"], []).append(c)
        ours = [db.payments[p] for p in created.values() if p in db.payments]

        differ = []
        wrong_txn = []
        for p in ours:
            made = charges.get(p["payment_id"], [])
            succeeded = [c for c in made if c["status"] == "succeeded"]
            truth_status = "Succeeded" if succeeded else "Failed"
            if p["status"] != truth_status:
                differ.append(f"{p['payment_id']}: ours {p['status']}, sandbox {[c['status'] for c in made] or 'none'}")
            if p["status"] == "Succeeded" and (
                not succeeded or p["provider_transaction_id"] not in {c["id"] for c in succeeded}
            ):
                wrong_txn.append(f"{p['payment_id']}: ours {p['provider_transaction_id']}")
        twice = [m for m in self.truth.get("multiple_charges", []) if m in {p["payment_id"] for p in ours}]

        missing = []
        acknowledged = 0
        for event in self.events:
            acked = sum(
                1 for a in event["attempt_log"] if a["status_code"] is not None and 200 <= a["status_code"] < 300
            )
            acknowledged += acked
            stored = db.callbacks_by_event.get((self.provider, event["id"]), Counter())
            kept = sum(n for status, n in stored.items() if status != CALLBACK_REJECTED)
            if acked > kept:
                missing.append(f"{event['id']}: {acked} acknowledged, {kept} stored")

        section = f"sandbox ({len(ours)} payments)"
        rows = [
            Row(
                "status equal to the sandbox's truth",
                f"all ({len(ours)})",
                str(len(ours) - len(differ)),
                not differ,
                examples(differ),
                section,
            ),
            Row(
                "merchant numbers charged more than once at the sandbox",
                "0",
                str(len(twice)),
                not twice,
                examples(twice),
                section,
            ),
            Row(
                "Succeeded payments whose provider transaction id is not the sandbox's",
                "0",
                str(len(wrong_txn)),
                not wrong_txn,
                examples(wrong_txn),
                section,
            ),
            Row(
                "acknowledged deliveries missing from payment_callback_log",
                f"0 (of {acknowledged} acknowledged)",
                str(len(missing)),
                not missing,
                examples(missing),
                section,
            ),
        ]
        return rows + self._reconciliation_rows(section)

    def _reconciliation_rows(self, section: str) -> list[Row]:
        """The day's reconciliation explains every line; the seal chain is whole and every event sealed."""
        unexplained = []
        lines = 0
        for report in self.reconciliations:
            if report.get("status") != "completed":
                unexplained.append(f"{report.get('date')}: run {report.get('status')} {report.get('error') or ''}")
                continue
            lines += report["file"]["lines"]
            for category, entry in report["categories"].items():
                if category in UNEXPLAINED and entry["count"]:
                    unexplained.append(f"{report['date']}: {entry['count']} {category}")
        if not self.reconciliations:
            unexplained.append("no reconciliation ran")
        chain = self.chain
        keys = ("first_break", "stale_unsealed", "stale_examples", "error")
        broken = [] if chain.get("ok") else [json.dumps({k: chain.get(k) for k in keys})]
        return [
            Row(
                "the reconciliation of the day has no unexplained item",
                f"0 (of {lines} settlement lines, {len(self.reconciliations)} day(s))",
                str(len(unexplained)),
                not unexplained,
                examples(unexplained),
                section,
            ),
            Row(
                "ledger chain verifies",
                "every event sealed, no break",
                f"{chain.get('verified', 0)} seals verified" if chain.get("ok") else "broken or incomplete",
                bool(chain.get("ok")),
                broken,
                section,
            ),
        ]

    def refund_truth(self) -> dict[str, list[dict[str, Any]]] | None:
        """The sandbox's refunds (``/_sandbox/truth``) by merchant refund id."""
        made: dict[str, list[dict[str, Any]]] = {}
        for r in self.truth.get("refunds", []):
            made.setdefault(r["merchant_refund_id"], []).append(r)
        return made

    def secrets(self) -> list[str]:
        """The webhook secret and the API key."""
        return [self.webhook_secret, self.api_key]

    def summary(self) -> dict[str, Any]:
        """What the platform really did: outcomes, and the webhook faults that happened."""
        statuses = Counter(c["status"] for c in self.truth.get("charges", []))
        attempts = [a for e in self.events for a in e["attempt_log"]]
        return {
            "charges": dict(statuses),
            "events": len(self.events),
            "events_dropped": sum(1 for e in self.events if e["status"] == "dropped"),
            "events_given_up": sum(1 for e in self.events if e["status"] == "failed"),
            "delivery_attempts": len(attempts),
            "duplicate_deliveries": sum(1 for a in attempts if a["duplicate"]),
            "bad_signature_attempts": sum(1 for a in attempts if a["bad_signature"]),
            "attempts_not_acknowledged": sum(1 for a in attempts if not _acknowledged(a)),
            "faults": self.faults,
        }


def _acknowledged(attempt: dict[str, Any]) -> bool:
    """A delivery attempt the gateway answered 2xx: it promised the platform the callback is stored."""
    return attempt["status_code"] is not None and 200 <= attempt["status_code"] < 300
