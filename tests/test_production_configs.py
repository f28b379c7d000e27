"""Production accepts every valid configuration of each provider, and refuses weak or shared secrets by name.

The gateway is started as the Procfile starts it, in PAYSYNC_ENV=production,
with a complete configuration of one provider shaped like the real thing:
RSA-2048 keys and a platform certificate made here with ``cryptography``,
application ids, merchant numbers, certificate serials and keys of the
lengths and alphabets the platforms issue.
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from payments.errors import ConfigError
from payments.infra.settings import enabled_providers, load_settings
from payments.runtime import check_deployment
from tests.support import Proc, free_port, wait_until
from tests.wechatpay_support import make_keys

ALNUM = string.ascii_letters + string.digits


def random_text(n: int, alphabet: str = ALNUM) -> str:
    """``n`` random characters of ``alphabet`` (how platforms issue keys)."""
    return "".join(secrets.choice(alphabet) for _ in range(n))


def base_env(tmp_path: Path) -> dict[str, str]:
    """Production with strong role tokens, the sandbox off, a database of the test's own and no broker."""
    return {
        "PAYSYNC_ENV": "production",
        "MERCHANT_API_TOKEN": "mt_" + random_text(32),
        "OPS_TOKEN": "ops_" + random_text(32),
        "SANDBOX_WEBHOOK_SECRET": "",
        "SANDBOX_API_KEY": "",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'paysync.db'}",
        "AMQP_URL": "",
        "WEB_WORKERS": "1",
        "WEB_THREADS": "4",
    }


