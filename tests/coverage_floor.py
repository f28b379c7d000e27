"""Line coverage per package, checked against the floors in pyproject.toml ([tool.paysync.coverage_floor]).

Run after the suite has written ``.coverage`` (``make test`` does both):
``python -m tests.coverage_floor``. Prints lines and branches per package,
then fails (exit 1) naming each package whose line coverage is under its
floor. ``--record`` writes the measured values, rounded down, as the floors.
"""

from __future__ import annotations

import argparse
import math
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("payments", "gateway", "consumer", "compensator", "broker")


@dataclass
class Totals:
    """Statements and branches of one package, and how many of each ran."""

    statements: int = 0
    missing: int = 0
    branches: int = 0
    partial: int = 0

    @property
    def lines(self) -> float:
        return 100.0 * (self.statements - self.missing) / self.statements if self.statements else 100.0

    @property
    def branch(self) -> float:
        return 100.0 * (self.branches - self.partial) / self.branches if self.branches else 100.0


def measure(data_file: Path) -> dict[str, Totals]:
    """Totals per package from a coverage data file; files that never ran count with all their lines missed."""
    cov = coverage.Coverage(data_file=str(data_file), config_file=str(ROOT / "pyproject.toml"))
    cov.load()
    totals = {name: Totals() for name in PACKAGES}
    for path in sorted(ROOT.glob("*/**/*.py")):
        package = path.relative_to(ROOT).parts[0]
        if package not in totals:
            continue
        analysis = cov._analyze(str(path))  # noqa: SLF001 - the public analysis2 has no branch numbers
        numbers = analysis.numbers
        t = totals[package]
        t.statements += numbers.n_statements
        t.missing += numbers.n_missing
        t.branches += numbers.n_branches
        t.partial += numbers.n_missing_branches
    return totals


def floors() -> dict[str, int]:
    """The floors kept in pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get("paysync", {}).get("coverage_floor", {})


def record(totals: dict[str, Totals]) -> None:
    """Write the measured line coverage, rounded down, as the new floors."""
    path = ROOT / "pyproject.toml"
    head, sep, _ = path.read_text().partition("[tool.paysync.coverage_floor]")
    body = "".join(f"{name} = {math.floor(totals[name].lines)}\n" for name in PACKAGES)
    path.write_text(f"{head}{sep}\n{body}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-file", type=Path, default=ROOT / ".coverage")
    parser.add_argument("--record", action="store_true", help="write the measured values as the floors")
    args = parser.parse_args(argv)
    totals = measure(args.data_file)
    limits = floors()
    print(f"\n{'package':<12} {'lines':>7} {'missed':>7} {'line %':>7} {'branch %':>9} {'floor':>6}")
    below = []
    for name in PACKAGES:
        t = totals[name]
        floor = limits.get(name)
        print(
            f"{name:<12} {t.statements:>7} {t.missing:>7} {t.lines:>6.2f}% {t.branch:>8.2f}% "
            f"{'' if floor is None else str(floor) + '%':>6}"
        )
        if floor is not None and t.lines < floor:
            below.append(f"{name} {t.lines:.2f}% < {floor}%")
    if args.record:
        record(totals)
        print("floors recorded in pyproject.toml")
        return 0
    if below:
        print("coverage under the floor: " + ", ".join(below), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
