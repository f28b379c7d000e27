"""The import graph holds (``python -m tests.import_graph``), and the checker would see a break."""

from __future__ import annotations

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
            "gateway/x.py": "from consumer.handler import handle\nimport payments.infra.db\nfrom broker import publisher\n",
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
