"""The native lighthouse answers routine heartbeats in C++ (RpcServer ``fast_heartbeat``):
they count exactly as heartbeats Python receives, and every unusual one still gets Python's
answer (errors have one source). On grpcio every heartbeat goes through Python."""

from __future__ import annotations

import time

import grpc
import pytest

from ft.coordination import LighthouseClient, LighthouseServer
from ft.coordination import _rpc
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.rpc_server import native_available
from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer

pytestmark = pytest.mark.skipif(
    not native_available(), reason="native gRPC server not built (no gRPC C++)"
)

PATH = "/torchft.LighthouseService/Heartbeat"


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
    lh.test_secret = SECRET if request.param else None
    python_calls = []
    original = lh._state.heartbeat

    def counted(replica_id, leaving=False):
        python_calls.append((replica_id, leaving))
        return original(replica_id, leaving=leaving)

    lh._state.heartbeat = counted  # the Python handler looks it up per call
    try:
        yield lh, python_calls
    finally:
        lh.shutdown(0.1)


def raw_call(lh, body: bytes, timeout=5.0):
    if lh.test_secret is not None:
        body = Signer(JobSecret(lh.test_secret), GRPC_PURPOSE).sign_request(PATH, body)
    with grpc.insecure_channel(lh.address().replace("http://", "")) as ch:
        return ch.unary_unary(PATH, request_serializer=None, response_deserializer=None)(
            body, timeout=timeout
        )


def test_a_routine_heartbeat_is_answered_without_python_and_still_counts(lighthouse):
    lh, python_calls = lighthouse
    before = time.monotonic()
    with LighthouseClient(lh.address(), 5.0, secret=lh.test_secret) as c:
        c.heartbeat("fast-replica", timeout=5.0)
    after = time.monotonic()
    assert python_calls == []
    st = lh.status()  # collects the C++ table
    assert "fast-replica" in lh._state.heartbeats
    assert before <= lh._state.heartbeats["fast-replica"] <= after  # the arrival time, kept
    assert any(r["replica_id"] == "fast-replica" for r in st["replicas"]), st


def test_heartbeats_answered_in_cpp_keep_a_replica_alive_and_their_absence_expires_it(lighthouse):
    lh, python_calls = lighthouse

    def replica(name):
        return {r["replica_id"]: r for r in lh.status()["replicas"]}[name]

    with LighthouseClient(lh.address(), 5.0, secret=lh.test_secret) as c:
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
    lh, python_calls = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, request_.SerializeToString())
    assert e.value.code() == code and words in e.value.details()


def test_a_name_of_exactly_the_limit_in_multibyte_characters_goes_to_python(lighthouse):
    # 1024 characters, 2048 UTF-8 bytes: over the C++ byte bound, within Python's char bound.
    lh, python_calls = lighthouse
    name = "é" * _rpc.MAX_NAME_LEN
    raw_call(lh, pb.LighthouseHeartbeatRequest(replica_id=name).SerializeToString())
    assert python_calls == [(name, False)]


def test_invalid_utf8_and_unknown_fields_are_left_to_python(lighthouse):
    lh, python_calls = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, b"\x0a\x02\xff\xfe")  # field 1, two bytes that are not UTF-8
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
    raw_call(lh, pb.LighthouseHeartbeatRequest(replica_id="u").SerializeToString() + b"\x18\x01")
    assert python_calls == [("u", False)]  # an unknown field 3: Python's parser skips it


def test_a_heartbeat_without_a_deadline_is_refused_by_python(lighthouse):
    lh, python_calls = lighthouse
    with pytest.raises(grpc.RpcError) as e:
        raw_call(
            lh, pb.LighthouseHeartbeatRequest(replica_id="n").SerializeToString(), timeout=None
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline" in e.value.details()


def test_leaving_goes_to_python_and_forgets_the_replica_at_once(lighthouse):
    lh, python_calls = lighthouse
    with LighthouseClient(lh.address(), 5.0, secret=lh.test_secret) as c:
        c.heartbeat("bye", timeout=5.0)
        c.heartbeat("bye", timeout=5.0, leaving=True)
        c.heartbeat("bye", timeout=5.0)  # a late one (still in flight when it left): ignored
    assert python_calls == [("bye", True)]
    lh.status()
    assert "bye" not in lh._state.heartbeats and "bye" in lh._state.left


def test_after_shutdown_begins_heartbeats_get_unavailable(lighthouse):
    lh, python_calls = lighthouse
    lh._server.close_heartbeat_fast_path()
    lh._state.close()
    with pytest.raises(grpc.RpcError) as e:
        raw_call(lh, pb.LighthouseHeartbeatRequest(replica_id="late").SerializeToString())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
