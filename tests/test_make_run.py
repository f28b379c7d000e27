"""``make run``: the sandbox calls back to the gateway's real port, the gateway binds loopback in development,
and the banner says what is bound, where the ops console is and how to log in.

The Makefile is read with ``make -n`` (nothing runs, the shared venv is not touched); the lines it would run
are then run by ``sh`` with honcho replaced by a print of the environment honcho would pass on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HONCHO = ".venv/bin/honcho start -p"

pytestmark = pytest.mark.fast


def _planned(*args: str, env: dict[str, str] | None = None) -> list[str]:
    """The shell lines ``make run`` would run after the venv is ready (continuations joined)."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", "run", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        check=True,
    )
    text = done.stdout.replace("\\\n", " ")
    lines = text.splitlines()
    return lines[lines.index("mkdir -p var") + 1 :]


def _banner(lines: list[str], env: dict[str, str] | None = None) -> str:
    echoes = "\n".join(line for line in lines if line.startswith("echo "))
    clean = {k: v for k, v in os.environ.items() if k not in ("OPS_TOKEN", "DATABASE_URL", "AMQP_URL")}
    return subprocess.run(["sh", "-c", echoes], capture_output=True, text=True, env={**clean, **(env or {})}).stdout


def _honcho_env(lines: list[str]) -> dict[str, str]:
    """The environment the honcho line hands its processes (honcho itself replaced by a print of it)."""
    (line,) = [line for line in lines if HONCHO in line]
    dump = f"{sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))' #"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "WEB_BIND"))}
    done = subprocess.run(
        ["sh", "-c", line.replace(HONCHO, dump)], cwd=ROOT, capture_output=True, text=True, env=clean, check=True
    )
    return json.loads(done.stdout)


def test_a_custom_port_and_sandbox_port_are_the_ones_the_sandbox_and_gateway_call():
    from payments.infra.settings import load_settings
    from sandbox.config import load_settings as load_sandbox

    env = _honcho_env(_planned("PORT=8123", "SANDBOX_PORT=8223"))
    assert load_sandbox(env).callback_url == "http://127.0.0.1:8123/callbacks/sandbox"
    assert load_sandbox(env).port == 8223
    assert load_settings(env).sandbox_api_url == "http://127.0.0.1:8223"


def test_the_gateway_binds_loopback_unless_asked_and_the_banner_says_so():
    lines = _planned("PORT=8123")
    env = _honcho_env(lines)
    assert env["WEB_BIND_ADDRESS"] == "127.0.0.1"
    banner = _banner(lines)
    assert "http://127.0.0.1:8123   (listening on 127.0.0.1;" in banner
    assert "0.0.0.0" not in banner

    lines = _planned("PORT=8123", "BIND=0.0.0.0")
    assert _honcho_env(lines)["WEB_BIND_ADDRESS"] == "0.0.0.0"
    assert "(listening on 0.0.0.0;" in _banner(lines)


def test_the_banner_names_the_console_and_how_to_log_in_without_printing_a_real_token():
    lines = _planned("PORT=8123")
    banner = _banner(lines)
    assert "console  http://127.0.0.1:8123/ops/" in banner
    assert "dev-ops-token" in banner
    mine = _banner(lines, {"OPS_TOKEN": "a-real-token-of-mine"})
    assert "your OPS_TOKEN" in mine and "a-real-token-of-mine" not in mine and "dev-ops-token" not in mine


def _bind(tmp_path: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("WEB_BIND_ADDRESS", "PAYSYNC_ENV", "PORT")}
    done = subprocess.run(
        [sys.executable, "-c", "import gateway.gunicorn_conf as c; print(c.bind)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**clean, "WEB_METRICS_DIR": str(tmp_path), "PAYSYNC_ENV": "development", **env},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_gunicorn_binds_loopback_in_development_and_where_asked(tmp_path):
    assert _bind(tmp_path, PORT="8123") == "127.0.0.1:8123"
    assert _bind(tmp_path, PORT="8123", WEB_BIND_ADDRESS="0.0.0.0") == "0.0.0.0:8123"


def test_production_binds_every_address_unless_asked():
    from tests.support import make_settings

    assert make_settings(paysync_env="production").gateway_bind_address == "0.0.0.0"
    assert make_settings(paysync_env="production", web_bind_address="10.1.2.3").gateway_bind_address == "10.1.2.3"
