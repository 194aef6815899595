"""Integration tests of the lighthouse over real gRPC on loopback (docs/design.md, "The quorum rule")."""

import json
import os
import threading
import time

import grpc
import pytest

from ft.coordination import CoordinationError, LighthouseClient, LighthouseServer
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination._proto import torchft_pb2_grpc as pb_grpc
from ft.coordination.rpc_server import Call
from tests.coordination._helpers import parallel, run_threads, wait_for


@pytest.fixture
def heartbeater():
    """heartbeater(client, replica_id) keeps heartbeating every 30 ms until stopped/teardown."""
    stops = []

    def start(client: LighthouseClient, replica_id: str):
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                try:
                    client.heartbeat(replica_id, timeout=1.0)
                except Exception:
                    pass
                stop.wait(0.03)

        t = threading.Thread(target=loop, daemon=True)
        t.start()
        stops.append((stop, t))
        return stop

    try:
        yield start
    finally:
        for stop, t in stops:
            stop.set()
            t.join(5)


def client(lh: LighthouseServer) -> LighthouseClient:
    return LighthouseClient(lh.address(), connect_timeout=5.0)


def ids(q):
    return [p.replica_id for p in q.participants]


def form(c: LighthouseClient, *rids: str, **kw):
    """All of rids ask at once; they heartbeat first so that none can go ahead alone."""
    for rid in rids:
        c.heartbeat(rid, timeout=1.0)
    qs = parallel([lambda rid=rid: c.quorum(rid, 5.0, **kw) for rid in rids])
    for q in qs:
        assert not isinstance(q, BaseException), q
        assert ids(q) == sorted(rids) and q == qs[0]
    return qs[0]


def test_quorum_of_two_and_fast_path_keeps_id(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=2)
    c = client(lh)
    a, b = parallel([lambda: c.quorum("a", 5.0, step=1), lambda: c.quorum("b", 5.0, step=2)])
    assert ids(a) == ["a", "b"] and a == b
    assert [p.step for p in a.participants] == [1, 2]
    # Same membership: fast path, same quorum id.
    a2, b2 = parallel([lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0)])
    assert a2.quorum_id == a.quorum_id and ids(a2) == ["a", "b"]
    # The created timestamp is set and recent.
    assert abs(a2.created.timestamp() - time.time()) < 10


def test_join_timeout_waits_for_heartbeating_straggler(lighthouse_factory, heartbeater):
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=400, heartbeat_timeout_ms=1000)
    c = client(lh)
    heartbeater(c, "straggler")
    wait_for(lambda: any(r["replica_id"] == "straggler" for r in lh.status()["replicas"]))
    t0 = time.monotonic()
    qa, qb = parallel([lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0)])
    waited = time.monotonic() - t0
    assert ids(qa) == ["a", "b"] and qa == qb
    assert 0.35 <= waited < 2.0, waited
    # Without stragglers, a quorum is immediate.
    lh2 = lighthouse_factory(min_replicas=1, join_timeout_ms=5000)
    t0 = time.monotonic()
    assert ids(client(lh2).quorum("a", 5.0)) == ["a"]
    assert time.monotonic() - t0 < 1.0


def test_python_defaults_are_torchfts_and_the_cli_keeps_its_own(heartbeater):
    from ft.coordination.cli import build_parser

    lh = LighthouseServer("127.0.0.1:0", 1, http_bind="")  # torchft's defaults: 100/100/5000 ms
    try:
        opts = lh._state.opts
        assert (opts.join_timeout_s, lh._state.tick_s, opts.heartbeat_timeout_s) == (0.1, 0.1, 5.0)
        # a heartbeating straggler delays a quorum by the 100 ms join timeout, not 60 s
        c = client(lh)
        heartbeater(c, "straggler")
        wait_for(lambda: any(r["replica_id"] == "straggler" for r in lh.status()["replicas"]))
        t0 = time.monotonic()
        qa, _ = parallel([lambda: c.quorum("a", 10.0), lambda: c.quorum("b", 10.0)])
        assert ids(qa) == ["a", "b"]
        assert time.monotonic() - t0 < 3.0
    finally:
        lh.shutdown()
    a = build_parser().parse_args(["--min_replicas", "1"])
    assert (a.join_timeout_ms, a.quorum_tick_ms, a.heartbeat_timeout_ms) == (60_000, 100, 5000)


