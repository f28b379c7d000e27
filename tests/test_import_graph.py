"""The import graph holds (``python -m tests.import_graph``), and the checker would see a break."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests import import_graph
from tests.import_graph import OURS, ROOT, edges, graph, violations


def test_every_import_between_our_packages_is_an_allowed_edge():
    assert violations(edges()) == []


def test_the_graph_is_the_intended_shape():
    assert graph(edges()) == {
        "gateway": {"payments", "broker"},
        "consumer": {"payments", "broker"},
        "compensator": {"payments", "broker"},
        "payments": set(),
        "broker": set(),
        "sandbox": set(),
    }


def test_the_fake_provider_platforms_are_read_too_and_import_nothing_of_ours():
    # sandbox/fakes/ are outside parties like the sandbox: the check must walk into them.
    found = [e for e in edges() if e.path.startswith("sandbox/fakes/")]
    assert {e.path for e in found} >= {
        "sandbox/fakes/alipay.py",
        "sandbox/fakes/stripe.py",
        "sandbox/fakes/wechatpay.py",
    }
    assert not {e.imported for e in found} & set(OURS) - {"sandbox"}


def test_pika_is_imported_by_broker_alone():
    assert {e.package for e in edges() if e.imported == "pika"} == {"broker"}


def _tree(tmp_path, files: dict[str, str]):
    for package in OURS:
        (tmp_path / package).mkdir()
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return edges(tmp_path)


def test_the_checker_names_each_forbidden_import_with_its_place(tmp_path):
    found = _tree(
        tmp_path,
        {
            "payments/core.py": "import os\nfrom sandbox import signing\n",
            "sandbox/app.py": "def f():\n    from payments.infra.ids import new_id\n",  # inside a function counts too
            "gateway/x.py": (
                "from consumer.handler import handle\nimport payments.infra.db\nfrom broker import publisher\n"
            ),
            "compensator/y.py": "import pika.exceptions\n",
            "payments/z.py": "from flask import Flask\nfrom . import core\n",
            "sandbox/fakes/f.py": "import flask\nfrom payments.providers import stripe_sign\n",
        },
    )
    assert sorted(violations(found)) == [
        "compensator/y.py:1: pika belongs in broker, not compensator",
        "gateway/x.py:1: gateway must not import consumer",
        "payments/core.py:2: payments must not import sandbox",
        "payments/z.py:1: flask belongs in gateway or sandbox, not payments",
        "sandbox/app.py:2: sandbox must not import payments",
        "sandbox/fakes/f.py:2: sandbox must not import payments",
    ]


def test_the_command_prints_the_graph_and_succeeds():
    done = subprocess.run(
        [sys.executable, "-m", "tests.import_graph"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gateway      -> broker, payments" in done.stdout
    assert "import graph: every edge allowed" in done.stdout
    assert import_graph.main.__doc__


def test_payments_floors_hold_no_upward_or_sideways_import_and_no_circle():
    assert import_graph.floor_violations() == []


def test_every_module_of_payments_is_in_a_wing_and_the_kernel_is_the_ground_floor():
    modules = import_graph.payments_modules()
    assert {m for m in modules if import_graph.wing_of(m) is None} == set()
    assert {m for m in modules if import_graph.wing_of(m) == "kernel"} == {"payments.errors", "payments.states"}
    # The kernel imports nothing of payments: every wing may stand on it.
    assert [e for e in import_graph.module_edges() if import_graph.wing_of(e[0]) == "kernel"] == []
    assert import_graph.floor_of("kernel") == 0
    assert import_graph.floor_of("top") == len(import_graph.FLOORS) - 1


def test_every_wing_says_in_its_docstring_what_it_owns_and_what_it_may_import():
    for floor in import_graph.FLOORS:
        for wing in set(floor) - {"kernel", "top"}:
            init = ROOT / "payments" / wing / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init} has no docstring"
            assert "import" in doc, f"{init}: say what the wing may import"


def test_the_floor_checker_names_upward_and_sideways_imports_circles_and_modules_outside_every_wing(tmp_path):
    files = {
        "payments/__init__.py": "",
        "payments/errors.py": "",
        "payments/states.py": "from payments import errors\n",  # the kernel among itself: allowed
        "payments/infra/__init__.py": "",
        "payments/infra/settings.py": "def f():\n    from payments.providers.acme import adapter\n",  # upward
        "payments/infra/db.py": "import payments.infra.schema\n",
        "payments/infra/schema.py": "from payments.infra import db\n",  # db <-> schema: a circle
        "payments/providers/__init__.py": "",
        "payments/providers/acme/__init__.py": "",
        "payments/providers/acme/adapter.py": "from payments.states import PaymentStatus\nfrom ..base import X\n",
        "payments/providers/base.py": "from payments.money.ledger import post\n",  # sideways, same floor
        "payments/money/__init__.py": "",
        "payments/money/ledger.py": "from payments.infra.schema import ledger_event\n",
        "payments/loose.py": "",  # a module left flat, in no wing
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert import_graph.floor_violations(tmp_path) == [
        "payments/loose.py: in no wing of FLOORS",
        "payments/infra/settings.py:2: payments.infra.settings (infra) imports payments.providers.acme.adapter "
        "(providers), a floor above",
        "payments/providers/base.py:1: payments.providers.base (providers) imports payments.money.ledger (money), "
        "another wing of its floor",
        "circle: payments.infra.db -> payments.infra.schema",
    ]


def test_the_command_prints_the_floors_with_their_modules():
    done = subprocess.run(
        [sys.executable, "-m", "tests.import_graph"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert "payments/ floors, bottom first" in done.stdout
    assert "  0: kernel 2 (" in done.stdout
