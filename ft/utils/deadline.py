"""The one deadline type of ft, and the one converter of timeouts (stdlib only).

A timeout arrives in many shapes: ``datetime.timedelta`` (torch and torchft's API), float or int
seconds (gRPC, sockets), or None (no limit). :func:`to_seconds` is the only converter, and a
bounded wait turns it into a :class:`Deadline` once, at its start, then asks the deadline how
long is left at every step::

    deadline = Deadline.after(timeout)
    with cond:
        if not deadline.wait(cond, lambda: self._done):
            raise TimeoutError(...)

    while not deadline.expired:
        ...
        deadline.sleep(0.1)

Every deadline is a point on ``time.monotonic()``, so it is immune to wall-clock steps.
"""

from __future__ import annotations

import datetime as _dt
import math
import threading
import time
from typing import Callable, Optional, Union

__all__ = ["Deadline", "Timeout", "to_seconds", "to_timedelta"]

Timeout = Union[_dt.timedelta, float, int]


def to_seconds(timeout: Optional[Timeout]) -> Optional[float]:
    """``timedelta`` / seconds / None → float seconds or None (no limit).

    Raises:
        TypeError: for any other type (a string, say), naming it.
        ValueError: for NaN.
    """
    if timeout is None:
        return None
    if isinstance(timeout, _dt.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"a timeout is a timedelta or seconds, got {type(timeout).__name__}")
    if math.isnan(timeout):
        raise ValueError("a timeout must not be NaN")
    return float(timeout)


def to_timedelta(timeout: Timeout) -> _dt.timedelta:
    """``timedelta`` / seconds → ``timedelta`` (what torch's and torchft's APIs store).

    Raises:
        TypeError: for None or any other type, naming it.
        ValueError: for NaN.
    """
    if isinstance(timeout, _dt.timedelta):
        return timeout
    s = to_seconds(timeout)
    if s is None:
        raise TypeError("a timeout is required here (a timedelta or seconds), got None")
    return _dt.timedelta(seconds=s)


class Deadline:
    """A point on the monotonic clock by which a wait must end (``at = inf``: never)."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    @classmethod
    def after(cls, timeout: Optional[Timeout]) -> "Deadline":
        """``timeout`` from now; None means no deadline."""
        s = to_seconds(timeout)
        return cls(math.inf if s is None else time.monotonic() + s)

    @classmethod
    def never(cls) -> "Deadline":
        return cls(math.inf)

    def remaining(self) -> float:
        """Seconds left, never negative (``inf`` for no deadline)."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def sooner(self, timeout: Optional[Timeout]) -> "Deadline":
        """The earlier of this deadline and ``timeout`` from now."""
        other = Deadline.after(timeout)
        return self if self.at <= other.at else other

    def wait(self, cond: threading.Condition, predicate: Callable[[], bool]) -> bool:
        """Waits on ``cond`` (held by the caller) until ``predicate()`` or the deadline.

        Returns the predicate's last value: False means the deadline passed first.
        """
        while not predicate():
            left = self.at - time.monotonic()
            if left <= 0:
                return bool(predicate())
            cond.wait(None if math.isinf(left) else left)
        return True

    def wait_event(self, event: threading.Event) -> bool:
        """Waits for ``event`` until the deadline; returns whether it is set."""
        left = self.remaining()
        return event.wait(None if math.isinf(left) else left)

    def sleep(self, seconds: Optional[float] = None) -> None:
        """Sleeps ``seconds`` (default: until the deadline), never past the deadline."""
        left = self.remaining()
        duration = left if seconds is None else min(seconds, left)
        if math.isinf(duration):
            raise ValueError("sleeping until a deadline that never comes")
        if duration > 0:
            time.sleep(duration)

    def __repr__(self) -> str:
        if math.isinf(self.at):
            return "Deadline(never)"
        return f"Deadline(in {self.at - time.monotonic():.3f}s)"