def test_member_data_comes_back_as_a_dict(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=3, join_timeout_ms=5000)
    c = client(lh)
    data = {"k": 1, "nested": {"s": "v", "l": [1, 2.5, None]}}
    qs = parallel(
        [
            lambda: c.quorum("a", 10.0, data=data),
            lambda: c.quorum("b", 10.0, data={}),
            lambda: c.quorum("c", 10.0),
        ]
    )
    for q in qs:
        by_id = {p.replica_id: p.data for p in q.participants}
        assert by_id == {"a": data, "b": {}, "c": None}
        assert isinstance(by_id["a"], dict)
    # on the wire it stays a JSON string (the proto's type, and what torchft's peers expect)
    from ft.coordination import wire
    from ft.coordination.quorum import QuorumMember

    msg = wire.member_to_pb(QuorumMember(replica_id="a", data=data))
    assert isinstance(msg.data, str) and json.loads(msg.data) == data
    assert wire.member_to_pb(QuorumMember(replica_id="c")).data == ""
    assert wire.member_from_pb(msg).data == data
    # members stay hashable (quorum code may put them in sets)
    hash(wire.member_from_pb(msg))
    # the dashboard still renders a quorum whose members carry data
    st = lh.status()
    assert sorted(r["replica_id"] for r in st["replicas"]) == ["a", "b", "c"]


def test_heartbeat_expiry_drops_member(lighthouse_factory, heartbeater):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=300)
    c = client(lh)
    q1 = form(c, "a", "b")
    # b is silent: a waits (no fast path: b is not participating) until b's heartbeat expires.
    t0 = time.monotonic()
    q2 = c.quorum("a", 5.0)
    assert ids(q2) == ["a"] and q2.quorum_id == q1.quorum_id + 1
    assert time.monotonic() - t0 < 2.0


def test_split_brain_guard(lighthouse_factory, heartbeater):
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=50, heartbeat_timeout_ms=1000)
    c = client(lh)
    for rid in "abcd":
        heartbeater(c, rid)
    wait_for(lambda: len(lh.status()["replicas"]) == 4)
    # 2 of 4 heartbeating replicas must not form a quorum, even after the join timeout.
    a, b = parallel([lambda: c.quorum("a", 0.6), lambda: c.quorum("b", 0.6)])
    assert isinstance(a, TimeoutError) and isinstance(b, TimeoutError), (a, b)
    assert "split-brain" in str(a) or "split-brain" in lh.status()["next_quorum"]["reason"]
    # 3 of 4 may.
    a, b, cc = parallel(
        [lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0), lambda: c.quorum("c", 5.0)]
    )
    assert ids(a) == ["a", "b", "c"] and a == b == cc


def test_min_replicas(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=3, join_timeout_ms=50)
    c = client(lh)
    a, b = parallel([lambda: c.quorum("a", 0.5), lambda: c.quorum("b", 0.5)])
    assert isinstance(a, TimeoutError) and isinstance(b, TimeoutError)
    assert "min_replicas" in str(a)


def test_shrink_only_and_waiter_outside_quorum(lighthouse_factory):
    # Long join timeout: a round without b must not be issued while b is still heartbeating.
    lh = lighthouse_factory(min_replicas=1, join_timeout_ms=5000, heartbeat_timeout_ms=5000)
    c = client(lh)
    q1 = form(c, "a", "b")
    with run_threads([lambda: c.quorum("n", 5.0)]) as newcomer:
        wait_for(lambda: "n" in lh.status()["next_quorum"]["participants"], what="n waiting")
        qa, qb = parallel(
            [lambda: c.quorum("a", 5.0, shrink_only=True), lambda: c.quorum("b", 5.0)]
        )
        assert ids(qa) == ["a", "b"] and qa.quorum_id == q1.quorum_id
        # n was not in that quorum: it waits for the next round, still a participant.
        time.sleep(0.1)
        assert newcomer[0] is None
        assert lh.status()["next_quorum"]["participants"] == ["n"]
        # The next (normal) round takes it in through the fast path.
        qa2, qb2 = parallel([lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0)])
    assert ids(qa2) == ["a", "b", "n"] and qa2.quorum_id == q1.quorum_id + 1
    assert newcomer[0] == qa2


