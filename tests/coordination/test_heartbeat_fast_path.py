"""The native lighthouse answers routine heartbeats in C++ (RpcServer ``fast_heartbeat``):
they count exactly as heartbeats Python receives, and every unusual one still gets Python's
answer (errors have one source). On grpcio every heartbeat goes through Python.

The same holds for heartbeats sent as messages of one ``HeartbeatStream`` call (the native
client's routine heartbeats, ``fast_heartbeat_stream``): recorded in C++, never in Python; a
message the C++ table does not take ends the stream, and the client's next heartbeat is a
Heartbeat call that gets Python's answer."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from ft.coordination import CoordinationError, LighthouseClient, LighthouseServer
from ft.coordination import _rpc
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.rpc_server import native_available
from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer
from tests.procs import free_port

pytestmark = pytest.mark.skipif(
    not native_available(), reason="native gRPC server not built (no gRPC C++)"
)

PATH = "/torchft.LighthouseService/Heartbeat"
STREAM = "/torchft.LighthouseService/HeartbeatStream"


SECRET = "fast-path-test-secret-0123456789abcdef"


@pytest.fixture(params=[False, True], ids=["open", "secret"])
def lighthouse(request):
    """A native lighthouse whose Python heartbeat handler counts its calls; with and without a
    job secret (signed heartbeats must take the C++ path too, once their signature is off)."""
    lh = LighthouseServer(
        "127.0.0.1:0",
        1,
        transport="native",
        join_timeout_ms=100,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=500,
        http_bind="",
        secret=SECRET if request.param else None,
    )
    python_calls = []
    original = lh._state.heartbeat

    def counted(replica_id, leaving=False):
        python_calls.append((replica_id, leaving))
        return original(replica_id, leaving=leaving)

    lh._state.heartbeat = counted  # the Python handler looks it up per call
    try:
        yield lh, python_calls, SECRET if request.param else None
    finally:
        lh.shutdown(0.1)


def raw_call(lh, secret, body: bytes, timeout=5.0):
    if secret is not None:
        body = Signer(JobSecret(secret), GRPC_PURPOSE).sign_request(PATH, body, lh.server_id)
    with grpc.insecure_channel(lh.address().replace("http://", "")) as ch:
        return ch.unary_unary(PATH, request_serializer=None, response_deserializer=None)(
            body, timeout=timeout
        )


def test_a_routine_heartbeat_is_answered_without_python_and_still_counts(lighthouse):
    lh, python_calls, secret = lighthouse
    before = time.monotonic()
    with LighthouseClient(lh.address(), 5.0, secret=secret) as c:
        c.heartbeat("fast-replica", timeout=5.0)
    after = time.monotonic()
    assert python_calls == []
    st = lh.status()  # collects the C++ table
    assert "fast-replica" in lh._state.heartbeats
    assert before <= lh._state.heartbeats["fast-replica"] <= after  # the arrival time, kept
    assert any(r["replica_id"] == "fast-replica" for r in st["replicas"]), st


def test_heartbeats_answered_in_cpp_keep_a_replica_alive_and_their_absence_expires_it(lighthouse):
    lh, python_calls, secret = lighthouse

    def replica(name):
        return {r["replica_id"]: r for r in lh.status()["replicas"]}[name]

    with LighthouseClient(lh.address(), 5.0, secret=secret) as c:
        q = c.quorum("alive", timeout=5.0)
        assert [m.replica_id for m in q.participants] == ["alive"]
        for _ in range(10):  # 1 s of heartbeats every 0.1 s: twice the heartbeat timeout
            c.heartbeat("alive", timeout=5.0)
            time.sleep(0.1)
        assert python_calls == []
        assert replica("alive")["alive"]
        time.sleep(0.8)  # then none for longer than the timeout
        assert not replica("alive")["alive"]
        assert replica("alive")["heartbeat_age_s"] > 0.5


@pytest.mark.parametrize(
    "request_,code,words",
    [
        (
            pb.LighthouseHeartbeatRequest(replica_id=""),
            grpc.StatusCode.INVALID_ARGUMENT,
            "must not be empty",
        ),
        (
            pb.LighthouseHeartbeatRequest(replica_id="x" * (_rpc.MAX_NAME_LEN + 1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "too long",
        ),
    ],
    ids=["empty-name", "long-name"],
)
def test_bad_heartbeats_get_pythons_answer(lighthouse, request_, code, words):
    lh, python_calls, secret = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, secret, request_.SerializeToString())
    assert e.value.code() == code and words in e.value.details()


def test_a_name_of_exactly_the_limit_in_multibyte_characters_goes_to_python(lighthouse):
    # 1024 characters, 2048 UTF-8 bytes: over the C++ byte bound, within Python's char bound.
    lh, python_calls, secret = lighthouse
    name = "é" * _rpc.MAX_NAME_LEN
    raw_call(lh, secret, pb.LighthouseHeartbeatRequest(replica_id=name).SerializeToString())
    assert python_calls == [(name, False)]


def test_invalid_utf8_and_unknown_fields_are_left_to_python(lighthouse):
    lh, python_calls, secret = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, secret, b"\x0a\x02\xff\xfe")  # field 1, two bytes that are not UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
    raw_call(
        lh, secret, pb.LighthouseHeartbeatRequest(replica_id="u").SerializeToString() + b"\x18\x01"
    )
    assert python_calls == [("u", False)]  # an unknown field 3: Python's parser skips it


def test_a_heartbeat_without_a_deadline_is_refused_by_python(lighthouse):
    lh, python_calls, secret = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(
            lh,
            secret,
            pb.LighthouseHeartbeatRequest(replica_id="n").SerializeToString(),
            timeout=None,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline" in e.value.details()


def test_leaving_goes_to_python_and_forgets_the_replica_at_once(lighthouse):
    lh, python_calls, secret = lighthouse
    with LighthouseClient(lh.address(), 5.0, secret=secret) as c:
        c.heartbeat("bye", timeout=5.0)
        c.heartbeat("bye", timeout=5.0, leaving=True)
        c.heartbeat("bye", timeout=5.0)  # a late one (still in flight when it left): ignored
    assert python_calls == [("bye", True)]
    lh.status()
    assert "bye" not in lh._state.heartbeats and "bye" in lh._state.left


def test_after_shutdown_begins_heartbeats_get_unavailable(lighthouse):
    lh, python_calls, secret = lighthouse
    lh._server.close_heartbeat_fast_path()
    lh._state.close()
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, secret, pb.LighthouseHeartbeatRequest(replica_id="late").SerializeToString())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()


# --- heartbeats on a stream


def open_stream(lh, secret):
    """A raw native heartbeat stream to ``lh``, signed with ``secret`` (None: unsigned)."""
    key = Signer(JobSecret(secret), GRPC_PURPOSE).key if secret is not None else b""
    channel = _rpc.make_native_channel(lh.address(), key)
    if secret is not None:
        channel.set_server_id(lh.server_id)  # what a client learns before it signs
    return channel, channel.open_stream(STREAM)


def hb(replica_id: str, **kw) -> bytes:
    return pb.LighthouseHeartbeatRequest(replica_id=replica_id, **kw).SerializeToString()


def recorded(lh, replica_id: str, timeout: float = 5.0) -> bool:
    """Whether the lighthouse has a heartbeat of ``replica_id`` (the C++ table is collected by
    ``status()``; a streamed message is written before the server records it, so poll)."""
    end = time.monotonic() + timeout
    while True:
        lh.status()
        if replica_id in lh._state.heartbeats or time.monotonic() >= end:
            return replica_id in lh._state.heartbeats
        time.sleep(0.01)


def test_streamed_heartbeats_skip_python_and_keep_a_replica_alive(lighthouse):
    lh, python_calls, secret = lighthouse

    def replica(name):
        return {r["replica_id"]: r for r in lh.status()["replicas"]}[name]

    with LighthouseClient(lh.address(), 5.0, secret=secret, transport="native") as c:
        c.quorum("streamed", timeout=5.0)
        for _ in range(10):  # 1 s of heartbeats every 0.1 s: twice the heartbeat timeout
            c.heartbeat("streamed", timeout=5.0)
            time.sleep(0.1)
        assert c._heartbeats.sent == 10  # all on the stream, and none reached Python
        assert python_calls == []
        assert replica("streamed")["alive"]
        time.sleep(0.8)  # an open stream with nothing on it is no heartbeat
        assert not replica("streamed")["alive"]


def test_a_stream_records_each_message_and_ends_ok_when_the_client_closes(lighthouse):
    lh, python_calls, secret = lighthouse
    channel, stream = open_stream(lh, secret)
    for name in ("s1", "s2", "s3"):
        stream.send(hb(name), 5.0)
    assert stream.close(5.0) == (0, "")
    assert all(recorded(lh, name) for name in ("s1", "s2", "s3"))
    assert python_calls == []
    assert stream.close(1.0) is None  # nothing open any more
    channel.close()


def send_until_refused(stream, first: bytes, then: bytes, attempts: int = 5):
    """Sends ``first``, then ``then``, until a send raises (the server's end of the stream
    reaches the client with the send of the message it refused, or with a later one); returns
    the CallError."""
    for i in range(attempts):
        try:
            stream.send(first if i == 0 else then, 5.0)
        except _rpc.native.CallError as e:
            return e
        time.sleep(0.05)
    raise AssertionError(f"the stream took {attempts} messages after it should have ended")


def test_a_message_the_table_refuses_ends_the_stream_and_the_stream_reopens(lighthouse):
    lh, python_calls, secret = lighthouse
    channel, stream = open_stream(lh, secret)
    stream.send(hb("before"), 5.0)
    e = send_until_refused(stream, hb("bye", leaving=True), hb("after"))  # refused by the server
    code, details = _rpc.native_status(e)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "send this one unary" in details
    assert python_calls == []
    assert recorded(lh, "before") and not recorded(lh, "after", timeout=0.2)
    assert "bye" not in lh._state.left  # the leaving message was not taken
    stream.send(hb("again"), 5.0)  # a new call
    assert recorded(lh, "again")
    channel.close()


def test_a_wrongly_signed_stream_is_refused_and_records_nothing(lighthouse):
    lh, _, secret = lighthouse
    if secret is None:
        pytest.skip("the lighthouse has no secret")
    for wrong in (None, "another-job-secret-0123456789abcdef"):
        channel, stream = open_stream(lh, wrong)
        e = send_until_refused(stream, hb("intruder"), hb("intruder"))
        assert _rpc.native_status(e)[0] == grpc.StatusCode.UNAUTHENTICATED
        channel.close()
    assert not recorded(lh, "intruder", timeout=0.2)


def test_the_client_reports_every_refused_heartbeat(lighthouse):
    """What the lighthouse refuses is raised by every heartbeat, never taken silently by a
    stream: a refused first message is never confirmed, and the heartbeat goes as a call."""
    lh, _, secret = lighthouse
    cases = [("", grpc.StatusCode.INVALID_ARGUMENT, secret)]
    if secret is not None:
        cases.append(("ok-name", grpc.StatusCode.UNAUTHENTICATED, "wrong-secret-0123456789abcdef"))
    for name, code, client_secret in cases:
        with LighthouseClient(lh.address(), 5.0, secret=client_secret, transport="native") as c:
            for _ in range(3):
                with pytest.raises(CoordinationError) as e:
                    c.heartbeat(name, timeout=5.0)
                assert e.value.code == code
            assert c._heartbeats.sent == 0


def test_when_the_fast_path_closes_the_stream_ends_and_heartbeats_get_pythons_answer(lighthouse):
    lh, _, secret = lighthouse
    with LighthouseClient(lh.address(), 5.0, secret=secret, transport="native") as c:
        c.heartbeat("late", timeout=5.0)
        c.heartbeat("late", timeout=5.0)
        assert c._heartbeats.sent == 2
        lh._server.close_heartbeat_fast_path()
        lh._state.close()
        # The next message ends the stream; the end reaches the client with that send or
        # one of the next, which is then sent as a Heartbeat call.
        for _ in range(4):
            try:
                c.heartbeat("late", timeout=0.5)  # UNAVAILABLE is retried until the deadline
            except CoordinationError as e:
                assert e.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.details
                break
            time.sleep(0.05)
        else:
            raise AssertionError("heartbeats went on being taken after the fast path closed")


def test_a_lighthouse_without_the_stream_gets_heartbeat_calls():
    """A lighthouse that does not serve HeartbeatStream (grpcio here; torchft's lighthouse
    likewise) answers UNIMPLEMENTED; the client then sends Heartbeat calls, and loses none:
    the stream's first message was never confirmed, so it went as a call too."""
    lh = LighthouseServer(
        "127.0.0.1:0", 1, transport="grpcio", heartbeat_timeout_ms=500, http_bind=""
    )
    try:
        with LighthouseClient(lh.address(), 5.0, transport="native") as c:
            for _ in range(5):
                before = time.monotonic()
                c.heartbeat("plain", timeout=5.0)
                assert lh._state.heartbeats["plain"] >= before  # each one arrived
            assert c._heartbeats.sent == 0
            assert c._heartbeats._unary_until > time.monotonic()
    finally:
        lh.shutdown(0.1)


