"""ft's coordination clients on both transports (ft.coordination.clients, ``transport=``):
the native client (gRPC C++, ft.coordination._grpc_server.Channel) and grpcio, each against
both lighthouse servers. Both must give callers the same answers, and the same exception types
and messages for the same failures; a lighthouse killed or frozen mid-call must not hold a
caller past its deadline."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import grpc
import pytest

from ft.coordination import CoordinationError, LighthouseClient, LighthouseServer, _rpc, wire
from ft.coordination.quorum import QuorumMember
from ft.coordination.rpc_server import native_available
from tests.coordination._helpers import parallel, run_threads, wait_for

SECRET = "client-transports-test-secret-0123456789"

_NEEDS_NATIVE = pytest.mark.skipif(
    _rpc.native is None, reason="native gRPC client not built (no gRPC C++)"
)
# "native": Quorum as messages of the client's QuorumStream (the default); "native-calls": the
# native client with call streams off (FT_CLIENT_CALL_STREAMS=0), every Quorum a call.
CLIENT_TRANSPORTS = [
    pytest.param("native", marks=_NEEDS_NATIVE),
    pytest.param("native-calls", marks=_NEEDS_NATIVE),
    "grpcio",
]


@pytest.fixture(params=CLIENT_TRANSPORTS)
def client_transport(request, monkeypatch) -> str:
    if request.param == "native-calls":
        monkeypatch.setenv(_rpc.CALL_STREAMS_ENV, "0")
        return "native"
    monkeypatch.delenv(_rpc.CALL_STREAMS_ENV, raising=False)
    return request.param


def _client(addr: str, transport: str, connect_timeout: float = 5.0, **kw) -> LighthouseClient:
    c = LighthouseClient(addr, connect_timeout, transport=transport, **kw)
    assert c.transport == transport
    return c


def _failure(fn):
    """(type, message) of what ``fn()`` raises."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    raise AssertionError("no exception")


def test_quorum_and_heartbeat(lighthouse_factory, client_transport):
    lh = lighthouse_factory(min_replicas=2)
    clients = [_client(lh.address(), client_transport) for _ in range(2)]
    try:
        for i, c in enumerate(clients):
            c.heartbeat(f"r{i}", timeout=5.0)
        wait_for(lambda: {"r0", "r1"} <= set(lh._state.heartbeats), what="both heartbeats")
        quorums = parallel(
            [
                lambda c=c, i=i: c.quorum(f"r{i}", timeout=10.0, step=i + 3, world_size=1)
                for i, c in enumerate(clients)
            ]
        )
        for q in quorums:
            assert not isinstance(q, BaseException), q
            assert sorted(m.replica_id for m in q.participants) == ["r0", "r1"]
            assert max(m.step for m in q.participants) == 4
        assert quorums[0].quorum_id == quorums[1].quorum_id
    finally:
        for c in clients:
            c.close()


def test_same_failures_on_both_clients(lighthouse_factory):
    """A server-side deadline explanation, a refused request, a bad secret, a missing secret:
    the native client and grpcio raise the same type with the same message."""
    if _rpc.native is None:
        pytest.skip("native gRPC client not built (no gRPC C++)")
    lh = lighthouse_factory(min_replicas=2, secret=SECRET)
    seen = {}
    for transport in ("native", "grpcio"):
        good = _client(lh.address(), transport, secret=SECRET)
        wrong = _client(lh.address(), transport, secret="another-secret-0123456789abcdef")
        none = _client(lh.address(), transport)
        try:
            seen[transport] = [
                # alone in a quorum of 2: the lighthouse explains before the deadline (by
                # 50 ms at most: a shorter timeout would leave it less on a loaded machine)
                _failure(lambda: good.quorum("alone", timeout=1.0, step=1)),
                # an empty replica id is INVALID_ARGUMENT
                _failure(lambda: good.heartbeat("", timeout=2.0)),
                _failure(lambda: wrong.heartbeat("r", timeout=2.0)),
                _failure(lambda: none.quorum("r", timeout=2.0)),
            ]
        finally:
            for c in (good, wrong, none):
                c.close()
    assert seen["native"] == seen["grpcio"]
    deadline, invalid, wrong_secret, no_secret = seen["native"]
    assert deadline[0] is TimeoutError and "min_replicas" in deadline[1], deadline
    assert invalid[0] is CoordinationError and "INVALID_ARGUMENT" in invalid[1], invalid
    assert wrong_secret[0] is CoordinationError, wrong_secret
    # the server's id is signed with the job's secret: this client cannot even sign for it
    assert "UNAUTHENTICATED" in wrong_secret[1] and "job secret" in wrong_secret[1]
    assert "UNAUTHENTICATED" in no_secret[1] and "no signature" in no_secret[1], no_secret


