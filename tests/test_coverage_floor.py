"""tests/coverage_floor.py: the per-package line coverage make test prints, and the floors it holds."""

from __future__ import annotations

import coverage

from tests import coverage_floor


def _data_file(tmp_path, executed: dict[str, set[int]]):
    path = tmp_path / ".coverage"
    data = coverage.CoverageData(basename=str(path))
    data.add_lines({str(coverage_floor.ROOT / name): lines for name, lines in executed.items()})
    data.write()
    return path


def test_a_package_under_its_floor_fails_and_is_named(tmp_path, monkeypatch, capsys):
    # Only two lines of one broker module ran: every package is far under a floor of 50%.
    path = _data_file(tmp_path, {"broker/__init__.py": {1, 2}})
    monkeypatch.setattr(coverage_floor, "PACKAGES", ("broker", "consumer"))  # the two smallest: analysis is slow
    monkeypatch.setattr(coverage_floor, "floors", lambda: {"broker": 50})
    assert coverage_floor.main(["--data-file", str(path)]) == 1
    assert "broker" in capsys.readouterr().err


def test_packages_at_or_over_their_floors_pass_and_every_package_is_printed(tmp_path, monkeypatch, capsys):
    path = _data_file(tmp_path, {"broker/__init__.py": {1, 2}})
    monkeypatch.setattr(coverage_floor, "PACKAGES", ("broker", "consumer"))
    monkeypatch.setattr(coverage_floor, "floors", lambda: {"broker": 0})
    assert coverage_floor.main(["--data-file", str(path)]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in coverage_floor.PACKAGES)


def test_the_floors_kept_in_pyproject_cover_every_package():
    assert set(coverage_floor.floors()) == set(coverage_floor.PACKAGES)
