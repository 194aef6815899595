"""ft.utils.retry.retry_until: the one retry-with-backoff helper."""

import pytest

from ft.utils.retry import retry_until


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, d):
        assert d > 0
        self.t += d


def test_retries_until_success():
    clock, calls = Clock(), []

    def fn(remaining):
        calls.append(remaining)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "ok"

    assert retry_until(fn, 10.0, clock=clock, sleep=clock.sleep) == "ok"
    assert len(calls) == 3 and calls[0] == 10.0 and calls[2] < 10.0


def test_retry_budget_and_filter():
    clock = Clock()
    n = [0]

    def fn(_):
        n[0] += 1
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        retry_until(fn, 100.0, retries=2, clock=clock, sleep=clock.sleep)
    assert n[0] == 3
    n[0] = 0
    with pytest.raises(ConnectionError):
        retry_until(fn, 100.0, retry_on=lambda e: False, clock=clock, sleep=clock.sleep)
    assert n[0] == 1


def test_never_sleeps_past_deadline():
    clock = Clock()

    def fn(_):
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):
        retry_until(fn, 0.5, clock=clock, sleep=clock.sleep, initial_backoff=0.2, max_backoff=0.2)
    assert clock.t <= 0.5
    with pytest.raises(TimeoutError):
        retry_until(fn, -1.0, clock=clock, sleep=clock.sleep)
