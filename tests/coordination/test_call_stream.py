"""Quorum calls as messages of one long-lived call (LighthouseService.QuorumStream, a call
stream: csrc/grpc_server/grpc_server.cpp CallStreamReactor, grpc_client.cpp ClientCallStream,
ft.coordination.clients._CallStream).

Each message is a Quorum call that the lighthouse (its Python handler, the signature check and
the steady round) sees exactly as a call of its own; its answer comes back as one message. A
request the client gives up on is dropped by the lighthouse as a cancelled call is; a
lighthouse without the stream gets calls; a stream that ends reopens at the next request."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from ft.coordination import LighthouseClient, LighthouseServer, _rpc
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.rpc_server import native_available
from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer
from tests.coordination._helpers import parallel
from tests.procs import free_port, wait_for

pytestmark = pytest.mark.skipif(
    not native_available(), reason="native gRPC server not built (no gRPC C++)"
)

QUORUM = "/torchft.LighthouseService/Quorum"
STREAM = "/torchft.LighthouseService/QuorumStream"
SECRET = "call-stream-test-secret-0123456789abcdef"


@pytest.fixture
def lighthouse_factory():
    made = []

    def make(min_replicas=2, secret=None, transport="native", **kw):
        kw.setdefault("join_timeout_ms", 60_000)
        kw.setdefault("quorum_tick_ms", 20)
        lh = LighthouseServer(
            "127.0.0.1:0", min_replicas, transport=transport, http_bind="", secret=secret, **kw
        )
        made.append(lh)
        return lh

    yield make
    for lh in made:
        lh.shutdown(0.1)


def answered(c: LighthouseClient) -> int:
    return c._call_streams["Quorum"].answered


def ask_all(clients, step, timeout=10.0):
    return parallel(
        [
            lambda i=i, c=c: c.quorum(f"r{i}", timeout=timeout, step=step)
            for i, c in enumerate(clients)
        ],
        timeout=timeout + 5,
    )


@pytest.mark.parametrize("secret", [None, SECRET], ids=["open", "secret"])
def test_quorums_are_answered_on_the_stream(lighthouse_factory, secret):
    """Every round, the first (decided by Python) and the steady ones (answered in C++), goes
    on each client's stream; the answers are the quorums calls would get."""
    lh = lighthouse_factory(2, secret=secret)
    clients = [
        LighthouseClient(lh.address(), 5.0, transport="native", secret=secret) for _ in range(2)
    ]
    try:
        quorums = [ask_all(clients, step) for step in range(6)]
        for step, (q0, q1) in enumerate(quorums):
            assert q0 == q1
            assert [m.replica_id for m in q0.participants] == ["r0", "r1"]
            assert [m.step for m in q0.participants] == [step, step]
        assert len({q[0].quorum_id for q in quorums}) == 1  # same members: same quorum
        assert [answered(c) for c in clients] == [6, 6]
        assert lh.status()["stats"]["native_rounds"] >= 1  # steady rounds of carried calls
    finally:
        for c in clients:
            c.close()


def raw_stream(lh, messages, timeout=5.0):
    """Sends CallStreamRequests on one QuorumStream (grpcio, message by message: each waits for
    its answer) and returns the CallStreamResponses; the stream's error, if it ends with one,
    as the last item."""
    out = []
    pending = threading.Semaphore(0)
    queue = list(messages)

    def requests():
        for m in queue:
            yield m.SerializeToString()
            pending.acquire(timeout=timeout)  # the next request once this one is answered

    with grpc.insecure_channel(lh.address().replace("http://", "")) as ch:
        call = ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        try:
            for raw in call(requests(), timeout=timeout):
                out.append(pb.CallStreamResponse.FromString(raw))
                pending.release()
        except grpc.RpcError as e:
            out.append(e)
    return out


def quorum_request(replica_id: str, step: int = 0, **kw) -> bytes:
    member = pb.QuorumMember(replica_id=replica_id, step=step, **kw)
    return pb.LighthouseQuorumRequest(requester=member).SerializeToString()


