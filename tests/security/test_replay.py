"""Capture and replay on the control plane: an eavesdropper on the path (a recording TCP proxy
on loopback, no TLS) keeps the signed requests a member sent -- a Kill, a vote, a quorum
request, heartbeats, on calls and on the native server's streams -- and sends those exact bytes
to another group's ManagerServer, to the lighthouse, and to a server that restarted. Each is
refused with the server's own reason (a signature is bound to one server life:
docs/security.md, "Bound to one server"), and the targeted process stays alive and serves the
job. Forgeries (a signature moved to another server id, one made with another secret, one
bound to no server) are refused on calls and on both kinds of stream.

Each test runs against the native gRPC server and grpcio (the clients use the same transport:
the native client carries Quorum and ShouldCommit on call streams and heartbeats on the
heartbeat stream)."""

from __future__ import annotations

import os
import time
from typing import Dict

import grpc
import pytest

from ft.coordination import CoordinationError, LighthouseClient, LighthouseServer, ManagerClient
from ft.coordination._proto import torchft_pb2 as pb
from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer, split_signed
from tests.coordination._helpers import TRANSPORTS, free_port
from tests.security._recording_proxy import RecordingProxy, find_signed

SECRET = "replay-test-secret-0123456789abcdef"
WRONG = "a-different-secret-0123456789abcdef"
MS = "/torchft.ManagerService/"
LH = "/torchft.LighthouseService/"
OTHER_SERVER = "signed for another server"  # the servers' reason (ft.utils.auth.OTHER_SERVER)


def _env(transport: str) -> Dict[str, str]:
    env = dict(os.environ)
    env["FT_JOB_SECRET"] = SECRET
    env.pop("FT_JOB_SECRET_FILE", None)
    env["FT_CLIENT_TRANSPORT"] = transport
    return env


def _target(addr: str) -> str:
    return addr.replace("http://", "")


def unary(addr: str, path: str, data: bytes) -> grpc.RpcError:
    """Sends ``data`` as a call of ``path``; the refusal (AssertionError if it was answered)."""
    with grpc.insecure_channel(_target(addr)) as ch:
        try:
            ch.unary_unary(path, request_serializer=None, response_deserializer=None)(
                data, timeout=5.0
            )
        except grpc.RpcError as e:
            return e
    raise AssertionError(f"{path}: the replayed request was answered")


def on_call_stream(addr: str, stream_path: str, data: bytes) -> pb.CallStreamResponse:
    """Sends ``data`` as the one message of a call stream (native server); its answer."""
    with grpc.insecure_channel(_target(addr)) as ch:
        call = ch.stream_stream(stream_path, request_serializer=None, response_deserializer=None)
        message = pb.CallStreamRequest(timeout_ms=5000, request=data).SerializeToString()
        answers = list(call(iter([message]), timeout=5.0))
    assert len(answers) == 1, answers
    return pb.CallStreamResponse.FromString(answers[0])


def on_heartbeat_stream(addr: str, data: bytes) -> grpc.RpcError:
    """Sends ``data`` as a message of a heartbeat stream (native lighthouse); the refusal."""
    with grpc.insecure_channel(_target(addr)) as ch:
        call = ch.stream_unary(
            LH + "HeartbeatStream", request_serializer=None, response_deserializer=None
        )
        try:
            call(iter([data]), timeout=5.0)
        except grpc.RpcError as e:
            return e
    raise AssertionError("the heartbeat stream took the replayed message")


def assert_refused(e: grpc.RpcError, why: str = OTHER_SERVER) -> None:
    assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (e.code(), e.details())
    assert why in e.details(), e.details()


def assert_refused_on_stream(answer: pb.CallStreamResponse, why: str = OTHER_SERVER) -> None:
    assert answer.code == grpc.StatusCode.UNAUTHENTICATED.value[0], answer
    assert why in answer.details, answer.details


def _lighthouse(port: int, transport: str) -> LighthouseServer:
    return LighthouseServer(
        f"127.0.0.1:{port}",
        1,
        http_bind="",
        transport=transport,
        secret=SECRET,
        join_timeout_ms=200,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=5000,
    )


def _request(message_type, **fields):
    """``match`` for find_signed: a request of that type with those field values."""

    def match(data: bytes) -> bool:
        m = message_type.FromString(data)
        return m.SerializeToString() == data and all(getattr(m, k) == v for k, v in fields.items())

    return match


def _with_token(token: str, body: bytes) -> bytes:
    """``body`` behind a leading auth field carrying ``token`` (ft.utils.auth's wire form)."""
    from ft.utils.auth import _AUTH_TAG, _varint

    return _AUTH_TAG + _varint(len(token)) + token.encode() + body


