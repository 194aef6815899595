"""Integration tests of ManagerServer / ManagerClient over real gRPC on loopback (docs/design.md, "Roles")."""

import os
import signal
import threading
import time

import grpc
import pytest

from ft.utils.deadline import Deadline
from ft.coordination import CoordinationError, LighthouseClient, ManagerClient, QuorumResult
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.manager_server import LocalManagerClient
from ft.coordination.quorum import GroupRequest
from ft.coordination._proto import torchft_pb2_grpc as pb_grpc
from tests.coordination._helpers import free_port, parallel, run_threads, wait_for


def mc(server, kind: str = "remote"):
    """A client of ``server``: over gRPC, or in-process (LocalManagerClient, as the Manager's
    rank 0 uses); both must behave the same."""
    if kind == "local":
        return LocalManagerClient(server)
    return ManagerClient(server.address(), connect_timeout=5.0)


CLIENT_KINDS = pytest.mark.parametrize("kind", ["remote", "local"])


def group_round(server, steps, timeout=5.0, **kw):
    """Every local rank of one group asks at once; returns the answers by group rank."""
    c = mc(server)
    return parallel(
        [
            lambda r=r, s=s: c._quorum(r, s, f"meta-{r}", False, timeout, **kw)
            for r, s in enumerate(steps)
        ]
    )


def count_lighthouse_calls(server):
    calls = []
    orig = server._lighthouse.quorum

    def wrapped(*a, **kw):
        calls.append(kw.get("step"))
        return orig(*a, **kw)

    server._lighthouse.quorum = wrapped
    return calls


def test_two_groups_per_rank_answers(lighthouse_factory, manager_factory):
    lh = lighthouse_factory(min_replicas=2)
    s0 = manager_factory("g0", lh.address(), world_size=2)
    s1 = manager_factory("g1", lh.address(), world_size=2)
    calls0 = count_lighthouse_calls(s0)
    wait_for(lambda: len(lh.status()["replicas"]) == 2, what="heartbeats from both groups")
    with run_threads([lambda: group_round(s0, [3, 3]), lambda: group_round(s1, [5, 5])]) as res:
        pass
    (a0, a1), (b0, b1) = res
    assert calls0 == [3], "one lighthouse request per group, with the group's step"
    for r in (a0, a1, b0, b1):
        assert isinstance(r, QuorumResult), r
        assert r.replica_ids == ["g0", "g1"] and r.replica_world_size == 2
        assert r.max_step == 5 and r.max_world_size == 1
        assert r.store_address == "store-g1"
        assert r.quorum_id == a0.quorum_id
    assert a0.replica_rank == 0 and b0.replica_rank == 1
    assert a0.heal and a1.heal and not b0.heal and not b1.heal
    assert a0.recover_src_replica_rank == 1 and a0.recover_src_manager_address == s1.address()
    assert b0.recover_dst_replica_ranks == [0] and b1.recover_dst_replica_ranks == [0]
    assert a0.max_replica_rank is None and b0.max_replica_rank == 0
    # Every answer names the heal's donors (ft's field 1001) across the wire.
    assert all(r.heal_donors == [(1, s1.address())] for r in (a0, a1, b0, b1))
    # A healing peer reads the source's checkpoint metadata for its group rank.
    assert (
        ManagerClient(a1.recover_src_manager_address, 5.0)._checkpoint_metadata(1, 5.0) == "meta-1"
    )


