"""The Manager's step parts on their own (ft/manager_parts): its settings, the step state the
parts share, the group rebuild, the reporting future, the vote, and a quorum round driven by
a stand-in client. Real Manager runs (test_manager_inproc.py, torchft's own tests) cover the
parts together."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from ft.coordination import QuorumResult
from ft.manager_parts.assembly import StepHooks, StepParts
from ft.manager_parts.group_rebuild import (
    configure_for_quorum,
    prepare_group,
    reconfigure_from_handles,
    require_rebuildable,
)
from ft.manager_parts.managed_work import reporting_future
from ft.manager_parts.settings import ManagerSettings
from ft.manager_parts.step_state import Forward, StepState

TO = timedelta(seconds=5)


def _resolve(env: Dict[str, str], **kw: Any) -> ManagerSettings:
    args: Dict[str, Any] = dict(
        min_replica_size=1,
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=60),
        rank=None,
        world_size=None,
        lighthouse_addr=None,
        quorum_retries=None,
    )
    args.update(kw)
    return ManagerSettings.resolve(**args, env=env)


@pytest.mark.parametrize(
    "env, kw, expect",
    [
        # torchft's variables win over the keywords
        ({"TORCHFT_TIMEOUT_SEC": "1.5", "TORCHFT_LIGHTHOUSE": "lh:1"}, {}, ("timeout", 1.5)),
        (
            {"TORCHFT_QUORUM_TIMEOUT_SEC": "7", "TORCHFT_LIGHTHOUSE": "lh:1"},
            {},
            ("quorum_timeout", 7),
        ),
        (
            {"TORCHFT_CONNECT_TIMEOUT_SEC": "3", "TORCHFT_LIGHTHOUSE": "lh:1"},
            {"connect_timeout": timedelta(seconds=9)},
            ("connect_timeout", 3),
        ),
        (
            {"TORCHFT_QUORUM_RETRIES": "4", "TORCHFT_LIGHTHOUSE": "lh:1"},
            {"quorum_retries": 1},
            ("quorum_retries", 4),
        ),
        ({"RANK": "1", "WORLD_SIZE": "3"}, {}, ("rank", 1)),
        (
            {"TORCHFT_LIGHTHOUSE": "lh:1"},
            {"lighthouse_addr": "given:2"},
            ("lighthouse_addr", "given:2"),
        ),
        ({"TORCHFT_LIGHTHOUSE": "lh:1"}, {}, ("lighthouse_addr", "lh:1")),
        # an empty variable leaves the keyword
        ({"TORCHFT_TIMEOUT_SEC": "", "TORCHFT_LIGHTHOUSE": "lh:1"}, {"timeout": 2}, ("timeout", 2)),
    ],
)
def test_settings_take_the_environment_over_the_keywords(env, kw, expect) -> None:
    name, value = expect
    got = getattr(_resolve(env, **kw), name)
    if isinstance(got, timedelta):
        got = got.total_seconds()
    assert got == value


@pytest.mark.parametrize(
    "env, kw, message",
    [
        ({"TORCHFT_LIGHTHOUSE": "lh:1"}, {"min_replica_size": 0}, "min_replica_size must be >= 1"),
        ({"TORCHFT_LIGHTHOUSE": "lh:1"}, {"rank": 2, "world_size": 2}, "rank 2 out of range"),
        ({}, {"rank": 0, "world_size": 2}, "lighthouse_addr is required"),
        ({"TORCHFT_TIMEOUT_SEC": "soon", "TORCHFT_LIGHTHOUSE": "lh:1"}, {}, "'soon'"),
    ],
)
def test_bad_settings_are_named(env, kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        _resolve(env, **kw)


def test_a_rank_other_than_zero_may_leave_the_lighthouse_to_rank_zero() -> None:
    assert _resolve({}, rank=1, world_size=2).lighthouse_addr is None


def test_step_state_enters_quorums_and_answers_membership() -> None:
    st = StepState(use_async_quorum=False, init_sync=True)
    assert st.enter_quorum(5, ["a", "b"]) is True
    assert st.enter_quorum(5, ["a", "b"]) is False
    assert st.in_quorum(5, "a") and not st.in_quorum(5, "c") and not st.in_quorum(4, "a")
    st.participating_rank = 1
    st.participating_world_size = 3
    assert (st.participation.rank, st.participation.contributors) == (1, 3)
    assert st.participation.commit_size == 3
    st.load_counters({"step": "7", "batches_committed": 21})
    assert st.counters() == {"step": 7, "batches_committed": 21}


def test_forward_reads_and_writes_the_owners_attribute() -> None:
    class Holder:
        alias = Forward("owner", "value")

        def __init__(self) -> None:
            self.owner = SimpleNamespace(value=1)

    h = Holder()
    assert h.alias == 1
    h.alias = 2
    assert h.owner.value == 2
    assert isinstance(Holder.alias, Forward)


class _Group:
    """A stand-in process group (no communication: what is asked of it is recorded)."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.calls: List[Any] = []

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int = -1
    ) -> None:
        self.calls.append((store_addr, replica_id, rank, world_size, quorum_id))

    def errored(self) -> None:
        return None

    def abort(self) -> None:
        self.calls.append("abort")


