"""The small variant of ``make chaos`` (bench/chaos.py), run by ``make test``: the whole system under faults.

300 payments through POST /payments against the sandbox with every fault on,
a private MariaDB and RabbitMQ, one SIGKILL each of a gateway worker, a
consumer and a compensator, one SIGKILL-and-restart of RabbitMQ and one of
MariaDB; then every invariant of the table must hold.

The unit tests below it feed the table's rows with made-up observations, so
each row is seen to fail on the fault it is there to catch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import IN_CI
from tests.support import ROOT

sys.path.append(str(ROOT / "bench"))

from chaos_invariants import Database, core_rows  # noqa: E402
from chaos_load import LoadResult, PaymentRequest, Replay  # noqa: E402
from chaos_mix import UNEXPLAINED, SandboxMix  # noqa: E402
from chaos_refunds import OVER_LIMIT, RefundAnswer, RefundDatabase, RefundLoad  # noqa: E402

SERVERS = ["mariadb-install-db", "mariadbd", "/usr/lib/rabbitmq/bin/rabbitmq-server"]


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.mariadb
@pytest.mark.rabbitmq
def test_the_small_chaos_run_holds_every_invariant(tmp_path):
    missing = [s for s in SERVERS if shutil.which(s) is None]
    if missing:
        message = f"make chaos needs MariaDB and RabbitMQ installed (not running): {', '.join(missing)} not found"
        pytest.fail(message) if IN_CI else pytest.skip(message)
    out = tmp_path / "chaos.json"
    command = [
        sys.executable,
        str(ROOT / "bench" / "chaos.py"),
        "--payments=300",
        "--process-kills=3",
        "--rate=10",
        "--kill-interval=2",
        "--deadline=300",
        f"--json-out={out}",
        f"--work-dir={tmp_path / 'work'}",
    ]
    started = time.monotonic()
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    took = time.monotonic() - started
    report = run.stdout[-6000:] + run.stderr[-4000:]
    assert run.returncode == 0, f"chaos run exited {run.returncode} after {took:.0f} s:\n{report}"
    result = json.loads(out.read_text())
    assert result["ok"] and all(row["ok"] for row in result["rows"]), report
    assert result["kill_counts"] == {"gateway_worker": 1, "consumer": 1, "compensator": 1, "rabbitmq": 1, "mariadb": 1}
    assert len(result["timeseries"]) > 10 and result["converged_at"] is not None
    # Each killed process was restarted by its supervisor loop.
    assert sum(result["restarts"].values()) >= 2
    print(f"chaos small variant: {took:.0f} s; converged {result['converge_seconds_after_load']} s after the load")


# --- the rows can fail ----------------------------------------------------------------------------------------


def _db(**overrides) -> Database:
    payments = {
        "pay_a": _p("pay_a", "Succeeded", "ch_a"),
        "pay_b": _p("pay_b", "Failed", None),
    }
    base = {
        "payments": payments,
        "callbacks_by_status": {1: 2, 3: 1},
        "callbacks_by_event": {("sandbox", "evt_a"): Counter({1: 1}), ("sandbox", "evt_b"): Counter({1: 1, 3: 1})},
        "ledger_by_currency": {"CNY": 0},
        "unbalanced_ledger_events": 0,
        "ledger_events": {
            "pay_a": Counter({"PaymentRequested": 1, "PaymentConfirmed": 1}),
            "pay_b": Counter({"PaymentRequested": 1, "PaymentFailed": 1}),
        },
        "reviews": [],
        "outbox_unsent": {},
        "deliveries_unsent": {},
    }
    return Database(**{**base, **overrides})


def _p(payment_id: str, status: str, txn: str | None) -> dict:
    return {
        "payment_id": payment_id,
        "provider": "sandbox",
        "status": status,
        "provider_transaction_id": txn,
        "amount_minor": 100,
        "currency": "CNY",
    }


def _load(**overrides) -> LoadResult:
    load = LoadResult(
        created={"k_a": "pay_a", "k_b": "pay_b"},
        requests={k: PaymentRequest(k, {}, "sandbox") for k in ("k_a", "k_b")},
        replays=[Replay("k_a", "pay_a", True, True)],
    )
    for key, value in overrides.items():
        setattr(load, key, value)
    return load


def _sandbox(**truth) -> SandboxMix:
    mix = SandboxMix(port=1)
    mix.truth = {
        "charges": [
            {"id": "ch_a", "merchant_transaction_id": "pay_a", "status": "succeeded"},
            {"id": "ch_b", "merchant_transaction_id": "pay_b", "status": "failed"},
        ],
        "multiple_charges": [],
        **truth,
    }
    mix.events = [
        {"id": "evt_a", "status": "delivered", "attempt_log": [{"status_code": 200}]},
        {"id": "evt_b", "status": "delivered", "attempt_log": [{"status_code": 401}, {"status_code": 200}]},
    ]
    mix.reconciliations = [_reconciliation()]
    mix.chain = {"ok": True, "verified": 3, "first_break": None, "stale_unsealed": 0, "stale_examples": []}
    return mix


def _reconciliation(**counts: int) -> dict:
    """A completed run of the day as ``reconcile --format json`` prints it, the categories counted as given."""
    categories = {c: {"count": 0, "amounts": {}} for c in ("matched", "resolved", "fee", "ignored", *UNEXPLAINED)}
    categories["matched"]["count"] = 2
    for category, count in counts.items():
        categories[category]["count"] = count
    return {"date": "2024-03-01", "status": "completed", "file": {"lines": 3}, "categories": categories}


def _failing(rows) -> set[str]:
    return {r.name for r in rows if not r.ok}


def test_a_clean_observation_passes_every_row():
    db = _db()
    assert _failing(core_rows(db, _load(), {})) == set()
    assert _failing(_sandbox().rows(db, _load().created)) == set()


@pytest.mark.parametrize(
    ("db_changes", "load_changes", "row"),
    [
        ({}, {"created": {"k_a": "pay_a"}}, "payments created"),
        ({"payments": {"pay_b": _p("pay_b", "Failed", None)}}, {}, "payments created"),
        ({}, {"server_errors": 1}, "merchant requests answered 500"),
        ({"payments": {"pay_a": _p("pay_a", "Unknown", None), "pay_b": _p("pay_b", "Failed", None)}}, {}, "terminal"),
        ({}, {"replays": [Replay("k_a", "pay_other", False, True)]}, "replays naming the same payment"),
        ({}, {"replays": [Replay("k_a", "pay_a", True, False)]}, "replays naming the same payment"),
        ({"callbacks_by_status": {0: 1, 1: 2}}, {}, "callback rows left at status 0 or 2"),
        ({"callbacks_by_status": {2: 1}}, {}, "callback rows left at status 0 or 2"),
        ({"callbacks_by_status": {4: 1}}, {}, "callback rows given up (status 4)"),
        ({"ledger_by_currency": {"CNY": 5}}, {}, "ledger balanced per currency"),
        ({"unbalanced_ledger_events": 1}, {}, "ledger balanced per currency"),
        (
            {"ledger_events": {"pay_a": Counter({"PaymentRequested": 1, "PaymentConfirmed": 2})}},
            {},
            "payments whose ledger effects are not exactly once",
        ),
        (
            {"reviews": [{"id": 7, "kind": "conflicting_report", "payment_id": "pay_a", "reason": "?"}]},
            {},
            "manual-review items, each explained",
        ),
        ({"outbox_unsent": {"ChargeRequested": 1}}, {}, "outbox rows not sent (pending or dead)"),
        ({"deliveries_unsent": {"amqp": 3}}, {}, "domain events not delivered to their destinations"),
    ],
)
def test_each_core_row_fails_on_its_fault(db_changes, load_changes, row):
    assert row in _failing(core_rows(_db(**db_changes), _load(**load_changes), {}))


def test_an_explained_review_passes():
    db = _db(reviews=[{"id": 7, "kind": "unresolved_payment", "payment_id": "pay_a", "reason": "deadline"}])
    assert _failing(core_rows(db, _load(), {7: "past its deadline by design"})) == set()


def test_each_sandbox_row_fails_on_its_fault():
    db = _db()
    created = _load().created
    differ = _sandbox(charges=[{"id": "ch_a", "merchant_transaction_id": "pay_a", "status": "failed"}])
    assert "status equal to the sandbox's truth" in _failing(differ.rows(db, created))
    twice = _sandbox(multiple_charges=["pay_a"])
    assert "merchant numbers charged more than once at the sandbox" in _failing(twice.rows(db, created))
    wrong = _db(payments={"pay_a": _p("pay_a", "Succeeded", "ch_other"), "pay_b": _p("pay_b", "Failed", None)})
    assert "Succeeded payments whose provider transaction id is not the sandbox's" in _failing(
        _sandbox().rows(wrong, created)
    )
    lost = _db(callbacks_by_event={("sandbox", "evt_a"): Counter({1: 1}), ("sandbox", "evt_b"): Counter({3: 1})})
    assert "acknowledged deliveries missing from payment_callback_log" in _failing(_sandbox().rows(lost, created))


@pytest.mark.parametrize("category", UNEXPLAINED)
def test_the_reconciliation_row_fails_on_an_unexplained_item(category):
    mix = _sandbox()
    mix.reconciliations = [_reconciliation(), _reconciliation(**{category: 1})]
    assert _failing(mix.rows(_db(), _load().created)) == {"the reconciliation of the day has no unexplained item"}


def test_the_reconciliation_row_fails_when_no_run_completed():
    failed = _sandbox()
    failed.reconciliations = [{"date": "2024-03-01", "error": "reconcile: settlement file not available: http_503"}]
    none = _sandbox()
    none.reconciliations = []
    for mix in (failed, none):
        assert "the reconciliation of the day has no unexplained item" in _failing(mix.rows(_db(), _load().created))


def test_the_chain_row_fails_on_a_break_or_an_event_left_unsealed():
    broken = _sandbox()
    broken.chain = {"ok": False, "verified": 1, "first_break": {"seq": 2, "reason": "digest"}, "stale_unsealed": 0}
    unsealed = _sandbox()
    unsealed.chain = {"ok": False, "verified": 3, "first_break": None, "stale_unsealed": 4}
    for mix in (broken, unsealed):
        assert _failing(mix.rows(_db(), _load().created)) == {"ledger chain verifies"}


@pytest.mark.server
def test_the_chaos_command_line_names_its_options():
    answer = subprocess.run(
        [sys.executable, str(Path(ROOT, "bench", "chaos.py")), "--help"], capture_output=True, text=True, check=True
    )
    for option in ("--payments", "--concurrency", "--seed", "--database-url", "--amqp-url", "--json-out"):
        assert option in answer.stdout


# --- the refund rows can fail ---------------------------------------------------------------------------------


def _refund_load(*answers: RefundAnswer) -> RefundLoad:
    load = RefundLoad("http://127.0.0.1:1", "t", run_id="r", mix="sandbox", seed=1)
    load.answers = list(answers) or [
        RefundAnswer("rk_1", "pay_a", 30, 201, None, "re_1", replay_same=True),
        RefundAnswer("rk_2", "pay_a", 20, 201, None, "re_2"),
        RefundAnswer("rk_over", "pay_a", 51, 422, OVER_LIMIT, over_limit=True),
    ]
    load.candidates = 1
    load._done.set()
    return load


def _refund_db(**refunds) -> RefundDatabase:
    rows = {
        "re_1": {"refund_id": "re_1", "payment_id": "pay_a", "status": "Succeeded", "amount_minor": 30,
                 "provider_refund_id": "rf_1"},
        "re_2": {"refund_id": "re_2", "payment_id": "pay_a", "status": "Succeeded", "amount_minor": 20,
                 "provider_refund_id": "rf_2"},
    }  # fmt: skip
    for refund_id, changes in refunds.items():
        rows[refund_id] = {**rows.get(refund_id, {"refund_id": refund_id, "payment_id": "pay_a"}), **changes}
    ledger = {r: Counter({"RefundRequested": 1, "RefundConfirmed": 1}) for r in rows}
    return RefundDatabase(rows, ledger)


def _refund_truth(**changes) -> dict:
    truth = {
        "re_1": [{"id": "rf_1", "status": "succeeded", "amount": 30, "charge": "ch_a"}],
        "re_2": [{"id": "rf_2", "status": "succeeded", "amount": 20, "charge": "ch_a"}],
    }
    truth.update(changes)
    return truth


def test_clean_refunds_pass_every_refund_row():
    assert _failing(_refund_load().rows(_refund_db(), _db().payments, _refund_truth(), "sandbox")) == set()


@pytest.mark.parametrize(
    ("load", "db", "truth", "row"),
    [
        (_refund_load(RefundAnswer("rk_1", "pay_a", 30, 503, None)), _refund_db(), _refund_truth(),
         "refunds requested and answered 201"),
        (_refund_load(RefundAnswer("rk_1", "pay_a", 30, 201, None, "re_9")), _refund_db(), _refund_truth(),
         "acknowledged refunds missing from the refund table"),
        (_refund_load(RefundAnswer("rk_1", "pay_a", 30, 201, None, "re_1", replay_same=False)), _refund_db(),
         _refund_truth(), "refund replays naming the same refund"),
        (_refund_load(RefundAnswer("rk_over", "pay_a", 51, 201, None, "re_3", over_limit=True)), _refund_db(),
         _refund_truth(), "refunds over what is left refused (422 amount_exceeds_refundable)"),
        (_refund_load(), _refund_db(re_2={"status": "Unknown"}), _refund_truth(), "refunds terminal"),
        (_refund_load(), _refund_db(), _refund_truth(re_2=[{"id": "rf_2", "status": "failed", "charge": "ch_a"}]),
         "refund status equal to the platform's truth"),
        (_refund_load(), _refund_db(re_2={"provider_refund_id": "rf_other"}), _refund_truth(),
         "refund status equal to the platform's truth"),
        (_refund_load(), _refund_db(re_3={"status": "Succeeded", "amount_minor": 51}), _refund_truth(),
         "payments refunded more than they were charged (ours or the platform's books)"),
        (_refund_load(), _refund_db(),
         _refund_truth(re_x=[{"id": "rf_x", "status": "succeeded", "amount": 51, "charge": "ch_a"}]),
         "payments refunded more than they were charged (ours or the platform's books)"),
    ],
)  # fmt: skip
def test_each_refund_row_fails_on_its_fault(load, db, truth, row):
    assert row in _failing(load.rows(db, _db().payments, truth, "sandbox"))


def test_a_refund_booked_twice_fails_the_ledger_row():
    db = _refund_db()
    db.ledger["re_1"]["RefundConfirmed"] = 2
    failing = _failing(_refund_load().rows(db, _db().payments, _refund_truth(), "sandbox"))
    assert failing == {"refunds whose ledger effects are not exactly once"}