def test_reconfigure_handles_travel_by_group_rank(lighthouse_factory, manager_factory):
    # torchft-nightly's fields: each rank sends its group's handle (ManagerQuorumRequest 7),
    # the ManagerServer sends its ranks' handles with the member (QuorumMember 9), and every
    # rank gets its own group rank's handle of every member, in replica rank order (14).
    lh = lighthouse_factory(min_replicas=2)
    s0 = manager_factory("g0", lh.address(), world_size=2)
    s1 = manager_factory("g1", lh.address(), world_size=2)
    wait_for(lambda: len(lh.status()["replicas"]) == 2, what="heartbeats from both groups")

    def ask(server, name):
        c = mc(server)
        return parallel(
            [
                lambda r=r: c._quorum(r, 0, "", False, 5.0, reconfigure_handle=f"{name}/{r}")
                for r in range(2)
            ]
        )

    with run_threads([lambda: ask(s0, "g0"), lambda: ask(s1, "g1")]) as res:
        pass
    (a0, a1), (b0, b1) = res
    assert a0.reconfigure_handles == b0.reconfigure_handles == ["g0/0", "g1/0"]
    assert a1.reconfigure_handles == b1.reconfigure_handles == ["g0/1", "g1/1"]
    # Without handles (torchft 0.2.0's clients, ft's configure() path): empty strings.
    with run_threads([lambda: group_round(s0, [1, 1]), lambda: group_round(s1, [1, 1])]) as res:
        pass
    assert all(r.reconfigure_handles == ["", ""] for pair in res for r in pair)


def test_steady_rounds_of_manager_servers(lighthouse_factory, manager_factory):
    """Two groups of two ranks step along: every answer is right, and on the native server the
    rounds after the first are answered without Python (grpcio: none)."""
    lh = lighthouse_factory(min_replicas=2)
    s0 = manager_factory("g0", lh.address(), world_size=2)
    s1 = manager_factory("g1", lh.address(), world_size=2)
    wait_for(lambda: len(lh.status()["replicas"]) == 2, what="heartbeats from both groups")
    first = None
    for step in range(1, 6):
        with run_threads(
            [lambda: group_round(s0, [step, step]), lambda: group_round(s1, [step, step])]
        ) as res:
            pass
        for r in [r for group in res for r in group]:
            assert isinstance(r, QuorumResult), r
            assert r.replica_ids == ["g0", "g1"] and r.max_step == step and not r.heal
            first = first or r.quorum_id
            assert r.quorum_id == first
    st = lh.status()["stats"]
    assert st["quorums_issued"] == 5
    assert st["native_rounds"] == (4 if lh.transport == "native" else 0), st


def test_each_ranks_step_calls_ride_its_call_streams(lighthouse_factory, manager_factory):
    """With a client per rank (as every rank has), the native client carries each rank's
    Quorum and ShouldCommit on its two call streams, step after step; the answers are those
    of calls (a server without the streams, grpcio here, gets calls)."""
    lh = lighthouse_factory(min_replicas=1)
    s = manager_factory("g0", lh.address(), world_size=2)
    clients = [ManagerClient(s.address(), connect_timeout=5.0) for _ in range(2)]
    try:
        for step in range(1, 5):
            q = parallel(
                [
                    lambda r=r, c=c: c._quorum(r, step, f"m{r}", False, 5.0)
                    for r, c in enumerate(clients)
                ]
            )
            assert [r.max_step for r in q] == [step, step] and q[0].quorum_id == q[1].quorum_id
            votes = parallel(
                [
                    lambda r=r, c=c: c.should_commit(r, step, r == 0 or step != 3, 5.0)
                    for r, c in enumerate(clients)
                ]
            )
            assert votes == [step != 3] * 2  # one rank's veto fails the step for both
        for c in clients:
            if c.transport != "native":
                assert c._call_streams == {}
                continue
            streams = c._call_streams
            carried = 4 if s._server.transport == "native" else 0
            assert streams["Quorum"].answered == carried
            assert streams["ShouldCommit"].answered == carried
    finally:
        for c in clients:
            c.close()


