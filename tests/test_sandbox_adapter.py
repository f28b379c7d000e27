"""The sandbox adapter's outbound calls: only an explicit decline is Failed; everything unclear is Unknown.

Invariant 5. The pure classification is checked for every HTTP answer; the
network failures (timeout, reset, refused) and the platform's own 5xx and
timeout-after-commit are checked against real sockets and the real sandbox.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process
from __future__ import annotations

import json
import socket
import threading

import pytest

from payments.providers.base import ChargeRequest, Failed, Mismatch, NotFound, Pending, Succeeded, Unknown
from payments.providers.sandbox.adapter import LegacySandboxProvider, SandboxProvider, read_answer, read_charge
from tests.support import API_KEY, SECRET, free_port

REQ = ChargeRequest("pay_1", 1000, "CNY")


def charge_reader(data):
    return read_charge(data, "pay_1", REQ)


def charge_body(status="succeeded", **overrides):
    data = {
        "id": "ch_1",
        "status": status,
        "merchant_transaction_id": "pay_1",
        "amount": 1000,
        "currency": "CNY",
        "failure_code": "card_declined" if status == "failed" else None,
    }
    data.update(overrides)
    return json.dumps(data).encode()


def test_a_succeeded_charge_is_succeeded_with_its_id():
    outcome = read_answer(200, charge_body(), charge_reader)
    assert isinstance(outcome, Succeeded) and outcome.provider_transaction_id == "ch_1"


def test_only_an_explicit_decline_is_failed():
    outcome = read_answer(200, charge_body("failed"), charge_reader)
    assert isinstance(outcome, Failed) and outcome.definitive and outcome.code == "card_declined"


def test_processing_is_pending():
    assert isinstance(read_answer(200, charge_body("processing"), charge_reader), Pending)


@pytest.mark.parametrize("status", [500, 502, 503, 504, 429, 408, 409, 404, 301])
def test_server_errors_rate_limits_and_surprises_are_unknown(status):
    body = b'{"error": {"code": "service_unavailable", "message": "try later"}}'
    outcome = read_answer(status, body, charge_reader)
    assert isinstance(outcome, Unknown), outcome
    assert outcome.reason.startswith(f"http_{status}")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>502 Bad Gateway</html>",
        b"\xff\xfe garbage",
        b"[]",
        b'"succeeded"',
        b'{"status": "succeeded"}',
        charge_body(status="weird"),
        charge_body(merchant_transaction_id="pay_other"),
        charge_body(id=""),
    ],
)
def test_a_200_we_cannot_read_is_unknown_never_failed(body):
    assert isinstance(read_answer(200, body, charge_reader), Unknown)


@pytest.mark.parametrize("body", [charge_body(amount=1), charge_body(currency="USD"), charge_body("failed", amount=1)])
def test_a_charge_for_another_amount_or_currency_is_a_mismatch_never_applied(body):
    outcome = read_answer(200, body, charge_reader)
    assert isinstance(outcome, Mismatch) and outcome.provider_transaction_id == "ch_1"


def test_a_refused_request_is_failed_but_bad_credentials_are_not_definitive():
    refused = read_answer(400, b'{"error": {"code": "invalid_currency"}}', charge_reader)
    assert isinstance(refused, Failed) and refused.definitive and refused.code == "invalid_currency"
    assert refused.refusal, "a 4xx refuses the request: on a re-send it is no decline"
    assert not read_answer(200, charge_body("failed"), charge_reader).refusal, "a declined charge is no refusal"
    auth = read_answer(401, b'{"error": {"code": "unauthorized"}}', charge_reader)
    assert isinstance(auth, Failed) and not auth.definitive


class RawServer:
    """A TCP server that misbehaves at the network edge: hangs, or resets the connection mid-request."""

    def __init__(self, mode):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            conn.recv(65536)
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            elif self.mode == "garbage":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!")
                conn.close()
            elif self.mode == "refuse":
                body = b'{"error": {"code": "invalid_request"}}'
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                conn.close()
            # "hang": read the request, never answer

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize(("mode", "reason"), [("hang", "timeout"), ("reset", None), ("garbage", None)])
def test_network_failures_are_unknown(mode, reason):
    server = RawServer(mode)
    try:
        adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=f"http://127.0.0.1:{server.port}")
        outcome = adapter.charge(REQ, "key-1", timeout=0.3)
        assert isinstance(outcome, Unknown), outcome
        if reason:
            assert outcome.reason == reason
        assert outcome.evidence is not None and outcome.evidence.latency_ms is not None
        assert isinstance(adapter.query("pay_1", timeout=0.3), Unknown)
    finally:
        server.close()


def test_a_refused_query_is_unknown_never_a_decline():
    # A 400 to GET /v1/charges refuses the question, it says nothing about the charge (invariant 5).
    server = RawServer("refuse")
    try:
        adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=f"http://127.0.0.1:{server.port}")
        outcome = adapter.query("pay_1", timeout=0.3)
        assert isinstance(outcome, Unknown), outcome
        assert outcome.evidence is not None and outcome.evidence.http_status == 400
    finally:
        server.close()


def test_an_absurdly_deep_answer_is_unknown_not_an_exception():
    deep = b"[" * 100_000 + b"]" * 100_000
    assert isinstance(read_answer(200, deep, charge_reader), Unknown)
    assert isinstance(read_answer(503, deep, charge_reader), Unknown)


def test_a_refused_connection_is_unknown():
    adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=f"http://127.0.0.1:{free_port()}")
    outcome = adapter.charge(REQ, "key-1", timeout=0.3)
    assert isinstance(outcome, Unknown) and outcome.reason == "connection_error"


def test_the_real_sandbox_charges_replays_by_key_and_is_queryable(sandbox):
    adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=sandbox.url)
    first = adapter.charge(REQ, "key-1", timeout=5)
    again = adapter.charge(REQ, "key-1", timeout=5)
    assert isinstance(first, Succeeded) and isinstance(again, Succeeded)
    assert again.provider_transaction_id == first.provider_transaction_id
    assert first.evidence.http_status == 200 and "ch_" in first.evidence.response
    found = adapter.query("pay_1", timeout=5)
    assert isinstance(found, Succeeded) and found.provider_transaction_id == first.provider_transaction_id
    assert isinstance(adapter.query("pay_never", timeout=5), NotFound)
    assert sandbox.charge_count("pay_1") == 1


def test_the_real_sandbox_5xx_and_timeout_after_commit_are_unknown(sandbox):
    adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=sandbox.url)
    sandbox.faults(error_5xx_rate=1.0)
    outcome = adapter.charge(REQ, "key-5xx", timeout=5)
    assert isinstance(outcome, Unknown) and outcome.reason.startswith("http_503")
    assert sandbox.charge_count("pay_1") == 0

    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    outcome = adapter.charge(REQ, "key-hang", timeout=0.3)
    assert isinstance(outcome, Unknown) and outcome.reason == "timeout"
    assert sandbox.charge_count("pay_1") == 1, "the platform did charge: which is why this is never Failed"

    sandbox.faults(decline_rate=1.0)
    declined = adapter.charge(ChargeRequest("pay_2", 1000, "CNY"), "key-decline", timeout=5)
    assert isinstance(declined, Failed) and declined.definitive


def test_the_legacy_variant_sends_a_new_key_each_time_and_cannot_query(sandbox):
    adapter = LegacySandboxProvider(SECRET, api_key=API_KEY, api_url=sandbox.url)
    assert not adapter.capabilities.may_resend and not adapter.capabilities.query_by_merchant_id
    adapter.charge(REQ, "ignored", timeout=5)
    adapter.charge(REQ, "ignored", timeout=5)
    assert sandbox.charge_count("pay_1") == 2, "without keys a re-send is a second charge"
    assert isinstance(adapter.query("pay_1", timeout=5), Unknown)


def test_a_query_for_another_amount_than_expected_is_a_mismatch(sandbox):
    adapter = SandboxProvider(SECRET, api_key=API_KEY, api_url=sandbox.url)
    assert isinstance(adapter.charge(REQ, "key-amount", timeout=5), Succeeded)
    other = ChargeRequest(REQ.payment_id, REQ.amount_minor + 1, REQ.currency)
    outcome = adapter.query(REQ.payment_id, timeout=5, expected=other)
    assert isinstance(outcome, Mismatch) and outcome.reason == "answer_for_another_amount"
    assert isinstance(adapter.query(REQ.payment_id, timeout=5, expected=REQ), Succeeded)