def test_commit_failures_bump_quorum_id(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=2)
    c = client(lh)
    q1, _ = parallel([lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0)])
    q2, _ = parallel([lambda: c.quorum("a", 5.0, commit_failures=1), lambda: c.quorum("b", 5.0)])
    assert q2.quorum_id == q1.quorum_id + 1
    assert [p.commit_failures for p in q2.participants] == [1, 0]
    q3, _ = parallel([lambda: c.quorum("a", 5.0), lambda: c.quorum("b", 5.0)])
    assert q3.quorum_id == q2.quorum_id


def test_quorum_ids_never_repeat_across_restart(lighthouse_factory, tmp_path):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=100)
    port = int(lh.address().rsplit(":", 1)[1])
    c = client(lh)
    first = [c.quorum("a", 5.0).quorum_id]
    for i in range(3):  # membership changes: ids go up
        first.append(c.quorum(f"x{i}", 5.0).quorum_id)
    assert first == sorted(set(first))
    lh.shutdown()
    c.close()
    # Restart on the same port: the new ids are above every old one.
    lh2 = lighthouse_factory(f"127.0.0.1:{port}", min_replicas=1)
    c2 = client(lh2)
    again = c2.quorum("a", 5.0).quorum_id
    assert again > max(first)
    # A persisted quorum id wins over the clock.
    f = tmp_path / "qid"
    f.write_text(str(1 << 60))
    lh3 = lighthouse_factory(min_replicas=1, quorum_id_file=str(f))
    q = client(lh3).quorum("a", 5.0)
    assert q.quorum_id == (1 << 60) + 1
    assert int(f.read_text()) == q.quorum_id


def test_failure_notification_within_one_tick(lighthouse_factory, heartbeater):
    timeout_ms, tick_ms = 300, 20
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=timeout_ms, quorum_tick_ms=tick_ms)
    c = client(lh)
    got = []
    arrived = threading.Event()
    sub = c.subscribe_failures(lambda n: (got.append((time.monotonic(), n)), arrived.set()))
    try:
        assert sub.wait_subscribed(5)
        stop_b = heartbeater(c, "b")
        heartbeater(c, "a")
        q = form(c, "a", "b")
        stop_b.set()
        time.sleep(0.06)  # let an in-flight heartbeat land
        last_b = time.monotonic()
        assert arrived.wait(5), "no failure notification"
        t, n = got[0]
        assert n.replica_id == "b" and n.quorum_id == q.quorum_id
        assert "heartbeat" in n.error_message
        # heartbeat_timeout + one tick (+ scheduling slack on a loaded 2-core machine)
        assert t - last_b <= (timeout_ms + tick_ms) / 1000 + 0.15, t - last_b
        time.sleep(0.2)
        assert [x[1].replica_id for x in got] == ["b"], "notified once per quorum"
    finally:
        sub.close()
    assert not sub.subscribed


def test_failure_notification_does_not_wait_for_a_slow_tick(lighthouse_factory, heartbeater):
    """The ticker wakes at the next quorum member's heartbeat deadline, so a 5 s tick does
    not delay a 300 ms heartbeat expiry (before, the notice came at the next tick)."""
    timeout_ms = 300
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=timeout_ms, quorum_tick_ms=5000)
    c = client(lh)
    got = []
    arrived = threading.Event()
    sub = c.subscribe_failures(lambda n: (got.append(time.monotonic()), arrived.set()))
    try:
        assert sub.wait_subscribed(5)
        stop_b = heartbeater(c, "b")
        heartbeater(c, "a")
        form(c, "a", "b")
        # the next wake-up is b's or a's heartbeat deadline, well under the 5 s tick
        assert 0 < lh._state.next_expiry_in() <= timeout_ms / 1000 + 0.002
        stop_b.set()
        time.sleep(0.06)  # let an in-flight heartbeat land
        last_b = time.monotonic()
        assert arrived.wait(5), "no failure notification"
        assert got[0] - last_b <= timeout_ms / 1000 + 0.15, got[0] - last_b
    finally:
        sub.close()