def _quorum(**kw: Any) -> QuorumResult:
    q = QuorumResult()
    q.quorum_id = kw.get("quorum_id", 9)
    q.replica_rank = kw.get("replica_rank", 1)
    q.replica_world_size = kw.get("replica_world_size", 2)
    q.replica_ids = kw.get("replica_ids", ["a", "b"])
    q.store_address = "host:1"
    q.max_step = kw.get("max_step", 0)
    q.heal = False
    return q


def test_a_group_is_bounded_by_the_tighter_timeout_and_configured_with_what_it_takes() -> None:
    pg = _Group(timedelta(seconds=30))
    takes = prepare_group(pg, timedelta(seconds=10))
    assert pg.timeout == timedelta(seconds=10)
    prepare_group(pg, timedelta(seconds=60))
    assert pg.timeout == timedelta(seconds=10)
    configure_for_quorum(pg, _quorum(), rank=0, world_size=1, replica_id="r", takes=takes)
    # it takes quorum_id, not ft's other facts (group_rank, global_ranks, ...)
    assert pg.calls == [("host:1/torchft/9/0", "r", 1, 2, 9)]


def test_a_group_that_cannot_be_rebuilt_and_a_missing_handle_are_named() -> None:
    with pytest.raises(ValueError, match="cannot be reconfigured at a new quorum"):
        require_rebuildable(object())
    with pytest.raises(RuntimeError, match="not every member sent a reconfigure handle"):
        reconfigure_from_handles(object(), 3, ["h", ""], TO)


def test_the_reporting_future_yields_the_default_and_reports_a_failure_or_a_timeout() -> None:
    reports: List[Any] = []
    report = lambda e, abort, phase: reports.append((type(e), abort, phase))  # noqa: E731
    failing: torch.futures.Future = torch.futures.Future()
    got = reporting_future(failing, "default", TO, report)
    failing.set_exception(RuntimeError("lost"))
    assert got.wait() == "default"
    never: torch.futures.Future = torch.futures.Future()
    assert reporting_future(never, 0, timedelta(milliseconds=20), report).wait() == 0
    assert reports == [(RuntimeError, False, "allreduce"), (TimeoutError, False, "allreduce")]
    ok: torch.futures.Future = torch.futures.Future()
    ok.set_result(5)
    assert reporting_future(ok, 0, TO, report).wait() == 5


class _Client:
    """Answers quorum calls from a list and votes as told, recording what it was sent."""

    def __init__(self, quorums: List[QuorumResult], votes: List[bool]) -> None:
        self.quorums, self.votes = quorums, votes
        self.sent: List[Dict[str, Any]] = []

    def _quorum(self, **kw: Any) -> QuorumResult:
        self.sent.append(kw)
        return self.quorums.pop(0)

    def should_commit(self, rank: int, step: int, vote: bool, timeout: timedelta) -> bool:
        return vote and self.votes.pop(0)


class _Transport:
    def metadata(self) -> str:
        return "meta"

    def disallow_checkpoint(self) -> None:
        pass


