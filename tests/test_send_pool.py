"""The process's pool for inline sends: bounded, and it stops cleanly (no thread per request, no send lost)."""

from __future__ import annotations

import threading

import pytest

from payments.outbound.send_pool import SendPool


def test_it_runs_a_send_on_one_of_its_own_workers():
    pool = SendPool(2, 1, name="t-send")
    names: list[str] = []
    try:
        future = pool.submit(lambda: names.append(threading.current_thread().name))
        assert future is not None
        future.result(5)
    finally:
        pool.shutdown()
    assert names and names[0].startswith("t-send")


def test_it_refuses_a_send_once_its_workers_and_queue_are_taken_and_takes_one_again_when_a_place_frees():
    pool = SendPool(1, 1)
    release = threading.Event()
    try:
        running, queued = pool.submit(release.wait), pool.submit(release.wait)
        assert running is not None and queued is not None
        assert pool.submit(lambda: None) is None, "a third send would wait in an unbounded queue"
        release.set()
        running.result(5), queued.result(5)
        again = pool.submit(lambda: 42)
        assert again is not None and again.result(5) == 42
    finally:
        release.set()
        pool.shutdown()


def test_shutdown_lets_running_sends_finish_and_takes_no_more():
    pool = SendPool(1, 0)
    started, release, finished = threading.Event(), threading.Event(), []
    future = pool.submit(lambda: (started.set(), release.wait(5), finished.append(True)))
    assert future is not None and started.wait(5)
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    release.set()
    stopper.join(5)
    assert not stopper.is_alive() and finished == [True]
    assert pool.submit(lambda: None) is None


def test_it_needs_a_worker():
    with pytest.raises(ValueError):
        SendPool(0, 4)