def test_killed_subscriber_is_dead_at_once_not_after_heartbeat_timeout(
    lighthouse_factory, heartbeater, children
):
    """A replica's process (heartbeating, subscribed as "victim/0") is kill -9'd: its stream
    drops, so the other member is notified and forms its next quorum in well under the 5 s
    heartbeat timeout."""
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=5000, join_timeout_ms=10000)
    c = client(lh)
    heartbeater(c, "a")
    victim = children("subscriber", "victim", lh.address())
    victim.ready_line()
    got = []
    arrived = threading.Event()
    sub = c.subscribe_failures(lambda n: (got.append((time.monotonic(), n)), arrived.set()))
    try:
        assert sub.wait_subscribed(5)
        q = c.quorum("a", 10.0)  # waits for the heartbeating victim's request: both join
        assert ids(q) == ["a", "victim"]
        wait_for(lambda: "QUORUM" in victim.lines, what="the victim's quorum answer")
        t0 = time.monotonic()
        victim.proc.kill()
        victim.proc.wait(5)
        assert arrived.wait(3), "no failure notification"
        t, n = got[0]
        assert n.replica_id == "victim" and n.quorum_id == q.quorum_id
        assert t - t0 < 1.0, t - t0
        q2 = c.quorum("a", 10.0)  # not held back waiting for the dead victim
        assert ids(q2) == ["a"] and time.monotonic() - t0 < 1.5
    finally:
        sub.close()


def test_subscription_deadline_is_not_a_death(lighthouse_factory, heartbeater):
    """A stream that reaches its deadline (the client re-subscribes) says nothing about
    liveness; nor does an anonymous subscriber."""
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=2000)
    c = client(lh)
    heartbeater(c, "b")
    form(c, "b")
    got = []
    sub = c.subscribe_failures(lambda n: got.append(n))
    try:
        assert sub.wait_subscribed(5)
        assert list(c.failures(timeout=0.6, subscriber="b/0")) == []
        assert list(c.failures(timeout=0.3)) == []
        time.sleep(0.3)
        assert got == []
        assert form(c, "b").quorum_id > 0
    finally:
        sub.close()


def test_closing_the_client_ends_its_failure_subscriptions(lighthouse_factory, monkeypatch):
    """A client closed under an open failure subscription closes it: the subscription's
    thread ends, and nothing raises on it (before, its next call on the closed channel
    raised ValueError "Cannot invoke RPC: Channel closed!" on the thread)."""
    lh = lighthouse_factory(min_replicas=1)
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    c = client(lh)
    sub = c.subscribe_failures(lambda n: None)
    assert sub.wait_subscribed(5)
    c.close()
    assert not sub.subscribed
    assert not sub._thread.is_alive()
    assert raised == []


def test_clean_leave_is_not_announced_as_failure(lighthouse_factory, heartbeater):
    """A replica that says it leaves (Heartbeat with leaving=True, as ManagerServer.leave
    sends at a clean shutdown) and then drops its subscription is not announced as failed,
    and the next quorum forms without it at once. Its stale heartbeats do not revive it."""
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=300, join_timeout_ms=10000)
    c = client(lh)
    heartbeater(c, "a")
    stop_b = heartbeater(c, "b")
    got = []
    sub = c.subscribe_failures(lambda n: got.append(n))
    try:
        assert sub.wait_subscribed(5)
        q = form(c, "a", "b")
        b_stream = threading.Thread(
            target=lambda: list(c.failures(timeout=0.4, subscriber="b/0")), daemon=True
        )
        b_stream.start()
        time.sleep(0.1)
        stop_b.set()
        time.sleep(0.06)
        c.heartbeat("b", timeout=1.0, leaving=True)
        c.heartbeat("b", timeout=1.0)  # a late, stale heartbeat
        t0 = time.monotonic()
        q2 = c.quorum("a", 5.0)  # not held back by the join timeout waiting for b
        assert ids(q2) == ["a"] and q2.quorum_id != q.quorum_id
        assert time.monotonic() - t0 < 1.0
        b_stream.join(5)
        time.sleep(0.5)  # past b's heartbeat timeout
        assert got == [], [n.error_message for n in got]
    finally:
        sub.close()