def test_unauthenticated_codes(lighthouse_factory, client_transport):
    lh = lighthouse_factory(secret=SECRET)
    with _client(lh.address(), client_transport, secret="x" * 32) as c:
        with pytest.raises(CoordinationError) as e:
            c.heartbeat("r", timeout=2.0)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert e.value.method == "Heartbeat" and "job secret" in e.value.details
    with _client(lh.address(), client_transport, secret=SECRET) as c:
        c.heartbeat("r", timeout=2.0)  # the right one passes, on the same server


def test_server_gone(client_transport):
    """Nothing listens: the connection phase times out (naming the address), and a call that
    does not wait for the server is UNAVAILABLE at once."""
    with _client("127.0.0.1:1", client_transport, connect_timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"Quorum: could not connect to 127\.0\.0\.1:1"):
            c.quorum("a", timeout=5.0)
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(CoordinationError) as e:
            c.heartbeat("a", timeout=1.0, wait_for_ready=False)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert e.value.method == "Heartbeat" and e.value.details
        assert time.monotonic() - t0 < 1.5


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_lighthouse_lost_mid_call_ends_by_the_deadline(children, client_transport, fault):
    """A Quorum call waits on a lighthouse (its own process) that is killed with SIGKILL, or
    frozen with SIGSTOP, mid-call: the call ends by its deadline (retrying the lost connection
    meanwhile), with TimeoutError or UNAVAILABLE, never later."""
    lh = children("lighthouse", '{"bind": "127.0.0.1:0", "min_replicas": 2}')
    addr = lh.address()
    c = _client(addr, client_transport)
    try:
        c.heartbeat("a", timeout=5.0)  # connected
        timeout = 1.0
        with run_threads([lambda: c.quorum("a", timeout=timeout)], timeout=timeout + 5) as res:
            time.sleep(0.2)  # the call is in flight, waiting for a second member
            t0 = time.monotonic()
            if fault == "kill":
                lh.kill()
            else:
                lh.stop()
        elapsed = time.monotonic() - t0
        err = res[0]
        assert isinstance(err, (TimeoutError, CoordinationError)), err
        if isinstance(err, CoordinationError):
            assert err.code == grpc.StatusCode.UNAVAILABLE, err
        assert elapsed < timeout + 0.5, elapsed
    finally:
        c.close()
        lh.kill()


def test_a_signal_interrupts_a_waiting_call(lighthouse_factory, client_transport):
    """Ctrl-C (here: a SIGALRM handler that raises) ends a long Quorum wait at once."""

    class Interrupted(Exception):
        pass

    def raise_interrupted(*_):
        raise Interrupted()

    lh = lighthouse_factory(min_replicas=2)
    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    try:
        with _client(lh.address(), client_transport) as c:
            c.heartbeat("a", timeout=5.0)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            t0 = time.monotonic()
            with pytest.raises(Interrupted):
                c.quorum("a", timeout=20.0)
            assert time.monotonic() - t0 < 2.0
            c.heartbeat("a", timeout=5.0)  # the client still works
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_process_exits_with_calls_in_flight(children, client_transport):
    """A process whose daemon threads still wait in calls exits cleanly (status 0): no abort
    while the interpreter finalizes under them, no hang."""
    lh = LighthouseServer("127.0.0.1:0", min_replicas=100)
    try:
        child = children("exit-mid-call", lh.address(), client_transport)
        assert child.wait(15.0) == 0, child.output()
    finally:
        lh.shutdown(grace=0.1)
    assert "EXITING" in child.output()


@pytest.mark.skipif(not native_available(), reason="native gRPC client not built")
def test_clients_dropped_with_open_heartbeat_streams_do_not_abort(children):
    """A native client dropped while its heartbeat stream is open leaves the stream's call to
    end on gRPC's callback thread, holding the channel's last reference. In a process with no
    gRPC server of its own, dropping it there made gRPC release its callback queue from the
    queue's own thread and abort ("assertion failed: prior > 0"): about 6 in 10 children of
    10 rounds did. Three children, 20 rounds of 16 clients each: every one exits 0."""
    lh = LighthouseServer("127.0.0.1:0", min_replicas=100, transport="native")
    try:
        kids = [children("drop-streaming-clients", lh.address(), "20") for _ in range(3)]
        for kid in kids:
            assert kid.wait(60.0) == 0, kid.output()
            assert "DROPPED" in kid.output()
    finally:
        lh.shutdown(grace=0.1)