def _assert_replays_refused_by_group(group, replica_id: str, replays, transport: str) -> None:
    """Each captured (method, request, call stream) in ``replays`` is refused by the group's
    ManagerServer, as a call and (native) on its call stream; the group lives on and still
    serves its own signed calls."""
    addr = group.address()
    for method, data, stream in replays:
        assert_refused(unary(addr, MS + method, data))
        if transport == "native" and stream is not None:
            assert_refused_on_stream(on_call_stream(addr, MS + stream, data))
    time.sleep(0.2)
    assert group.poll() is None, group.output()
    with ManagerClient(
        addr, 5.0, secret=SECRET, transport=transport, replica_id=replica_id
    ) as rank0:
        assert rank0.should_commit(0, 1, True, timeout=5.0)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_captured_kill_vote_and_quorum_are_refused_by_another_group_and_after_a_restart(
    children, transport
):
    lh_port = free_port()
    lh = _lighthouse(lh_port, transport)
    proxy_a = None
    try:
        env = _env(transport)
        group_a = children("manager", "A", lh.address(), "1", "0.05", transport, env=env)
        addr_a = group_a.address()
        proxy_a = RecordingProxy(int(addr_a.rsplit(":", 1)[1]))

        # The job's own traffic to group A, through the eavesdropper: rank 0's quorum and
        # vote, then the operator's kill of A (the dashboard's path: signed for replica A).
        with ManagerClient(
            proxy_a.address, 5.0, secret=SECRET, transport=transport, replica_id="A"
        ) as rank0:
            assert rank0.quorum(0, 1, "meta-A", False, timeout=10.0).max_step == 1
            assert rank0.should_commit(0, 1, True, timeout=5.0)
            try:
                rank0.kill("operator kill of A", timeout=5.0)
            except (CoordinationError, TimeoutError):
                pass  # A may exit before it answers
        assert group_a.wait(10) != 0
        group_b = children("manager", "B", lh.address(), "1", "0.05", transport, env=env)
        captured = proxy_a.messages()
        kill, _ = find_signed(captured, _request(pb.KillRequest, msg="operator kill of A"))
        vote, vote_on = find_signed(captured, _request(pb.ShouldCommitRequest, step=1))
        quorum, quorum_on = find_signed(
            captured, _request(pb.ManagerQuorumRequest, step=1, checkpoint_metadata="meta-A")
        )
        if transport == "native":  # the native client carried these on its call streams
            assert vote_on == quorum_on == "stream"
        replays = [
            ("Kill", kill, None),
            ("ShouldCommit", vote, "ShouldCommitStream"),
            ("Quorum", quorum, "QuorumStream"),
        ]

        # 1. To another group's ManagerServer: refused, as calls and on its call streams.
        _assert_replays_refused_by_group(group_b, "B", replays, transport)  # B still serves

        # 2. To the lighthouse: the native server checks every signature first (another
        # server's), grpcio finds no such method; the lighthouse's own methods refuse them too
        # (the signature covers the method).
        for method, data, _ in replays:
            e = unary(lh.address(), MS + method, data)
            if transport == "native":
                assert_refused(e)
            else:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED, e
        assert_refused(unary(lh.address(), LH + "Quorum", quorum), "bad signature")
        with LighthouseClient(lh.address(), 5.0, secret=SECRET, transport=transport) as c:
            c.heartbeat("C", timeout=5.0)  # the lighthouse still serves the job
        assert "C" in {r["replica_id"] for r in lh.status()["replicas"]}

        # 3. To group A restarted (same replica id, a new server life): refused.
        group_a2 = children("manager", "A", lh.address(), "1", "0.05", transport, env=env)
        _assert_replays_refused_by_group(group_a2, "A", replays, transport)
    finally:
        if proxy_a is not None:
            proxy_a.close()
        lh.shutdown(grace=0.1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_captured_quorum_and_heartbeats_are_refused_by_a_restarted_lighthouse(transport):
    port = free_port()
    lh = _lighthouse(port, transport)
    proxy = RecordingProxy(port)
    try:
        with LighthouseClient(proxy.address, 5.0, secret=SECRET, transport=transport) as c:
            c.heartbeat("A", timeout=5.0)
            c.heartbeat("A", timeout=5.0)
            assert [m.replica_id for m in c.quorum("A", timeout=5.0, step=7).participants]
            if transport == "native":
                assert c._heartbeats.sent == 2  # both went on the heartbeat stream
        captured = proxy.messages()
        heartbeat, _ = find_signed(
            captured, _request(pb.LighthouseHeartbeatRequest, replica_id="A")
        )
        quorum, quorum_on = find_signed(
            captured,
            lambda d: pb.LighthouseQuorumRequest.FromString(d).requester.step == 7,
        )
        if transport == "native":
            assert quorum_on == "stream"
        lh.shutdown(grace=0.1)
        lh = _lighthouse(port, transport)  # the same address, a new life that saw no nonce

        assert_refused(unary(lh.address(), LH + "Quorum", quorum))
        if transport == "native":
            # captured from the heartbeat stream (signed for it: as a call it is refused too)
            assert_refused(on_heartbeat_stream(lh.address(), heartbeat))
            assert_refused(unary(lh.address(), LH + "Heartbeat", heartbeat), "bad signature")
            assert_refused_on_stream(on_call_stream(lh.address(), LH + "QuorumStream", quorum))
        else:
            assert_refused(unary(lh.address(), LH + "Heartbeat", heartbeat))
        assert "A" not in {r["replica_id"] for r in lh.status()["replicas"]}
        # the job goes on with the restarted lighthouse: its clients learn the new life's id
        with LighthouseClient(lh.address(), 5.0, secret=SECRET, transport=transport) as c:
            c.heartbeat("B", timeout=5.0)
            assert [m.replica_id for m in c.quorum("B", timeout=5.0, step=1).participants] == ["B"]
    finally:
        proxy.close()
        lh.shutdown(grace=0.1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_client_follows_its_server_across_a_restart(transport):
    """A client made before the lighthouse restarted signs for its old life, is refused once
    (by the server, unread), learns the new id and is answered: no call of the job fails."""
    port = free_port()
    lh = _lighthouse(port, transport)
    try:
        with LighthouseClient(lh.address(), 5.0, secret=SECRET, transport=transport) as c:
            c.quorum("A", timeout=5.0, step=1)
            old = lh.server_id
            lh.shutdown(grace=0.1)
            lh = _lighthouse(port, transport)
            assert lh.server_id != old
            for step in (2, 3):
                c.heartbeat("A", timeout=5.0)
                assert [m.step for m in c.quorum("A", timeout=5.0, step=step).participants] == [
                    step
                ]
            if c._heartbeats is not None:  # native: heartbeats went back to a stream at once
                sent = c._heartbeats.sent
                c.heartbeat("A", timeout=5.0)
                assert c._heartbeats.sent == sent + 1
    finally:
        lh.shutdown(grace=0.1)


def test_forged_signatures_are_refused_on_calls_and_streams(lighthouse_factory):
    lh = lighthouse_factory(secret=SECRET)  # on each transport
    other = lighthouse_factory(secret=SECRET)
    transport = lh._server.transport
    body = pb.LighthouseHeartbeatRequest(replica_id="forged").SerializeToString()
    genuine = Signer(JobSecret(SECRET), GRPC_PURPOSE).sign_request(
        LH + "Heartbeat", body, other.server_id
    )
    _, token = split_signed(genuine)
    v, ms, nonce, _, mac = token.split(".")
    signer, wrong = Signer(JobSecret(SECRET), GRPC_PURPOSE), Signer(JobSecret(WRONG), GRPC_PURPOSE)
    forgeries = [
        # a genuine signature whose server id was rewritten to the target's
        ("bad signature", _with_token(f"{v}.{ms}.{nonce}.{lh.server_id}.{mac}", body)),
        # made for the target, with another secret
        ("bad signature", wrong.sign_request(LH + "Heartbeat", body, lh.server_id)),
        # bound to no server (v1, as ft signed before server ids)
        ("not bound to a server", _with_token(signer.sign(LH + "Heartbeat", body), body)),
    ]
    for why, data in forgeries:
        assert_refused(unary(lh.address(), LH + "Heartbeat", data), why)
        if transport == "native":
            assert_refused(on_heartbeat_stream(lh.address(), data), why)
            quorum_body = pb.LighthouseQuorumRequest(
                requester=pb.QuorumMember(replica_id="forged")
            ).SerializeToString()
            head = data[: len(data) - len(body)]
            assert_refused_on_stream(
                on_call_stream(lh.address(), LH + "QuorumStream", head + quorum_body), "signature"
            )
    assert "forged" not in {r["replica_id"] for r in lh.status()["replicas"]}
    # the genuine one, at the server it was made for, is taken
    with grpc.insecure_channel(_target(other.address())) as ch:
        ch.unary_unary(LH + "Heartbeat", request_serializer=None, response_deserializer=None)(
            genuine, timeout=5.0
        )


def test_a_client_refuses_to_sign_for_another_groups_server(lighthouse_factory, manager_factory):
    """A ManagerClient that knows whom it calls (the lighthouse's kill, a group's ranks) signs
    only for a server that proves it serves that replica: a connection that reaches another
    group's server (a stale or redirected address) fails before a signed request is sent."""
    lh = lighthouse_factory(secret=SECRET)
    b = manager_factory("B", lh.address(), secret=SECRET)
    with ManagerClient(b.address(), 5.0, secret=SECRET, replica_id="A") as c:
        with pytest.raises(CoordinationError) as e:
            c.kill("meant for A", timeout=5.0)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "the server is 'manager:B', not 'manager:A'" in str(e.value)
    with ManagerClient(b.address(), 5.0, secret=SECRET, replica_id="B") as c:
        assert c.should_commit(0, 0, True, timeout=5.0)


def test_a_client_with_a_secret_still_talks_to_a_server_without_one(lighthouse_factory):
    """A server without a secret (or torchft's) does not know the server-id call: the client
    signs for the all-zero id, which no server that checks signatures accepts, and the
    server, which checks none, answers."""
    from ft.utils.auth import NO_SERVER_ID

    lh = lighthouse_factory()  # no secret
    transport = lh._server.transport
    with LighthouseClient(lh.address(), 5.0, secret=SECRET, transport=transport) as c:
        c.heartbeat("A", timeout=5.0)
        assert [m.replica_id for m in c.quorum("A", timeout=5.0, step=1).participants] == ["A"]
        assert c._server_id == NO_SERVER_ID
