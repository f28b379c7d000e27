"""Keep N units of work in flight: claim only as many rows as there are free slots, refill as slots free up.

A batch-at-a-time loop would wait for the slowest call of each batch; with a
provider where one call in five hangs until the timeout, that stalls every
call behind it. Here a hanging call holds one slot and the others keep moving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

log = logging.getLogger("paysync.compensator.workpool")

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def pool_for(name: str, size: int) -> ThreadPoolExecutor:
    """This process's worker threads for ``name``, kept across runs: their HTTP sessions keep their connections."""
    with _pools_lock:
        key = (name, size)
        if key not in _pools:
            _pools[key] = ThreadPoolExecutor(max_workers=size, thread_name_prefix=name)
        return _pools[key]


def drain(
    claim: Callable[[int], Sequence[Any]],
    work: Callable[[Any], Any],
    *,
    concurrency: int,
    max_seconds: float,
    poll_seconds: float,
    name: str,
    batch: int | None = None,
    linger_seconds: float = 0.0,
) -> list[Any]:
    """Claim and work until nothing is due and nothing is in flight (or ``max_seconds`` pass); return the results.

    ``claim(n)`` returns up to n items (and must lease them); ``work(item)``
    handles one and returns a result. An exception in ``work`` is logged and
    counted as no result: the item's lease runs out and it is claimed again.

    Claims are batched. After a claim that came back short (everything due
    was taken), the next one is ``poll_seconds`` later. After one that came
    back full (more is due), the next one waits until an eighth of the slots
    are free (or ``poll_seconds`` passed), so the slots that free up one by one
    are filled by one claim, not one claim each. Whenever nothing is in
    flight, it claims at once. ``batch`` caps one claim (default: every free
    slot). With ``linger_seconds``, a run that finds nothing to do keeps
    polling until that long after its start before it returns (the
    scheduler's interval, less a little, so a row written between two
    scheduled runs waits for a poll, not for the next run).
    """
    started = time.monotonic()
    results: list[Any] = []
    inflight: set[Future] = set()
    pool = pool_for(name, concurrency)
    claiming = True
    refill = max(1, concurrency // 8)
    last_claim = started - poll_seconds
    backlog = False
    while True:
        now = time.monotonic()
        free = concurrency - len(inflight)
        if claiming and now - started >= max_seconds:
            claiming = False
        polled = now - last_claim >= poll_seconds
        if claiming and free > 0 and (not inflight or polled or (backlog and free >= refill)):
            asked = min(free, batch or free)
            try:
                items = claim(asked)
            except Exception:  # noqa: BLE001 - database trouble: stop claiming, finish what is in flight
                log.exception("%s: claim failed", name)
                items, claiming = [], False
            inflight.update(pool.submit(work, item) for item in items)
            last_claim, backlog = now, len(items) == asked
        if not inflight and (not claiming or now - started >= linger_seconds):
            break
        # Wait for a slot to free up or for the next poll, whichever comes first.
        timeout = max(0.0, last_claim + poll_seconds - time.monotonic()) if claiming and free > 0 else poll_seconds
        if not inflight:
            time.sleep(timeout)
            continue
        done, inflight = wait(inflight, timeout=timeout, return_when=FIRST_COMPLETED)
        for future in done:
            try:
                results.append(future.result())
            except Exception:  # noqa: BLE001
                log.exception("%s: one unit of work failed; its lease will bring it back", name)
    return results
