"""The import graph between paysync's top-level packages, checked against the allowed edges.

    python -m tests.import_graph        (or: make import-graph)

prints which of our packages each one imports and exits 1 naming every
import (file:line) that breaks a rule:

- ``gateway``, ``consumer`` and ``compensator`` use ``payments`` and ``broker``,
  never one another;
- ``broker`` (the only package that imports pika) imports nothing of ours;
- ``payments`` imports nothing of ours but itself, and no framework (Flask,
  Werkzeug, gunicorn, pika, APScheduler);
- ``sandbox`` is an outside party: it imports nothing of ours.

Every import counts, also those inside functions. Read with ``ast``: nothing
is imported to find out.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = ("gateway", "consumer", "compensator", "payments", "broker", "sandbox")
"""Our top-level packages."""
ALLOWED = {
    "gateway": {"payments", "broker"},
    "consumer": {"payments", "broker"},
    "compensator": {"payments", "broker"},
    "broker": set(),
    "payments": set(),
    "sandbox": set(),
}
"""Which of our other packages each package may import."""
THIRD_PARTY_ONLY_IN = {
    "pika": {"broker"},
    "flask": {"gateway", "sandbox"},
    "werkzeug": {"gateway", "sandbox"},
    "gunicorn": {"gateway", "sandbox"},
    "apscheduler": {"compensator"},
}
"""Libraries that belong to one or two packages only."""


@dataclass(frozen=True)
class Edge:
    """One import of one module by a file of one of our packages."""

    package: str
    imported: str
    """Top-level name of what is imported."""
    path: str
    line: int


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Top-level names of every absolute import in ``path``, with their line numbers."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], node.lineno))
    return found


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import made by a file of one of our packages."""
    out = []
    for package in OURS:
        for path in sorted((root / package).rglob("*.py")):
            rel = str(path.relative_to(root))
            out += [Edge(package, name, rel, line) for name, line in imports_of(path)]
    return out


def violations(found: list[Edge]) -> list[str]:
    """A line per import that breaks a rule."""
    bad = []
    for e in found:
        if e.imported in OURS and e.imported != e.package and e.imported not in ALLOWED[e.package]:
            bad.append(f"{e.path}:{e.line}: {e.package} must not import {e.imported}")
        owners = THIRD_PARTY_ONLY_IN.get(e.imported)
        if owners is not None and e.package not in owners:
            bad.append(f"{e.path}:{e.line}: {e.imported} belongs in {' or '.join(sorted(owners))}, not {e.package}")
    return bad


def graph(found: list[Edge]) -> dict[str, set[str]]:
    """Our package -> the other packages of ours it imports."""
    out: dict[str, set[str]] = {p: set() for p in OURS}
    for e in found:
        if e.imported in OURS and e.imported != e.package:
            out[e.package].add(e.imported)
    return out


def main() -> int:
    """Print the graph and the violations; 0 when there are none."""
    found = edges()
    for package, targets in graph(found).items():
        print(f"{package:<12} -> {', '.join(sorted(targets)) or '(nothing of ours)'}")
    bad = violations(found)
    for line in bad:
        print(line)
    print(f"{len(bad)} forbidden import(s)" if bad else "import graph: every edge allowed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