def test_init_sync_at_step_zero(lighthouse_factory, manager_factory):
    lh = lighthouse_factory(min_replicas=2)
    s0 = manager_factory("g0", lh.address(), world_size=2)
    s1 = manager_factory("g1", lh.address(), world_size=2)
    wait_for(lambda: len(lh.status()["replicas"]) == 2)
    with run_threads([lambda: group_round(s0, [0, 0]), lambda: group_round(s1, [0, 0])]) as res:
        pass
    (a0, a1), (b0, b1) = res
    # group rank 0: primary is g0 (max_participants[0]); g1 heals from it. group rank 1: reversed.
    assert (a0.heal, b0.heal) == (False, True) and b0.recover_src_replica_rank == 0
    assert (a1.heal, b1.heal) == (True, False) and a1.recover_src_replica_rank == 1
    assert a0.store_address == b0.store_address == "store-g0"
    assert a1.store_address == b1.store_address == "store-g1"
    with run_threads(
        [
            lambda: group_round(s0, [0, 0], init_sync=False),
            lambda: group_round(s1, [0, 0], init_sync=False),
        ]
    ) as res:
        pass
    assert not any(r.heal for pair in res for r in pair)


def test_commit_failures_is_max_and_bumps_quorum(lighthouse_factory, manager_factory):
    lh = lighthouse_factory(min_replicas=1)
    s = manager_factory("g0", lh.address(), world_size=2)
    c = mc(s)
    first = group_round(s, [1, 1])
    res = parallel(
        [
            lambda: c._quorum(0, 1, "", False, 5.0, commit_failures=0),
            lambda: c._quorum(1, 1, "", False, 5.0, commit_failures=2),
        ]
    )
    assert [r.commit_failures for r in res] == [2, 2]
    assert res[0].quorum_id == first[0].quorum_id + 1


@CLIENT_KINDS
def test_missing_rank_times_out_under_one_second(lighthouse_factory, manager_factory, kind):
    lh = lighthouse_factory(min_replicas=1)
    s = manager_factory("g0", lh.address(), world_size=3)
    c = mc(s, kind)
    t0 = time.monotonic()
    res = parallel(
        [lambda: c._quorum(0, 1, "", False, 0.5), lambda: c._quorum(1, 1, "", False, 0.5)]
    )
    elapsed = time.monotonic() - t0
    assert all(isinstance(r, TimeoutError) for r in res), res
    assert "group ranks [2]" in str(res[0])
    assert elapsed < 1.0, elapsed
    # The server survives and the next full round works.
    assert all(isinstance(r, QuorumResult) for r in group_round(s, [1, 1, 1]))


@CLIENT_KINDS
def test_should_commit_vote(manager_factory, lighthouse_factory, kind):
    lh = lighthouse_factory()
    s = manager_factory("g0", lh.address(), world_size=2)
    c = mc(s, kind)
    assert parallel(
        [lambda: c.should_commit(0, 1, True, 5.0), lambda: c.should_commit(1, 1, True, 5.0)]
    ) == [True, True]
    assert parallel(
        [lambda: c.should_commit(0, 2, True, 5.0), lambda: c.should_commit(1, 2, False, 5.0)]
    ) == [False, False]
    # A vote whose step disagrees is rejected and counts as "no".
    with run_threads([lambda: c.should_commit(0, 3, True, 5.0)]) as first:
        wait_for(lambda: len(s._commit.votes) == 1)
        with pytest.raises(CoordinationError) as e:
            c.should_commit(1, 4, True, 5.0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "step 4" in e.value.details and "step 3" in e.value.details
    assert first == [False]
    # A missing vote: bounded timeout, then the server still works.
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"group ranks \[1\]"):
        c.should_commit(0, 5, True, 0.3)
    assert time.monotonic() - t0 < 0.8
    assert parallel(
        [lambda: c.should_commit(0, 5, True, 5.0), lambda: c.should_commit(1, 5, True, 5.0)]
    ) == [True, True]