def test_dropped_subscription_without_leave_is_a_failure(lighthouse_factory, heartbeater):
    """The counterpart of the clean leave: the same stream ended early without a leave is
    announced (the kill -9 case)."""
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=5000, join_timeout_ms=10000)
    c = client(lh)
    heartbeater(c, "a")
    heartbeater(c, "b")
    got = []
    arrived = threading.Event()
    sub = c.subscribe_failures(lambda n: (got.append(n), arrived.set()))
    try:
        assert sub.wait_subscribed(5)
        form(c, "a", "b")
        b_sub = c.subscribe_failures(lambda n: None, subscriber="b/0")
        assert b_sub.wait_subscribed(5)
        b_sub.close()
        assert arrived.wait(3), "a dropped subscription was not announced"
        assert got[0].replica_id == "b"
    finally:
        sub.close()


def test_failures_iterator(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=200)
    c = client(lh)
    c.quorum("a", 5.0)
    got = list(c.failures(timeout=0.6))
    assert [n.replica_id for n in got] == ["a"]


def test_dead_replicas_leave_dashboard(lighthouse_factory, heartbeater):
    lh = lighthouse_factory(min_replicas=1, heartbeat_timeout_ms=200, dead_grace_ms=200)
    c = client(lh)
    heartbeater(c, "a")
    c.heartbeat("ghost", timeout=1.0)
    form(c, "a", "b")

    def replica(rid):
        return next((r for r in lh.status()["replicas"] if r["replica_id"] == rid), None)

    wait_for(lambda: replica("b") is not None and not replica("b")["alive"], what="b marked dead")
    member_b = [m for m in lh.status()["quorum"]["members"] if m["replica_id"] == "b"][0]
    assert member_b["alive"] is False
    wait_for(lambda: replica("ghost") is None, timeout=3, what="ghost forgotten")
    # b stays listed while it is a member of the current quorum, and goes once it is not.
    c.quorum("a", 5.0)
    wait_for(lambda: replica("b") is None, timeout=3, what="b forgotten")
    assert replica("a")["alive"]
    with lh._state.lock:  # nothing of b is kept (replica ids are new at every restart)
        assert "b" not in lh._state.identities and "b" not in lh._state.last_member


def test_waiter_timeout_is_bounded_and_cleans_up(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=2)
    c = client(lh)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="min_replicas"):
        c.quorum("a", 0.3)
    assert time.monotonic() - t0 < 0.8
    assert lh.status()["next_quorum"]["participants"] == []


def test_shutdown_releases_waiters(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=2)
    c = client(lh)
    # retries=0: the server's answer itself (by default the client retries until its deadline)
    with run_threads([lambda: c.quorum("a", 10.0, retries=0)]) as res:
        wait_for(lambda: lh.status()["next_quorum"]["participants"] == ["a"])
        t0 = time.monotonic()
        lh.shutdown()
    assert isinstance(res[0], CoordinationError), res
    assert res[0].code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - t0 < 3


def test_unreachable_lighthouse_times_out():
    port_dead = "127.0.0.1:1"
    c = LighthouseClient(port_dead, connect_timeout=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="connect"):
        c.quorum("a", 5.0)
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(CoordinationError) as e:
        c.heartbeat("a", timeout=1.0, wait_for_ready=False)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def _raw_stub(lh, max_send=64 * 1024 * 1024):
    ch = grpc.insecure_channel(
        lh.address().replace("http://", ""), options=[("grpc.max_send_message_length", max_send)]
    )
    return ch, pb_grpc.LighthouseServiceStub(ch)


def test_rpc_without_deadline_is_invalid_argument(lighthouse_factory):
    lh = lighthouse_factory()
    ch, stub = _raw_stub(lh)
    with ch:
        calls = [
            lambda: stub.Quorum(
                pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a"))
            ),
            lambda: stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id="a")),
            lambda: list(stub.SubscribeFailures(pb.SubscribeFailuresRequest())),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "deadline" in e.value.details()


