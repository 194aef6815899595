"""Table tests of the persistent-failure rule, ft.manager_parts.step_failures (docs/design.md, "Persistent
failures"), and of the pieces around it: settings, normalization, the exception, the step
record's error, and a quorum that keeps failing (a real lighthouse, in process)."""

from __future__ import annotations

import logging

import pickle
import sys
import time
from datetime import timedelta

import pytest

import ft
from ft.launch.worker import emit_step, parse_progress, step_error
from ft.manager import ExceptionWithTraceback
from ft.manager_parts.step_failures import (
    FailureStreak,
    PersistentStepFailure,
    StepFailure,
    StepFailurePolicy,
    next_streak,
    normalize_message,
)
from tests.manager.inproc import make_manager, reporting_manager
from tests.procs import lighthouse

POLICY = StepFailurePolicy(backoff_after=3, max_consecutive_failures=5)
AB = frozenset({"a", "b"})
A = frozenset({"a"})
NCCL = StepFailure("allreduce", "DistBackendError", "ncclInvalidUsage on generation 7")
NCCL_LATER = StepFailure("allreduce", "DistBackendError", "ncclInvalidUsage on generation 12")
OTHER = StepFailure("allreduce", "DistBackendError", "connection reset by peer")
SAME_TEXT_OTHER_PHASE = StepFailure("configure", "DistBackendError", NCCL.message)
SAME_TEXT_OTHER_TYPE = StepFailure("allreduce", "TimeoutError", NCCL.message)


def streak(count, failure=NCCL, members=AB):
    return FailureStreak(count=count, failure=failure, members=members)


# (name, streak before, committed, failure, members, count after, backoff attempt, give up)
CASES = [
    ("first failure", FailureStreak(), False, NCCL, AB, 1, None, False),
    ("second identical", streak(1), False, NCCL, AB, 2, None, False),
    ("third identical backs off", streak(2), False, NCCL, AB, 3, 0, False),
    ("fourth: next backoff", streak(3), False, NCCL, AB, 4, 1, False),
    ("numbers differ only: same fault", streak(3), False, NCCL_LATER, AB, 4, 1, False),
    ("at the bound: give up", streak(4), False, NCCL, AB, 5, 2, True),
    ("past the bound: still giving up", streak(5), False, NCCL, AB, 6, 3, True),
    ("another message: new streak", streak(4), False, OTHER, AB, 1, None, False),
    ("another phase: new streak", streak(4), False, SAME_TEXT_OTHER_PHASE, AB, 1, None, False),
    ("another type: new streak", streak(4), False, SAME_TEXT_OTHER_TYPE, AB, 1, None, False),
    ("membership changed: new streak", streak(4), False, NCCL, A, 1, None, False),
    ("a commit ends it", streak(4), True, None, AB, 0, None, False),
    ("too few replicas: a streak of its own", streak(4), False, None, AB, 1, None, False),
    ("too few again, same members", streak(1, None), False, None, AB, 2, None, False),
    ("too few a third time backs off", streak(2, None), False, None, AB, 3, 0, False),
    ("too few never gives up", streak(4, None), False, None, AB, 5, 2, False),
    ("too few with other members: new streak", streak(3, None), False, None, A, 1, None, False),
    ("a fault after too few: new streak", streak(3, None), False, NCCL, AB, 1, None, False),
    ("a commit ends too few", streak(3, None), True, None, AB, 0, None, False),
]


@pytest.mark.parametrize(
    "name,before,committed,failure,members,count,backoff,give_up", CASES, ids=[c[0] for c in CASES]
)
def test_next_streak(name, before, committed, failure, members, count, backoff, give_up) -> None:
    d = next_streak(POLICY, before, committed=committed, failure=failure, members=members)
    assert (d.streak.count, d.backoff_attempt, d.give_up) == (count, backoff, give_up), name
    if count:
        assert d.streak.failure == failure and d.streak.members == members
    else:
        assert d.streak == FailureStreak()


def test_a_bound_of_zero_never_gives_up_but_backs_off() -> None:
    policy = StepFailurePolicy(backoff_after=1, max_consecutive_failures=0)
    d = next_streak(policy, streak(1000), committed=False, failure=NCCL, members=AB)
    assert d.streak.count == 1001 and d.backoff_attempt == 1000 and not d.give_up


