"""Production unless told otherwise: weak secrets stop every process; development says once what it uses."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from gateway import create_app
from payments.errors import ConfigError
from payments.infra.settings import enabled_providers, load_settings
from payments.providers import build_providers
from payments.runtime import check_deployment
from payments.states import CallbackStatus
from tests.stack import callback_rows, db_url
from tests.support import ROOT, env_for, free_port, procfile_command, sandbox_event, signed

STRONG = {
    "MERCHANT_API_TOKEN": "mt_Qm7rT2xK9vLw4pZs8nBc3hJd6fGy",
    "OPS_TOKEN": "ops_Hc5tW8qNz2mRx7kVb4sLp9dFj3gY",
    "SANDBOX_WEBHOOK_SECRET": "whsec_Zt4pK8wQm2xR7vLn9cBs3hJd6fGy",
    "SANDBOX_API_KEY": "sk_Rb6nW3qTz8mKx2vLp7sHc4dFj9gY",
}
WEAK = {
    "empty": "",
    "development default": None,  # filled in per variable below
    "short": "x" * 23,
    "short entry in a rotation list": "zW4k8QmT2xR7vLn9cBs3hJd6fGy" + ",q7x9k",
    "too little variety": "ab" * 15,
}
DEV_DEFAULT = {
    "MERCHANT_API_TOKEN": "dev-merchant-token",
    "OPS_TOKEN": "dev-ops-token",
    "SANDBOX_WEBHOOK_SECRET": "whsec_dev_sandbox",
    "SANDBOX_API_KEY": "sk_sandbox_dev_key",
}
SANDBOX_OFF = {"SANDBOX_WEBHOOK_SECRET": "", "SANDBOX_API_KEY": ""}
"""Neither of the sandbox's secrets: the provider is not enabled (one without the other is refused)."""
ENTRY_POINTS = {
    "gateway (gunicorn, Procfile web)": procfile_command("web"),
    "consumer": [sys.executable, "-m", "consumer"],
    "compensator": [sys.executable, "-m", "compensator"],
    "init-db": [sys.executable, "-m", "payments", "init-db"],
}


def production(**overrides: str) -> dict[str, str]:
    return {"PAYSYNC_ENV": "production", **STRONG, **overrides}


def weak_value(variable: str, kind: str) -> str:
    return DEV_DEFAULT[variable] if WEAK[kind] is None else WEAK[kind]


# --- the rule, on the settings alone ---------------------------------------------------------------------


# An empty provider secret beside a set one is a partly configured provider: refused too. Both empty
# disable the provider (tested below).
REFUSALS = [(variable, kind) for variable in sorted(STRONG) for kind in sorted(WEAK)]


@pytest.mark.parametrize(("variable", "kind"), REFUSALS)
def test_production_refuses_each_weak_secret_naming_it(variable, kind):
    value = weak_value(variable, kind)
    with pytest.raises(ConfigError) as caught:
        check_deployment(load_settings(production(**{variable: value})))
    message = str(caught.value)
    assert message.startswith(variable) and "\n" not in message
    for secret in [*STRONG.values(), *value.split(",")]:
        if len(secret) > 3:
            assert secret not in message  # the message names the variable, never the value


def test_production_accepts_strong_secrets_and_rotation_lists_of_them():
    new, old = "n_" + "Qm7rT2xK9vLw4pZs8nBc3h", "o_" + "Jd6fGyHc5tW8qNz2mRx7kV"
    settings = load_settings(production(MERCHANT_API_TOKEN=f"{new},{old}"))
    assert check_deployment(settings) is None
    assert settings.merchant_api_token == (new, old)


def test_development_fills_in_defaults_and_warns_once_listing_them():
    settings = load_settings({"PAYSYNC_ENV": "development"})
    assert settings.merchant_api_token == ("dev-merchant-token",)
    assert "sandbox" in enabled_providers(settings)
    warning = check_deployment(settings)
    assert warning is not None
    for variable in STRONG:
        assert variable in warning
    assert check_deployment(load_settings({"PAYSYNC_ENV": "development", **STRONG})) is None


