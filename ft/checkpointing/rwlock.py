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
from contextlib import contextmanager
from typing import Callable, ContextManager, Iterator, Optional

from ft.utils.deadline import Deadline, Timeout, to_seconds

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

    def _deadline(self, timeout: Optional[Timeout]) -> Deadline:
        seconds = to_seconds(self._timeout if timeout is None else timeout)
        if seconds is None or seconds < 0:
            return Deadline.never()
        return Deadline.after(seconds)

    def r_acquire(self, timeout: Optional[float] = None) -> None:
        deadline = self._deadline(timeout)
        with self._cond:
            if not deadline.wait(self._cond, lambda: not (self._writer or self._writers_waiting)):
                raise TimeoutError("timed out waiting for the read lock")
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
                if not deadline.wait(self._cond, lambda: not (self._writer or self._readers)):
                    raise TimeoutError("timed out waiting for the write lock")
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

    def r_lock(self, timeout: Optional[float] = None) -> ContextManager[None]:
        """The read lock, held for a ``with`` block."""
        return _held(self.r_acquire, self.r_release, timeout)

    def w_lock(self, timeout: Optional[float] = None) -> ContextManager[None]:
        """The write lock, held for a ``with`` block."""
        return _held(self.w_acquire, self.w_release, timeout)


@contextmanager
def _held(
    acquire: Callable[[Optional[float]], None],
    release: Callable[[], None],
    timeout: Optional[float],
) -> Iterator[None]:
    acquire(timeout)
    try:
        yield
    finally:
        release()
