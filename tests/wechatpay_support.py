"""WeChat Pay test kit: keys generated with ``cryptography``, the fake platform on a real socket, notifications.

The notifications are built with the fake platform's own signing and
encryption (``sandbox.fakes.wechatpay``), an implementation independent of
the adapter's, so a shared misreading of the protocol would have to be made
twice to go unseen.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from werkzeug.serving import WSGIRequestHandler, make_server

from payments.infra.settings import Settings
from sandbox.fakes import wechatpay as fake
from tests.support import make_settings

MCHID = "1900000109"
APPID = "wxd678efh567hg6787"


@dataclass(frozen=True)
class PlatformKeyFiles:
    """One platform key: its id, its private key (the fake signs with it), and the PEM file paysync reads."""

    key_id: str
    private_key: rsa.RSAPrivateKey
    pem_path: Path


@dataclass(frozen=True)
class Keys:
    """A merchant and its platform keys, on disk."""

    directory: Path
    apiv3_key: str
    merchant_key: rsa.RSAPrivateKey
    merchant_key_path: Path
    merchant_serial: str
    cert_key: PlatformKeyFiles
    """A platform certificate (ID = its hex serial)."""
    pub_key: PlatformKeyFiles
    """A platform public key (ID = PUB_KEY_ID_…)."""
    stranger: PlatformKeyFiles
    """A key paysync is never told about."""


def _pem_private(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _pem_public(key: rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def make_keys(directory: Path) -> Keys:
    """Generate RSA-2048 keys: merchant, a certificate platform key, a PUB_KEY_ID platform key, a stranger."""
    directory.mkdir(parents=True, exist_ok=True)
    new = [rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in range(4)]
    merchant, cert_key, pub_key, stranger = new
    merchant_path = directory / "apiclient_key.pem"
    merchant_path.write_bytes(_pem_private(merchant))
    serial = secrets.randbits(150) | (1 << 149)
    cert_path = directory / "wechatpay_platform.pem"
    cert_path.write_bytes(fake.certificate(cert_key, serial, "Tenpay.com Root CA"))
    pub_path = directory / "pub_key.pem"
    pub_path.write_bytes(_pem_public(pub_key))
    stranger_path = directory / "stranger.pem"
    stranger_path.write_bytes(_pem_public(stranger))
    return Keys(
        directory=directory,
        apiv3_key=secrets.token_hex(16),
        merchant_key=merchant,
        merchant_key_path=merchant_path,
        merchant_serial=f"{secrets.randbits(160):040X}",
        cert_key=PlatformKeyFiles(f"{serial:X}", cert_key, cert_path),
        pub_key=PlatformKeyFiles(f"PUB_KEY_ID_{secrets.randbelow(10**20):020d}", pub_key, pub_path),
        stranger=PlatformKeyFiles(f"PUB_KEY_ID_{secrets.randbelow(10**20):020d}", stranger, stranger_path),
    )


@pytest.fixture(scope="session")
def wx_keys(tmp_path_factory) -> Keys:  # noqa: ANN001
    """One key set for the session (RSA key generation is the slow part)."""
    return make_keys(tmp_path_factory.mktemp("wechatpay-keys"))


def wx_settings(
    keys: Keys,
    *,
    api_base: str = "http://127.0.0.1:9",
    notify_url: str = "http://127.0.0.1:9/callbacks/wechatpay",
    platform: tuple[PlatformKeyFiles, ...] | None = None,
    **overrides: Any,
) -> Settings:
    """Settings with WeChat Pay configured for ``keys`` (both platform keys, unless ``platform`` says which)."""
    platform = platform if platform is not None else (keys.cert_key, keys.pub_key)
    return replace(
        make_settings(**overrides),
        wechatpay_mchid=MCHID,
        wechatpay_appid=APPID,
        wechatpay_apiv3_key=keys.apiv3_key,
        wechatpay_merchant_private_key_file=str(keys.merchant_key_path),
        wechatpay_merchant_serial=keys.merchant_serial,
        wechatpay_platform_keys=tuple((p.key_id, str(p.pem_path)) for p in platform),
        wechatpay_api_base=api_base,
        wechatpay_notify_url=notify_url,
    )


def fake_config(
    keys: Keys, *, signing: tuple[PlatformKeyFiles, ...] | None = None, **overrides: Any
) -> fake.FakeConfig:
    """The fake platform's view of the same merchant (it signs with ``signing``, the first one active)."""
    signing = signing if signing is not None else (keys.cert_key, keys.pub_key, keys.stranger)
    config = fake.FakeConfig(
        mchid=MCHID,
        appid=APPID,
        apiv3_key=keys.apiv3_key.encode(),
        merchant_public_key=keys.merchant_key.public_key(),
        merchant_serial=keys.merchant_serial,
        platform_keys=[(p.key_id, p.private_key) for p in signing],
        notify_max_attempts=3,
        notify_backoff_scale=0.002,
    )
    return replace(config, **overrides)


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


