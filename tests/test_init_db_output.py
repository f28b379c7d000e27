"""`python -m payments init-db` starts quietly: one line saying what it applied, no Alembic INFO lines unless asked."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from payments.infra.db import make_engine
from payments.infra.migrations import FIRST_REVISION, head_revision, script_directory, upgrade
from tests.support import ROOT, env_for

pytestmark = pytest.mark.server  # each test runs init-db as a process


def _init_db(url: str, *args: str, **settings: str) -> subprocess.CompletedProcess:
    env = env_for({"DATABASE_URL": url, "PAYSYNC_ENV": "development", "LOG_LEVEL": "INFO", **settings})
    return subprocess.run(
        [sys.executable, "-m", "payments", "init-db", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _log_lines(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_it_says_once_what_it_applied_and_then_that_it_is_at_head(tmp_path):
    url = f"sqlite:///{tmp_path / 'paysync.db'}"
    first = _init_db(url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [f"init-db: applied {FIRST_REVISION}..{head_revision()} to {url} (was empty)"]
    # Development's one warning about its defaults, and nothing of Alembic's (it logged ~25 INFO lines here).
    logged = _log_lines(first.stderr)
    assert [line["logger"] for line in logged] == ["paysync.paysync"], first.stderr
    assert logged[0]["level"] == "WARNING" and len(first.stderr.splitlines()) == 1, first.stderr

    again = _init_db(url)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"init-db: already at head {head_revision()} in {url}"]
    assert not any(line["logger"].startswith("alembic") for line in _log_lines(again.stderr)), again.stderr


def test_from_an_earlier_revision_it_names_the_revisions_it_applied(tmp_path):
    revisions = [rev.revision for rev in script_directory().walk_revisions()][::-1]
    earlier = revisions[-3]
    url = f"sqlite:///{tmp_path / 'paysync.db'}"
    engine = make_engine(url)
    try:
        upgrade(engine, target=earlier)
    finally:
        engine.dispose()
    done = _init_db(url)
    assert done.returncode == 0, done.stderr
    said = f"init-db: applied {revisions[-2]}..{revisions[-1]} to {url} (was at revision {earlier})"
    assert done.stdout.splitlines() == [said]


def test_verbose_or_log_level_debug_shows_alembics_own_lines(tmp_path):
    verbose = _init_db(f"sqlite:///{tmp_path / 'a.db'}", "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    running = [line["msg"] for line in _log_lines(verbose.stderr) if line["logger"] == "alembic.runtime.migration"]
    assert any(msg.startswith(f"Running upgrade  -> {FIRST_REVISION}") for msg in running), verbose.stderr
    assert len([msg for msg in running if msg.startswith("Running upgrade")]) == len(
        list(script_directory().walk_revisions())
    )
    assert verbose.stdout.startswith("init-db: applied "), verbose.stdout

    debug = _init_db(f"sqlite:///{tmp_path / 'b.db'}", LOG_LEVEL="DEBUG")
    assert debug.returncode == 0, debug.stderr
    assert any(line["logger"].startswith("alembic") for line in _log_lines(debug.stderr)), debug.stderr