def test_paysync_env_is_production_unless_it_says_development():
    assert load_settings({}).paysync_env == "production"
    assert load_settings({}).merchant_api_token == ()  # no development defaults in production
    with pytest.raises(ConfigError, match="PAYSYNC_ENV"):
        load_settings({"PAYSYNC_ENV": "staging"})


# --- providers exist only when configured ----------------------------------------------------------------


def test_the_sandbox_is_absent_in_production_without_its_secret():
    without = load_settings(production(**SANDBOX_OFF))
    assert check_deployment(without) is None
    assert "sandbox" not in build_providers(without)
    assert "sandbox" in build_providers(load_settings(production()))
    with pytest.raises(ConfigError, match="SANDBOX_WEBHOOK_SECRET and SANDBOX_API_KEY"):
        check_deployment(load_settings(production(**SANDBOX_OFF, SANDBOX_LEGACY_ENABLED="true")))


def test_a_provider_not_enabled_has_no_route_and_cannot_be_charged(engine):
    settings = load_settings(production(**SANDBOX_OFF, DATABASE_URL=db_url(engine)))
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event("pay_x"))
    answer = client.post("/callbacks/sandbox", data=body, headers=headers)
    assert answer.status_code == 404 and answer.get_json()["error"]["code"] == "unknown_provider"
    assert callback_rows(engine) == []
    created = client.post(
        "/payments",
        json={"order_no": "o-1", "amount": 100, "currency": "CNY", "provider": "sandbox"},
        headers={"Authorization": f"Bearer {STRONG['MERCHANT_API_TOKEN']}", "Idempotency-Key": "k-1"},
    )
    assert created.status_code == 400 and created.get_json()["error"]["code"] == "unknown_provider"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT COUNT(*) FROM payment").scalar() == 0


def test_an_enabled_provider_in_production_takes_callbacks_signed_with_its_secret(engine):
    # Not processed inline: the row as the gateway verified and stored it.
    settings = load_settings(production(DATABASE_URL=db_url(engine), CALLBACK_PROCESS_INLINE="false"))
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event("pay_x"), secret=STRONG["SANDBOX_WEBHOOK_SECRET"])
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
    assert [r.status for r in callback_rows(engine)] == [CallbackStatus.PENDING]


# --- every process, really started ----------------------------------------------------------------------


def _run(command: list[str], env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:  # noqa: ANN001
    database = f"sqlite:///{tmp_path / f'refuse-{uuid.uuid4().hex[:6]}.db'}"
    full = env_for({"DATABASE_URL": database, "AMQP_URL": "", "PORT": str(free_port()), **env})
    for name in STRONG:  # the test environment's own values must not leak in
        full.setdefault(name, "")
    full.update(env)
    return subprocess.run(command, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.slow
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("variable", sorted(STRONG))
def test_every_process_refuses_to_start_in_production_with_a_weak_secret(entry, variable, tmp_path):
    kind = "development default" if variable.startswith("SANDBOX_") else "empty"
    done = _run(ENTRY_POINTS[entry], production(**{variable: weak_value(variable, kind)}), tmp_path)
    assert done.returncode == 2, (done.returncode, done.stdout[-500:], done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-2000:]
    assert variable in lines[0] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_development_starts_with_one_warning_listing_the_defaults(tmp_path):
    done = _run(ENTRY_POINTS["init-db"], {"PAYSYNC_ENV": "development"}, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "PAYSYNC_ENV=development" in line]
    assert len(warnings) == 1, done.stderr[-2000:]
    assert all(variable in warnings[0] for variable in STRONG)


@pytest.mark.slow
def test_production_with_strong_secrets_starts(tmp_path):
    done = _run(ENTRY_POINTS["init-db"], production(), tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PAYSYNC_ENV=development" not in done.stderr
