"""WeChat Pay v3 signatures, pure: our request signatures as WeChat checks them, its signatures as we check them.

The other side of every check is the fake platform's own implementation
(``sandbox.fakes.wechatpay``), written separately from the documentation.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.wechatpay_support

from __future__ import annotations

import base64
import json
import time

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.errors import ConfigError
from payments.infra.sources import source_allowed
from payments.providers.wechatpay import sign
from payments.providers.wechatpay.adapter import load_config, validate
from sandbox.fakes import wechatpay as fake
from tests.wechatpay_support import MCHID, make_keys, wx_keys, wx_settings  # noqa: F401

NOW = 1_714_528_800.0


def keyring(keys, *which):  # noqa: ANN001, ANN201
    return sign.PlatformKeys(
        [sign.load_platform_key(p.key_id, p.pem_path.read_bytes()) for p in (which or (keys.cert_key, keys.pub_key))]
    )


def signed(keys, body: bytes, signer=None, now: float = NOW):  # noqa: ANN001, ANN201
    signer = signer or keys.cert_key
    return fake.signature_headers(signer.key_id, signer.private_key, body, now)


# --------------------------------------------------------------------------------------------- requests


def test_the_request_signature_string_is_five_lines_each_ending_in_a_newline():
    message = sign.request_message("get", "/v3/certificates", "1554208460", "593BEC0C930BF1AFEB40B4A08C8FB242", b"")
    assert message == b"GET\n/v3/certificates\n1554208460\n593BEC0C930BF1AFEB40B4A08C8FB242\n\n"


def test_our_authorization_header_is_what_the_fake_platform_parses_and_verifies(wx_keys):
    body = json.dumps({"mchid": MCHID, "描述": "测试"}, ensure_ascii=False, separators=(",", ":")).encode()
    path = "/v3/pay/transactions/out-trade-no/pay_1234567?mchid=1900000109"
    value = sign.authorization(
        mchid=MCHID,
        serial_no=wx_keys.merchant_serial,
        private_key=wx_keys.merchant_key,
        method="POST",
        path=path,
        body=body,
        timestamp="1714528800",
        nonce="N0NCE",
    )
    assert value.startswith('WECHATPAY2-SHA256-RSA2048 mchid="1900000109",nonce_str="N0NCE",signature="')
    params = fake.parse_authorization(value)
    assert params is not None and set(params) == {"mchid", "nonce_str", "signature", "timestamp", "serial_no"}
    assert params["serial_no"] == wx_keys.merchant_serial and params["timestamp"] == "1714528800"
    message = f"POST\n{path}\n1714528800\nN0NCE\n".encode() + body + b"\n"
    wx_keys.merchant_key.public_key().verify(
        base64.b64decode(params["signature"]), message, padding.PKCS1v15(), hashes.SHA256()
    )


# --------------------------------------------------------------------------------------------- verification


def test_both_key_schemes_verify_and_the_key_used_is_named(wx_keys):
    keys = keyring(wx_keys)
    body = b'{"code_url":"weixin://wxpay/bizpayurl?pr=p4lpSuKzz"}'
    assert sign.verify(signed(wx_keys, body), body, keys, NOW) == wx_keys.cert_key.key_id
    assert sign.verify(signed(wx_keys, body, wx_keys.pub_key), body, keys, NOW) == wx_keys.pub_key.key_id


def test_header_names_and_certificate_serials_are_case_insensitive(wx_keys):
    body = b"{}"
    headers = {k.lower(): v for k, v in signed(wx_keys, body).items()}
    headers["wechatpay-serial"] = headers["wechatpay-serial"].lower()
    assert sign.verify(headers, body, keyring(wx_keys), NOW) == wx_keys.cert_key.key_id
    upper = {k.upper(): v for k, v in signed(wx_keys, body, wx_keys.pub_key).items()}
    assert sign.verify(upper, body, keyring(wx_keys), NOW) == wx_keys.pub_key.key_id


@pytest.mark.parametrize("skew", [-301, 301, -3600, 86400])
def test_a_timestamp_more_than_five_minutes_off_either_way_is_refused(wx_keys, skew):
    body = b"{}"
    with pytest.raises(sign.StaleTimestamp):
        sign.verify(signed(wx_keys, body, now=NOW + skew), body, keyring(wx_keys), NOW)


@pytest.mark.parametrize("skew", [-300, 0, 300])
def test_five_minutes_either_way_is_still_accepted(wx_keys, skew):
    body = b"{}"
    sign.verify(signed(wx_keys, body, now=NOW + skew), body, keyring(wx_keys), NOW)


def test_an_unknown_serial_is_refused_without_looking_anywhere_else(wx_keys):
    body = b"{}"
    with pytest.raises(sign.UnknownSerial):
        sign.verify(signed(wx_keys, body, wx_keys.stranger), body, keyring(wx_keys), NOW)


def test_a_known_serial_with_another_keys_signature_is_refused(wx_keys):
    body = b"{}"
    headers = signed(wx_keys, body, wx_keys.stranger)
    headers["Wechatpay-Serial"] = wx_keys.pub_key.key_id
    with pytest.raises(sign.BadSignature):
        sign.verify(headers, body, keyring(wx_keys), NOW)


def test_signtest_probes_are_refused_as_probes(wx_keys):
    body = b"{}"
    headers = signed(wx_keys, body)
    headers["Wechatpay-Signature"] = "WECHATPAY/SIGNTEST/" + headers["Wechatpay-Signature"]
    with pytest.raises(sign.ProbeSignature):
        sign.verify(headers, body, keyring(wx_keys), NOW)


@pytest.mark.parametrize(
    "missing", ["Wechatpay-Timestamp", "Wechatpay-Nonce", "Wechatpay-Signature", "Wechatpay-Serial"]
)
def test_each_missing_header_is_named(wx_keys, missing):
    body = b"{}"
    headers = signed(wx_keys, body)
    del headers[missing]
    with pytest.raises(sign.MissingHeader, match=missing):
        sign.verify(headers, body, keyring(wx_keys), NOW)


def test_garbage_signature_timestamp_and_type_are_refused(wx_keys):
    body = b"{}"
    for name, value in [
        ("Wechatpay-Signature", "not base64 at all!"),
        ("Wechatpay-Timestamp", "12e3"),
        ("Wechatpay-Signature-Type", "WECHATPAY2-SM2-WITH-SM3"),
    ]:
        headers = {**signed(wx_keys, body), name: value}
        with pytest.raises(sign.BadSignature):
            sign.verify(headers, body, keyring(wx_keys), NOW)


@settings(max_examples=40, deadline=None)
@given(body=st.binary(max_size=300), flip=st.integers(min_value=0))
def test_any_body_verifies_and_any_changed_byte_does_not(wx_keys, body, flip):
    keys = wx_keys
    ring = keyring(keys)
    headers = signed(keys, body)
    assert sign.verify(headers, body, ring, NOW) == keys.cert_key.key_id
    changed = bytearray(body + b"x")
    changed[flip % len(changed)] ^= 0x01
    with pytest.raises(sign.BadSignature):
        sign.verify(headers, bytes(changed), ring, NOW)


# --------------------------------------------------------------------------------------------- resources


def test_a_resource_decrypts_with_the_apiv3_key_and_nothing_else(wx_keys):
    plaintext = json.dumps({"out_trade_no": "pay_1234567", "描述": "中文"}, ensure_ascii=False).encode()
    resource = fake.encrypt_resource(wx_keys.apiv3_key.encode(), plaintext, "transaction", "transaction")
    assert sign.decrypt_resource(wx_keys.apiv3_key.encode(), resource) == plaintext
    with pytest.raises(sign.UndecryptableResource):
        sign.decrypt_resource(b"0" * 32, resource)
    for field, value in [("associated_data", "refund"), ("nonce", "AAAAAAAAAAAA"), ("algorithm", "AES_128_CBC")]:
        with pytest.raises(sign.UndecryptableResource):
            sign.decrypt_resource(wx_keys.apiv3_key.encode(), {**resource, field: value})
    tampered = bytearray(base64.b64decode(resource["ciphertext"]))
    tampered[0] ^= 1
    with pytest.raises(sign.UndecryptableResource):
        sign.decrypt_resource(
            wx_keys.apiv3_key.encode(), {**resource, "ciphertext": base64.b64encode(tampered).decode()}
        )


# --------------------------------------------------------------------------------------------- configuration


def test_unusable_key_files_stop_start_up_naming_the_variable_the_file_and_why(wx_keys, tmp_path):
    good = wx_settings(wx_keys)
    load_config(good)  # the good set loads
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    weak_path = tmp_path / "weak.pem"
    weak_path.write_bytes(
        weak.private_bytes(
            fake.serialization.Encoding.PEM, fake.serialization.PrivateFormat.PKCS8, fake.serialization.NoEncryption()
        )
    )
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("hello")
    cert = wx_keys.cert_key
    cases = [
        (
            {"wechatpay_merchant_private_key_file": str(tmp_path / "absent.pem")},
            "WECHATPAY_MERCHANT_PRIVATE_KEY_FILE: cannot read",
        ),
        ({"wechatpay_merchant_private_key_file": str(not_pem)}, "not an unencrypted PEM private key"),
        ({"wechatpay_merchant_private_key_file": str(weak_path)}, "1024 bits"),
        ({"wechatpay_platform_keys": (("ABCDEF", str(cert.pem_path)),)}, f"certificate serial is {cert.key_id}"),
        ({"wechatpay_platform_keys": (("PUB_KEY_ID_1", str(cert.pem_path)),)}, "but the file is a certificate"),
        ({"wechatpay_platform_keys": ((cert.key_id, str(not_pem)),)}, "neither a PEM certificate nor"),
        ({"wechatpay_notify_url": ""}, "WECHATPAY_NOTIFY_URL missing"),
    ]
    from dataclasses import replace

    for change, message in cases:
        with pytest.raises(ConfigError, match=message) as caught:
            load_config(replace(good, **change))
        assert wx_keys.apiv3_key not in str(caught.value)


def test_production_validation_refuses_an_expired_platform_certificate(wx_keys, tmp_path):
    from dataclasses import replace
    from datetime import UTC, datetime, timedelta

    validate(wx_settings(wx_keys))
    later = datetime.now(UTC) + timedelta(days=400)
    with pytest.raises(ConfigError, match=f"{wx_keys.cert_key.key_id}=.*certificate expired"):
        validate(wx_settings(wx_keys), now=later)
    validate(replace(wx_settings(wx_keys, platform=(wx_keys.pub_key,))), now=later)  # public keys do not expire


def test_settings_parse_platform_keys_and_refuse_partial_configuration():
    from payments.infra.settings import load_settings

    settings = load_settings(
        {
            "WECHATPAY_PLATFORM_KEYS": " 5157F09EFDC096DE = /k/a.pem , PUB_KEY_ID_0114232134912410000=/k/b.pem",
            "WECHATPAY_MCHID": "1900000109",
            "WECHATPAY_APPID": "wxd678efh567hg6787",
            "WECHATPAY_APIV3_KEY": "a" * 32,
            "WECHATPAY_MERCHANT_PRIVATE_KEY_FILE": "/k/m.pem",
            "WECHATPAY_MERCHANT_SERIAL": "3775B6A45ACD588826D15E583A95F5DD",
            "WECHATPAY_NOTIFY_URL": "https://shop.example/callbacks/wechatpay",
            "WECHATPAY_SOURCE_CIDRS": "101.226.103.0/25, 2001:db8::/32",
        }
    )
    assert settings.wechatpay_platform_keys == (
        ("5157F09EFDC096DE", "/k/a.pem"),
        ("PUB_KEY_ID_0114232134912410000", "/k/b.pem"),
    )
    assert settings.wechatpay_api_base == "https://api.mch.weixin.qq.com"
    for env, message in [
        ({"WECHATPAY_MCHID": "1900000109"}, "WECHATPAY_APPID, WECHATPAY_APIV3_KEY"),
        ({"WECHATPAY_APIV3_KEY": "short"}, "32-character APIv3 key, got 5 bytes"),
        ({"WECHATPAY_PLATFORM_KEYS": "ABC"}, "ID=path.pem"),
        ({"WECHATPAY_PLATFORM_KEYS": "serial-1=/a.pem"}, "neither a certificate serial"),
        ({"WECHATPAY_PLATFORM_KEYS": "abc=/a.pem,ABC=/b.pem"}, "listed twice"),
        ({"WECHATPAY_SOURCE_CIDRS": "10.0.0.1/8"}, "WECHATPAY_SOURCE_CIDRS"),
        ({"WECHATPAY_MCHID": "19x"}, "WECHATPAY_MCHID must be digits"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_settings(env)


def test_source_checks_are_a_pure_membership_question():
    from payments.infra.settings import load_settings

    nets = load_settings({"WECHATPAY_SOURCE_CIDRS": "101.226.103.0/25,2001:db8::/32"}).wechatpay_source_cidrs
    assert source_allowed("101.226.103.14", nets)
    assert source_allowed("::ffff:101.226.103.14", nets)  # dual-stack sockets report IPv4 this way
    assert source_allowed("2001:db8::1", nets)
    assert not source_allowed("101.226.103.200", nets)
    assert not source_allowed("", nets) and not source_allowed(None, nets) and not source_allowed("nonsense", nets)
    assert source_allowed("203.0.113.9", ())  # no list: any source


def test_time_is_not_read_by_verification(wx_keys):
    body = b"{}"
    headers = signed(wx_keys, body, now=time.time() - 10_000)
    with pytest.raises(sign.StaleTimestamp):
        sign.verify(headers, body, keyring(wx_keys), time.time())
    sign.verify(headers, body, keyring(wx_keys), time.time() - 10_000)  # re-verification uses the receive time
