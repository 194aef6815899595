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
