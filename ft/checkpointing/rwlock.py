"""A read/write lock with timeouts, for the Manager's state-dict registry.

Many readers (checkpoint transfers reading the state dict) or one writer (the optimizer step
that mutates it). Writers are preferred: once a writer waits, new readers queue behind it, so a
stream of transfers cannot starve the training loop. Locks are not owned by a thread: the
Manager may acquire in one call (``disallow_state_dict_read``) and release in another. The lock
is not reentrant; a thread that holds the read lock and asks for it again while a writer waits
would wait for itself (use a timeout).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator, Optional

__all__ = ["RWLock"]


class RWLock:
    """Writer-preferring read/write lock.

    Args:
        timeout: default seconds to wait in ``r_acquire``/``w_acquire`` (and the context
            managers); negative or None waits forever. A timeout raises ``TimeoutError``.
    """

    def __init__(self, timeout: Optional[float] = -1) -> None:
        self._timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def _deadline(self, timeout: Optional[float]) -> Optional[float]:
        if timeout is None:
            timeout = self._timeout
        if timeout is None or timeout < 0:
            return None
        return time.monotonic() + timeout

    def _wait(self, deadline: Optional[float], what: str) -> None:
        if deadline is None:
            self._cond.wait()
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out waiting for the {what} lock")
        self._cond.wait(remaining)  # the caller's loop re-checks its condition and the time

    def r_acquire(self, timeout: Optional[float] = None) -> None:
        deadline = self._deadline(timeout)
        with self._cond:
            while self._writer or self._writers_waiting:
                self._wait(deadline, "read")
            self._readers += 1

    def r_release(self) -> None:
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("RWLock.r_release() without a matching r_acquire()")
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def w_acquire(self, timeout: Optional[float] = None) -> None:
        deadline = self._deadline(timeout)
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._wait(deadline, "write")
            except BaseException:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers blocked behind this writer may go now
                raise
            self._writers_waiting -= 1
            self._writer = True

    def w_release(self) -> None:
        with self._cond:
            if not self._writer:
                raise RuntimeError("RWLock.w_release() without a matching w_acquire()")
            self._writer = False
            self._cond.notify_all()

    def w_locked(self) -> bool:
        """True while a writer holds the lock."""
        with self._cond:
            return self._writer

    def r_count(self) -> int:
        """Number of readers holding the lock."""
        with self._cond:
            return self._readers

    @contextmanager
    def r_lock(self, timeout: Optional[float] = None) -> Iterator[None]:
        self.r_acquire(timeout)
        try:
            yield
        finally:
            self.r_release()

    @contextmanager
    def w_lock(self, timeout: Optional[float] = None) -> Iterator[None]:
        self.w_acquire(timeout)
        try:
            yield
        finally:
            self.w_release()