def _pem_private(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def alipay_env(tmp_path: Path) -> dict[str, str]:
    """A 16-digit APPID, our RSA2 application key and Alipay's public key (current and next) as PEM files."""
    ours = rsa.generate_private_key(65537, 2048)
    (tmp_path / "app_private_key.pem").write_bytes(_pem_private(ours))
    paths = []
    for name in ("alipay_public_key.pem", "alipay_public_key_next.pem"):
        theirs = rsa.generate_private_key(65537, 2048).public_key()
        pem = theirs.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        (tmp_path / name).write_bytes(pem)
        paths.append(str(tmp_path / name))
    return {
        "ALIPAY_APP_ID": "2021" + random_text(12, string.digits),
        "ALIPAY_APP_PRIVATE_KEY_FILE": str(tmp_path / "app_private_key.pem"),
        "ALIPAY_PUBLIC_KEY_FILES": ",".join(paths),
        "ALIPAY_NOTIFY_URL": "https://pay.example.com/callbacks/alipay",
    }


def wechatpay_env(tmp_path: Path) -> dict[str, str]:
    """Merchant number, APPID, a 32-character APIv3 key, our key and serial, a platform certificate and public key."""
    keys = make_keys(tmp_path / "wechatpay")
    return {
        "WECHATPAY_MCHID": "1" + random_text(9, string.digits),
        "WECHATPAY_APPID": "wx" + random_text(16, string.ascii_lowercase + string.digits),
        "WECHATPAY_APIV3_KEY": random_text(32),
        "WECHATPAY_MERCHANT_PRIVATE_KEY_FILE": str(keys.merchant_key_path),
        "WECHATPAY_MERCHANT_SERIAL": keys.merchant_serial,
        "WECHATPAY_PLATFORM_KEYS": ",".join(f"{p.key_id}={p.pem_path}" for p in (keys.cert_key, keys.pub_key)),
        "WECHATPAY_NOTIFY_URL": "https://pay.example.com/callbacks/wechatpay",
    }


def stripe_env(_tmp_path: Path) -> dict[str, str]:
    """A live secret key (sk_live_ and 24 alphanumerics, the issue's example) and two endpoint secrets."""
    return {
        "STRIPE_API_KEY": "sk_live_" + random_text(24),
        "STRIPE_WEBHOOK_SECRETS": f"whsec_{random_text(32)},whsec_{random_text(32)}",
    }


PROVIDER_ENVS = {"alipay": alipay_env, "wechatpay": wechatpay_env, "stripe": stripe_env}


@pytest.mark.parametrize("provider", sorted(PROVIDER_ENVS))
def test_production_accepts_a_full_configuration_of_each_provider(provider, tmp_path):
    settings = load_settings({**base_env(tmp_path), **PROVIDER_ENVS[provider](tmp_path)})
    assert enabled_providers(settings) == [provider]
    assert check_deployment(settings) is None


@pytest.mark.slow
@pytest.mark.parametrize("provider", sorted(PROVIDER_ENVS))
def test_the_gateway_starts_in_production_with_each_provider_and_is_ready(provider, tmp_path):
    port = free_port()
    env = {**base_env(tmp_path), **PROVIDER_ENVS[provider](tmp_path), "PORT": str(port)}
    web = Proc("web", env, tmp_path / "web.log")
    try:

        def ready() -> bool:
            assert web.popen.poll() is None, web.output()[-2000:]  # exited: the configuration was refused
            try:
                return requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except requests.ConnectionError:
                return False

        wait_until(ready, timeout=60, message=f"/readyz of a production gateway with {provider}")
        # The provider's route exists (a POST with nothing in it is stored and refused, not a 404).
        answer = requests.post(f"http://127.0.0.1:{port}/callbacks/{provider}", data=b"{}", timeout=5)
        assert answer.status_code != 404
    finally:
        web.stop()


# --- item 2: weak and shared secrets ------------------------------------------------------------------------

ROLE_TOKENS = ("MERCHANT_API_TOKEN", "OPS_TOKEN", "OPS_READONLY_TOKEN", "METRICS_TOKEN")


def strong_roles() -> dict[str, str]:
    return {name: name.lower()[:4] + "_" + random_text(32) for name in ROLE_TOKENS}


@pytest.mark.parametrize(("first", "second"), [(a, b) for i, a in enumerate(ROLE_TOKENS) for b in ROLE_TOKENS[i + 1 :]])
def test_production_refuses_two_roles_sharing_one_token_naming_the_setting_not_the_value(first, second, tmp_path):
    env = {**base_env(tmp_path), **strong_roles()}
    shared = env[first]
    env[second] = f"{env[second]},{shared}"  # shared in a rotation list counts too
    try:
        check_deployment(load_settings(env))
    except ConfigError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{first} and {second} share a token and production started")
    assert second in message and first in message
    assert shared not in message and shared[5:] not in message


def test_production_accepts_four_distinct_role_tokens(tmp_path):
    assert check_deployment(load_settings({**base_env(tmp_path), **strong_roles()})) is None


@pytest.mark.parametrize(
    "value",
    [
        "a" * 30,
        "abababababababababababab",
        "abcdefgabcdefgabcdefgabcdefg",  # 7 distinct
    ],
)
@pytest.mark.parametrize("variable", ["MERCHANT_API_TOKEN", "OPS_TOKEN", "METRICS_TOKEN", "STRIPE_WEBHOOK_SECRETS"])
def test_production_refuses_a_long_secret_with_too_little_variety(variable, value, tmp_path):
    env = {**base_env(tmp_path), **stripe_env(tmp_path)}
    env[variable] = ("whsec_" + value) if variable == "STRIPE_WEBHOOK_SECRETS" else value
    with pytest.raises(ConfigError) as caught:
        check_deployment(load_settings(env))
    message = str(caught.value)
    assert message.startswith(variable) and "distinct characters" in message
    assert value not in message


def test_development_warns_about_a_shared_token_instead_of_refusing(tmp_path):
    env = {**base_env(tmp_path), "PAYSYNC_ENV": "development"}
    env["OPS_TOKEN"] = env["MERCHANT_API_TOKEN"]
    warning = check_deployment(load_settings(env))
    assert warning and "OPS_TOKEN repeats a value of MERCHANT_API_TOKEN" in warning
    assert env["OPS_TOKEN"] not in warning
