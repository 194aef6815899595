"""The Manager's parts on their own (ft/manager_parts): the registered state and its lock, and
a step's errors. The group wiring needs a store, servers and a lighthouse: the Manager's tests
cover it (test_group_store.py, test_torchft_extras.py, tests/security/test_store_auth.py)."""

from __future__ import annotations

import threading
import time

import pytest

from ft.manager_parts.state_dicts import RegisteredState
from ft.manager_parts.step_errors import ExceptionWithTraceback, StepErrors


def _state():
    loaded = {}
    st = RegisteredState(lock_timeout_s=5.0)
    st.register("a", lambda v: loaded.__setitem__("a", v), lambda: {"x": 1})
    st.register("b", lambda v: loaded.__setitem__("b", v), lambda: {"y": 2})
    return st, loaded


def test_a_key_registers_once_and_reads_and_loads_every_key():
    st, loaded = _state()
    with pytest.raises(ValueError, match="'a'"):
        st.register("a", lambda v: None, lambda: None)
    assert st.read() == {"a": {"x": 1}, "b": {"y": 2}}
    assert sorted(st.load_fns) == ["a", "b"]
    st.load({"a": 10, "b": 20})
    assert loaded == {"a": 10, "b": 20}


def test_a_state_without_a_registered_key_loads_nothing():
    st, loaded = _state()
    with pytest.raises(KeyError, match="'b'"):
        st.load({"a": 10})
    assert loaded == {}


def test_reads_wait_while_the_training_thread_holds_the_state():
    st, _ = _state()
    st.disallow_reads()
    st.disallow_reads()  # nests as a no-op, as in torchft
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("v", st.read()), daemon=True)
    reader.start()
    time.sleep(0.2)
    assert "v" not in got  # still waiting for the state
    st.allow_reads()
    reader.join(5)
    assert got["v"] == {"a": {"x": 1}, "b": {"y": 2}}
    st.allow_reads()  # a second allow is a no-op too
    assert st.read()["b"] == {"y": 2}


def test_the_first_error_of_a_step_is_kept_and_an_abort_aborts_the_group():
    aborts, firsts = [], []
    errors = StepErrors(abort_group=lambda: aborts.append(1), on_first=firsts.append)
    first = TimeoutError("the allreduce timed out")
    errors.report(first, abort=False, phase="allreduce")
    errors.report(RuntimeError("refused after the abort"), abort=True, phase="user")
    assert isinstance(errors.first, ExceptionWithTraceback)
    assert isinstance(errors.first, TimeoutError)  # keeps the original's type
    assert errors.first.original_exception is first
    assert errors.phase == "allreduce" and errors.aborted and aborts == [1]
    assert firsts == [first]  # logged once, for the first
    errors.clear()
    assert (errors.first, errors.phase, errors.aborted) == (None, "user", False)


def test_reporting_survives_a_group_whose_abort_raises():
    def broken() -> None:
        raise RuntimeError("abort failed")

    errors = StepErrors(abort_group=broken, on_first=lambda e: None)
    errors.report(ValueError("bad step"), abort=True)
    assert errors.aborted and isinstance(errors.first, ValueError)


class _RecordingLog:
    def __init__(self):
        self.errors = []
        self.warnings = []

    def error(self, event, message, **fields):
        self.errors.append((event, fields))

    def warning(self, event, message, **fields):
        self.warnings.append((event, fields))


def test_identical_failures_back_off_then_give_up_and_a_commit_clears_the_streak():
    from ft.manager_parts.step_failures import (
        PersistentStepFailure,
        StepFailure,
        StepFailurePolicy,
    )
    from ft.manager_parts.step_outcomes import StepOutcomes

    log = _RecordingLog()
    policy = StepFailurePolicy(backoff_after=2, max_consecutive_failures=4)
    out = StepOutcomes(policy, log)
    members = frozenset({"a", "b"})
    fail = StepFailure(phase="allreduce", error_type="RuntimeError", message="mismatch")
    raised = []
    for step in range(4):
        out.new_step()
        raised.append(out.settle(False, fail, members, 7, "short"))
        if step == 0:
            assert out.take_backoff() == 0.0  # a first failure is retried at once
    assert raised[:3] == [None, None, None]
    assert isinstance(raised[3], PersistentStepFailure) and raised[3].count == 4
    assert [e for e, _ in log.errors].count("step_failure_backoff") >= 1
    assert log.errors[-1][0] == "persistent_failure"
    assert out.last_error.startswith("allreduce: RuntimeError")
    # the quorum's failure surfaces again within the step: the same exception, settled once
    out.new_step()
    e = TimeoutError("quorum timed out")
    first = out.quorum_failed(e, members, 7, "short")
    assert out.quorum_failed(e, members, 7, "short") is first
    # a commit ends the streak and owes nothing
    out.new_step()
    assert out.settle(True, None, members, 8, "") is None
    assert (out.streak.count, out.last_error, out.take_backoff()) == (0, None, 0.0)
    # too few replicas is no fault: a streak of its own, said as given, backed off from after
    # backoff_after steps and never given up on (max_consecutive_failures is 4 here)
    for count in range(1, 7):
        out.new_step()
        assert out.settle(False, None, members, 8, "commit: 1 replica(s)") is None
        assert out.last_error == "commit: 1 replica(s)" and out.streak.count == count
        assert (out.take_backoff() > 0) == (count >= policy.backoff_after), count
    assert [e for e, _ in log.warnings] == ["short_of_replicas_backoff"] * 5