def test_grpcio_channel_closed_right_after_concurrent_connects_raises_nothing(monkeypatch):
    """Several threads wait for one grpcio channel to connect (as a client's threads do after
    a lost connection), then the channel is closed at once (``LighthouseClient.close()``
    closes it with ``_rpc.close_channel``). grpcio's connectivity poller, still running, raised
    "ValueError: Cannot invoke RPC: Channel closed!" on its thread in 38 of 40 such rounds with
    a plain ``channel.close()``; here in none."""
    lh = LighthouseServer("127.0.0.1:0", min_replicas=1, transport="grpcio")
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    addr = lh.address().replace("http://", "")
    try:
        for _ in range(5):
            channel = grpc.insecure_channel(addr)
            results = parallel([lambda: _rpc.wait_ready(channel, addr, 5.0)] * 8)
            assert results == [None] * 8, results
            _rpc.close_channel(channel)
        time.sleep(0.5)  # the poller of the last round would raise within its 0.2 s watch
    finally:
        lh.shutdown(grace=0.1)
    assert raised == [], raised


def test_many_threads_share_one_client(lighthouse_factory, client_transport):
    lh = lighthouse_factory()
    with _client(lh.address(), client_transport) as c:
        errors = []

        def beat(i: int) -> None:
            try:
                for _ in range(20):
                    c.heartbeat(f"t{i}", timeout=5.0)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=beat, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not errors and not any(t.is_alive() for t in threads), errors


def test_closed_client_refuses_calls(lighthouse_factory, client_transport):
    lh = lighthouse_factory()
    c = _client(lh.address(), client_transport)
    c.heartbeat("a", timeout=5.0)
    c.close()
    with pytest.raises(ValueError, match="closed channel"):
        c.heartbeat("a", timeout=1.0)


def test_transport_selection(monkeypatch):
    monkeypatch.setenv(_rpc.CLIENT_TRANSPORT_ENV, "grpcio")
    assert LighthouseClient("127.0.0.1:1", 1.0).transport == "grpcio"
    monkeypatch.setenv(_rpc.CLIENT_TRANSPORT_ENV, "bogus")
    with pytest.raises(ValueError, match=_rpc.CLIENT_TRANSPORT_ENV):
        LighthouseClient("127.0.0.1:1", 1.0)
    monkeypatch.delenv(_rpc.CLIENT_TRANSPORT_ENV)
    expected = "native" if _rpc.native is not None else "grpcio"
    assert LighthouseClient("127.0.0.1:1", 1.0).transport == expected
    # TLS is grpcio's: "auto" falls back to it, "native" refuses
    assert _rpc.client_transport("auto", tls=True) == "grpcio"
    if _rpc.native is not None:
        with pytest.raises(ValueError, match="TLS"):
            _rpc.client_transport("native", tls=True)


def test_decoded_member_is_the_dataclass():
    """wire.member_from_pb fills a QuorumMember without its __init__ (speed): the object must
    be the one the constructor makes: equal, same hash and repr, still frozen."""
    m = QuorumMember("r", "http://h:1", "h:2", 7, 3, True, {"k": [1, 2]}, 4)
    got = wire.member_from_pb(wire.member_to_pb(m))
    assert type(got) is QuorumMember
    assert got == m and hash(got) == hash(m) and repr(got) == repr(m)
    assert dataclasses.asdict(got) == dataclasses.asdict(m)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.step = 8


@pytest.mark.skipif(_rpc.native is None, reason="native gRPC client not built (no gRPC C++)")
def test_load_generator(lighthouse_factory):
    """The benchmarks' open-loop heartbeat load (bench/quorum_vs_torchft.py): every call
    answered, each id heard, the rate kept."""
    from ft.coordination._proto import torchft_pb2 as pb

    lh = lighthouse_factory()
    bodies = [
        pb.LighthouseHeartbeatRequest(replica_id=f"g{i}").SerializeToString() for i in range(8)
    ]
    gen = _rpc.native.LoadGenerator(
        _rpc.grpc_target(lh.address()), _rpc.CHANNEL_OPTIONS, connections=4, connect_timeout_s=5.0
    )
    r = gen.run("/torchft.LighthouseService/Heartbeat", bodies, 2000.0, 0.1, 5.0)
    assert (r["sent"], r["ok"], r["failed"]) == (200, 200, 0), r
    assert r["send_s"] < 1.0, r
    wait_for(lambda: {f"g{i}" for i in range(8)} <= set(lh._state.heartbeats), what="all ids")
