"""ft.utils.deadline: the one converter of timeouts and the one deadline type."""

from __future__ import annotations

import datetime as dt
import math
import threading
import time

import pytest

from ft.utils.deadline import Deadline, to_seconds, to_timedelta


@pytest.mark.parametrize(
    "timeout, seconds",
    [
        (None, None),
        (dt.timedelta(seconds=1.5), 1.5),
        (dt.timedelta(milliseconds=20), 0.02),
        (3, 3.0),
        (0.25, 0.25),
        (0, 0.0),
        (-1, -1.0),  # the caller decides what a negative timeout means (an expired deadline)
        (math.inf, math.inf),
    ],
)
def test_to_seconds(timeout, seconds):
    assert to_seconds(timeout) == seconds


@pytest.mark.parametrize(
    "bad, error, says",
    [
        ("10", TypeError, "str"),
        (True, TypeError, "bool"),
        ([1], TypeError, "list"),
        (math.nan, ValueError, "NaN"),
    ],
)
def test_to_seconds_refuses_what_is_not_a_timeout(bad, error, says):
    with pytest.raises(error, match=says):
        to_seconds(bad)


@pytest.mark.parametrize(
    "timeout, want",
    [
        (dt.timedelta(seconds=2), dt.timedelta(seconds=2)),
        (2, dt.timedelta(seconds=2)),
        (0.5, dt.timedelta(milliseconds=500)),
    ],
)
def test_to_timedelta(timeout, want):
    assert to_timedelta(timeout) == want


@pytest.mark.parametrize(
    "bad, error", [(None, TypeError), ("1", TypeError), (math.nan, ValueError)]
)
def test_to_timedelta_refuses(bad, error):
    with pytest.raises(error):
        to_timedelta(bad)


def test_a_deadline_counts_down_on_the_monotonic_clock():
    d = Deadline.after(0.2)
    assert not d.expired and 0 < d.remaining() <= 0.2
    time.sleep(0.25)
    assert d.expired and d.remaining() == 0.0
    assert Deadline.after(0).expired and Deadline.after(-5).remaining() == 0.0


def test_no_deadline_never_expires():
    for d in (Deadline.after(None), Deadline.never()):
        assert not d.expired and d.remaining() == math.inf and "never" in repr(d)
    with pytest.raises(ValueError, match="never comes"):
        Deadline.never().sleep()


def test_sooner_keeps_the_earlier_deadline():
    far, near = Deadline.after(100), Deadline.after(1)
    assert far.sooner(1).at <= near.at + 0.1
    assert near.sooner(100) is near
    assert Deadline.never().sooner(None).at == math.inf


def test_wait_returns_true_as_soon_as_the_condition_holds():
    cond = threading.Condition()
    state = {"done": False}

    def finish():
        time.sleep(0.05)
        with cond:
            state["done"] = True
            cond.notify_all()

    t = threading.Thread(target=finish)
    t.start()
    d = Deadline.after(10)
    with cond:
        assert d.wait(cond, lambda: state["done"]) is True
    t.join(10)
    assert d.remaining() > 5  # it did not wait out the deadline


def test_wait_returns_false_at_the_deadline_and_survives_spurious_wakeups():
    cond = threading.Condition()
    stop = threading.Event()

    def poke():  # wakes the waiter without making the condition true
        while not stop.is_set():
            with cond:
                cond.notify_all()
            time.sleep(0.01)

    t = threading.Thread(target=poke)
    t.start()
    try:
        d = Deadline.after(0.15)
        with cond:
            assert d.wait(cond, lambda: False) is False
        assert d.expired
    finally:
        stop.set()
        t.join(10)


def test_wait_event_and_sleep_never_pass_the_deadline():
    ev = threading.Event()
    d = Deadline.after(0.1)
    assert d.wait_event(ev) is False and d.expired
    ev.set()
    assert Deadline.after(0).wait_event(ev) is True
    d = Deadline.after(0.1)
    t0 = time.monotonic()
    d.sleep(5)  # capped by the deadline
    assert d.expired and time.monotonic() - t0 < 2