# (env, keyword, expected (backoff_after, max_consecutive_failures, initial, max backoff))
SETTINGS = [
    ({}, None, (3, 20, 0.1, 1.0)),
    ({}, 7, (3, 7, 0.1, 1.0)),
    ({"FT_MAX_CONSECUTIVE_FAILURES": "9"}, 7, (3, 9, 0.1, 1.0)),  # the variable wins
    ({"FT_MAX_CONSECUTIVE_FAILURES": " "}, 7, (3, 7, 0.1, 1.0)),  # empty: unset
    ({"FT_FAILURE_BACKOFF_AFTER": "2", "FT_FAILURE_BACKOFF_MAX_SEC": "0.5"}, 0, (2, 0, 0.1, 0.5)),
    ({"FT_FAILURE_BACKOFF_MAX_SEC": "0.05"}, None, (3, 20, 0.05, 0.05)),
]


@pytest.mark.parametrize("env,keyword,expected", SETTINGS)
def test_policy_from_settings(env, keyword, expected) -> None:
    p = StepFailurePolicy.from_settings(keyword, env)
    assert (p.backoff_after, p.max_consecutive_failures, p.initial_backoff_s, p.max_backoff_s) == (
        expected
    )


@pytest.mark.parametrize(
    "env,keyword,match",
    [
        ({"FT_MAX_CONSECUTIVE_FAILURES": "many"}, None, "FT_MAX_CONSECUTIVE_FAILURES"),
        ({"FT_FAILURE_BACKOFF_MAX_SEC": "soon"}, None, "FT_FAILURE_BACKOFF_MAX_SEC"),
        ({}, -1, "max_consecutive_failures"),
        ({"FT_FAILURE_BACKOFF_AFTER": "0"}, None, "backoff_after"),
        ({"FT_FAILURE_BACKOFF_MAX_SEC": "0"}, None, "backoff"),
    ],
)
def test_bad_settings_are_refused_naming_them(env, keyword, match) -> None:
    with pytest.raises(ValueError, match=match):
        StepFailurePolicy.from_settings(keyword, env)


def test_normalization_keeps_the_words_and_drops_what_varies() -> None:
    a = (
        "ft: allreduce on lane 0 of generation 3 failed: Connection closed by peer "
        "[127.0.0.1]:436 (replica g1:0b6f4a4e-8a4b-4a7e-9f3e-0123456789ab, ptr 0x7f3a9c)"
    )
    b = a.replace("3 failed", "41 failed").replace(":436", ":51371").replace("0x7f3a9c", "0xbeef")
    b = b.replace("0b6f4a4e-8a4b-4a7e-9f3e-0123456789ab", "ffffffff-8a4b-4a7e-9f3e-0123456789ab")
    assert normalize_message(a) == normalize_message(b)
    assert "Connection closed by peer" in normalize_message(a)
    assert normalize_message("Connection reset by peer") != normalize_message(
        "Connection closed by peer"
    )


def test_a_failure_reads_through_the_managers_wrapper_and_fits_one_line() -> None:
    try:
        raise ValueError("tensors must be contiguous\nsecond line")
    except ValueError as e:
        wrapped = ExceptionWithTraceback(e)
    f = StepFailure.from_exception(wrapped, "allreduce")
    assert f == StepFailure("allreduce", "ValueError", "tensors must be contiguous")
    assert f.one_line() == "allreduce: ValueError: tensors must be contiguous"
    long = StepFailure("heal", "RuntimeError", "x" * 500).one_line()
    assert len(long) == 200 and long.startswith("heal: RuntimeError: x") and long.endswith("...")


def test_the_exception_names_the_error_the_phase_the_count_and_the_setting() -> None:
    policy = StepFailurePolicy(max_consecutive_failures=5)
    e = PersistentStepFailure.of(streak(5), policy, step=12)
    assert isinstance(e, RuntimeError) and ft.PersistentStepFailure is PersistentStepFailure
    text = str(e)
    for part in (
        "step 12",
        "5 times in a row",
        "phase allreduce",
        "DistBackendError: ncclInvalidUsage on generation 7",
        "max_consecutive_failures=5",
        "FT_MAX_CONSECUTIVE_FAILURES",
    ):
        assert part in text, (part, text)
    assert (e.phase, e.count, e.bound) == ("allreduce", 5, 5)
    again = pickle.loads(pickle.dumps(e))
    assert str(again) == text and (again.phase, again.error, again.count) == (
        "allreduce",
        e.error,
        5,
    )


