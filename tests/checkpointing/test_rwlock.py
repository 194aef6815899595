"""RWLock: shared readers, exclusive writer, writer preference, bounded waits."""

from __future__ import annotations

import threading
import time

import pytest

from ft.checkpointing import RWLock


def test_readers_share_and_writer_excludes() -> None:
    lock = RWLock()
    with lock.r_lock():
        with lock.r_lock(timeout=0.1):  # a second reader gets in
            assert lock.r_count() == 2
        with pytest.raises(TimeoutError):
            with lock.w_lock(timeout=0.05):
                pass
    with lock.w_lock():
        assert lock.w_locked()
        with pytest.raises(TimeoutError, match="read"):
            lock.r_acquire(timeout=0.05)
        with pytest.raises(TimeoutError, match="write"):
            lock.w_acquire(timeout=0.05)
    assert not lock.w_locked() and lock.r_count() == 0


def test_default_timeout_from_constructor() -> None:
    lock = RWLock(timeout=0.05)
    lock.w_acquire()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        lock.r_acquire()
    assert time.monotonic() - t0 < 1
    lock.w_release()


def test_waiting_writer_blocks_new_readers_and_gets_the_lock() -> None:
    lock = RWLock()
    lock.r_acquire()
    order = []

    def writer() -> None:
        with lock.w_lock(timeout=5):
            order.append("w")

    def reader() -> None:
        with lock.r_lock(timeout=5):
            order.append("r")

    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.05)  # writer now waits for the first reader
    r = threading.Thread(target=reader)
    r.start()
    time.sleep(0.05)
    assert order == []  # the new reader queues behind the waiting writer
    lock.r_release()
    w.join(5)
    r.join(5)
    assert order == ["w", "r"]


def test_writer_timeout_lets_queued_readers_in() -> None:
    lock = RWLock()
    lock.r_acquire()
    got = threading.Event()

    def writer() -> None:
        with pytest.raises(TimeoutError):
            lock.w_acquire(timeout=0.2)

    def reader() -> None:
        with lock.r_lock(timeout=5):
            got.set()

    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.05)
    r = threading.Thread(target=reader)
    r.start()
    w.join(5)
    assert got.wait(2)
    r.join(5)
    lock.r_release()


def test_release_from_another_thread_and_misuse() -> None:
    lock = RWLock()
    lock.w_acquire()
    t = threading.Thread(target=lock.w_release)
    t.start()
    t.join(5)
    assert not lock.w_locked()
    with pytest.raises(RuntimeError):
        lock.w_release()
    with pytest.raises(RuntimeError):
        lock.r_release()