def _parts(client: _Client, pg: _Group, rebuilt: List[int], **kw: Any) -> StepParts:
    settings = _resolve({}, rank=0, world_size=1, lighthouse_addr="lh:1", timeout=TO)
    links = {
        "pg": pg,
        "client": client,
        "transport": _Transport(),
        "replica_id": "r",
        "lighthouse": "lh:1",
    }
    hooks = StepHooks(
        links=lambda: links,
        rebuild=kw.get("rebuild", lambda q: rebuilt.append(q.quorum_id)),
        checkpoint=lambda: {},
        log_context=lambda: {},
    )
    parts = StepParts.build(
        settings, hooks, use_async_quorum=False, init_sync=True, min_replica_size=kw.get("min_replica_size", 1),
        spares_above=None, max_retries=kw.get("max_retries"), max_consecutive_failures=0,
    )  # fmt: skip
    parts.heal.healer = SimpleNamespace(serves=lambda q: False, confirms_delivery=lambda: True)
    return parts


def _step(parts: StepParts) -> bool:
    parts.begin_step(threading.Event())
    parts.round.start(allow_heal=True, shrink_only=False, timeout=TO)
    parts.round.wait_done()
    return parts.vote.vote(TO)


def test_a_round_rebuilds_the_group_only_for_a_new_quorum_and_a_commit_counts() -> None:
    pg, rebuilt = _Group(TO), []
    client = _Client(
        [_quorum(quorum_id=1), _quorum(quorum_id=1), _quorum(quorum_id=2)], [True, False, True]
    )
    parts = _parts(client, pg, rebuilt)
    try:
        assert _step(parts) is True
        assert (parts.state.step, parts.state.batches_committed) == (1, 2)
        assert _step(parts) is False  # the group's vote said no
        assert (parts.state.step, parts.state.commit_failures) == (1, 1)
        assert _step(parts) is True
        assert rebuilt == [1, 2]
        # each call carried the step and the failures the lighthouse should know of
        assert [(c["step"], c["commit_failures"]) for c in client.sent] == [(0, 0), (1, 0), (1, 1)]
    finally:
        parts.close(wait=True)


def test_a_failed_rebuild_fails_the_step_and_aborts_the_group() -> None:
    def refuse(_q: QuorumResult) -> None:
        raise RuntimeError("no peers")

    pg = _Group(TO)
    parts = _parts(_Client([_quorum()], [True]), pg, [], rebuild=refuse)
    try:
        assert _step(parts) is False
        assert parts.errors.phase == "configure" and parts.errors.aborted
        assert "abort" in pg.calls
    finally:
        parts.close(wait=True)


def test_max_retries_ends_a_run_of_failed_votes() -> None:
    pg, rebuilt = _Group(TO), []
    parts = _parts(_Client([_quorum(), _quorum()], [False, False]), pg, rebuilt, max_retries=1)
    try:
        assert _step(parts) is False
        with pytest.raises(RuntimeError, match="exceeding max_retries=1"):
            _step(parts)
    finally:
        parts.close(wait=True)


def test_a_source_announces_its_checkpoint_before_the_group_is_configured_in_sync_mode() -> None:
    # Its receivers ask only once the group is configured (a rendezvous the source is part
    # of). Announced before, a checkpoint is waited for even at a step whose earlier attempt
    # withdrew it (a failed step tried again); not announced, a receiver faster than the
    # source's staging was told "withdrawn" and failed its heal.
    events: List[str] = []
    parts = _parts(
        _Client([_quorum()], [True]), _Group(TO), [], rebuild=lambda q: events.append("configure")
    )
    parts.heal.healer = SimpleNamespace(
        serves=lambda q: True,
        striped=lambda q: False,
        confirms_delivery=lambda: True,
        announce=lambda q: events.append(f"announce {q.max_step}"),
        send=lambda q, state, timeout: events.append("send"),
        wait_delivered=lambda q, timeout, stop: events.append("delivered") or True,
        abandon=lambda q, reason: events.append("abandon"),
    )
    try:
        assert _step(parts) is True
        assert events == ["announce 0", "configure", "send", "delivered"], events
    finally:
        parts.close(wait=True)


def test_a_healer_drives_a_transport_written_for_torchft() -> None:
    # torchft's transport interface has no expect_checkpoint / abandon_checkpoint: announcing
    # to such a transport, or abandoning on it, does nothing (and raises nothing).
    from ft.manager_parts.heal import Healer

    class TorchftStyle:
        def metadata(self) -> str:
            return "meta"

    healer = Healer(TorchftStyle(), TO, client_factory=lambda *a, **k: None)
    q = _quorum(max_step=4)
    healer.announce(q)
    healer.abandon(q, "no reason")
