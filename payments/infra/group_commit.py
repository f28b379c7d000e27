"""Group commit: units of work handed in by many threads, written by one of them in one transaction.

A relay thread whose provider call came back hands its outcome to ``submit``
and waits. If no thread is writing, it writes its own outcome together with
every other outcome waiting at that moment; if one is, it waits until its
outcome is written with the next group. So under load, one thread writes a
group while the next group gathers, and each group costs one transaction (a
few set-wise statements and one COMMIT) instead of one per unit; with a single
unit waiting, it is written at once, alone, with no added delay. The leader
hands over to the first waiter, not to everybody, so hundreds of waiting
threads are not all woken for every group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class _Waiter(Generic[T, R]):
    __slots__ = ("item", "wake", "done", "result", "error")

    def __init__(self, item: T) -> None:
        self.item = item
        self.wake = threading.Event()
        self.done = False
        self.result: R | None = None
        self.error: BaseException | None = None


class GroupCommit(Generic[T, R]):
    """Write units handed in by many threads in groups (module docstring).

    ``write(items)`` returns one result per item, in order; if it raises, every
    item of that group gets the exception. ``max_group`` caps a group.
    """

    def __init__(self, write: Callable[[Sequence[T]], Sequence[R]], max_group: int = 100) -> None:
        self._write = write
        self._max = max(1, max_group)
        self._lock = threading.Lock()
        self._queue: list[_Waiter[T, R]] = []
        self._busy = False
        self.groups = 0
        """Groups written so far (with ``units``: how well units were grouped, for tests and benchmarks)."""
        self.units = 0

    def submit(self, item: T) -> R:
        """Have ``item`` written (by this thread or with another's group); return its result or raise its error."""
        me: _Waiter[T, R] = _Waiter(item)
        with self._lock:
            self._queue.append(me)
            lead = not self._busy
            self._busy = True
        if not lead:
            me.wake.wait()
            if me.done:
                return self._outcome(me)
        # We lead: our unit and whatever else is waiting, up to max_group.
        with self._lock:
            self._queue.remove(me)
            group = [me, *self._queue[: self._max - 1]]
            del self._queue[: self._max - 1]
        try:
            results = list(self._write([w.item for w in group]))
            if len(results) != len(group):
                raise RuntimeError(f"group write returned {len(results)} results for {len(group)} units")
            for waiter, result in zip(group, results, strict=True):
                waiter.result = result
        except BaseException as exc:  # noqa: BLE001 - every unit of the group learns what happened to it
            for waiter in group:
                waiter.error = exc
        with self._lock:
            self.groups += 1
            self.units += len(group)
            for waiter in group:
                waiter.done = True
                if waiter is not me:
                    waiter.wake.set()
            if self._queue:
                self._queue[0].wake.set()  # the next leader; _busy stays True for it
            else:
                self._busy = False
        return self._outcome(me)

    @staticmethod
    def _outcome(waiter: _Waiter[T, R]) -> R:
        if waiter.error is not None:
            raise waiter.error
        return waiter.result  # type: ignore[return-value]
