"""The statement budget: per POST /payments, relay send and callback, MariaDB round trips stay within the budget file.

``bench/statements.py`` counts every round trip at the driver, each path warmed up first; the most each may take is
``bench/statement_budget.toml``. A count past its budget fails with the statements listed, so the change that added
one can be read off the failure.
"""

from __future__ import annotations

import sys

import pytest

from tests.sandbox_process import sandbox, sandbox_process  # noqa: F401
from tests.support import ROOT, make_settings

sys.path.append(str(ROOT / "bench"))
import statements  # noqa: E402  (bench/statements.py)

TOKEN = "test-merchant-token"


@pytest.fixture
def counts(mariadb, sandbox):  # noqa: F811
    settings = make_settings(
        database_url=mariadb.url.render_as_string(hide_password=False),
        sandbox_api_url=sandbox.url,
        merchant_api_token=(TOKEN,),
        provider_timeout_seconds=5.0,
    )
    return statements.measure(settings, mariadb)


@pytest.mark.mariadb
def test_no_path_sends_more_statements_than_its_budget(counts):
    reports = statements.over_budget(counts, statements.load_budget())
    assert not reports, "statement budget exceeded (bench/statement_budget.toml):\n" + "\n\n".join(reports)


@pytest.mark.mariadb
def test_every_path_is_counted_commits_and_the_raw_driver_insert_included(counts):
    assert set(counts) == set(statements.PATHS)
    for name, counted in counts.items():
        assert counted.count > 0, name
        assert "COMMIT" in counted.statements, f"{name} commits nothing? {counted.statements}"
    # The callback INSERT goes to the DBAPI connection itself (payments.infra.db.DriverStatement), past SQLAlchemy's
    # events.
    assert any(s.startswith("INSERT INTO payment_callback_log") for s in counts["callback_ingest"].statements)
    assert any(s.startswith("INSERT INTO payment") for s in counts["post_payment"].statements)


def test_a_count_past_its_budget_is_reported_with_its_statements():
    counted = {name: statements.Counted([f"SELECT {n}" for n in range(3)]) for name in statements.PATHS}
    budget = dict.fromkeys(statements.PATHS, 3)
    assert statements.over_budget(counted, budget) == []
    budget["relay_send"] = 2
    (report,) = statements.over_budget(counted, budget)
    assert report.startswith("relay_send: 3 statements, budget 2:") and "3. SELECT 2" in report


def test_the_budget_file_names_every_path_and_nothing_else(tmp_path):
    assert set(statements.load_budget()) == set(statements.PATHS)
    bad = tmp_path / "budget.toml"
    bad.write_text("[statements]\npost_payment = 1\n")
    with pytest.raises(ValueError, match="relay_send"):
        statements.load_budget(bad)
