"""``payments.providers.base.api_session``: the environment's proxies and CA bundle, read once per adapter."""

from __future__ import annotations

from payments.providers.base import api_session


def test_the_proxy_variables_are_honoured_for_the_adapters_host_and_no_proxy_too(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "sandbox.local")
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    through = api_session("https://openapi.alipay.com/gateway.do")
    assert through.proxies.get("https") == "http://proxy.internal:3128"
    assert api_session("https://sandbox.local:9000").proxies == {}, "NO_PROXY names this host"
    assert through.trust_env is False and through.verify is True


def test_a_ca_bundle_variable_is_the_sessions_verify(monkeypatch, tmp_path):
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    assert api_session("https://api.stripe.com").verify == str(bundle)


def test_later_changes_to_the_environment_do_not_reach_a_session_already_made(monkeypatch):
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)
    session = api_session("https://api.mch.weixin.qq.com")
    monkeypatch.setenv("HTTPS_PROXY", "http://late.internal:3128")
    assert "https" not in session.proxies
    assert session.merge_environment_settings("https://api.mch.weixin.qq.com", {}, None, None, None)["proxies"] == {}
