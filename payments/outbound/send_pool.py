"""Sending a charge while POST /payments waits: a bounded pool of worker threads owned by the process.

POST /payments may send its ChargeRequested at once, so the answer can carry
the provider's QR code (``payments.outbound.charges``). The send is the relay's own
(``outbound_protocol.relay_charge``, under a claim and a lease exactly as
``relay_outbox`` takes one), run on one of this process's send workers, and
the request waits for it at most CHARGE_INLINE_BUDGET_SECONDS; past that the
send finishes under its lease and the request goes on.

The pool is made once at start-up (``gateway.create_app``) and shut down when
the process ends (gunicorn's ``worker_exit``). Its queue is bounded: when
every worker is busy and the queue is full, a send is not queued at all, and
the payment simply waits for the relay loop, which sends every row it finds
due. Nothing is lost either way: the outbox row is the truth.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from datetime import timedelta

from sqlalchemy import select

from payments.infra.db import claim_rows, utcnow
from payments.infra.schema import outbox as outbox_table
from payments.outbound.protocol import Context, relay_charge
from payments.states import OutboxStatus

log = logging.getLogger("paysync.send_pool")


class SendPool:
    """``workers`` threads and at most ``queue_size`` sends waiting for one; a send past that is refused."""

    def __init__(self, workers: int, queue_size: int, name: str = "send") -> None:
        if workers < 1 or queue_size < 0:
            raise ValueError("a send pool needs at least one worker and a queue of zero or more")
        # The executor starts its threads on the first submit, so a pool made before a fork holds none.
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._slots = threading.BoundedSemaphore(workers + queue_size)
        self._closed = False

    def submit(self, fn: Callable[[], object]) -> Future[object] | None:
        """Run ``fn`` on a worker; None (nothing queued) when the pool is full or shut down."""
        if self._closed or not self._slots.acquire(blocking=False):
            return None
        try:
            future = self._executor.submit(fn)
        except RuntimeError:  # shut down between the check and the submit
            self._slots.release()
            return None
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def shutdown(self, wait_for_sends: bool = True) -> None:
        """Take no more sends; with ``wait_for_sends``, let the running and queued ones finish first."""
        self._closed = True
        self._executor.shutdown(wait=wait_for_sends, cancel_futures=not wait_for_sends)


def relay_charge_inline(
    ctx: Context,
    pool: SendPool,
    event_id: str,
    provider_name: str,
    budget_seconds: float,
    throttle: Callable[[str], bool],
) -> bool:
    """Send the ChargeRequested outbox row ``event_id`` now, as relay_outbox would; True if done within the budget.

    ``throttle`` takes one of this process's calls to the provider, or
    refuses (then the row is left for the relay). A full ``pool`` leaves it
    for the relay too.
    """
    future = pool.submit(lambda: _send(ctx, event_id, provider_name, throttle))
    if future is None:
        log.info("inline charge of %s not queued: every send worker is busy; left to the relay", event_id)
        return False
    done, _ = wait([future], timeout=budget_seconds)
    return bool(done)


def _send(ctx: Context, event_id: str, provider_name: str, throttle: Callable[[str], bool]) -> None:
    """Claim the row the way ``relay_outbox`` claims it and send it; a failure leaves it to the relay."""
    try:
        if not throttle(provider_name):
            return
        lease_until = utcnow() + timedelta(seconds=ctx.settings.call_lease_seconds)
        t = outbox_table
        claimed = claim_rows(
            ctx.engine,
            select(t.c.id).where(
                t.c.event_id == event_id, t.c.status == OutboxStatus.PENDING, t.c.next_attempt_at <= utcnow()
            ),
            t,
            t.c.next_attempt_at,
            lease_until,
        )
        if claimed:
            relay_charge(ctx, claimed[0].id, provider_name, lease_until)
    except Exception:  # noqa: BLE001 - the row stays with the relay, which sends it when the lease runs out
        log.warning("inline charge of %s failed; left to the relay", event_id, exc_info=True)
