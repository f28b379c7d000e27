"""Alipay test kit: keys made with ``cryptography``, notifies built to the published rules, the fake gateway.

Notifies are signed with the fake platform's own signing code (``sandbox.fakes.alipay``), an implementation
independent of the adapter's, so a misreading of the rules on either side shows up as a failed verification.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from payments.providers.alipay import AlipayProvider
from sandbox.fakes.alipay import FakeAlipay, beijing_now, rsa2_sign, serve, sign_string

APP_ID = "2021000000000001"


@dataclass(frozen=True)
class Keys:
    """Key pairs for one test session, and their PEM files."""

    app: rsa.RSAPrivateKey
    """Ours: signs requests."""
    app_next: rsa.RSAPrivateKey
    alipay: rsa.RSAPrivateKey
    """The platform's: signs answers and notifies."""
    alipay_next: rsa.RSAPrivateKey
    """The platform's next key (rotation)."""
    stranger: rsa.RSAPrivateKey
    files: dict[str, str]
    """name → PEM path; ``<name>.pub`` for public halves."""


def _write(directory: Path, name: str, key: rsa.RSAPrivateKey) -> dict[str, str]:
    private = directory / f"{name}.pem"
    public = directory / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return {name: str(private), f"{name}.pub": str(public)}


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """Five fresh 2048-bit RSA key pairs, written as PEM files."""
    directory = tmp_path_factory.mktemp("alipay-keys")
    made = {n: rsa.generate_private_key(65537, 2048) for n in ("app", "app_next", "alipay", "alipay_next", "stranger")}
    files: dict[str, str] = {}
    for name, key in made.items():
        files.update(_write(directory, name, key))
    return Keys(**made, files=files)


def notify_fields(out_trade_no: str, **overrides: Any) -> dict[str, str]:
    """The fields of a TRADE_SUCCESS notify for ``out_trade_no`` (unsigned), as the documentation lists them."""
    fields = {
        "notify_time": beijing_now(),
        "notify_type": "trade_status_sync",
        "notify_id": f"ac05099524730693a8b330c5ecf72da9{time.monotonic_ns() % 10**6:06d}",
        "app_id": APP_ID,
        "auth_app_id": APP_ID,
        "charset": "utf-8",
        "version": "1.0",
        "sign_type": "RSA2",
        "trade_no": "2024011522001412345678901234",
        "out_trade_no": out_trade_no,
        "buyer_id": "2088102122524333",
        "seller_id": "2088101106499364",
        "trade_status": "TRADE_SUCCESS",
        "total_amount": "10.00",
        "receipt_amount": "10.00",
        "buyer_pay_amount": "10.00",
        "subject": "测试订单 & more+",
        "body": "",
        "gmt_create": beijing_now(),
        "gmt_payment": beijing_now(),
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    for key in [k for k, v in overrides.items() if v is None]:
        fields.pop(key, None)
    return fields


def signed_notify(fields: dict[str, str], key: rsa.RSAPrivateKey, *, charset: str = "utf-8") -> bytes:
    """The form body Alipay POSTs: the fields plus a sign over all but sign/sign_type (empty values left out)."""
    content = sign_string(fields, ["sign", "sign_type"])
    if charset == "utf-8":
        signature = rsa2_sign(key, content)
    else:  # the fake signs UTF-8 only; a GBK merchant's notify is signed over the GBK bytes
        import base64

        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import padding

        signature = base64.b64encode(key.sign(content.encode(charset), padding.PKCS1v15(), hashes.SHA256())).decode()
    return urllib.parse.urlencode({**fields, "sign": signature}, encoding=charset).encode("ascii")


@dataclass
class FakeServer:
    """A running fake gateway."""

    fake: FakeAlipay
    url: str
    """Base URL, e.g. http://127.0.0.1:PORT"""

    @property
    def gateway(self) -> str:
        """The openapi endpoint."""
        return self.url + "/gateway.do"

    def control(self, path: str, data: dict[str, Any] | None = None) -> Any:
        """POST (with data) or GET a /_fake/… control and return its JSON."""
        if data is None:
            return requests.get(f"{self.url}/_fake/{path}", timeout=5).json()
        return requests.post(f"{self.url}/_fake/{path}", json=data, timeout=5).json()


@pytest.fixture
def fake_alipay(keys: Keys) -> Iterator[FakeServer]:
    """The fake gateway on a free port, knowing our current and next app keys."""
    fake = FakeAlipay(APP_ID, [keys.app.public_key(), keys.app_next.public_key()], keys.alipay, retry_delays=(0.2, 0.4))
    server, thread = serve(fake)
    yield FakeServer(fake, f"http://127.0.0.1:{server.server_port}")
    server.shutdown()
    thread.join(5)
    fake.close()


def provider_for(
    keys: Keys, server: FakeServer | None = None, *, app: rsa.RSAPrivateKey | None = None, **kwargs: Any
) -> AlipayProvider:
    """An adapter with our app key, trusting the platform's key (plus any ``public_keys`` given)."""
    public_keys = kwargs.pop("public_keys", [keys.alipay.public_key()])
    gateway = kwargs.pop("gateway", None) or (server.gateway if server else "http://127.0.0.1:9/gateway.do")
    return AlipayProvider(APP_ID, app or keys.app, public_keys, gateway, **kwargs)
