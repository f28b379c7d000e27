"""Inline processing: the gateway applies a callback before acknowledging it, within a time budget.

The seed's handler processes the notification in the request; with
CALLBACK_PROCESS_INLINE (the default when there is no broker) the gateway
does the same, after the raw row is committed and published, so in embedded
mode a payment is Succeeded by the time the provider has its answer.

The acknowledgement still depends only on the raw row's commit. Processing
runs on a thread pool of this worker, one thread per request thread
(WEB_THREADS), and the request waits for it at most
CALLBACK_INLINE_BUDGET_SECONDS: a failure is recorded on the row (status 2,
backoff) and an overrun carries on in the background, so either way the row
stays 0 or 2 for the consumer and the sweep. When every inline thread is still busy with earlier overruns (a
database that hangs), new callbacks skip inline processing instead of queueing
behind them.

Callbacks that arrive while another is being processed are processed
together, in one transaction (``payments.infra.group_commit`` with
``callback_processing.process_batch``, as the consumer processes a batch of messages:
set-wise when they are the usual reports, a savepoint each otherwise), each
with exactly the effects it would get alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from payments.inbound.callbacks import CallbackResult
from payments.inbound.hints import HintLimits
from payments.inbound.processing import process_batch
from payments.infra.group_commit import GroupCommit
from payments.runtime import Runtime

log = logging.getLogger("paysync.gateway.inline")

GROUP_MAX = 50
"""At most this many callbacks are processed in one transaction."""


class InlineProcessor:
    """Process stored callbacks in this worker, each bounded by the budget (see module docstring)."""

    def __init__(self, runtime: Runtime, threads: int | None = None) -> None:
        self.runtime = runtime
        self.budget = runtime.settings.callback_inline_budget_seconds
        # As many as the worker has request threads: with fewer, concurrent callbacks on one worker would skip
        # inline processing while the database is perfectly healthy.
        self._threads = threads or runtime.settings.web_threads
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._busy = 0
        self._hints = HintLimits.from_settings(runtime.settings)
        self._group: GroupCommit[int, CallbackResult | None] = GroupCommit(self._write, GROUP_MAX)

    def _executor(self) -> ThreadPoolExecutor:
        # Created on first use, so a gunicorn worker gets its own threads after the fork.
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="inline")
        return self._pool

    def _write(self, log_ids: Sequence[int]) -> list[CallbackResult | None]:
        rt = self.runtime
        outcomes = process_batch(rt.engine, rt.providers, list(log_ids), rt.callback_policy, hints=self._hints)
        return [outcome for _, outcome in outcomes]

    def _run(self, log_id: int) -> CallbackResult | None:
        try:
            return self._group.submit(log_id)
        finally:
            with self._lock:
                self._busy -= 1

    def process(self, log_id: int) -> CallbackResult | None:
        """Process callback ``log_id``; None when it did not finish within the budget (or was not tried)."""
        with self._lock:
            if self._busy >= self._threads:
                log.warning("callback %s: inline processing skipped, every inline thread is busy", log_id)
                return None
            self._busy += 1
        future: Future[CallbackResult | None] = self._executor().submit(self._run, log_id)
        try:
            return future.result(timeout=self.budget)
        except FutureTimeout:
            log.warning(
                "callback %s: inline processing overran %.2f s; left to the consumer and sweep", log_id, self.budget
            )
        except Exception as exc:  # noqa: BLE001 - not even the failure could be recorded (database down)
            log.warning("callback %s: inline processing failed (%s); left to the sweep", log_id, type(exc).__name__)
        return None
