"""The chaos run's merchant: POST /payments with a fixed Idempotency-Key each, retried through every fault.

A merchant that follows the contract: every request has its own key, fixed
before the first attempt; a connection error, a timeout, a 5xx or a 409
(the same key still in flight) is retried with the same key and the same body
until an answer comes. A share of the payments is then sent once more, and
the answer must name the same payment (the replay check). Any other answer
is recorded as a finding, never retried away.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

RETRYABLE_STATUS = frozenset({409, 429, 500, 502, 503, 504})
"""Answers a merchant retries with the same key (500 also counted as a finding)."""


@dataclass(frozen=True)
class PaymentRequest:
    """One payment the merchant wants: its key, its body, and the mix that asked for it."""

    key: str
    body: dict[str, Any]
    mix: str
    replay: bool = False
    """Send it again once created, and check the answer names the same payment."""


@dataclass
class Replay:
    """What a second send of a created payment's request answered."""

    key: str
    payment_id: str | None
    same: bool
    replayed_header: bool


@dataclass
class LoadResult:
    """Everything the merchant saw."""

    created: dict[str, str] = field(default_factory=dict)
    """key -> payment_id."""
    requests: dict[str, PaymentRequest] = field(default_factory=dict)
    replays: list[Replay] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    """key -> the answer, for requests that got a final answer other than 201 (a finding)."""
    abandoned: list[str] = field(default_factory=list)
    """Keys still without an answer at the deadline."""
    retries: Counter = field(default_factory=Counter)
    """Why attempts were retried: http_503, http_409, ConnectionError, …"""
    server_errors: int = 0
    """500 answers (each a finding: a 500 means the gateway crashed on the request)."""
    started: float = 0.0
    finished: float = 0.0


class Pacer:
    """At most ``rate`` starts per second across threads (0: no limit)."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate if rate > 0 else 0.0
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self) -> None:
        """Block until this caller's slot."""
        if not self.interval:
            return
        with self._lock:
            slot = max(self._next, time.monotonic())
            self._next = slot + self.interval
        delay = slot - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class LoadDriver:
    """Sends the payments from ``concurrency`` threads; ``progress`` is readable while it runs."""

    def __init__(
        self,
        base_url: str,
        token: str,
        *,
        concurrency: int,
        rate: float = 0.0,
        request_deadline: float = 600.0,
        seed: int = 0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.concurrency = concurrency
        self.pacer = Pacer(rate)
        self.request_deadline = request_deadline
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rng = random.Random(seed)

    @property
    def answered(self) -> int:
        """Requests with a final answer so far."""
        return len(self.result.created) + len(self.result.refused)

    def run(self, payments: Iterable[PaymentRequest]) -> LoadResult:
        """Send every payment (and its replay); return when each has an answer or its deadline passed."""
        items = list(payments)
        self.result.requests = {p.key: p for p in items}
        self.result.started = time.monotonic()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="merchant") as pool:
            for future in [pool.submit(self._one, p) for p in items]:
                future.result()
        self.result.finished = time.monotonic()
        return self.result

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _one(self, request: PaymentRequest) -> None:
        self.pacer.wait()
        answer = self._send(request)
        if answer is None:
            with self._lock:
                self.result.abandoned.append(request.key)
            return
        status, body, _replayed = answer
        payment_id = body.get("payment_id") if isinstance(body, dict) else None
        if status != 201 or not payment_id:
            with self._lock:
                self.result.refused[request.key] = f"{status} {str(body)[:200]}"
            return
        with self._lock:
            self.result.created[request.key] = payment_id
        if request.replay:
            again = self._send(request)
            if again is None:
                with self._lock:
                    self.result.abandoned.append(f"{request.key} (replay)")
                return
            status, body, replayed = again
            other = body.get("payment_id") if isinstance(body, dict) else None
            with self._lock:
                self.result.replays.append(Replay(request.key, other, other == payment_id, replayed))

    def _send(self, request: PaymentRequest) -> tuple[int, Any, bool] | None:
        """POST until a final answer: (status, decoded body, Idempotent-Replayed); None past the deadline."""
        headers = {"Authorization": f"Bearer {self.token}", "Idempotency-Key": request.key}
        deadline = time.monotonic() + self.request_deadline
        pause = 0.1
        while time.monotonic() < deadline:
            try:
                response = self._session().post(
                    f"{self.base_url}/payments", json=request.body, headers=headers, timeout=(3, 30)
                )
            except requests.RequestException as exc:
                reason = type(exc).__name__
                self._session().close()  # a killed worker leaves a dead keep-alive connection behind
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    try:
                        body: Any = response.json()
                    except ValueError:
                        body = response.text[:200]
                    return response.status_code, body, response.headers.get("Idempotent-Replayed") == "true"
                reason = f"http_{response.status_code}"
                if response.status_code == 500:
                    with self._lock:
                        self.result.server_errors += 1
            with self._lock:
                self.result.retries[reason] += 1
            time.sleep(self._rng.uniform(pause / 2, pause))
            pause = min(pause * 2, 2.0)
        return None
