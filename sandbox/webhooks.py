"""Webhook delivery: a background thread that completes processing charges and sends due events.

Like a real platform: each event is POSTed to the callback URL signed with
``sandbox.signing`` (re-signed at every attempt with that attempt's time), the
same event id on every retry; any non-2xx answer or connection error is
retried with exponential backoff with jitter until ``max_attempts``; every
attempt and its answer is recorded in the store. Sends run on a small thread
pool so one slow receiver does not hold up the rest; the loop wakes at once
when a new event is queued (``wake``) and otherwise sleeps until the next one
is due. Never logs the secret or a signature.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from sandbox import signing
from sandbox.faults import Faults, bad_signature
from sandbox.store import DueEvent, Store

log = logging.getLogger("sandbox.webhooks")

WRONG_SECRET = "whsec_sandbox_wrong_secret"  # noqa: S105 - deliberately wrong, public by design
"""What a bad-signature attempt is signed with."""
REORDER_MAX_HOLD_SECONDS = 5.0
"""A reordered event waits for a later one to be sent at most this long."""
MAX_IDLE_SECONDS = 0.5
"""The loop checks the database at least this often (covers events written by another path)."""


@dataclass(frozen=True)
class DeliveryPolicy:
    """Where and how hard to deliver."""

    url: str
    secret: str
    max_attempts: int = 8
    backoff_seconds: float = 1.0
    backoff_max_seconds: float = 3600.0
    timeout_seconds: float = 5.0
    concurrency: int = 16


def retry_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Seconds before attempt ``attempt + 1``: exponential, capped, with equal jitter (a delay in [d/2, d])."""
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 62))
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


def next_status(status_code: int | None, attempt: int, max_attempts: int) -> str:
    """An event's status after attempt number ``attempt`` got ``status_code`` (None: no answer)."""
    if status_code is not None and 200 <= status_code < 300:
        return "delivered"
    return "failed" if attempt >= max_attempts else "pending"


class Dispatcher:
    """The background loop; ``start`` once, ``stop`` on shutdown."""

    def __init__(self, store: Store, policy: DeliveryPolicy, faults: Callable[[], Faults]) -> None:
        self.store = store
        self.policy = policy
        self._faults = faults
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._inflight: set[str] = set()
        self._inflight_lock = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=policy.concurrency, thread_name_prefix="sandbox-webhook")
        self._thread = threading.Thread(target=self._run, name="sandbox-dispatcher", daemon=True)
        self._rng = random.Random()  # noqa: S311 - backoff jitter

    def start(self) -> None:
        """Start the loop thread."""
        self._thread.start()

    def wake(self) -> None:
        """Something new may be due: look now rather than at the next tick."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop taking work, let sends in progress finish (bounded by their HTTP timeout)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self.tick(time.time())
            except Exception:  # noqa: BLE001 - the loop must survive anything; the next tick retries
                log.exception("dispatcher tick failed")
            self._wake.wait(self._sleep_seconds())
            self._wake.clear()

    def _sleep_seconds(self) -> float:
        next_at = self.store.next_due_at()
        if next_at is None:
            return MAX_IDLE_SECONDS
        wait = next_at - time.time()
        if wait <= 0:
            # Due but not handed out: in flight, held for reordering, or the pool is full. A finished
            # send or a new event wakes the loop; polling faster would only spin.
            return MAX_IDLE_SECONDS
        return max(0.005, min(MAX_IDLE_SECONDS, wait))

    def tick(self, now: float) -> int:
        """Complete due processing work, then hand due events to the senders. Returns events handed out."""
        self.store.complete_due(now)
        with self._inflight_lock:
            free = self.policy.concurrency * 4 - len(self._inflight)
            exclude = set(self._inflight)
        if free <= 0:
            return 0
        events = self.store.due_events(now, free, exclude, REORDER_MAX_HOLD_SECONDS)
        for event in events:
            with self._inflight_lock:
                self._inflight.add(event.id)
            self._pool.submit(self._deliver, event)
        return len(events)

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _send(self, event: DueEvent, attempt: int, duplicate: bool = False) -> int | None:
        """POST one attempt, record it, and return the HTTP status (None when there was no answer)."""
        body = event.body.encode()
        wrong = bad_signature(event.signature_seed, attempt, self._faults().bad_signature_rate) and not duplicate
        header = signing.sign(WRONG_SECRET if wrong else self.policy.secret, body)
        started = time.monotonic()
        status_code: int | None = None
        error: str | None = None
        try:
            response = self._session().post(
                self.policy.url,
                data=body,
                headers={signing.HEADER: header, "Content-Type": "application/json", "User-Agent": "paysync-sandbox"},
                timeout=self.policy.timeout_seconds,
            )
            status_code = response.status_code
            if not 200 <= status_code < 300:
                error = response.text[:200]
        except requests.RequestException as exc:
            error = type(exc).__name__
        now = time.time()
        status = next_status(status_code, attempt, self.policy.max_attempts)
        retry_at = None
        if status == "pending":
            retry_at = now + retry_delay(
                attempt, self.policy.backoff_seconds, self.policy.backoff_max_seconds, self._rng
            )
        self.store.record_attempt(
            event.id,
            attempt,
            url=self.policy.url,
            status_code=status_code,
            error=error,
            bad_signature=wrong,
            duration_ms=round((time.monotonic() - started) * 1000, 2),
            now=now,
            next_status=status,
            next_attempt_at=retry_at,
            duplicate=duplicate,
        )
        if status == "failed" and not duplicate:
            log.warning("webhook %s given up after %d attempts", event.id, attempt)
        return status_code

    def _deliver(self, event: DueEvent) -> None:
        try:
            status_code = self._send(event, event.attempts + 1)
            if event.duplicate and status_code is not None and 200 <= status_code < 300:
                # Fault "duplicate": the platform sends the same event once more, as real ones do.
                self._send(event, event.attempts + 1, duplicate=True)
        except Exception:  # noqa: BLE001 - a thread-pool task must not die silently
            log.exception("webhook delivery of %s failed", event.id)
        finally:
            with self._inflight_lock:
                self._inflight.discard(event.id)
            self._wake.set()
