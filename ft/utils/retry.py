"""The one "retry with backoff until a deadline" helper of ft.

Use it instead of writing another retry loop::

    from ft.utils.retry import retry_until

    value = retry_until(
        lambda remaining: call(timeout=remaining),
        deadline=Deadline.after(5.0),
        retries=3,                               # None: until the deadline
        retry_on=lambda exc: isinstance(exc, ConnectionError),
    )

``fn`` receives the seconds left before the deadline. A failure that ``retry_on`` rejects is
raised at once; when the retries or the time run out, the last failure is raised. Backoff is
exponential with full jitter, and a sleep never runs past the deadline.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional, TypeVar, Union

from .deadline import Deadline

T = TypeVar("T")

__all__ = ["retry_until", "backoff_delays"]


def backoff_delays(initial: float = 0.05, maximum: float = 1.0, multiplier: float = 2.0):
    """Infinite generator of jittered exponential backoff delays (seconds)."""
    delay = initial
    while True:
        yield delay * (0.5 + random.random() / 2)
        delay = min(maximum, delay * multiplier)


def retry_until(
    fn: Callable[[float], T],
    deadline: Union[Deadline, float],
    *,
    retries: Optional[int] = None,
    retry_on: Callable[[BaseException], bool] = lambda exc: isinstance(exc, Exception),
    initial_backoff: float = 0.05,
    max_backoff: float = 1.0,
    on_retry: Optional[Callable[[int, BaseException, float], None]] = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Calls ``fn(remaining_seconds)`` until it returns, retrying failures with backoff.

    Args:
        fn: the attempt; gets the time left (> 0) before ``deadline``.
        deadline: a :class:`~ft.utils.deadline.Deadline`, or an absolute time on ``clock``
            (``time.monotonic`` by default).
        retries: number of retries after the first attempt; ``None`` = until the deadline.
        retry_on: predicate deciding whether an exception is worth retrying.
        on_retry: called as ``on_retry(attempt, exc, delay)`` before each backoff sleep.

    Raises:
        The last exception of ``fn``; ``TimeoutError`` if the deadline passed before the first
        attempt.
    """
    if isinstance(deadline, Deadline):
        deadline = deadline.at
    attempt = 0
    delays = backoff_delays(initial_backoff, max_backoff)
    while True:
        remaining = deadline - clock()
        if remaining <= 0:
            raise TimeoutError("deadline passed before the call could be attempted")
        try:
            return fn(remaining)
        except BaseException as exc:  # noqa: B902 - filtered by retry_on
            if not retry_on(exc) or (retries is not None and attempt >= retries):
                raise
            delay = next(delays)
            if delay >= deadline - clock():
                raise  # no time left for another attempt after the backoff
            if on_retry is not None:
                on_retry(attempt, exc, delay)
            sleep(delay)
            attempt += 1