def test_a_step_record_carries_the_error_only_when_the_step_did_not_commit(capsys) -> None:
    emit_step(
        reporting_manager(last_step_error="allreduce: ValueError: bad\ttensor"),
        loss=1.0,
        committed=False,
    )
    emit_step(
        reporting_manager(last_step_error="allreduce: ValueError: bad"), loss=1.0, committed=True
    )
    out = [parse_progress(line) for line in capsys.readouterr().out.splitlines()]
    assert out[0]["error"] == "allreduce: ValueError: bad tensor"
    assert "error" not in out[1]
    # A Manager-like object without ft's summary: the first line of errored().
    assert step_error(reporting_manager(errored=RuntimeError("peer gone\ntraceback..."))) == (
        "RuntimeError: peer gone"
    )
    assert step_error(reporting_manager()) is None


def test_a_quorum_that_keeps_failing_raises_persistent_step_failure() -> None:
    # The lighthouse goes away after the Manager starts: every quorum ends at its deadline
    # with the same TimeoutError, and the third raises PersistentStepFailure instead.
    lh = lighthouse()
    manager = make_manager(
        lh.address(),
        "q",
        use_async_quorum=False,
        quorum_timeout=timedelta(seconds=0.3),
        connect_timeout=timedelta(seconds=0.3),
        max_consecutive_failures=3,
    )
    try:
        lh.shutdown()
        raised = []
        deadline = time.monotonic() + 60
        while len(raised) < 3 and time.monotonic() < deadline:
            try:
                manager.start_quorum()
            except Exception as e:  # noqa: BLE001 - collected and checked below
                raised.append(e)
        assert len(raised) == 3, raised
        assert not any(isinstance(e, PersistentStepFailure) for e in raised[:2]), raised
        last = raised[2]
        assert isinstance(last, PersistentStepFailure), repr(last)
        assert last.phase == "quorum" and last.count == 3
        assert type(last.__cause__).__name__ == type(raised[0]).__name__
        assert manager.last_step_error().startswith("quorum: ")
        # Settled once per step: asking again in the same step raises the same exception.
        with pytest.raises(PersistentStepFailure) as again:
            manager.wait_quorum()
        assert again.value is last
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()


def test_a_group_short_of_replicas_backs_off_and_never_gives_up(caplog) -> None:
    # One replica where min_replica_size wants two: the lighthouse forms a quorum of one, and
    # every step fails for want of a second replica, with the same members. From the third
    # such step on the Manager waits before its next quorum (logged), and it never raises
    # PersistentStepFailure, not even past max_consecutive_failures.
    lh = lighthouse()
    manager = make_manager(
        lh.address(),
        "short",
        use_async_quorum=False,
        min_replica_size=2,
        max_consecutive_failures=3,
    )
    caplog.set_level(logging.WARNING, logger="ft.manager")
    try:
        for _ in range(5):
            manager.start_quorum()
            assert manager.should_commit() is False
        backoffs = [
            r.ft
            for r in caplog.records
            if getattr(r, "ft", {}).get("event") == "short_of_replicas_backoff"
        ]
        assert [b["consecutive_failures"] for b in backoffs] == [3, 4, 5], backoffs
        assert all(b["backoff_s"] > 0 for b in backoffs), backoffs
        assert "min_replica_size=2" in manager.last_step_error()
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()


def test_a_worker_that_gives_up_reports_the_cause_first_and_exits_78(procs) -> None:
    code = (
        "from ft.launch import worker\n"
        "from ft.manager_parts.step_failures import FailureStreak, StepFailure, StepFailurePolicy\n"
        "from ft.manager_parts.step_failures import PersistentStepFailure\n"
        "f = StepFailure('allreduce', 'ValueError', 'tensors must be contiguous ' + 'x' * 300)\n"
        "s = FailureStreak(count=20, failure=f, members=frozenset({'a', 'b'}))\n"
        "e = PersistentStepFailure.of(s, StepFailurePolicy(), step=4)\n"
        "worker.exit_for_persistent_failure('train: group 1 rank 0', e)\n"
    )
    child = procs.start([sys.executable, "-c", code])
    assert child.wait(60) == 78, child.output()
    records = [parse_progress(line) for line in child.output().splitlines()]
    gave_up = [r for r in records if r is not None and r["event"] == "gave_up"]
    assert len(gave_up) == 1, child.output()
    line = gave_up[0]["error"]
    assert line.startswith("20 consecutive steps failed: allreduce: ValueError: tensors must"), line
    assert len(line) <= 200
    assert "train: group 1 rank 0: PersistentStepFailure: step 4 failed 20 times" in child.output()
