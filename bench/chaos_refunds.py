"""The chaos run's refunds: partial refunds of a share of each mix's Succeeded payments, while the faults go on.

``RefundLoad`` is the merchant asking for refunds, for any provider's mix. It
watches the payments the merchant created (``LoadDriver.result.created``),
picks a seeded share of them, waits (``GET /payments/<id>``) until each is
terminal, and for each Succeeded one sends one or two partial refunds with a
fixed Idempotency-Key each (``POST /payments/<id>/refunds``), retrying every
transient answer with the same key; a share is sent again (the replay check),
and a share gets one more request for one minor unit more than is left, which
must be refused (422 ``amount_exceeds_refundable``). All of it runs while the
kill schedule runs.

``rows`` checks the converged system, per mix: every refund answered and on
file, replays naming the same refund, over-limit requests refused, every
refund terminal and equal to the platform's truth (when the mix can read it),
never more refunded than charged (ours and the platform's books), and each
refund's ledger effects exactly once. The day's reconciliation (the mix's own
row) covers the refunds' settlement lines.

The database is read with plain SQL on the contract's table names, like
``chaos_invariants``.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
from chaos_invariants import TERMINAL, Row, examples
from sqlalchemy import Engine, text

OVER_LIMIT = "amount_exceeds_refundable"


@dataclass
class RefundAnswer:
    """What one refund request finally got."""

    key: str
    payment_id: str
    amount: int
    status: int | None
    """None: no final answer before the deadline."""
    code: str | None = None
    refund_id: str | None = None
    over_limit: bool = False
    """Sent on purpose for more than is left: must be refused."""
    replay_same: bool | None = None
    """For a replayed request: whether the second answer named the same refund with Idempotent-Replayed."""


@dataclass
class RefundDatabase:
    """The refunds as the database holds them after the run."""

    refunds: dict[str, dict[str, Any]]
    """refund_id -> payment_id, status, amount_minor, provider_refund_id."""
    ledger: dict[str, Counter]
    """refund_id -> Counter of ledger event types."""


def read_refunds(engine: Engine) -> RefundDatabase:
    """Every refund row and its ledger events."""
    with engine.connect() as conn:
        refunds = {
            r.refund_id: dict(r._mapping)
            for r in conn.execute(
                text("SELECT refund_id, payment_id, status, amount_minor, provider_refund_id, provider FROM refund")
            )
        }
        ledger: dict[str, Counter] = defaultdict(Counter)
        for refund_id, event_type, n in conn.execute(
            text(
                "SELECT refund_id, event_type, COUNT(*) FROM ledger_event"
                " WHERE refund_id IS NOT NULL GROUP BY refund_id, event_type"
            )
        ):
            ledger[refund_id][event_type] += n
    return RefundDatabase(refunds, ledger)


def open_refunds(conn: Any) -> int:
    """Refunds not terminal yet (for the progress sample and convergence)."""
    return conn.execute(text("SELECT COUNT(*) FROM refund WHERE status NOT IN ('Succeeded', 'Failed')")).scalar_one()


class RefundLoad:
    """Partial refunds of a share of one mix's Succeeded payments (module docstring); any provider's mix can use it."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        run_id: str,
        mix: str,
        seed: int,
        share: float = 0.3,
        replay_share: float = 0.3,
        over_share: float = 0.2,
        concurrency: int = 4,
        deadline: float = 900.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.run_id, self.mix, self.seed = run_id, mix, seed
        self.share, self.replay_share, self.over_share = share, replay_share, over_share
        self.concurrency = concurrency
        self.deadline = deadline
        self.answers: list[RefundAnswer] = []
        self.candidates = 0
        self.not_refunded: Counter = Counter()
        """Candidates that were not refunded, by why: their payment Failed, or never became terminal."""
        self.retries: Counter = Counter()
        self.server_errors = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        """True once every candidate is refunded (or dropped) and every request answered."""
        return self._done.is_set()

    def start(self, created: Callable[[], dict[str, str]], load_done: Callable[[], bool]) -> None:
        """Run in a thread: ``created()`` is key -> payment_id of this mix so far; ``load_done()`` ends the watch."""
        self._thread = threading.Thread(target=self._run, args=(created, load_done), name=f"refunds-{self.mix}")
        self._thread.daemon = True
        self._thread.start()

    def wait(self, timeout: float) -> bool:
        """Wait for the thread; True when it finished."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.done

    # --- the merchant -----------------------------------------------------------------------------------------

    def _run(self, created: Callable[[], dict[str, str]], load_done: Callable[[], bool]) -> None:
        started = time.monotonic()
        seen: set[str] = set()
        waiting: dict[str, tuple[str, float]] = {}  # payment_id -> (key, next check)
        inflight: set[Future] = set()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"refund-{self.mix}") as pool:
            while time.monotonic() - started < self.deadline:
                finished = load_done()
                for key, payment_id in list(created().items()):
                    if key in seen:
                        continue
                    seen.add(key)
                    if random.Random(f"{self.seed}:refund:{key}").random() < self.share:
                        self.candidates += 1
                        waiting[payment_id] = (key, 0.0)
                now = time.monotonic()
                for payment_id, (key, due) in list(waiting.items()):
                    if due > now or len(inflight) >= self.concurrency * 2:
                        continue
                    payment = self._get(f"/payments/{payment_id}")
                    status = payment.get("status") if payment else None
                    if status == "Succeeded":
                        del waiting[payment_id]
                        inflight.add(pool.submit(self._refund, key, payment_id, int(payment["amount"])))
                    elif status == "Failed":
                        del waiting[payment_id]
                        self.not_refunded["payment failed"] += 1
                    else:
                        waiting[payment_id] = (key, now + 1.0)
                inflight = {f for f in inflight if not f.done()}
                if finished and not waiting and not inflight:
                    break
                time.sleep(0.2)
            for future in inflight:
                future.result()
        self.not_refunded["payment not terminal before the deadline"] += len(waiting)
        self._done.set()

    def _refund(self, key: str, payment_id: str, amount: int) -> None:
        """One or two partial refunds of one payment, a replay of some, an over-limit request for some."""
        rng = random.Random(f"{self.seed}:refund-plan:{key}")
        first = rng.randint(1, max(1, amount // 2)) if amount > 1 else 1
        plan = [first]
        if amount - first >= 1 and rng.random() < 0.5:
            plan.append(rng.randint(1, amount - first))
        for n, part in enumerate(plan):
            reason = f"chaos {self.run_id} refund {n + 1}"
            refund_key = f"chaos-{self.run_id}-{key}-refund-{n}"
            answer = self._send(refund_key, payment_id, {"amount": part, "reason": reason})
            if answer.status == 201 and rng.random() < self.replay_share:
                again = self._send(refund_key, payment_id, {"amount": part, "reason": reason})
                same = again.status == 201 and again.refund_id == answer.refund_id
                answer.replay_same = same and again.code == "replayed"
            with self._lock:
                self.answers.append(answer)
        if rng.random() < self.over_share:
            over = amount - sum(plan) + 1
            answer = self._send(f"chaos-{self.run_id}-{key}-refund-over", payment_id, {"amount": over})
            answer.over_limit = True
            with self._lock:
                self.answers.append(answer)

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _get(self, path: str) -> dict[str, Any] | None:
        """GET once; None on any trouble (the caller looks again later)."""
        try:
            response = self._session().get(f"{self.base_url}{path}", headers=self.headers, timeout=(3, 30))
        except requests.RequestException:
            self._session().close()
            return None
        return response.json() if response.status_code == 200 else None

    def _send(self, key: str, payment_id: str, body: dict[str, Any]) -> RefundAnswer:
        """POST until a final answer, with the same key every time (LoadDriver's rules; a 409 only while in flight)."""
        headers = {**self.headers, "Idempotency-Key": key}
        deadline = time.monotonic() + self.deadline
        pause = 0.1
        rng = random.Random(key)
        while time.monotonic() < deadline:
            try:
                response = self._session().post(
                    f"{self.base_url}/payments/{payment_id}/refunds", json=body, headers=headers, timeout=(3, 30)
                )
            except requests.RequestException as exc:
                reason = type(exc).__name__
                self._session().close()  # a killed worker leaves a dead keep-alive connection behind
            else:
                try:
                    data: Any = response.json()
                except ValueError:
                    data = {}
                code = (data.get("error") or {}).get("code") if isinstance(data, dict) else None
                retry = response.status_code in (429, 500, 502, 503, 504) or code == "request_in_progress"
                if not retry:
                    if response.headers.get("Idempotent-Replayed") == "true":
                        code = "replayed"
                    refund_id = data.get("refund_id") if isinstance(data, dict) else None
                    return RefundAnswer(key, payment_id, body["amount"], response.status_code, code, refund_id)
                reason = f"http_{response.status_code}"
                if response.status_code == 500:
                    with self._lock:
                        self.server_errors += 1
            with self._lock:
                self.retries[reason] += 1
            time.sleep(rng.uniform(pause / 2, pause))
            pause = min(pause * 2, 2.0)
        return RefundAnswer(key, payment_id, body["amount"], None)

    # --- the invariants ---------------------------------------------------------------------------------------

    def rows(
        self,
        db: RefundDatabase,
        payments: dict[str, dict[str, Any]],
        truth: dict[str, list[dict[str, Any]]] | None,
        section: str,
    ) -> list[Row]:
        """The refund rows for this mix. ``payments`` is payment_id -> row; ``truth`` the platform's refunds by
        our refund number (``status`` succeeded/failed/processing, ``amount``, ``charge``), None if unknown."""
        planned = [a for a in self.answers if not a.over_limit]
        over = [a for a in self.answers if a.over_limit]
        section = f"{section}: refunds"
        not_created = [f"{a.key}: {a.status} {a.code}" for a in planned if a.status != 201 or not a.refund_id]
        ours = {a.refund_id for a in planned if a.refund_id}
        missing = sorted(r for r in ours if r not in db.refunds)
        replays = [a for a in planned if a.replay_same is not None]
        bad_replays = [a.key for a in replays if not a.replay_same]
        accepted_over = [f"{a.key}: {a.status} {a.code}" for a in over if (a.status, a.code) != (422, OVER_LIMIT)]

        rows_ = [db.refunds[r] for r in sorted(ours) if r in db.refunds]
        open_ = [f"{r['refund_id']} {r['status']}" for r in rows_ if r["status"] not in TERMINAL]
        differ = []
        if truth is not None:
            for r in rows_:
                made = truth.get(r["refund_id"], [])
                succeeded = [m for m in made if m.get("status") == "succeeded"]
                want = "Succeeded" if succeeded else "Failed"
                if r["status"] != want or (succeeded and r["provider_refund_id"] not in {m["id"] for m in succeeded}):
                    differ.append(f"{r['refund_id']}: ours {r['status']}, platform {[m.get('status') for m in made]}")
        refunded: Counter = Counter()
        for r in db.refunds.values():
            if r["status"] == "Succeeded":
                refunded[r["payment_id"]] += int(r["amount_minor"])
        too_much = [
            f"{pid}: refunded {n} of {payments[pid]['amount_minor']}"
            for pid, n in refunded.items()
            if pid in payments and n > int(payments[pid]["amount_minor"])
        ]
        if truth is not None:
            by_charge: Counter = Counter()
            for made in truth.values():
                for m in made:
                    if m.get("status") == "succeeded":
                        by_charge[m.get("charge")] += int(m.get("amount", 0))
            charges = {p["provider_transaction_id"]: p for p in payments.values() if p["provider_transaction_id"]}
            too_much += [
                f"platform charge {c}: refunded {n} of {charges[c]['amount_minor']}"
                for c, n in by_charge.items()
                if c in charges and n > int(charges[c]["amount_minor"])
            ]
        effects = []
        for r in rows_:
            counts = db.ledger.get(r["refund_id"], Counter())
            want = {"RefundRequested": 1, "RefundConfirmed": int(r["status"] == "Succeeded")}
            want["RefundFailed"] = int(r["status"] == "Failed")
            wrong = {k: counts.get(k, 0) for k, n in want.items() if counts.get(k, 0) != n}
            if wrong:
                effects.append(f"{r['refund_id']} {r['status']} {wrong}")
        skipped = ", ".join(f"{why} {n}" for why, n in sorted(self.not_refunded.items()) if n) or "none"
        return [
            Row(
                "refunds requested and answered 201",
                f"all ({len(planned)}, of {self.candidates} payments picked; not refunded: {skipped})",
                str(len(planned) - len(not_created)),
                self.done and not not_created and self.server_errors == 0,
                examples(not_created) + ([f"{self.server_errors} answers 500"] if self.server_errors else []),
                section,
            ),
            Row(
                "acknowledged refunds missing from the refund table",
                "0",
                str(len(missing)),
                not missing,
                examples(missing),
                section,
            ),
            Row(
                "refund replays naming the same refund",
                f"all ({len(replays)})",
                str(len(replays) - len(bad_replays)),
                not bad_replays,
                examples(bad_replays),
                section,
            ),
            Row(
                "refunds over what is left refused (422 amount_exceeds_refundable)",
                f"all ({len(over)})",
                str(len(over) - len(accepted_over)),
                not accepted_over,
                examples(accepted_over),
                section,
            ),
            Row(
                "refunds terminal",
                f"all ({len(rows_)})",
                str(len(rows_) - len(open_)),
                not open_,
                examples(open_),
                section,
            ),  # fmt: skip
            Row(
                "refund status equal to the platform's truth",
                f"all ({len(rows_)})" if truth is not None else "(no truth for this platform)",
                str(len(rows_) - len(differ)),
                not differ,
                examples(differ),
                section,
            ),
            Row(
                "payments refunded more than they were charged (ours or the platform's books)",
                "0",
                str(len(too_much)),
                not too_much,
                examples(too_much),
                section,
            ),
            Row(
                "refunds whose ledger effects are not exactly once",
                "0",
                str(len(effects)),
                not effects,
                examples(effects),
                section,
            ),
        ]

    def summary(self) -> dict[str, Any]:
        """What the refund merchant did."""
        return {
            "candidates": self.candidates,
            "requests": len(self.answers),
            "answers": dict(Counter(f"{a.status} {a.code or ''}".strip() for a in self.answers)),
            "not_refunded": dict(self.not_refunded),
            "retries": dict(self.retries),
        }
