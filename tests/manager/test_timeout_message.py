"""A missed quorum or commit deadline raises TimeoutError in ft's words (which call, what it
waited for) and ends with torchft's phrase for it, so code written against torchft that
matches on the text keeps working."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest

from tests.manager.inproc import lighthouse, make_manager

TORCHFT_REGEX = "status: Cancelled, message.*Timeout expired"  # torchft's own test's pattern


@pytest.fixture
def lh():
    server = lighthouse(min_replicas=2)  # never met: the quorum waits out its deadline
    yield server.address()
    server.shutdown()


def _raises_in_time(fn, ft_words: str) -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        fn()
    assert time.monotonic() - start < 5.0  # torchft asks for < 1 s; slack for a loaded machine
    message = str(info.value)
    assert re.search(TORCHFT_REGEX, message), message
    assert ft_words in message, message


def test_quorum_and_commit_timeouts_carry_ft_and_torchft_words(lh) -> None:
    manager = make_manager(lh, "lonely", min_replica_size=2, use_async_quorum=False)
    try:
        _raises_in_time(
            lambda: manager.start_quorum(timeout=timedelta(seconds=0.01)),
            "Quorum: deadline exceeded",
        )
        _raises_in_time(
            lambda: manager.should_commit(timeout=timedelta(seconds=0.01)),
            "deadline exceeded",
        )
    finally:
        manager.shutdown(wait=False)


def test_deadline_error_of_a_remote_call_has_both_phrasings() -> None:
    import grpc

    from ft.coordination import _rpc

    err = _rpc.status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "waited 10 ms", "ShouldCommit")
    assert isinstance(err, TimeoutError)
    assert str(err).startswith("ShouldCommit: deadline exceeded: waited 10 ms")
    assert re.search(TORCHFT_REGEX, str(err)), str(err)


def test_work_wait_honours_its_timeout_and_fails_the_step() -> None:
    # Two groups. In one step g1 never issues its allreduce, so g0's cannot complete: wait()
    # with a timeout returns False once it passes (as torchft's does), and nobody commits
    # that step. The steps before and after it commit.
    import threading

    import torch

    from tests.manager.inproc import in_threads, tensor_managers

    server = lighthouse(min_replicas=2)
    managers = []
    try:
        state = [torch.zeros(4), torch.zeros(4)]
        managers = tensor_managers(
            server.address(), state, pg_timeout=timedelta(seconds=30), use_async_quorum=False
        )
        gave_up = threading.Event()

        def healthy(i: int):
            m = managers[i]
            m.start_quorum()
            m.wait_quorum()
            t = torch.full((4,), float(i + 1))
            ok = m.allreduce(t).wait(timeout=timedelta(seconds=20))
            return ok, t, m.should_commit()

        def check_healthy() -> None:
            outs = in_threads([lambda: healthy(0), lambda: healthy(1)], timeout=60)
            for ok, t, committed in [o["value"] for o in outs]:
                assert ok and committed
                assert torch.equal(t, torch.full((4,), 1.5))  # AVG over both groups

        def stalled(i: int):
            m = managers[i]
            m.start_quorum()
            m.wait_quorum()
            if i == 0:
                t0 = time.monotonic()
                ok = m.allreduce(torch.ones(4)).wait(timeout=timedelta(seconds=0.5))
                took = time.monotonic() - t0
                gave_up.set()
            else:
                gave_up.wait(30)  # skips its allreduce until g0 gave up, then fails its step
                m.report_error(RuntimeError("g1 skipped its allreduce"))
                ok, took = None, 0.0
            return ok, took, m.should_commit()

        check_healthy()
        step = managers[0].current_step()
        outs = in_threads([lambda: stalled(0), lambda: stalled(1)], timeout=60)
        (ok0, took0, commit0), (_, _, commit1) = [o["value"] for o in outs]
        assert ok0 is False and took0 < 10, (ok0, took0)
        assert not commit0 and not commit1
        assert managers[0].current_step() == step
        check_healthy()
        assert managers[0].current_step() == step + 1
    finally:
        for m in managers:
            m.shutdown(wait=False)
        server.shutdown()
