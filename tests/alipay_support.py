"""Alipay test kit: keys made with ``cryptography``, notifies built to the published rules, the fake gateway.

Notifies are signed with the fake platform's own signing code (``sandbox.fakes.alipay``), an implementation
independent of the adapter's, so a misreading of the rules on either side shows up as a failed verification.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from payments.providers.alipay.adapter import AlipayProvider
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


@dataclass(frozen=True)
class Certs:
    """Certificate mode's files, issued as Alipay issues them: Alipay's CA signs our key and its own."""

    app_cert: str
    """appCertPublicKey_<APPID>.crt: our app key's certificate."""
    alipay_cert: str
    """alipayCertPublicKey_RSA2.crt: the platform key's certificate, then the CA that issued it."""
    root_cert: str
    """alipayRootCert.crt: two RSA-signed roots and an ECDSA one (which alipay_root_cert_sn leaves out)."""
    stranger_cert: str
    """A certificate of a key that is not our app key."""


def _name(cn: str) -> x509.Name:
    # Alipay's issuer names are C, O, OU, CN (in that order in the certificate).
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COUNTRY_NAME, "CN"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Ant Financial"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, "Certification Authority"),
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
        ]
    )


def issue(subject: x509.Name, public_key: Any, issuer: x509.Name, signer: Any, serial: int | None = None) -> bytes:
    """A PEM certificate for ``public_key`` named ``subject``, signed by ``signer`` as ``issuer``."""
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(serial or x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=365))
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="session")
def certs(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A root chain file, an intermediate CA, and certificates of our app key and of the platform key."""
    directory = tmp_path_factory.mktemp("alipay-certs")
    root_key, class2_key = keys.stranger, rsa.generate_private_key(65537, 2048)
    ec_root_key = ec.generate_private_key(ec.SECP256R1())
    root, ec_root, second_root = (
        _name("Ant Financial Certification Authority R1"),
        _name("Ant Financial Certification Authority E1"),
        _name("iTrusChina Class 2 Root CA - G3"),
    )
    class2 = _name("Ant Financial Certification Authority Class 2 R1")
    ca_pem = issue(class2, class2_key.public_key(), root, root_key)
    files = {
        "root_cert": issue(root, root_key.public_key(), root, root_key)
        + issue(ec_root, ec_root_key.public_key(), ec_root, ec_root_key)
        + issue(second_root, keys.app_next.public_key(), second_root, keys.app_next),
        "app_cert": issue(_name(f"{APP_ID}-app"), keys.app.public_key(), class2, class2_key),
        "alipay_cert": issue(_name("支付宝(中国)网络技术有限公司-alipay"), keys.alipay.public_key(), class2, class2_key)
        + ca_pem,
        "stranger_cert": issue(_name("someone else"), keys.stranger.public_key(), class2, class2_key),
    }
    paths = {}
    for name, pem in files.items():
        path = directory / f"{name}.crt"
        path.write_bytes(pem)
        paths[name] = str(path)
    return Certs(**paths)


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
