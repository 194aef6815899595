"""Timeouts for futures, code blocks and accelerator streams (torchft's ``torchft.futures``).

Contract:
* ``future_timeout(fut, timeout)`` returns a new future: it completes with ``fut``'s value
  (or ``fut``'s exception) if ``fut`` completes within ``timeout``, otherwise with a
  :class:`TimeoutError` at ``timeout``. ``fut`` itself is never changed (a future that
  completes late is simply not listened to any more).
* ``future_wait(fut, timeout)`` blocks the caller for at most ``timeout`` and returns ``fut``'s
  value, re-raises its exception, or raises :class:`TimeoutError`.
* ``context_timeout(callback, timeout)`` is a context manager: if the block has not exited
  ``timeout`` after it was entered, ``callback()`` runs (once, on the timer thread); exiting
  first cancels it. The block is not interrupted: the callback is how it gets unstuck (for a
  process group: ``pg.abort()``, which fails the op the block is waiting in).
* ``stream_timeout(callback, timeout)`` marks the current accelerator stream now; if the
  work queued on it so far has not finished ``timeout`` later, ``callback()`` runs. Without
  an accelerator (CPU only) there is no stream and nothing is pending: it does nothing.
* Callbacks run on one shared daemon timer thread, in deadline order; they must be quick
  and must not block (a callback that raises is logged, and the thread carries on).

Differences from torchft: one heap-ordered timer thread instead of an asyncio event loop
plus a watchdog thread that exits the process when the loop stalls; ``future_timeout`` of a
``unittest.mock.Mock`` is not special-cased.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Dict, Iterator, List, Optional, Tuple, TypeVar

import torch
from torch.futures import Future

__all__ = ["future_timeout", "future_wait", "stream_timeout", "context_timeout"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


def _seconds(timeout: timedelta) -> float:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, (int, float)):
        return float(timeout)
    raise TypeError(f"timeout must be a timedelta (or seconds), got {type(timeout).__name__}")


class _Timer:
    """One daemon thread running callbacks at their deadlines (a heap of pending entries)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int]] = []  # (deadline, handle)
        # handle -> callback, for the entries neither run nor cancelled. Cancelling drops the
        # callback at once: a closure may hold a future's value (tensors) that must not
        # live until the deadline of a timeout that no longer matters.
        self._callbacks: Dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def schedule(self, delay_s: float, callback: Callable[[], None]) -> int:
        """Runs ``callback`` ``delay_s`` from now unless cancelled first; returns its handle."""
        with self._cond:
            handle = next(self._ids)
            heapq.heappush(self._heap, (time.monotonic() + max(0.0, delay_s), handle))
            self._callbacks[handle] = callback
            if self._thread is None or not self._thread.is_alive():
                # Started on first use (and again after a fork, where the thread is gone).
                self._thread = threading.Thread(target=self._run, name="ft-timeouts", daemon=True)
                self._thread.start()
            self._cond.notify()
            return handle

    def cancel(self, handle: int) -> None:
        with self._cond:
            self._callbacks.pop(handle, None)  # its heap entry is skipped at its deadline

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    due, handle = self._heap[0]
                    left = due - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    heapq.heappop(self._heap)
                    callback = self._callbacks.pop(handle, None)
                    if callback is not None:
                        break
            try:
                callback()
            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                logger.exception("timeout callback %r raised", callback)
            del callback  # its closure may hold tensors: release it now, not at the next one


_TIMER = _Timer()


def _result_devices() -> Optional[List[torch.device]]:
    # A future holding CUDA tensors must know their devices to synchronize its waiters' streams.
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return None


def future_timeout(fut: Future, timeout: timedelta) -> Future:
    """A future with ``fut``'s outcome, or a :class:`TimeoutError` if ``fut`` has not
    completed ``timeout`` from now."""
    delay = _seconds(timeout)
    out: Future = Future(devices=_result_devices())
    lock = threading.Lock()
    settled = [False]

    def settle(outcome: Callable[[], None]) -> bool:
        # First of (fut completes, deadline) wins; the other finds the future settled.
        with lock:
            if settled[0]:
                return False
            settled[0] = True
        outcome()
        return True

    def expire() -> None:
        settle(
            lambda: out.set_exception(TimeoutError(f"future did not complete within {delay:g}s"))
        )

    handle = _TIMER.schedule(delay, expire)

    def done(f: Future) -> None:
        _TIMER.cancel(handle)
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - handed on through the returned future
            settle(lambda err=e: out.set_exception(err))
            return
        settle(lambda: out.set_result(value))

    fut.add_done_callback(done)
    return out


def future_wait(fut: Future, timeout: timedelta) -> T:
    """``fut``'s value, waiting at most ``timeout``.

    Raises:
        TimeoutError: ``fut`` did not complete within ``timeout``.
        Exception: whatever ``fut`` completed with.
    """
    delay = _seconds(timeout)
    event = threading.Event()
    fut.add_done_callback(lambda _f: event.set())
    if not event.wait(timeout=delay):
        raise TimeoutError(f"future did not complete within {delay:g}s")
    return fut.wait()


@contextlib.contextmanager
def context_timeout(callback: Callable[[], None], timeout: timedelta) -> Iterator[None]:
    """Runs ``callback()`` if the block is still running ``timeout`` after it was entered."""
    handle = _TIMER.schedule(_seconds(timeout), callback)
    try:
        yield
    finally:
        _TIMER.cancel(handle)


def stream_timeout(callback: Callable[[], None], timeout: timedelta) -> None:
    """Runs ``callback()`` if the work queued so far on the current accelerator stream has not
    finished ``timeout`` from now. Does nothing without an accelerator."""
    delay = _seconds(timeout)
    if not (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        return  # CPU work is synchronous: nothing is left pending on a stream
    event = torch.Event()
    event.record()

    def check() -> None:
        if not event.query():
            callback()

    _TIMER.schedule(delay, check)
