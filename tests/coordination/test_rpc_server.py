"""ft.coordination.rpc_server: handlers that answer later, on both transports, with real gRPC
clients on loopback. The lighthouse suite runs on both transports too (conftest)."""

import os
import threading
import time

import grpc
import pytest

from ft.coordination import rpc_server
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.rpc_server import Method, RpcServer

from tests.coordination._helpers import TRANSPORTS, wait_for

SVC = "/torchft.LighthouseService/"


def test_native_server_is_built_where_required():
    """CI builds against gRPC C++ and sets FT_REQUIRE_NATIVE_GRPC=1: the fallback must not hide
    a broken build there."""
    if os.environ.get("FT_REQUIRE_NATIVE_GRPC") != "1":
        pytest.skip("FT_REQUIRE_NATIVE_GRPC not set (the native server is optional)")
    assert rpc_server.native_available(), "ft.coordination._grpc_server was not built"


@pytest.fixture(params=TRANSPORTS)
def serve(request):
    made = []

    def make(methods, **kw):
        s = RpcServer("127.0.0.1:0", methods, transport=request.param, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown(0.1)


def stub_for(server):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, {
        "Heartbeat": channel.unary_unary(
            SVC + "Heartbeat",
            pb.LighthouseHeartbeatRequest.SerializeToString,
            pb.LighthouseHeartbeatResponse.FromString,
        ),
        "Quorum": channel.unary_unary(
            SVC + "Quorum",
            pb.LighthouseQuorumRequest.SerializeToString,
            pb.LighthouseQuorumResponse.FromString,
        ),
        "Subscribe": channel.unary_stream(
            SVC + "SubscribeFailures",
            pb.SubscribeFailuresRequest.SerializeToString,
            pb.FailureNotification.FromString,
        ),
        "Raw": channel.unary_unary(SVC + "Quorum"),  # bytes in, bytes out
        "Unknown": channel.unary_unary("/torchft.LighthouseService/Nope"),
    }


def test_answer_now_later_and_from_another_thread(serve):
    open_calls = []

    def heartbeat(req, call):
        call.reply(pb.LighthouseHeartbeatResponse())

    def quorum(req, call):
        # Answered by the second request, from a timer thread: no thread waits per call.
        open_calls.append(call)
        if len(open_calls) == 2:
            answer = pb.LighthouseQuorumResponse(
                quorum=pb.Quorum(quorum_id=7, participants=[req.requester])
            )
            data = answer.SerializeToString()
            threading.Timer(0.05, lambda: [c.reply_serialized(data) for c in open_calls]).start()

    s = serve(
        {
            SVC + "Heartbeat": Method(pb.LighthouseHeartbeatRequest, heartbeat),
            SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum),
        }
    )
    channel, stub = stub_for(s)
    with channel:
        stub["Heartbeat"](pb.LighthouseHeartbeatRequest(replica_id="a"), timeout=5)
        results = []

        def ask(rid):
            req = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=rid))
            results.append(stub["Quorum"](req, timeout=5))

        threads = [threading.Thread(target=ask, args=(r,)) for r in ("x", "y")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert [r.quorum.quorum_id for r in results] == [7, 7]
        # A second answer to an answered call is refused, not sent.
        assert not open_calls[0].reply(pb.LighthouseQuorumResponse())
        assert not open_calls[0].is_active()


def test_bad_requests_get_statuses_and_the_server_goes_on(serve):
    def quorum(req, call):
        if req.requester.replica_id == "boom":
            raise ValueError("handler bug")
        if req.requester.replica_id == "abort":
            call.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id 'abort' is not allowed")
        call.reply(pb.LighthouseQuorumResponse())

    s = serve({SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum)})
    channel, stub = stub_for(s)
    with channel:

        def status_of(fn, *args):
            with pytest.raises(grpc.RpcError) as ei:
                fn(*args, timeout=5)
            return ei.value.code(), ei.value.details()

        code, details = status_of(stub["Unknown"], b"")
        assert code == grpc.StatusCode.UNIMPLEMENTED
        code, details = status_of(stub["Raw"], b"\xff\xff\xff")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "malformed request" in details
        code, details = status_of(
            stub["Quorum"], pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="boom"))
        )
        assert code == grpc.StatusCode.INTERNAL and "handler bug" in details
        code, details = status_of(
            stub["Quorum"],
            pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="abort")),
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not allowed" in details
        big = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x" * (5 << 20)))
        code, _ = status_of(stub["Quorum"], big)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Still serving.
        stub["Quorum"](
            pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="ok")), timeout=5
        )


def test_on_cancel_when_the_caller_leaves_or_its_deadline_passes(serve):
    calls, cancelled = {}, []

    def quorum(req, call):
        rid = req.requester.replica_id
        call.on_cancel = lambda: cancelled.append(rid)
        calls[rid] = call
        assert 0 < call.time_remaining() <= 31  # gRPC rounds the timeout header up

    s = serve({SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum)})
    channel, stub = stub_for(s)
    with channel:
        req = lambda rid: pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id=rid))  # noqa: E731
        with pytest.raises(grpc.RpcError) as ei:
            stub["Quorum"](req("deadline"), timeout=0.2)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        fut = stub["Quorum"].future(req("leaves"), timeout=30)
        wait_for(lambda: "leaves" in calls, what="the call to arrive")
        fut.cancel()
        wait_for(lambda: sorted(cancelled) == ["deadline", "leaves"], what="both on_cancel calls")
        assert not calls["leaves"].is_active()
        assert not calls["leaves"].reply(pb.LighthouseQuorumResponse())  # too late: refused


