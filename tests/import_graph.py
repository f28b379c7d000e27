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

Inside ``payments/`` the wings stand on floors (``FLOORS``): a module imports
its own wing and the floors below it, never a floor above nor another wing of
its own floor, and no module imports itself back through others (a circle).
Every module of ``payments/`` belongs to a wing; the kernel (errors, states)
is the ground floor and the entry points (runtime, ``__main__``) the roof.

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


FLOORS: tuple[tuple[str, ...], ...] = (
    ("kernel",),
    ("infra",),
    ("providers", "money", "escalation"),
    ("lifecycle",),
    ("inbound", "reconciliation"),
    ("outbound",),
    ("ops",),
    ("top",),
)
"""The wings of ``payments/``, bottom floor first; a wing imports its own floor's modules only from itself."""
KERNEL = {"payments.errors", "payments.states"}
"""The ground floor: what every wing may name."""
TOP = {"payments", "payments.__main__", "payments.runtime"}
"""The roof: the start-up step and the command line, which put every wing together."""


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


def payments_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of ``payments/`` (migration revisions aside: Alembic loads them)."""
    found = {}
    for path in sorted((root / "payments").rglob("*.py")):
        rel = path.relative_to(root)
        if "versions" in rel.parts:
            continue
        found[".".join(rel.with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def module_edges(root: Path = ROOT) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of one module of payments/ by another.

    ``from payments.x import y`` names the module ``payments.x.y`` when that is
    a module, else ``payments.x``; a relative import is resolved against the
    importer's package.
    """
    modules = payments_modules(root)
    out = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # import payments.x.y.z: the module part of it
                    target = target.rpartition(".")[0]
                if target and target != name and target != "payments":
                    out.append((name, target, node.lineno))
    return out


def wing_of(module: str) -> str | None:
    """The wing a module of payments/ belongs to (``kernel``, ``top``, a subpackage's name), or None."""
    if module in KERNEL:
        return "kernel"
    if module in TOP:
        return "top"
    parts = module.split(".")
    wings = {w for floor in FLOORS for w in floor} - {"kernel", "top"}
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in wings) else None


def floor_of(wing: str) -> int:
    """Which floor a wing stands on (0: the kernel)."""
    return next(i for i, floor in enumerate(FLOORS) if wing in floor)


def circles(found: list[tuple[str, str, int]]) -> list[list[str]]:
    """Every circle of imports between modules (strongly connected parts of more than one module), sorted."""
    graph_: dict[str, set[str]] = {}
    for importer, imported, _ in found:
        graph_.setdefault(importer, set()).add(imported)
        graph_.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is a few hundred modules, recursion is shallow enough
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph_[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for node in sorted(graph_):
        if node not in index:
            visit(node)
    return sorted(parts)


def floor_violations(root: Path = ROOT) -> list[str]:
    """A line per module outside every wing, per import that runs upward or sideways, and per circle."""
    modules = payments_modules(root)
    found = module_edges(root)
    bad = [f"{modules[m].relative_to(root)}: in no wing of FLOORS" for m in modules if wing_of(m) is None]
    for importer, imported, line in found:
        a, b = wing_of(importer), wing_of(imported)
        if a is None or b is None or a == b:
            continue
        where = f"{modules[importer].relative_to(root)}:{line}"
        if floor_of(b) > floor_of(a):
            bad.append(f"{where}: {importer} ({a}) imports {imported} ({b}), a floor above")
        elif floor_of(b) == floor_of(a):
            bad.append(f"{where}: {importer} ({a}) imports {imported} ({b}), another wing of its floor")
    bad += [f"circle: {' -> '.join(part)}" for part in circles(found)]
    return bad


def wings_table(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """Wing -> (modules, lines), bottom floor first: the layout at a glance."""
    table: dict[str, tuple[int, int]] = {}
    for floor in FLOORS:
        for wing in floor:
            table[wing] = (0, 0)
    for module, path in payments_modules(root).items():
        wing = wing_of(module)
        if wing is not None:
            count, lines = table[wing]
            table[wing] = (count + 1, lines + len(path.read_text().splitlines()))
    return table


def main() -> int:
    """Print the graph, the floors of payments/ and the violations; 0 when there are none."""
    found = edges()
    for package, targets in graph(found).items():
        print(f"{package:<12} -> {', '.join(sorted(targets)) or '(nothing of ours)'}")
    print("payments/ floors, bottom first (wing: modules, lines):")
    for i, floor in enumerate(FLOORS):
        table = wings_table()
        print(f"  {i}: " + "; ".join(f"{w} {table[w][0]} ({table[w][1]})" for w in floor))
    bad = violations(found) + floor_violations()
    for line in bad:
        print(line)
    print(f"{len(bad)} forbidden import(s)" if bad else "import graph: every edge allowed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
