"""The real providers in the chaos run: Alipay, WeChat Pay and Stripe, each through its fake platform.

Each mix (``chaos_mix.Mix``) starts its fake (``python -m sandbox.fakes.…``)
with keys generated for the run and its fault knobs on, gives paysync the
settings to reach it, and contributes its share of the payments. Alipay and
WeChat Pay are paid by scanning a QR code, so a *customer* thread plays the
payer: seeded per payment, most pay a moment after the code appears, some scan
and walk away, some never look; the unpaid ones expire (60 s) and paysync must
close them at the platform before it marks them Failed. Stripe's
``pm_fake_processing`` payments are finished by the same thread playing the
bank.

After convergence each mix reconciles its days through
``python -m compensator reconcile --provider P``, and its rows compare paysync
with the fake's own truth: status equal, no merchant number charged twice,
the Succeeded transaction id the platform's, every Failed QR order closed at
the platform, and nothing unexplained in the reconciliation.

Refunds take part in each of them as they do for the sandbox (``refunds =
True``): ``read_refunds`` reads the fake's own refunds over its control
surface, by our refund number, and ``refund_truth`` hands them to the refund
rows; the fakes' bills carry the refund lines, so the reconciliation row
covers them too.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import requests
from chaos_invariants import Database, Row, examples
from chaos_load import PaymentRequest
from chaos_mix import UNEXPLAINED, Command, Mix, RunContext
from chaos_stack import Supervised, free_port, port_open, wait_for
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

BEIJING = timezone(timedelta(hours=8))
RECONCILE_ATTEMPTS = 5
"""Runs of ``reconcile`` per day before its failure counts (the platform's faults hit bill downloads too)."""
ORDER_EXPIRE_SECONDS = 60
"""ALIPAY_ORDER_EXPIRE_SECONDS / WECHATPAY_ORDER_EXPIRE_SECONDS in the run (the settings' minimum)."""
WECHAT_REFUND_STATUS = {"SUCCESS": "succeeded", "PROCESSING": "processing", "CLOSED": "failed", "ABNORMAL": "failed"}
STRIPE_REFUND_STATUS = {
    "succeeded": "succeeded",
    "pending": "processing",
    "requires_action": "processing",
    "failed": "failed",
    "canceled": "failed",
}
"""The platforms' refund states in ``refund_truth``'s words."""


@dataclass(frozen=True)
class Truth:
    """What the platform holds for one of our payment ids."""

    status: str
    """What paysync's status must be: Succeeded or Failed."""
    transaction_ids: frozenset[str] = frozenset()
    """The platform's ids of the charges that took money."""
    charges: int = 0
    """How many charges took money under this number (more than one: a double charge)."""
    open_order: bool = False
    """An order that could still take money (not paid, not closed)."""
    raw: str = ""
    """The platform's own words, for the table's examples."""


@dataclass
class Customer:
    """What the payer behind one QR code does: pay after ``delay`` seconds, scan only, or nothing."""

    action: str
    delay: float


class ProviderMix(Mix):
    """The parts every fake-platform mix shares: a process, a customer thread, reconciliation, truth rows."""

    name = "provider"
    provider = ""
    currencies: tuple[str, ...] = ("CNY",)
    day_zone: Any = BEIJING
    """The time zone the platform's bills name days in."""
    faults: dict[str, Any]
    refunds = True

    def __init__(self, faults: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        self.refunds_made: dict[str, list[dict[str, Any]]] = {}
        self.faults = dict(self.default_faults() if faults is None else faults)
        self.started_day = ""
        self.reconciliations: list[dict[str, Any]] = []
        self.truths: dict[str, Truth] = {}
        self.customers: dict[str, Customer] = {}
        self.seed = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []

    # ----------------------------------------------------------------------------------------- overridden

    def default_faults(self) -> dict[str, Any]:
        """The fault knobs the platform starts with."""
        return {}

    def command(self, ctx: RunContext) -> tuple[list[str], dict[str, str]]:
        """The fake's command line and its environment."""
        raise NotImplementedError

    def read_truth(self) -> dict[str, Truth]:
        """Our payment id -> what the platform holds (read over its control surface)."""
        raise NotImplementedError

    def read_refunds(self) -> dict[str, list[dict[str, Any]]]:
        """Our refund id -> the platform's refunds under it (``id``, ``status`` succeeded|failed|processing,
        ``amount`` in minor units, ``charge``: the charge's id as paysync stores it)."""
        raise NotImplementedError

    def play_customers(self) -> None:
        """One pass of the customer thread (the payers, or Stripe's bank)."""

    def body_extra(self, rng: random.Random) -> dict[str, Any]:
        """More fields of POST /payments (Stripe's payment_method)."""
        return {}

    # ----------------------------------------------------------------------------------------- Mix

    @property
    def url(self) -> str:
        """The fake platform's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, ctx: RunContext) -> list[Supervised]:
        """The fake as its own process, then the customer thread."""
        self.seed = ctx.seed
        argv, env = self.command(ctx)
        self.started_day = datetime.now(self.day_zone).date().isoformat()
        proc = Supervised(self.name, self.name, {**ctx.base_env, **env}, ctx.log_dir, command=argv)
        proc.start()
        wait_for(lambda: port_open(self.port), 60, f"fake {self.provider}")
        self._thread = threading.Thread(target=self._customers, name=f"customers-{self.name}", daemon=True)
        self._thread.start()
        return [proc]

    def payments(self, ctx: RunContext, count: int, replay_share: float) -> list[PaymentRequest]:
        """``count`` payments in the platform's currencies; a share marked for replay."""
        rng = random.Random(f"{ctx.seed}:{self.name}")
        items = []
        for n in range(count):
            body = {
                "order_no": f"chaos-{ctx.run_id}-{self.name}-{n}",
                "amount": rng.randint(1, 500_000),
                "currency": rng.choice(self.currencies),
                "provider": self.provider,
                "description": f"chaos run {ctx.run_id} #{n}",
                **self.body_extra(rng),
            }
            key = f"chaos-{ctx.run_id}-{self.name}-{n}"
            items.append(PaymentRequest(key, body, self.name, replay=rng.random() < replay_share))
        return items

    def customer(self, payment_id: str) -> Customer:
        """The payer behind ``payment_id``'s code, drawn from the run's seed (the same on every pass)."""
        known = self.customers.get(payment_id)
        if known is None:
            rng = random.Random(f"{self.seed}:{self.name}:{payment_id}")
            roll = rng.random()
            action = "pay" if roll < 0.8 else "scan" if roll < 0.9 else "ignore"
            known = self.customers[payment_id] = Customer(action, rng.uniform(0.2, 3.0))
        return known

    def _customers(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.play_customers()
            except requests.RequestException as exc:
                self.errors.append(f"customer pass: {type(exc).__name__}")

    def after_convergence(self, command: Command) -> None:
        """Stop the customers, then reconcile each of the platform's days of the run."""
        self._stop.set()
        self.reconciliations = []
        for day in self.days():
            self.reconciliations.append(self._reconcile(command, day))

    def _reconcile(self, command: Command, day: str) -> dict[str, Any]:
        """``reconcile --provider P --date DAY``; again a few times when the platform's faults broke the download.

        The daily job does the same: a day whose bill could not be had is fetched again on its next run.
        """
        report: dict[str, Any] = {}
        for attempt in range(RECONCILE_ATTEMPTS):
            done = command(["python", "-m", "compensator", "reconcile", "--provider", self.provider, "--date", day,
                            "--format", "json"])  # fmt: skip
            try:
                report = json.loads(done.stdout)
            except ValueError:
                report = {"date": day, "error": done.stderr.strip().splitlines()[-1:] or done.stdout[-500:]}
            if report.get("status") == "completed":
                break
            report["attempts"] = attempt + 1
            time.sleep(1.0)
        return report

    def days(self) -> list[str]:
        """The platform's days from the one the run started on to today."""
        day = datetime.fromisoformat(self.started_day).date()
        today = datetime.now(self.day_zone).date()
        days = []
        while day <= today:
            days.append(day.isoformat())
            day += timedelta(days=1)
        return days

    def quiet(self) -> bool:
        """No refund still processing at the platform (its notification is still to come)."""
        try:
            made = self.read_refunds()
        except requests.RequestException:
            return False
        return not any(m["status"] == "processing" for ms in made.values() for m in ms)

    def refund_truth(self) -> dict[str, list[dict[str, Any]]] | None:
        """The platform's refunds as ``observe`` read them."""
        return self.refunds_made

    def observe(self) -> None:
        """The platform's truth, once."""
        for attempt in range(5):
            try:
                self.truths = self.read_truth()
                self.refunds_made = self.read_refunds()
                return
            except requests.RequestException:
                time.sleep(2 * (attempt + 1))
        raise RuntimeError(f"the fake {self.provider} did not answer its control surface")

    def rows(self, db: Database, created: dict[str, str]) -> list[Row]:
        """Truth, double charges, transaction ids, orders left open, reconciliation."""
        ours = [db.payments[p] for p in created.values() if p in db.payments]
        differ, twice, wrong_txn, left_open = [], [], [], []
        for p in ours:
            truth = self.truths.get(p["payment_id"], Truth("Failed", raw="no order"))
            if p["status"] != truth.status:
                differ.append(f"{p['payment_id']}: ours {p['status']}, {self.provider} {truth.raw}")
            if truth.charges > 1:
                twice.append(f"{p['payment_id']}: {truth.charges} charges")
            if p["status"] == "Succeeded" and p["provider_transaction_id"] not in truth.transaction_ids:
                wrong_txn.append(f"{p['payment_id']}: ours {p['provider_transaction_id']}")
            if p["status"] == "Failed" and truth.open_order:
                left_open.append(f"{p['payment_id']}: {truth.raw}")
        section = f"{self.provider} ({len(ours)} payments)"
        rows = [
            Row(
                f"status equal to {self.provider}'s truth",
                f"all ({len(ours)})",
                str(len(ours) - len(differ)),
                not differ,
                examples(differ),
                section,
            ),  # fmt: skip
            Row(
                f"merchant numbers charged more than once at {self.provider}",
                "0",
                str(len(twice)),
                not twice,
                examples(twice),
                section,
            ),  # fmt: skip
            Row(
                f"Succeeded payments whose transaction id is not {self.provider}'s",
                "0",
                str(len(wrong_txn)),
                not wrong_txn,
                examples(wrong_txn),
                section,
            ),  # fmt: skip
            Row(
                f"Failed payments whose order {self.provider} would still take money for",
                "0",
                str(len(left_open)),
                not left_open,
                examples(left_open),
                section,
            ),  # fmt: skip
        ]
        return rows + [self._reconciliation_row(section)]

    def _reconciliation_row(self, section: str) -> Row:
        unexplained, lines = [], 0
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
        return Row(
            f"the reconciliation of {self.provider}'s day has no unexplained item",
            f"0 (of {lines} bill lines, {len(self.reconciliations)} day(s))",
            str(len(unexplained)),
            not unexplained,
            examples(unexplained),
            section,
        )

    def summary(self) -> dict[str, Any]:
        """What the customers did and the faults the platform had."""
        actions: dict[str, int] = {}
        for c in self.customers.values():
            actions[c.action] = actions.get(c.action, 0) + 1
        return {"customers": actions, "faults": self.faults, "customer_errors": self.errors[:5]}

    def _get(self, path: str) -> Any:
        response = requests.get(f"{self.url}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, data: dict[str, Any] | None = None) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=data or {}, timeout=30)


def _write_key(directory: Path, name: str) -> tuple[Path, Path]:
    """A fresh RSA 2048 key pair as PEM files (PKCS#8 private, SubjectPublicKeyInfo public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = directory / f"{name}.pem", directory / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


class AlipayMix(ProviderMix):
    """Precreate QR codes at the fake Alipay gateway; customers scan and pay (or not)."""

    name = "alipay"
    provider = "alipay"
    app_id = "2021000000000002"
    """Not the documents' example 2021000000000001: that one passes the Luhn check, and the log scan would
    take it, printed in the fake's access log, for a card number."""

    def default_faults(self) -> dict[str, Any]:
        """Every call fault the fake knows, and bad notify signatures (each one a hint)."""
        return {
            "system_error_rate": 0.04,
            "acq_system_error_rate": 0.03,
            "timeout_after_commit_rate": 0.03,
            "http_502_rate": 0.03,
            "bad_sign_rate": 0.02,
            "hang_seconds": 2.5,
            "notify_duplicate_rate": 0.05,
            "notify_bad_sign_rate": 0.05,
        }

    def command(self, ctx: RunContext) -> tuple[list[str], dict[str, str]]:
        keys = ctx.work_dir / "alipay-keys"
        keys.mkdir(parents=True, exist_ok=True)
        self.app_key, app_pub = _write_key(keys, "app")
        platform_key, self.platform_pub = _write_key(keys, "alipay")
        self.notify_url = f"{ctx.gateway_url}/callbacks/alipay"
        env = {
            "FAKE_ALIPAY_HOST": "127.0.0.1",
            "FAKE_ALIPAY_PORT": str(self.port),
            "FAKE_ALIPAY_APP_ID": self.app_id,
            "FAKE_ALIPAY_APP_PUBLIC_KEYS": str(app_pub),
            "FAKE_ALIPAY_PRIVATE_KEY": str(platform_key),
            "FAKE_ALIPAY_NOTIFY_URL": self.notify_url,
            "FAKE_ALIPAY_FAULTS": json.dumps({**self.faults, "seed": ctx.seed}),
        }
        return [sys.executable, "-m", "sandbox.fakes.alipay"], env

    def paysync_env(self) -> dict[str, str]:
        return {
            "ALIPAY_APP_ID": self.app_id,
            "ALIPAY_APP_PRIVATE_KEY_FILE": str(self.app_key),
            "ALIPAY_PUBLIC_KEY_FILES": str(self.platform_pub),
            "ALIPAY_GATEWAY_URL": f"{self.url}/gateway.do",
            "ALIPAY_NOTIFY_URL": self.notify_url,
            "ALIPAY_ORDER_EXPIRE_SECONDS": str(ORDER_EXPIRE_SECONDS),
        }

    def play_customers(self) -> None:
        """Scan and pay each new code once its payer's delay has passed."""
        now = time.monotonic()
        for out_trade_no, trade in self._get("/_fake/trades").items():
            who = self.customer(out_trade_no)
            seen = self._first_seen(out_trade_no, now)
            if who.action == "ignore" or now - seen < who.delay or trade["status"] not in ("PRECREATED",):
                continue
            if trade["closed_unscanned"]:
                continue
            self._post("/_fake/pay" if who.action == "pay" else "/_fake/scan", {"out_trade_no": out_trade_no})

    def _first_seen(self, key: str, now: float) -> float:
        seen = self.__dict__.setdefault("_seen", {})
        return seen.setdefault(key, now)

    def read_truth(self) -> dict[str, Truth]:
        truths = {}
        for out_trade_no, t in self._get("/_fake/trades").items():
            paid = t["status"] in ("TRADE_SUCCESS", "TRADE_FINISHED")
            closed = t["status"] == "TRADE_CLOSED" or t["closed_unscanned"]
            truths[out_trade_no] = Truth(
                "Succeeded" if paid else "Failed",
                frozenset({t["trade_no"]}) if paid and t["trade_no"] else frozenset(),
                1 if paid else 0,
                open_order=not paid and not closed,
                raw=f"{t['status']}{' closed unscanned' if t['closed_unscanned'] else ''}",
            )
        return truths

    def read_refunds(self) -> dict[str, list[dict[str, Any]]]:
        """Each trade's refunds by out_request_no (our refund id); Alipay refunds at once, so each one succeeded.

        Alipay has no refund id: paysync names one ``trade_no:out_request_no`` (its bill's key too).
        """
        made: dict[str, list[dict[str, Any]]] = {}
        for t in self._get("/_fake/trades").values():
            for out_request_no, yuan in t["refunds"].items():
                fen = int(Decimal(yuan) * 100)
                ref = f"{t['trade_no']}:{out_request_no}"
                made.setdefault(out_request_no, []).append(
                    {"id": ref, "status": "succeeded", "amount": fen, "charge": t["trade_no"]}
                )
        return made


class WechatPayMix(ProviderMix):
    """Native orders at the fake WeChat Pay v3 platform; customers pay the code_url (or not)."""

    name = "wechatpay"
    provider = "wechatpay"

    def default_faults(self) -> dict[str, Any]:
        """Every call fault of the fake, probes before notifications, duplicate notifications."""
        return {
            "system_error_rate": 0.04,
            "frequency_limited_rate": 0.03,
            "error_5xx_rate": 0.03,
            "timeout_after_rate": 0.03,
            "bad_signature_rate": 0.02,
            "hang_seconds": 2.5,
            "probe_notifications": True,
            "duplicate_notification_rate": 0.05,
        }

    def command(self, ctx: RunContext) -> tuple[list[str], dict[str, str]]:
        keys = ctx.work_dir / "wechatpay-keys"
        made = subprocess.run(
            [sys.executable, "-m", "sandbox.fakes.wechatpay", "--keygen", str(keys)],
            env=ctx.base_env,
            capture_output=True,
            text=True,
            check=True,
        )
        both = dict(line.split("=", 1) for line in made.stdout.splitlines() if "=" in line)
        self.paysync = {k: v for k, v in both.items() if not k.startswith("WECHATPAY_FAKE_")}
        self.paysync.update(
            WECHATPAY_API_BASE=self.url,
            WECHATPAY_NOTIFY_URL=f"{ctx.gateway_url}/callbacks/wechatpay",
            WECHATPAY_ORDER_EXPIRE_SECONDS=str(ORDER_EXPIRE_SECONDS),
        )
        env = {k: v for k, v in both.items() if k.startswith("WECHATPAY_FAKE_")}
        env.update(
            WECHATPAY_FAKE_HOST="127.0.0.1",
            WECHATPAY_FAKE_FAULTS=json.dumps(self.faults),
            WECHATPAY_FAKE_SEED=str(ctx.seed),
            # WeChat re-sends after 15 s, 15 s, 30 s, 3 min …: a tenth of that, so a run sees the retries.
            WECHATPAY_FAKE_NOTIFY_BACKOFF_SCALE="0.1",
        )
        return [sys.executable, "-m", "sandbox.fakes.wechatpay", "--port", str(self.port)], env

    def paysync_env(self) -> dict[str, str]:
        return dict(self.paysync)

    def secrets(self) -> list[str]:
        return [self.paysync["WECHATPAY_APIV3_KEY"]]

    def _orders(self) -> dict[str, dict[str, Any]]:
        return self._get("/_fake/state")["orders"]

    def play_customers(self) -> None:
        """Pay each new order once its payer's delay has passed (a scan alone changes nothing at WeChat)."""
        now = time.monotonic()
        seen = self.__dict__.setdefault("_seen", {})
        for out_trade_no, order in self._orders().items():
            who = self.customer(out_trade_no)
            first = seen.setdefault(out_trade_no, now)
            if who.action == "pay" and now - first >= who.delay and order["trade_state"] == "NOTPAY":
                self._post(f"/_fake/orders/{out_trade_no}/pay", {"notify": True})

    def read_truth(self) -> dict[str, Truth]:
        truths = {}
        for out_trade_no, o in self._orders().items():
            paid = o["trade_state"] in ("SUCCESS", "REFUND")
            truths[out_trade_no] = Truth(
                "Succeeded" if paid else "Failed",
                frozenset({o["transaction_id"]}) if paid and o.get("transaction_id") else frozenset(),
                1 if paid else 0,
                open_order=o["trade_state"] in ("NOTPAY", "USERPAYING"),
                raw=o["trade_state"],
            )
        return truths

    def read_refunds(self) -> dict[str, list[dict[str, Any]]]:
        """The fake's refunds by out_refund_no (our refund id); the charge is the order's transaction_id."""
        state = self._get("/_fake/state")
        made: dict[str, list[dict[str, Any]]] = {}
        for out_refund_no, r in state["refunds"].items():
            order = state["orders"].get(r["out_trade_no"]) or {}
            made.setdefault(out_refund_no, []).append(
                {
                    "id": r["refund_id"],
                    "status": WECHAT_REFUND_STATUS.get(r["status"], r["status"]),
                    "amount": r["amount"],
                    "charge": order.get("transaction_id"),
                }
            )
        return made


class StripeMix(ProviderMix):
    """PaymentIntents at the fake Stripe with test payment methods; processing ones finished by the bank.

    The account settles in USD, so the EUR and JPY payments are cross-currency: their balance transactions are in
    USD with an ``exchange_rate``. The reconciliation must match them on their own money (nothing unexplained)
    and book the conversions, after which the ledger's Stripe receivable is the fake's balance, currency by
    currency: USD the net of every balance transaction, nothing left in EUR or JPY.
    """

    name = "stripe"
    provider = "stripe"
    currencies = ("USD", "USD", "EUR", "JPY")
    settlement_currency = "USD"
    day_zone = UTC
    methods = (
        ("pm_card_visa", 0.75),
        ("pm_card_chargeDeclined", 0.08),
        ("pm_card_chargeDeclinedInsufficientFunds", 0.05),
        ("pm_fake_processing", 0.12),
    )

    def __init__(self, faults: dict[str, Any] | None = None) -> None:
        super().__init__(faults)
        self.api_key = "sk_test_chaos" + secrets.token_hex(12)
        self.webhook_secret = "whsec_chaos" + secrets.token_hex(16)
        self.balance: dict[str, int] | None = None
        """The fake's balance after the reconciliation: net per currency (upper case) of its balance transactions."""

    def after_convergence(self, command: Command) -> None:
        """Reconcile the days, then read what the account's balance holds."""
        super().after_convergence(command)
        for attempt in range(5):
            try:
                response = self._post("/_fake/balance")
                response.raise_for_status()
                self.balance = {c.upper(): int(v) for c, v in response.json()["net"].items()}
                return
            except requests.RequestException:
                time.sleep(2 * (attempt + 1))

    def rows(self, db: Database, created: dict[str, str]) -> list[Row]:
        """The provider rows, then the cross-currency ones: some took part, and the receivable is the balance."""
        rows = super().rows(db, created)
        section = rows[0].section
        ours = [db.payments[p] for p in created.values() if p in db.payments]
        converted = [p for p in ours if p["status"] == "Succeeded" and p["currency"] != self.settlement_currency]
        rows.append(
            Row(
                f"Succeeded Stripe payments settled from another currency into {self.settlement_currency}",
                "> 0",
                str(len(converted)),
                bool(converted),
                examples(f"{p['payment_id']} {p['currency']}" for p in converted[:3]),
                section,
            )
        )
        held = {c: v for (account, c), v in db.receivables.items() if account == f"assets:provider:{self.provider}"}
        balance = self.balance or {}
        differ = [
            f"{c}: ledger {held.get(c, 0)}, Stripe {balance.get(c, 0)}"
            for c in sorted(set(held) | set(balance))
            if held.get(c, 0) != balance.get(c, 0)
        ]
        if self.balance is None:
            differ.append("the fake's balance could not be read")
        shown = "; ".join(f"{c} {held.get(c, 0)}" for c in sorted(set(held) | set(balance)))
        rows.append(
            Row(
                "Stripe receivable in the ledger equal to Stripe's balance, per currency (conversions booked)",
                f"{self.settlement_currency} = the balance's net, every other currency 0",
                shown or "nothing",
                not differ,
                examples(differ),
                section,
            )
        )
        return rows

    def default_faults(self) -> dict[str, Any]:
        """Every fault of the fake: 5xx, api_error under the key, rate limits, hangs, held answers, dropped webhooks."""
        return {
            "error_5xx_rate": 0.03,
            "api_error_rate": 0.03,
            "rate_limit_rate": 0.02,
            "lock_timeout_rate": 0.02,
            "hang_rate": 0.02,
            "timeout_after_commit_rate": 0.03,
            "drop_webhook_rate": 0.05,
            "hang_seconds": 2.5,
        }

    def body_extra(self, rng: random.Random) -> dict[str, Any]:
        roll, total = rng.random(), 0.0
        for method, share in self.methods:
            total += share
            if roll < total:
                return {"payment_method": method}
        return {"payment_method": self.methods[0][0]}

    def command(self, ctx: RunContext) -> tuple[list[str], dict[str, str]]:
        env = {
            "STRIPE_FAKE_API_KEY": self.api_key,
            "STRIPE_FAKE_WEBHOOK_SECRETS": self.webhook_secret,
            "STRIPE_FAKE_WEBHOOK_URL": f"{ctx.gateway_url}/callbacks/stripe",
            "STRIPE_FAKE_SEARCH_LAG_SECONDS": "1",
            "STRIPE_FAKE_SEED": str(ctx.seed),
            "STRIPE_FAKE_FAULTS": json.dumps(self.faults),
            # Refunds wait for the bank (the customer thread), so refund.updated and refund.failed happen.
            "STRIPE_FAKE_REFUNDS_PENDING": "1",
            "STRIPE_FAKE_SETTLEMENT_CURRENCY": self.settlement_currency.lower(),
        }
        return [sys.executable, "-m", "sandbox.fakes.stripe", "--port", str(self.port)], env

    def paysync_env(self) -> dict[str, str]:
        return {"STRIPE_API_KEY": self.api_key, "STRIPE_WEBHOOK_SECRETS": self.webhook_secret,
                "STRIPE_API_BASE": self.url}  # fmt: skip

    def secrets(self) -> list[str]:
        return [self.api_key, self.webhook_secret]

    def _intents(self) -> Iterator[dict[str, Any]]:
        response = self._post("/_fake/payment_intents")
        response.raise_for_status()
        yield from response.json()["payment_intents"]

    def play_customers(self) -> None:
        """The bank: a processing PaymentIntent settles after its delay, most of them successfully."""
        now = time.monotonic()
        seen = self.__dict__.setdefault("_seen", {})
        for pi in self._intents():
            if pi["status"] != "processing":
                continue
            who = self.customer(pi["id"])
            if now - seen.setdefault(pi["id"], now) >= who.delay:
                self._post("/_fake/complete_payment_intent", {"id": pi["id"], "succeed": who.action == "pay"})
        for refund in self._refunds():
            if refund["status"] != "pending":
                continue
            who = self.customer(refund["id"])
            if now - seen.setdefault(refund["id"], now) >= who.delay:
                # Most pending refunds land; the bank sends the rest back (refund.updated, refund.failed).
                self._post("/_fake/complete_refund", {"id": refund["id"], "succeed": who.action != "ignore"})

    def _refunds(self) -> list[dict[str, Any]]:
        response = self._post("/_fake/refunds")
        response.raise_for_status()
        return response.json()["refunds"]

    def read_refunds(self) -> dict[str, list[dict[str, Any]]]:
        """The fake's refunds by metadata.refund_id (our refund id); the charge is the PaymentIntent, as paysync
        stores it."""
        made: dict[str, list[dict[str, Any]]] = {}
        for r in self._refunds():
            refund_id = (r.get("metadata") or {}).get("refund_id")
            if refund_id:
                made.setdefault(refund_id, []).append(
                    {
                        "id": r["id"],
                        "status": STRIPE_REFUND_STATUS.get(r["status"], r["status"]),
                        "amount": r["amount"],
                        "charge": r["payment_intent"],
                    }
                )
        return made

    def read_truth(self) -> dict[str, Truth]:
        by_payment: dict[str, list[dict[str, Any]]] = {}
        for pi in self._intents():
            payment_id = (pi.get("metadata") or {}).get("payment_id")
            if payment_id:
                by_payment.setdefault(payment_id, []).append(pi)
        truths = {}
        for payment_id, intents in by_payment.items():
            succeeded = [pi for pi in intents if pi["status"] == "succeeded"]
            truths[payment_id] = Truth(
                "Succeeded" if succeeded else "Failed",
                frozenset(pi["id"] for pi in succeeded),
                len(succeeded),
                open_order=any(pi["status"] == "processing" for pi in intents),
                raw=",".join(pi["status"] for pi in intents),
            )
        return truths


PROVIDER_MIXES: dict[str, type[ProviderMix]] = {"alipay": AlipayMix, "wechatpay": WechatPayMix, "stripe": StripeMix}
"""The real providers' mixes by provider name (``--providers``)."""