BAD_REQUESTS = [
    (pb.LighthouseQuorumRequest(), "requester is required"),
    (pb.LighthouseQuorumRequest(requester=pb.QuorumMember()), "replica_id must not be empty"),
    (pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", step=-1)), "step"),
    (
        pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", commit_failures=-3)),
        "commit_failures",
    ),
    (
        pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", world_size=1 << 40)),
        "world_size",
    ),
    (pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a", data="{nope")), "JSON"),
    (pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x" * 5000)), "too long"),
]


def test_bad_fields_are_invalid_argument_and_server_survives(lighthouse_factory):
    lh = lighthouse_factory(min_replicas=1)
    ch, stub = _raw_stub(lh)
    with ch:
        for req, msg in BAD_REQUESTS:
            with pytest.raises(grpc.RpcError) as e:
                stub.Quorum(req, timeout=2)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req
            assert msg in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.Heartbeat(pb.LighthouseHeartbeatRequest(replica_id=""), timeout=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Oversized message: refused by the server's size limit.
        huge = pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(replica_id="a", data="x" * (5 << 20))
        )
        with pytest.raises(grpc.RpcError) as e:
            stub.Quorum(huge, timeout=5)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert [p.replica_id for p in client(lh).quorum("ok", 5.0).participants] == ["ok"]


def test_ipv6_loopback(lighthouse_factory):
    if not os.path.exists("/proc/net/if_inet6"):
        pytest.skip("no IPv6 on this machine")
    try:
        lh = lighthouse_factory("[::1]:0", min_replicas=1)
    except OSError:
        pytest.skip("cannot bind [::1]")
    assert "[::1]" in lh.address()
    assert ids(client(lh).quorum("a", 5.0)) == ["a"]


# ------------------------------------------------------------------ batched arrivals


class _RecordingCall(Call):
    """A Quorum call as the lighthouse state sees it, recording how it was answered."""

    method = "/torchft.LighthouseService/Quorum"

    def __init__(self) -> None:
        self.answer = None
        self.status = None
        self.on_cancel = None

    def is_active(self) -> bool:
        return self.answer is None and self.status is None

    def reply_serialized(self, data: bytes) -> bool:
        self.answer = pb.LighthouseQuorumResponse.FromString(data)
        return True

    def finish(self, code=grpc.StatusCode.OK, details: str = "") -> bool:
        self.status = (code, details)
        return True


def test_concurrent_arrivals_are_decided_once_for_all(monkeypatch):
    """Quorum calls that arrive while the lighthouse is busy are registered together and the
    quorum rule is evaluated once for the batch (not once per arrival, which made a round of
    N arrivals cost O(N^2)); every caller gets the same quorum, holding all of them."""
    from ft.coordination import lighthouse as lh_mod
    from ft.coordination.quorum import LighthouseOptions, QuorumMember
    from ft.utils.deadline import Deadline

    evaluations = []
    rule = lh_mod.quorum_compute
    monkeypatch.setattr(
        lh_mod, "quorum_compute", lambda *a: (evaluations.append(len(a[1])), rule(*a))[1]
    )
    opts = LighthouseOptions(min_replicas=8, join_timeout_s=60.0, heartbeat_timeout_s=5.0)
    state = lh_mod._LighthouseState(opts, tick_s=0.1, dead_grace_s=30.0, quorum_id_file=None)
    calls = [_RecordingCall() for _ in range(8)]

    def ask(i: int) -> None:
        member = QuorumMember(replica_id=f"r{i}", address=f"a{i}", store_address=f"s{i}", step=0)
        state.quorum(member, Deadline.after(10.0), calls[i])

    with state.lock:  # busy: the arrivals queue up behind it
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: len(state._arrivals) == 8, timeout=10)
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)
    assert evaluations == [8], evaluations
    ids = {c.answer.quorum.quorum_id for c in calls}
    assert len(ids) == 1 and None not in ids
    for c in calls:
        assert sorted(p.replica_id for p in c.answer.quorum.participants) == [
            f"r{i}" for i in range(8)
        ]


def test_arrivals_after_close_are_refused_unavailable():
    from ft.coordination import lighthouse as lh_mod
    from ft.coordination.quorum import LighthouseOptions, QuorumMember
    from ft.utils.deadline import Deadline

    opts = LighthouseOptions(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=5.0)
    state = lh_mod._LighthouseState(opts, tick_s=0.1, dead_grace_s=30.0, quorum_id_file=None)
    state.closed = True
    call = _RecordingCall()
    state.quorum(QuorumMember(replica_id="r0", address="a"), Deadline.after(5.0), call)
    assert call.status == (grpc.StatusCode.UNAVAILABLE, "lighthouse is shutting down")