def test_streamed_heartbeats_resume_after_the_lighthouse_restarts(children):
    port = free_port()
    spec = json.dumps({"bind": f"127.0.0.1:{port}", "min_replicas": 1, "transport": "native"})
    lh = children("lighthouse", spec)
    addr = lh.address()
    with LighthouseClient(addr, 5.0, transport="native") as c:
        for _ in range(3):
            c.heartbeat("r", timeout=5.0)
        assert c._heartbeats.sent == 3
        lh.kill()  # SIGKILL, reaped
        failures = 0
        for _ in range(3):
            try:
                c.heartbeat("r", timeout=1.0, wait_for_ready=False)
            except (CoordinationError, TimeoutError):
                failures += 1
        assert failures >= 2  # at most one taken by a dying connection
        lh = children("lighthouse", spec)
        lh.address()
        sent = c._heartbeats.sent
        for _ in range(3):
            c.heartbeat("r", timeout=5.0)
        # On a new stream (the first may go as a call while the channel reconnects).
        assert c._heartbeats.sent >= sent + 2


def test_the_load_generator_streams_heartbeats_the_lighthouse_records(lighthouse):
    """bench/quorum_vs_torchft's streamed load: every message written, every stream ended OK,
    every replica id recorded (the generator does not sign: the open lighthouse only)."""
    lh, python_calls, secret = lighthouse
    if secret is not None:
        pytest.skip("the load generator does not sign")
    names = [f"load-{i}" for i in range(8)]
    gen = _rpc.native.LoadGenerator(_rpc.grpc_target(lh.address()), _rpc.CHANNEL_OPTIONS, 4, 10.0)
    r = gen.run_streams(STREAM, [hb(n) for n in names], 200.0, 0.5, 5.0)
    assert r["sent"] == 100 and r["ok"] == 100, r
    assert r["failed"] == 0 and r["streams_failed"] == 0, r
    assert all(recorded(lh, n) for n in names)
    assert python_calls == []