def test_the_stream_answers_each_message_with_the_calls_status(lighthouse_factory):
    """A bad request gets Python's answer in its response and the stream goes on; every good
    one gets its quorum."""
    lh = lighthouse_factory(1)
    answers = raw_stream(
        lh,
        [
            pb.CallStreamRequest(timeout_ms=5000, request=quorum_request("a", step=3)),
            pb.CallStreamRequest(timeout_ms=5000, request=b""),  # no requester
            pb.CallStreamRequest(timeout_ms=5000, request=quorum_request("a", step=4)),
        ],
    )
    assert len(answers) == 3, answers
    first, bad, second = answers
    assert first.code == 0 and second.code == 0
    q1 = pb.LighthouseQuorumResponse.FromString(first.response).quorum
    q2 = pb.LighthouseQuorumResponse.FromString(second.response).quorum
    assert [(m.replica_id, m.step) for m in q1.participants] == [("a", 3)]
    assert [(m.replica_id, m.step) for m in q2.participants] == [("a", 4)]
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "requester is required" in bad.details and not bad.response


@pytest.mark.parametrize(
    "message",
    [
        pb.CallStreamRequest(timeout_ms=0, request=quorum_request("a")),
        pb.CallStreamRequest(timeout_ms=-5, request=quorum_request("a")),
    ],
    ids=["no-timeout", "negative-timeout"],
)
def test_a_message_without_a_timeout_ends_the_stream(lighthouse_factory, message):
    lh = lighthouse_factory(1)
    answers = raw_stream(lh, [message])
    assert len(answers) == 1 and isinstance(answers[0], grpc.RpcError), answers
    assert answers[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "timeout_ms > 0" in answers[0].details()
    assert lh._state.participants == {}


def test_a_message_that_is_not_a_call_stream_request_ends_the_stream(lighthouse_factory):
    lh = lighthouse_factory(1)
    with grpc.insecure_channel(lh.address().replace("http://", "")) as ch:
        call = ch.stream_stream(STREAM, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as e:
            list(call(iter([b"\xff\xff\xff"]), timeout=5.0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_each_message_is_checked_against_the_job_secret(lighthouse_factory):
    """With a secret, each request carries its own signature for the Quorum method: unsigned,
    wrongly signed or signed for another method is UNAUTHENTICATED in its answer, and a good
    one on the same stream is answered."""
    lh = lighthouse_factory(1, secret=SECRET)
    body = quorum_request("a", step=1)
    good = Signer(JobSecret(SECRET), GRPC_PURPOSE)
    wrong = Signer(JobSecret("another-secret-0123456789abcdef0123"), GRPC_PURPOSE)
    answers = raw_stream(
        lh,
        [
            pb.CallStreamRequest(timeout_ms=5000, request=body),
            pb.CallStreamRequest(
                timeout_ms=5000, request=wrong.sign_request(QUORUM, body, lh.server_id)
            ),
            pb.CallStreamRequest(
                timeout_ms=5000,
                request=good.sign_request(
                    "/torchft.LighthouseService/Heartbeat", body, lh.server_id
                ),
            ),
            pb.CallStreamRequest(
                timeout_ms=5000, request=good.sign_request(QUORUM, body, lh.server_id)
            ),
        ],
    )
    assert [a.code for a in answers] == [grpc.StatusCode.UNAUTHENTICATED.value[0]] * 3 + [0]
    assert all("job secret" in a.details for a in answers[:3])
    q = pb.LighthouseQuorumResponse.FromString(answers[3].response).quorum
    assert [m.replica_id for m in q.participants] == ["a"]


def test_a_lighthouse_without_the_stream_gets_quorum_calls(lighthouse_factory):
    """ft's lighthouse on grpcio (as torchft's) ends the stream UNIMPLEMENTED before reading
    the request: the client sends it as a call, and keeps to calls for a while."""
    lh = lighthouse_factory(1, transport="grpcio")
    with LighthouseClient(lh.address(), 5.0, transport="native") as c:
        for step in range(3):
            q = c.quorum("a", timeout=5.0, step=step)
            assert [(m.replica_id, m.step) for m in q.participants] == [("a", step)]
        stream = c._call_streams["Quorum"]
        assert stream.answered == 0
        assert stream._unary_until > time.monotonic()


def test_a_request_the_client_gives_up_on_is_dropped_by_the_lighthouse(lighthouse_factory):
    """The client cancels the stream at its request's deadline: the lighthouse drops the
    request as it drops a cancelled call (no longer a participant), and the client's next
    request opens a new stream."""
    lh = lighthouse_factory(2)
    a = LighthouseClient(lh.address(), 5.0, transport="native")
    b = LighthouseClient(lh.address(), 5.0, transport="native")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            a.quorum("a", timeout=0.5)
        assert time.monotonic() - t0 < 1.5
        wait_for(lambda: "a" not in lh._state.participants, timeout=5.0, what="a dropped")
        q0, q1 = parallel(
            [
                lambda: a.quorum("a", timeout=10.0, step=1),
                lambda: b.quorum("b", timeout=10.0, step=1),
            ],
            timeout=15,
        )
        assert q0 == q1 and [m.replica_id for m in q0.participants] == ["a", "b"]
        assert answered(a) == 1 and answered(b) == 1
    finally:
        a.close()
        b.close()


def test_a_second_thread_on_a_busy_stream_makes_a_call(lighthouse_factory):
    """One request at a time on a stream: a second thread's request goes as a call."""
    lh = lighthouse_factory(2)
    with LighthouseClient(lh.address(), 5.0, transport="native") as c:
        q0, q1 = parallel(
            [lambda: c.quorum("x", timeout=10.0), lambda: c.quorum("y", timeout=10.0)], timeout=15
        )
        assert q0 == q1 and [m.replica_id for m in q0.participants] == ["x", "y"]
        assert answered(c) == 1


def test_the_stream_reopens_after_the_lighthouse_restarts(children):
    """A request while the lighthouse is gone fails as a call would; once it is back, the
    next request opens a new stream without a failed attempt (the idle stream's pending read
    showed that it had ended)."""
    port = free_port()
    spec = json.dumps({"bind": f"127.0.0.1:{port}", "min_replicas": 1, "transport": "native"})
    lh = children("lighthouse", spec)
    with LighthouseClient(lh.address(), 5.0, transport="native") as c:
        c.quorum("r", timeout=5.0, step=1)
        assert answered(c) == 1
        lh.kill()  # SIGKILL, reaped
        with pytest.raises((TimeoutError, _rpc.CoordinationError)):
            c.quorum("r", timeout=1.0, step=2)
        lh = children("lighthouse", spec)
        lh.address()
        c.quorum("r", timeout=10.0, step=3)
        assert answered(c) == 2
        lh.kill()  # again, while the client's stream is idle
        lh = children("lighthouse", spec)
        lh.address()
        retries = []
        q = c.quorum("r", timeout=10.0, step=4, on_retry=lambda *a: retries.append(a))
        assert [(m.replica_id, m.step) for m in q.participants] == [("r", 4)]
        assert answered(c) == 3 and retries == []


def test_a_closed_client_sends_nothing_on_its_stream(lighthouse_factory):
    lh = lighthouse_factory(1)
    c = LighthouseClient(lh.address(), 5.0, transport="native")
    c.quorum("a", timeout=5.0)
    c.close()
    with pytest.raises(ValueError, match="closed channel"):
        c.quorum("a", timeout=1.0)
    assert answered(c) == 1


def test_answers_racing_with_cancelled_streams(lighthouse_factory):
    """A steady round completes while its members' streams are being cancelled at their
    deadlines (a carried call answered as its stream ends): for 2 s one member asks with
    deadlines of 1-20 ms and another with a normal one, 0-24 ms apart. The lighthouse stays up and answers
    a final round of both."""
    lh = lighthouse_factory(2)
    a = LighthouseClient(lh.address(), 5.0, transport="native")
    b = LighthouseClient(lh.address(), 5.0, transport="native")
    stop = threading.Event()
    outcomes = {"ok": 0, "timeout": 0}

    def hasty():
        step = 0
        while not stop.is_set():
            step += 1
            try:
                a.quorum("a", timeout=0.001 + (step % 20) / 1000, step=step)
                outcomes["ok"] += 1
            except TimeoutError:
                outcomes["timeout"] += 1

    def patient():
        step = 0
        while not stop.is_set():
            step += 1
            time.sleep((step % 7) * 0.004)  # so that the hasty one's deadlines fall everywhere
            try:
                b.quorum("b", timeout=0.5, step=step)
            except TimeoutError:
                pass

    try:
        threads = [threading.Thread(target=hasty), threading.Thread(target=patient)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert outcomes["timeout"] > 0, outcomes
        q0, q1 = parallel(
            [
                lambda: a.quorum("a", timeout=10.0, step=10_000),
                lambda: b.quorum("b", timeout=10.0, step=10_000),
            ],
            timeout=15,
        )
        assert q0 == q1 and [m.replica_id for m in q0.participants] == ["a", "b"]
    finally:
        a.close()
        b.close()


def test_call_streams_can_be_turned_off(lighthouse_factory, monkeypatch):
    monkeypatch.setenv(_rpc.CALL_STREAMS_ENV, "0")
    lh = lighthouse_factory(1)
    with LighthouseClient(lh.address(), 5.0, transport="native") as c:
        c.quorum("a", timeout=5.0)
        assert c._call_streams == {}