def test_local_rank0_and_remote_rank1_share_rounds(lighthouse_factory, manager_factory):
    """The Manager's layout: rank 0 calls its server in-process, rank 1 over gRPC."""
    lh = lighthouse_factory(min_replicas=1)
    s = manager_factory("g0", lh.address(), world_size=2)
    local, remote = mc(s, "local"), mc(s, "remote")
    a, b = parallel(
        [
            lambda: local._quorum(0, 4, "meta-0", False, 5.0),
            lambda: remote._quorum(1, 4, "meta-1", False, 5.0),
        ]
    )
    assert isinstance(a, QuorumResult) and isinstance(b, QuorumResult), (a, b)
    assert a.quorum_id == b.quorum_id and a.max_step == 4
    assert local._checkpoint_metadata(1, 2.0) == "meta-1"
    assert remote._checkpoint_metadata(0, 2.0) == "meta-0"
    assert parallel(
        [
            lambda: local.should_commit(0, 4, True, 5.0),
            lambda: remote.should_commit(1, 4, False, 5.0),
        ]
    ) == [False, False]
    with pytest.raises(ValueError, match="timeout is required"):
        local.should_commit(0, 4, True, None)
    with pytest.raises(CoordinationError) as e:
        local._quorum(5, 0, "", False, 1.0)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.method == "Quorum"


