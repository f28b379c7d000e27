"""Hostile clients against the real gateway (gunicorn from the Procfile): an answer, never a stall or a 500."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
import requests

from payments.states import CallbackStatus
from tests.stack import Stack, callback_rows, db_url, post
from tests.support import DEV_DEFAULTS, create_payment, sandbox_event, signed

pytestmark = [pytest.mark.mariadb, pytest.mark.slow]

MAX_BODY = 256 * 1024
TOKEN = DEV_DEFAULTS["merchant_api_token"][0]


def _chunked(body: bytes):  # noqa: ANN202
    return (body[i : i + 16384] for i in range(0, len(body), 16384))


def hostile_bodies() -> list[tuple[str, bytes, str, bool]]:
    """(name, body, Content-Type, send chunked?): each must get a 4xx from every route that takes a body."""
    event = json.dumps(sandbox_event("pay_hostile")).encode()
    return [
        ("nested 100,000 levels", b"[" * 100_000, "application/json", False),
        ("nested objects", b'{"a":' * 50_000, "application/json", False),
        ("invalid utf-8", b'{"order_no": "\xff\xfe\xfd", "amount": 1}', "application/json", False),
        ("over the limit", b'{"pad": "' + b"p" * MAX_BODY + b'"}', "application/json", False),
        ("over the limit, chunked", b'{"pad": "' + b"p" * MAX_BODY + b'"}', "application/json", True),
        ("wrong content type", event, "text/plain", False),
        ("form instead of json", b"order_no=1&amount=100", "application/x-www-form-urlencoded", False),
        ("empty", b"", "application/json", False),
        ("not an object", b"[1, 2, 3]", "application/json", False),
    ]


def _send(port: int, path: str, body: bytes, headers: dict[str, str], chunked: bool) -> int:
    try:
        return post(port, _chunked(body) if chunked else body, headers, path=path).status_code
    except requests.ConnectionError:
        # gunicorn may answer an oversized body and close before the client finished sending it.
        return 413 if len(body) > MAX_BODY else -1


def test_every_route_answers_a_hostile_body_with_a_4xx_and_callbacks_keep_the_delivery(mariadb, tmp_path):
    payment_id = create_payment(mariadb)
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb)) as stack:
        _, port = stack.start_web(workers=2)
        for name, body, content_type, chunked in hostile_bodies():
            # The callback route: signed with the right secret, so the body itself is what gets judged.
            before = len(callback_rows(mariadb))
            headers = {**signed(body)[1], "Content-Type": content_type}
            status = _send(port, "/callbacks/sandbox", body, headers, chunked)
            assert 400 <= status < 500, (name, status, stack.output()[-2000:])
            rows = callback_rows(mariadb)
            assert len(rows) == before + 1, f"{name}: the delivery must be stored"
            assert rows[-1].status == CallbackStatus.REJECTED, (name, rows[-1].result)
            assert bytes(rows[-1].callback_data) == body[:MAX_BODY], name

            # The merchant API: authorized, with a key, so the body is what gets judged; nothing is written.
            headers = {
                "Authorization": f"Bearer {TOKEN}",
                "Idempotency-Key": f"hostile-{uuid.uuid4().hex}",
                "Content-Type": content_type,
            }
            status = _send(port, "/payments", body, headers, chunked)
            assert 400 <= status < 500, (name, status, stack.output()[-2000:])
            # Routes that take no body ignore one, and never fail on it.
            for path in ("/healthz", "/readyz", "/metrics", f"/payments/{payment_id}"):
                answer = requests.get(
                    f"http://127.0.0.1:{port}{path}",
                    data=body,
                    headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": content_type},
                    timeout=15,
                )
                assert answer.status_code < 500, (name, path, answer.status_code)
        assert "Traceback" not in stack.output()
        with mariadb.connect() as conn:
            assert conn.exec_driver_sql("SELECT COUNT(*) FROM payment").scalar() == 1  # only ours


def _stall(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(data)
    return s


HALF_REQUESTS = [
    b"POST /callbacks/sandbox HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",  # half the headers
    b"POST /callbacks/sandbox HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n" + b'{"id": "evt_' + b"x" * 400,  # all headers, half the body
    b"POST /payments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Authorization: Bearer " + TOKEN.encode() + b"\r\nIdempotency-Key: slow\r\nContent-Length: 500\r\n\r\n{",
    b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # headers never finished
]


def test_eight_half_requests_leave_healthz_answering_in_under_100_ms(mariadb, tmp_path):
    read_timeout = 2.0
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), WEB_READ_TIMEOUT_SECONDS=str(read_timeout)) as stack:
        _, port = stack.start_web(workers=2)
        stalled = [_stall(port, HALF_REQUESTS[i % len(HALF_REQUESTS)]) for i in range(8)]
        opened = time.monotonic()
        try:
            time.sleep(0.3)  # every half request has reached a worker thread, blocked reading
            # Probe while they stall, while the read timeout drops them, and after: the workers never freeze.
            timings = []
            while time.monotonic() - opened < read_timeout + 4:
                started = time.perf_counter()
                answer = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
                timings.append(time.perf_counter() - started)
                assert answer.status_code == 200
                time.sleep(0.05)
            timings.sort()
            median, slowest = timings[len(timings) // 2], timings[-1]
            assert median < 0.1, f"median /healthz {median * 1000:.0f} ms over {len(timings)} probes"
            assert slowest < 1.0, f"slowest /healthz {slowest * 1000:.0f} ms over {len(timings)} probes"

            # The stalled connections did not keep their threads: past the read timeout the gateway
            # answered (400: the body never came) or closed each of them.
            for s in stalled:
                s.settimeout(0.5)
                data = s.recv(4096)
                assert data == b"" or data.startswith(b"HTTP/1.1 400"), data[:80]
        finally:
            for s in stalled:
                s.close()
        assert "Traceback" not in stack.output()
