"""The sandbox platform as a real process (the Procfile line) over real HTTP, with a webhook receiver.

The receiver verifies every delivery with ``sandbox.signing.verify`` and
answers what the test scripts. Each test uses its own merchant numbers, so a
late delivery left over from an earlier test cannot be mistaken for its own.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from sandbox import signing
from tests.support import API_HEADERS, SECRET, Proc, free_port, wait_for_port, wait_until

MAX_ATTEMPTS = 3


class Receiver:
    """A tiny webhook endpoint: records each delivery, checks its signature, answers as scripted."""

    def __init__(self) -> None:
        self.deliveries: list[dict] = []
        self.lock = threading.Lock()
        self.answers: dict[str, list[int]] = {}  # merchant number -> statuses to answer, in order; then 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    signing.verify(SECRET, body, self.headers.get(signing.HEADER))
                    valid = True
                except signing.SignatureError:
                    valid = False
                event = json.loads(body)
                status = receiver._answer(event, valid)
                with receiver.lock:
                    receiver.deliveries.append({"event": event, "valid": valid, "status": status, "at": time.time()})
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/callbacks/sandbox"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _answer(self, event: dict, valid: bool) -> int:
        if not valid:
            return 401
        with self.lock:
            queue = self.answers.get(event["data"]["merchant_transaction_id"], [])
            return queue.pop(0) if queue else 200

    def of(self, merchant_id: str) -> list[dict]:
        """Deliveries that concern one merchant number, in arrival order."""
        with self.lock:
            return [d for d in self.deliveries if d["event"]["data"]["merchant_transaction_id"] == merchant_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start(tmp_path, callback_url: str, **env: str) -> tuple[Proc, str]:
    port = free_port()
    settings = {
        "SANDBOX_PORT": str(port),
        "SANDBOX_DB_PATH": str(tmp_path / "sandbox.db"),
        "SANDBOX_CALLBACK_URL": callback_url,
        "SANDBOX_WEBHOOK_SECRET": SECRET,
        "SANDBOX_WEBHOOK_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
        "SANDBOX_WEBHOOK_BACKOFF_SECONDS": "0.05",
        **env,
    }
    proc = Proc("sandbox", settings, log_path=tmp_path / f"sandbox-{port}.log")
    try:
        wait_for_port(port)
    except TimeoutError:
        proc.kill()
        raise AssertionError(proc.output()) from None
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory, receiver):
    proc, url = start(tmp_path_factory.mktemp("sandbox"), receiver.url)
    yield url
    assert proc.stop() == 0, proc.output()


@pytest.fixture
def url(service):
    requests.post(f"{service}/_sandbox/reset", timeout=5).raise_for_status()
    return service


def faults(url: str, **knobs) -> None:
    requests.post(f"{url}/_sandbox/faults", json=knobs, timeout=5).raise_for_status()


def charge(url: str, merchant_id: str, key: str | None = None, amount: int = 1000, timeout: float = 10):
    return requests.post(
        f"{url}/v1/charges",
        json={"merchant_transaction_id": merchant_id, "amount": amount, "currency": "CNY"},
        headers={"Idempotency-Key": key or uuid.uuid4().hex, **API_HEADERS},
        timeout=timeout,
    )


def event_record(url: str, merchant_id: str) -> dict:
    events = requests.get(f"{url}/_sandbox/deliveries", timeout=5).json()["events"]
    (event,) = [e for e in events if e["data"]["merchant_transaction_id"] == merchant_id]
    return event


def mid() -> str:
    return f"pay_{uuid.uuid4().hex[:16]}"


# --- charges -----------------------------------------------------------------------------------


def test_twenty_concurrent_requests_with_one_key_make_one_charge(url):
    merchant_id = mid()
    barrier = threading.Barrier(20)

    def send(_):
        barrier.wait()
        return charge(url, merchant_id, key="the-one-key")

    with ThreadPoolExecutor(20) as pool:
        responses = list(pool.map(send, range(20)))
    assert {r.status_code for r in responses} == {200}
    assert len({r.json()["id"] for r in responses}) == 1
    truth = requests.get(f"{url}/_sandbox/truth", timeout=5).json()
    assert truth["charge_counts"] == {merchant_id: 1}
    assert truth["multiple_charges"] == []


def test_timeout_after_commit_charges_but_the_reply_comes_too_late(url):
    merchant_id = mid()
    faults(url, timeout_after_commit_rate=1.0, hang_seconds=2.0)
    with pytest.raises(requests.Timeout):
        charge(url, merchant_id, key="k-hang", timeout=0.5)
    (made,) = requests.get(f"{url}/_sandbox/truth", timeout=5).json()["charges"]
    assert (made["merchant_transaction_id"], made["status"]) == (merchant_id, "succeeded")
    # The client retries with the same key: the stored answer, at once, and no second charge.
    started = time.monotonic()
    again = charge(url, merchant_id, key="k-hang", timeout=1.5)
    assert time.monotonic() - started < 1.0
    assert again.json()["id"] == made["id"]
    found = requests.get(
        f"{url}/v1/charges", params={"merchant_transaction_id": merchant_id}, headers=API_HEADERS, timeout=5
    )
    assert found.json()["id"] == made["id"]
    assert requests.get(f"{url}/_sandbox/truth", timeout=5).json()["charge_counts"] == {merchant_id: 1}


def test_hanging_replies_do_not_hold_up_other_requests(url):
    faults(url, timeout_after_commit_rate=1.0, hang_seconds=2.0)
    with ThreadPoolExecutor(40) as pool:
        hanging = [pool.submit(charge, url, mid(), None, 1000, 5) for _ in range(30)]
        time.sleep(0.3)
        faults(url)
        started = time.monotonic()
        assert charge(url, mid()).status_code == 200
        assert time.monotonic() - started < 0.5
        assert all(f.result().status_code == 200 for f in hanging)


# --- webhooks ----------------------------------------------------------------------------------


def test_a_charge_webhook_is_signed_and_retried_until_2xx_with_every_attempt_recorded(url, receiver):
    merchant_id = mid()
    receiver.answers[merchant_id] = [500, 503]
    made = charge(url, merchant_id, amount=4321).json()
    wait_until(lambda: event_record(url, merchant_id)["status"] == "delivered", timeout=10, message="delivery")
    got = receiver.of(merchant_id)
    assert [d["status"] for d in got] == [500, 503, 200]
    assert all(d["valid"] for d in got)
    assert len({d["event"]["id"] for d in got}) == 1
    event = got[-1]["event"]
    assert event["id"].startswith("evt_")
    assert event["type"] == "charge.succeeded"
    assert isinstance(event["created"], int)
    assert event["data"] == {
        "merchant_transaction_id": merchant_id,
        "provider_transaction_id": made["id"],
        "amount": 4321,
        "currency": "CNY",
        "failure_code": None,
    }
    record = event_record(url, merchant_id)
    assert [a["status_code"] for a in record["attempt_log"]] == [500, 503, 200]
    assert [a["attempt"] for a in record["attempt_log"]] == [1, 2, 3]
    assert record["attempts"] == 3


def test_a_webhook_nobody_accepts_is_given_up_after_max_attempts(url, receiver):
    merchant_id = mid()
    receiver.answers[merchant_id] = [500] * 10
    charge(url, merchant_id)
    wait_until(lambda: event_record(url, merchant_id)["status"] == "failed", timeout=10, message="give-up")
    record = event_record(url, merchant_id)
    assert [a["status_code"] for a in record["attempt_log"]] == [500] * MAX_ATTEMPTS
    time.sleep(0.3)
    assert len(receiver.of(merchant_id)) == MAX_ATTEMPTS


def test_a_declined_charge_sends_charge_failed(url, receiver):
    merchant_id = mid()
    faults(url, decline_rate=1.0)
    charge(url, merchant_id)
    (delivery,) = wait_until(lambda: receiver.of(merchant_id), timeout=5, message="delivery")
    assert delivery["event"]["type"] == "charge.failed"
    assert delivery["event"]["data"]["failure_code"] == "card_declined"


def test_a_refund_webhook_names_the_refund_the_charge_and_both_merchant_numbers(url, receiver):
    merchant_id = mid()
    made = charge(url, merchant_id).json()
    refund = requests.post(
        f"{url}/v1/refunds",
        json={"charge": made["id"], "amount": 250, "merchant_refund_id": "ref_" + merchant_id[4:]},
        headers={"Idempotency-Key": uuid.uuid4().hex, **API_HEADERS},
        timeout=5,
    ).json()
    wait_until(lambda: len(receiver.of(merchant_id)) == 2, timeout=5, message="two deliveries")
    (event,) = [d["event"] for d in receiver.of(merchant_id) if d["event"]["type"].startswith("refund.")]
    assert event["type"] == "refund.succeeded"
    assert event["data"] == {
        "merchant_transaction_id": merchant_id,
        "merchant_refund_id": "ref_" + merchant_id[4:],
        "provider_transaction_id": refund["id"],
        "charge": made["id"],
        "amount": 250,
        "currency": "CNY",
        "failure_code": None,
    }


def test_a_processing_charge_completes_by_itself_and_then_sends_its_webhook(url, receiver):
    merchant_id = mid()
    faults(url, processing_rate=1.0, processing_seconds=0.5)
    made = charge(url, merchant_id).json()
    assert made["status"] == "processing"
    time.sleep(0.2)
    assert receiver.of(merchant_id) == []
    (delivery,) = wait_until(lambda: receiver.of(merchant_id), timeout=5, message="delivery")
    assert delivery["event"]["type"] == "charge.succeeded"
    assert (
        requests.get(f"{url}/v1/charges/{made['id']}", headers=API_HEADERS, timeout=5).json()["status"] == "succeeded"
    )


def test_dropped_webhooks_are_never_delivered(url, receiver):
    merchant_id = mid()
    faults(url, drop_rate=1.0)
    charge(url, merchant_id)
    time.sleep(0.5)
    assert receiver.of(merchant_id) == []
    record = event_record(url, merchant_id)
    assert (record["status"], record["attempt_log"]) == ("dropped", [])


def test_duplicated_webhooks_arrive_twice_with_the_same_event_id(url, receiver):
    merchant_id = mid()
    faults(url, duplicate_rate=1.0)
    charge(url, merchant_id)
    got = wait_until(lambda: len(receiver.of(merchant_id)) == 2 and receiver.of(merchant_id), timeout=5)
    assert got[0]["event"] == got[1]["event"]
    assert all(d["valid"] for d in got)
    log = event_record(url, merchant_id)["attempt_log"]
    assert [a["duplicate"] for a in log] == [False, True]


def test_delayed_webhooks_wait_delay_seconds(url, receiver):
    merchant_id = mid()
    faults(url, delay_rate=1.0, delay_seconds=1.0)
    sent = time.time()
    charge(url, merchant_id)
    (delivery,) = wait_until(lambda: receiver.of(merchant_id), timeout=5, message="delivery")
    assert delivery["at"] - sent >= 1.0


def test_reordered_webhooks_arrive_after_a_later_one(url, receiver):
    first, second = mid(), mid()
    faults(url, reorder_rate=1.0)
    charge(url, first)
    time.sleep(0.3)
    assert receiver.of(first) == []  # held back
    faults(url)
    charge(url, second)
    wait_until(lambda: receiver.of(first) and receiver.of(second), timeout=4, message="both deliveries")
    assert receiver.of(second)[0]["at"] <= receiver.of(first)[0]["at"]


def test_bad_signature_attempts_are_refused_by_the_receiver_and_retried(url, receiver):
    merchant_id = mid()
    faults(url, bad_signature_rate=1.0)
    charge(url, merchant_id)
    wait_until(lambda: len(receiver.of(merchant_id)) >= 1, timeout=5)
    faults(url)  # the next retry is signed properly
    wait_until(lambda: event_record(url, merchant_id)["status"] == "delivered", timeout=5, message="delivery")
    got = receiver.of(merchant_id)
    assert [d["valid"] for d in got][0] is False
    assert got[-1]["valid"] is True
    log = event_record(url, merchant_id)["attempt_log"]
    assert log[0]["bad_signature"] is True
    assert log[0]["status_code"] == 401
    assert log[-1]["bad_signature"] is False


# --- hostile clients ---------------------------------------------------------------------------


def raw_post(url: str, path: str, body: bytes, headers: dict[str, str], chunked: bool = False) -> int:
    """POST over a plain socket (requests would fix up what these tests break); return the HTTP status."""
    port = int(url.rsplit(":", 1)[1])
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in _parts(body, 8192)) + b"0\r\n\r\n"
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
        except (BrokenPipeError, ConnectionResetError):
            # The server may refuse a body from its headers (413 for a Content-Length past the limit) and
            # close before we finished sending it; its answer came first and is still there to read.
            pass
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ", 2)[1])


def _parts(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


HOSTILE = [
    ("deep_json_100k", b"[" * 100_000 + b"]" * 100_000, "application/json", False, {413}),
    ("deep_json_100k_chunked", b"[" * 100_000 + b"]" * 100_000, "application/json", True, {413}),
    ("deep_json_30k", b"[" * 30_000 + b"]" * 30_000, "application/json", False, {400}),
    (
        "invalid_utf8",
        b'{"merchant_transaction_id": "\xff", "amount": 1, "currency": "CNY"}',
        "application/json",
        False,
        {400},
    ),
    ("oversized", b'{"a": "' + b"x" * (1024 * 1024) + b'"}', "application/json", False, {413}),
    ("oversized_chunked", b'{"a": "' + b"x" * (1024 * 1024) + b'"}', "application/json", True, {413}),
    # Valid JSON up to the limit: cut there, it would still parse and charge.
    (
        "oversized_chunked_padded",
        b'{"merchant_transaction_id": "pay_pad", "amount": 1, "currency": "CNY"}' + b" " * (128 * 1024),
        "application/json",
        True,
        {413},
    ),
    ("wrong_type", b'{"amount": 1}', "text/plain", False, {415}),
]


@pytest.mark.parametrize("path", ["/v1/charges", "/v1/refunds", "/_sandbox/faults"])
@pytest.mark.parametrize(("kind", "body", "content_type", "chunked", "statuses"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_the_real_service_answers_hostile_bodies_with_a_4xx_and_keeps_serving(
    url, path, kind, body, content_type, chunked, statuses
):
    headers = {"Content-Type": content_type, "Idempotency-Key": f"k-{kind}", **API_HEADERS}
    assert raw_post(url, path, body, headers, chunked=chunked) in statuses
    truth = requests.get(f"{url}/_sandbox/truth", timeout=5).json()
    assert truth["charges"] == [] and truth["refunds"] == []
    assert requests.get(f"{url}/_sandbox/faults", timeout=5).json()["decline_rate"] == 0.0
    assert charge(url, mid()).status_code == 200, "the service still serves"


def test_the_real_service_wants_an_api_key_and_a_local_host_and_origin(url):
    body = {"merchant_transaction_id": mid(), "amount": 1, "currency": "CNY"}
    no_key = requests.post(f"{url}/v1/charges", json=body, headers={"Idempotency-Key": "k1"}, timeout=5)
    assert no_key.status_code == 401
    wrong = requests.post(
        f"{url}/v1/charges", json=body, headers={"Idempotency-Key": "k1", "Authorization": "Bearer nope"}, timeout=5
    )
    assert wrong.status_code == 401
    for headers in ({"Host": "attacker.example"}, {"Origin": "http://attacker.example"}, {"Origin": "null"}):
        assert requests.post(f"{url}/_sandbox/reset", headers=headers, timeout=5).status_code == 403
        answer = requests.post(f"{url}/_sandbox/faults", json={"decline_rate": 1}, headers=headers, timeout=5)
        assert answer.status_code == 403
    assert requests.get(f"{url}/_sandbox/faults", timeout=5).json()["decline_rate"] == 0.0
    assert requests.get(f"{url}/_sandbox/truth", timeout=5).json()["charges"] == []


# --- process life ------------------------------------------------------------------------------


@pytest.mark.server
def test_the_service_logs_its_url_and_stops_cleanly_on_sigterm(tmp_path):
    proc, url = start(tmp_path, f"http://127.0.0.1:{free_port()}/callbacks/sandbox")
    assert charge(url, mid()).status_code == 200
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(15) == 0
    output = proc.output()
    assert f"listening on {url}" in output
    assert "sandbox stopped" in output
    assert SECRET not in output


def test_a_bad_faults_setting_stops_the_service_at_start_naming_the_variable(tmp_path):
    proc = Proc(
        "sandbox",
        {"SANDBOX_PORT": str(free_port()), "SANDBOX_FAULTS": '{"decline_rate": 7}'},
        log_path=tmp_path / "bad.log",
    )
    assert proc.popen.wait(15) == 2
    assert "SANDBOX_FAULTS: decline_rate must be between 0 and 1" in proc.output()


def test_state_and_pending_work_survive_a_restart(tmp_path, receiver):
    merchant_id = mid()
    proc, url = start(tmp_path, receiver.url, SANDBOX_FAULTS='{"processing_rate": 1.0, "processing_seconds": 1.0}')
    made = charge(url, merchant_id, key="k-restart").json()
    assert made["status"] == "processing"
    assert proc.stop() == 0
    proc, url = start(tmp_path, receiver.url)
    try:
        (delivery,) = wait_until(lambda: receiver.of(merchant_id), timeout=10, message="delivery after restart")
        assert delivery["event"]["data"]["provider_transaction_id"] == made["id"]
        assert charge(url, merchant_id, key="k-restart").json() == made  # the key outlived the process
    finally:
        assert proc.stop() == 0