@CLIENT_KINDS
def test_checkpoint_metadata_errors(manager_factory, lighthouse_factory, kind):
    lh = lighthouse_factory()
    s = manager_factory("g0", lh.address(), world_size=2)
    c = mc(s, kind)
    with pytest.raises(CoordinationError) as e:
        c._checkpoint_metadata(1, 2.0)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    for bad in (-1, 2, 1 << 40):
        with pytest.raises(CoordinationError) as e:
            c._checkpoint_metadata(bad, 2.0)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_requests(manager_factory, lighthouse_factory):
    lh = lighthouse_factory()
    s = manager_factory("g0", lh.address(), world_size=2)
    ch = grpc.insecure_channel(s.address().replace("http://", ""))
    stub = pb_grpc.ManagerServiceStub(ch)
    with ch:
        no_deadline = [
            lambda: stub.Quorum(pb.ManagerQuorumRequest(group_rank=0)),
            lambda: stub.ShouldCommit(pb.ShouldCommitRequest(group_rank=0)),
            lambda: stub.CheckpointMetadata(pb.CheckpointMetadataRequest(rank=0)),
            lambda: stub.Kill(pb.KillRequest(msg="x")),
        ]
        for call in no_deadline:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert (
                e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "deadline" in e.value.details()
            )
        bad = [
            (stub.Quorum, pb.ManagerQuorumRequest(group_rank=-1), "group_rank"),
            (stub.Quorum, pb.ManagerQuorumRequest(group_rank=2), "out of range"),
            (stub.Quorum, pb.ManagerQuorumRequest(group_rank=1 << 62), "group_rank"),
            (stub.Quorum, pb.ManagerQuorumRequest(group_rank=0, step=-5), "step"),
            (
                stub.Quorum,
                pb.ManagerQuorumRequest(group_rank=0, commit_failures=-1),
                "commit_failures",
            ),
            (stub.ShouldCommit, pb.ShouldCommitRequest(group_rank=7), "out of range"),
            (stub.ShouldCommit, pb.ShouldCommitRequest(group_rank=0, step=-1), "step"),
        ]
        for method, req, msg in bad:
            with pytest.raises(grpc.RpcError) as e:
                method(req, timeout=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert msg in e.value.details()
        big = pb.ManagerQuorumRequest(group_rank=0, checkpoint_metadata="x" * (5 << 20))
        ch2 = grpc.insecure_channel(
            s.address().replace("http://", ""), options=[("grpc.max_send_message_length", 64 << 20)]
        )
        with ch2, pytest.raises(grpc.RpcError) as e:
            pb_grpc.ManagerServiceStub(ch2).Quorum(big, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(isinstance(r, QuorumResult) for r in group_round(s, [0, 0]))


def test_heartbeats_at_interval(lighthouse_factory, manager_factory):
    lh = lighthouse_factory(heartbeat_timeout_ms=2000)
    manager_factory("g0", lh.address(), world_size=1, heartbeat_interval=0.05)
    wait_for(lambda: lh.status()["replicas"], what="first heartbeat")
    ages = []
    for _ in range(10):
        ages.append(lh.status()["replicas"][0]["heartbeat_age_s"])
        time.sleep(0.03)
    assert max(ages) < 0.3, ages


def test_quorum_requests_stand_in_for_heartbeats(lighthouse_factory, manager_factory):
    """A group asking for a quorum more often than heartbeat_interval sends no heartbeat
    RPCs, yet stays alive at the lighthouse; when it stops asking, heartbeats resume."""
    lh = lighthouse_factory(heartbeat_timeout_ms=2000)
    s = manager_factory("g0", lh.address(), world_size=1, heartbeat_interval=0.1)
    beats = []
    orig = s._lighthouse.heartbeat
    s._lighthouse.heartbeat = lambda *a, **kw: (beats.append(time.monotonic()), orig(*a, **kw))
    c = mc(s, "local")
    c._quorum(0, 0, "", False, 5.0)
    t0 = time.monotonic()
    ages = []
    while time.monotonic() - t0 < 1.0:
        c._quorum(0, 0, "", False, 5.0)
        ages.append(lh.status()["replicas"][0]["heartbeat_age_s"])
        time.sleep(0.03)
    assert [b for b in beats if b > t0 + 0.15] == [], "heartbeats while quorums were flowing"
    assert max(ages) < 0.3, ages
    n = len(beats)
    time.sleep(0.5)
    assert len(beats) >= n + 3, "heartbeats did not resume"


def test_lighthouse_down_fails_waiting_ranks(manager_factory):
    port = free_port()  # nothing listens here
    s = manager_factory("g0", f"http://127.0.0.1:{port}", world_size=2, quorum_retries=2)
    t0 = time.monotonic()
    res = parallel([lambda r=r: mc(s)._quorum(r, 0, "", False, 3.0) for r in range(2)])
    for r in res:
        # ABORTED: the server already retried; the ranks' clients must not retry it again
        assert isinstance(r, CoordinationError) and r.code == grpc.StatusCode.ABORTED, r
        assert "3 attempt(s)" in str(r) and "UNAVAILABLE" in str(r)
    assert time.monotonic() - t0 < 2.9, "failure is delivered before the deadline"


def test_lighthouse_restart_mid_quorum(lighthouse_factory, manager_factory):
    port = free_port()
    lh = lighthouse_factory(f"127.0.0.1:{port}", min_replicas=2)
    addr = lh.address()
    s0 = manager_factory("g0", addr, world_size=1, quorum_retries=20)
    s1 = manager_factory("g1", addr, world_size=1, quorum_retries=20)
    wait_for(lambda: len(lh.status()["replicas"]) == 2)
    first = parallel(
        [lambda: mc(s0)._quorum(0, 1, "", False, 5.0), lambda: mc(s1)._quorum(0, 1, "", False, 5.0)]
    )
    with run_threads([lambda: mc(s0)._quorum(0, 2, "", False, 8.0)]) as res:
        wait_for(lambda: lh.status()["next_quorum"]["participants"] == ["g0"], what="g0 waiting")
        lh.shutdown()  # the lighthouse dies while g0 waits
        time.sleep(0.2)
        lh2 = lighthouse_factory(f"127.0.0.1:{port}", min_replicas=2)
        r1 = mc(s1)._quorum(0, 2, "", False, 8.0)
    r0 = res[0]
    assert isinstance(r0, QuorumResult), r0
    assert r0.quorum_id == r1.quorum_id > first[0].quorum_id
    assert r0.replica_ids == ["g0", "g1"]
    assert lh2.status()["quorum"]["quorum_id"] == r0.quorum_id


def test_kill_exits_process_nonzero(lighthouse_factory, children):
    lh = lighthouse_factory()
    child = children("manager", "victim", lh.address(), "1")
    c = ManagerClient(child.address(), 5.0)
    c.kill("test says die", timeout=5.0)
    assert child.wait(10) == 1
    assert "test says die" in child.output()


def test_kill9_manager_survivors_and_notification(lighthouse_factory, manager_factory, children):
    hb_ms, tick_ms = 400, 20
    lh = lighthouse_factory(
        min_replicas=1, heartbeat_timeout_ms=hb_ms, quorum_tick_ms=tick_ms, join_timeout_ms=100
    )
    survivor = manager_factory("a-survivor", lh.address(), world_size=1)
    child = children("manager", "b-victim", lh.address(), "1", "0.05")
    victim = ManagerClient(child.address(), 5.0)
    wait_for(lambda: len(lh.status()["replicas"]) == 2, what="two replicas heartbeating")
    notified = []
    got = threading.Event()
    sub = LighthouseClient(lh.address(), 5.0).subscribe_failures(
        lambda n: (notified.append((time.monotonic(), n)), got.set())
    )
    try:
        assert sub.wait_subscribed(5)
        first = parallel(
            [
                lambda: mc(survivor)._quorum(0, 1, "", False, 5.0),
                lambda: victim._quorum(0, 1, "", False, 5.0),
            ]
        )
        assert first[0].replica_ids == ["a-survivor", "b-victim"], first
        os.kill(child.proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        assert child.wait(10) == -signal.SIGKILL
        r = mc(survivor)._quorum(0, 2, "", False, 5.0)
        t_quorum = time.monotonic()
        assert r.replica_ids == ["a-survivor"] and r.quorum_id == first[0].quorum_id + 1
        assert got.wait(5)
        t_note, note = notified[0]
        assert note.replica_id == "b-victim" and note.quorum_id == first[0].quorum_id
        bound = (hb_ms + tick_ms) / 1000 + 0.25
        assert t_note - t_kill < bound, t_note - t_kill
        assert t_quorum - t_kill < bound + 0.2, t_quorum - t_kill
    finally:
        sub.close()


def test_calls_past_their_deadline_never_join_a_round(lighthouse_factory, manager_factory):
    """A Quorum or ShouldCommit that reaches the server's logic after its caller's deadline
    (e.g. it waited behind others) is refused; it neither votes in nor leads a later round."""
    lh = lighthouse_factory()
    s = manager_factory("g0", lh.address(), world_size=2)
    past = Deadline(time.monotonic() - 0.1)
    with pytest.raises(CoordinationError) as e:
        s.should_commit(1, 7, False, past)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(CoordinationError) as e:
        s.quorum(
            GroupRequest(
                group_rank=1,
                step=7,
                checkpoint_metadata="",
                shrink_only=False,
                init_sync=True,
                commit_failures=0,
            ),
            past,
        )
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not s._commit.votes and not s._round.requests  # nothing was recorded
    c = mc(s)
    # the stale "no" above did not count: the next round commits
    assert parallel(
        [lambda: c.should_commit(0, 8, True, 5.0), lambda: c.should_commit(1, 8, True, 5.0)]
    ) == [True, True]


def test_open_calls_beyond_the_pool_get_resource_exhausted(
    lighthouse_factory, manager_factory, monkeypatch
):
    """Quorum/ShouldCommit calls hold a worker each while they wait for the group; past the
    cap a call is refused at once instead of queueing behind the others."""
    from ft.coordination import manager_server

    real = manager_server._methods
    monkeypatch.setattr(
        manager_server, "_methods", lambda server, pool, workers: real(server, pool, 2)
    )
    lh = lighthouse_factory()
    s = manager_factory("g0", lh.address(), world_size=4)
    c = mc(s)
    with run_threads(
        [lambda: c.should_commit(0, 1, True, 3.0), lambda: c.should_commit(1, 1, True, 3.0)]
    ) as waiting:
        wait_for(lambda: len(s._commit.votes) == 2)
        with pytest.raises(CoordinationError) as e:
            c.should_commit(2, 1, True, 3.0)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert all(isinstance(x, TimeoutError) for x in waiting), waiting  # rank 3 never voted
    # the slots are free again once those calls ended: two remote ranks (the cap) and two
    # in-process ones (no gRPC call) complete a round
    local = mc(s, "local")
    assert (
        parallel(
            [
                lambda: c.should_commit(0, 2, True, 5.0),
                lambda: c.should_commit(1, 2, True, 5.0),
                lambda: local.should_commit(2, 2, True, 5.0),
                lambda: local.should_commit(3, 2, True, 5.0),
            ]
        )
        == [True] * 4
    )