def test_stream_writes_in_order_then_finishes(serve):
    def subscribe(req, call):
        def run():
            for i in range(50):
                assert call.write(pb.FailureNotification(replica_id=f"r{i}"))
            call.finish()
            assert not call.write(pb.FailureNotification(replica_id="after finish"))

        threading.Thread(target=run).start()

    s = serve(
        {SVC + "SubscribeFailures": Method(pb.SubscribeFailuresRequest, subscribe, streaming=True)}
    )
    channel, stub = stub_for(s)
    with channel:
        got = [m.replica_id for m in stub["Subscribe"](pb.SubscribeFailuresRequest(), timeout=10)]
    assert got == [f"r{i}" for i in range(50)]


def test_stream_ends_with_the_status_given(serve):
    def subscribe(req, call):
        call.write(pb.FailureNotification(replica_id="first"))
        call.finish(grpc.StatusCode.UNAVAILABLE, "shutting down")

    s = serve(
        {SVC + "SubscribeFailures": Method(pb.SubscribeFailuresRequest, subscribe, streaming=True)}
    )
    channel, stub = stub_for(s)
    with channel:
        it = stub["Subscribe"](pb.SubscribeFailuresRequest(), timeout=10)
        assert next(it).replica_id == "first"
        with pytest.raises(grpc.RpcError) as ei:
            next(it)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == "shutting down"


def test_shutdown_ends_open_calls_within_grace(serve):
    cancelled = threading.Event()

    def quorum(req, call):
        call.on_cancel = cancelled.set  # never answered

    s = serve({SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum)})
    channel, stub = stub_for(s)
    with channel:
        fut = stub["Quorum"].future(
            pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x")), timeout=30
        )
        time.sleep(0.2)
        t0 = time.monotonic()
        s.shutdown(0.2)
        assert time.monotonic() - t0 < 5
        with pytest.raises(grpc.RpcError):
            fut.result(timeout=5)
        assert cancelled.wait(5)


def test_transport_choice_is_validated():
    with pytest.raises(ValueError, match="transport"):
        RpcServer("127.0.0.1:0", {}, transport="carrier-pigeon")
    if not rpc_server.native_available():
        with pytest.raises(RuntimeError, match="not built"):
            RpcServer("127.0.0.1:0", {}, transport="native")


def test_bind_failure_is_an_oserror(serve):
    s = serve({})
    with pytest.raises(OSError):
        RpcServer(
            f"127.0.0.1:{s.port}",
            {},
            transport="native" if rpc_server.native_available() else "grpcio",
        )


def test_on_cancel_set_after_the_caller_left_is_called_at_once(serve):
    calls = []

    def quorum(req, call):
        calls.append(call)  # no on_cancel yet

    s = serve({SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum)})
    channel, stub = stub_for(s)
    with channel:
        fut = stub["Quorum"].future(
            pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="x")), timeout=30
        )
        wait_for(lambda: calls, what="the call to arrive")
        fut.cancel()
        wait_for(lambda: not calls[0].is_active(), what="the cancellation to be seen")
        told = []
        calls[0].on_cancel = lambda: told.append(True)
        assert told == [True]
        assert not calls[0].write(pb.FailureNotification())  # over: writes refused


@pytest.mark.parametrize("with_verifier", [True, False], ids=["verifier", "no-verifier"])
def test_the_signature_field_is_taken_off_before_the_handler_parses(serve, with_verifier):
    """The signature rides in the request's leading field (ft.utils.auth): whichever transport
    and whether or not it checks signatures, the handler gets the request its client serialized,
    and with a verifier a broken or missing field is refused with the reason."""
    from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer, Verifier, new_server_id

    secret = JobSecret("rpc-server-test-secret-0123456789")
    seen = []

    def quorum(req, call):
        # Nothing of the auth field is left for the parser: the request re-serializes to
        # exactly its client's bytes (protobuf keeps unknown fields it skipped).
        seen.append((req.requester.replica_id, call.verified, req.SerializeToString()))
        call.reply(pb.LighthouseQuorumResponse())

    sid = new_server_id()
    verifier = Verifier(secret, GRPC_PURPOSE, server_id=sid) if with_verifier else None
    s = serve({SVC + "Quorum": Method(pb.LighthouseQuorumRequest, quorum)}, verifier=verifier)
    body = pb.LighthouseQuorumRequest(requester=pb.QuorumMember(replica_id="a")).SerializeToString()
    signed = Signer(secret, GRPC_PURPOSE).sign_request(SVC + "Quorum", body, sid)
    assert signed.endswith(body) and len(signed) > len(body)
    checked_in_cpp = with_verifier and s.transport == "native"
    channel, stub = stub_for(s)
    with channel:
        stub["Raw"](signed, timeout=5)
        assert seen == [("a", checked_in_cpp, body)]
        broken = signed[:3] + bytes([200]) + signed[4:]  # a length past the token's end
        head = signed[: len(signed) - len(body)]
        twice = head + Signer(secret, GRPC_PURPOSE).sign_request(SVC + "Quorum", body, sid)
        if with_verifier:
            for bad, why in (
                (body, "no signature"),
                (broken, "malformed signature"),
                (twice, "bad signature"),  # the first field signs what follows: not the body
            ):
                with pytest.raises(grpc.RpcError) as e:
                    stub["Raw"](bad, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert why in e.value.details()
            assert len(seen) == 1
        else:
            stub["Raw"](body, timeout=5)
            assert seen[1] == ("a", False, body)