def serve(app: Any) -> Any:
    """A threaded werkzeug server for ``app`` on a free port (not started)."""
    return make_server("127.0.0.1", 0, app, threaded=True, request_handler=_Quiet)


class FakeServer:
    """The fake platform served by werkzeug on a free port, in a thread of this process."""

    def __init__(self, platform: fake.FakeWechatPay) -> None:
        self.platform = platform
        self.server = serve(platform.app())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        self.platform.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.platform.stop()
        self.server.shutdown()
        self.server.server_close()


def transaction(
    out_trade_no: str,
    *,
    total: int = 1000,
    trade_state: str = "SUCCESS",
    transaction_id: str | None = "4200000001202405011234567890",
    mchid: str = MCHID,
    appid: str = APPID,
    **extra: Any,
) -> dict[str, Any]:
    """A decrypted TRANSACTION.* resource, as the notification guide shows it."""
    body: dict[str, Any] = {
        "appid": appid,
        "mchid": mchid,
        "out_trade_no": out_trade_no,
        "transaction_id": transaction_id,
        "trade_type": "NATIVE",
        "trade_state": trade_state,
        "trade_state_desc": "支付成功",
        "bank_type": "OTHERS",
        "attach": "",
        "success_time": "2024-05-01T10:00:00+08:00",
        "payer": {"openid": "oUpF8uMuAJO_M2pxb1Q9zNjWeS6o"},
        "amount": {"total": total, "payer_total": total, "currency": "CNY", "payer_currency": "CNY"},
    }
    body.update(extra)
    return body


def refund_resource(
    out_refund_no: str, out_trade_no: str, *, refund: int = 400, total: int = 1000, status: str = "SUCCESS"
) -> dict[str, Any]:
    """A decrypted REFUND.* resource."""
    return {
        "mchid": MCHID,
        "out_trade_no": out_trade_no,
        "transaction_id": "4200000001202405011234567890",
        "out_refund_no": out_refund_no,
        "refund_id": "50000000382019052709732678859",
        "refund_status": status,
        "success_time": "2024-05-01T11:00:00+08:00",
        "user_received_account": "招商银行信用卡0403",
        "amount": {"total": total, "refund": refund, "payer_total": total, "payer_refund": refund},
    }


def notification(
    keys: Keys,
    resource: dict[str, Any],
    *,
    event_type: str = "TRANSACTION.SUCCESS",
    signer: PlatformKeyFiles | None = None,
    timestamp: float | None = None,
    event_id: str | None = None,
    apiv3_key: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of a notification signed by ``signer`` (the certificate key by default)."""
    signer = signer or keys.cert_key
    original = "refund" if event_type.startswith("REFUND.") else "transaction"
    plaintext = json.dumps(resource, ensure_ascii=False).encode()
    body = {
        "id": event_id or f"{secrets.token_hex(4)}-be04-5c9b-b022-{secrets.token_hex(6)}",
        "create_time": "2024-05-01T10:00:01+08:00",
        "resource_type": "encrypt-resource",
        "event_type": event_type,
        "summary": "支付成功",
        "resource": fake.encrypt_resource((apiv3_key or keys.apiv3_key).encode(), plaintext, original, original),
    }
    raw = json.dumps(body, ensure_ascii=False).encode()
    headers = fake.signature_headers(
        signer.key_id, signer.private_key, raw, time.time() if timestamp is None else timestamp
    )
    headers.update({"Wechatpay-Signature-Type": fake.SCHEME, "Content-Type": "application/json"})
    return raw, headers
