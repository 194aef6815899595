"""Property-based fuzzing: random requests at both services, which must answer each with a clear
gRPC status (never crash or hang), and then still serve a correct quorum."""

import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.coordination import LighthouseClient, LighthouseServer, ManagerClient, ManagerServer
from ft.coordination._proto import torchft_pb2 as pb
from tests.coordination._helpers import parallel, wait_for

# Statuses a server may answer to garbage. UNKNOWN would mean a handler raised.
ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
}

ints = st.one_of(st.integers(-5, 5), st.integers(-(1 << 63), (1 << 63) - 1))
uints = st.one_of(st.integers(0, 5), st.integers(0, (1 << 64) - 1))
texts = st.one_of(st.sampled_from(["", "x", "y", "{}", "[1]", "{bad"]), st.text(max_size=40))
deadlines = st.one_of(st.none(), st.floats(0.001, 0.05))

members = st.builds(
    pb.QuorumMember,
    replica_id=st.one_of(
        st.sampled_from(["", "fz-x", "fz-y"]), st.text(max_size=20).map(lambda s: "fz-" + s)
    ),
    address=texts,
    store_address=texts,
    step=ints,
    world_size=uints,
    shrink_only=st.booleans(),
    data=texts,
    commit_failures=ints,
)
lighthouse_calls = st.one_of(
    st.tuples(
        st.just("Quorum"),
        st.one_of(
            st.just(pb.LighthouseQuorumRequest()),
            st.builds(pb.LighthouseQuorumRequest, requester=members),
        ),
    ),
    st.tuples(
        st.just("Heartbeat"),
        st.builds(pb.LighthouseHeartbeatRequest, replica_id=texts.map(lambda s: s and "fz-" + s)),
    ),
    st.tuples(
        st.just("SubscribeFailures"), st.builds(pb.SubscribeFailuresRequest, subscriber=texts)
    ),
    st.tuples(st.sampled_from(["Quorum", "Heartbeat"]), st.binary(max_size=64)),
)
manager_calls = st.one_of(
    st.tuples(
        st.just("Quorum"),
        st.builds(
            pb.ManagerQuorumRequest,
            group_rank=ints,
            step=ints,
            checkpoint_metadata=texts,
            shrink_only=st.booleans(),
            init_sync=st.booleans(),
            commit_failures=ints,
        ),
    ),
    st.tuples(
        st.just("ShouldCommit"),
        st.builds(pb.ShouldCommitRequest, should_commit=st.booleans(), group_rank=ints, step=ints),
    ),
    st.tuples(st.just("CheckpointMetadata"), st.builds(pb.CheckpointMetadataRequest, rank=ints)),
    st.tuples(st.just("Kill"), st.builds(pb.KillRequest, msg=texts)),
    st.tuples(
        st.sampled_from(["Quorum", "ShouldCommit", "CheckpointMetadata"]), st.binary(max_size=64)
    ),
)

STREAMING = {"SubscribeFailures"}


def _call(channel, service, method, request, timeout):
    path = f"/torchft.{service}/{method}"
    ser = (lambda b: b) if isinstance(request, bytes) else (lambda m: m.SerializeToString())
    if method in STREAMING:
        call = channel.unary_stream(path, request_serializer=ser, response_deserializer=lambda b: b)
        it = call(request, timeout=timeout)
        try:
            next(it)  # first message (keep-alive) or error
        finally:
            it.cancel()
        return
    channel.unary_unary(path, request_serializer=ser, response_deserializer=lambda b: b)(
        request, timeout=timeout
    )


def _check(channel, service, method, request, timeout):
    try:
        _call(channel, service, method, request, timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and method in STREAMING:
            return
        if isinstance(request, bytes) and e.code() == grpc.StatusCode.INTERNAL:
            return  # undecodable bytes: grpc's own "Exception deserializing request"
        assert e.code() in ALLOWED, (method, request, e.code(), e.details())
        if timeout is None and e.code() != grpc.StatusCode.INVALID_ARGUMENT:
            pytest.fail(f"{method} without deadline answered {e.code()}")


@pytest.fixture(scope="module")
def servers():
    lh = LighthouseServer(
        "127.0.0.1:0",
        1,
        join_timeout_ms=50,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=300,
        dead_grace_ms=100,
    )
    ms = ManagerServer(
        "fz-manager", lh.address(), "127.0.0.1", "127.0.0.1:0", "store", 2, 0.05, 5.0
    )
    kills = []
    ms.exit_process = kills.append
    lch = grpc.insecure_channel(lh.address()[len("http://") :])
    mch = grpc.insecure_channel(ms.address()[len("http://") :])
    try:
        yield lh, ms, lch, mch, kills
    finally:
        lch.close()
        mch.close()
        ms.shutdown(0.1)
        lh.shutdown(0.1)


# Each service's fuzzer: the strategy of its calls, and its channel in ``servers``.
FUZZED = {"LighthouseService": (lighthouse_calls, 2), "ManagerService": (manager_calls, 3)}


@pytest.mark.parametrize("service", list(FUZZED))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzz(servers, service, data):
    calls_of, channel = FUZZED[service]
    calls = data.draw(st.lists(st.tuples(calls_of, deadlines), min_size=1, max_size=3))
    for (method, req), timeout in calls:
        _check(servers[channel], service, method, req, timeout)


def test_still_correct_after_fuzz(servers):
    """Runs after the fuzz tests (file order): both services still serve a correct quorum."""
    lh, ms, _, _, kills = servers
    # Let the fuzzers' replicas expire, then a clean round among known replicas.
    time.sleep(0.35)
    c = LighthouseClient(lh.address(), 5.0)
    for rid in ("ok-a", "ok-b"):
        c.heartbeat(rid, timeout=1.0)
    qa, qb = parallel(
        [lambda: c.quorum("ok-a", 5.0, step=3), lambda: c.quorum("ok-b", 5.0, step=3)]
    )
    assert [p.replica_id for p in qa.participants] == ["ok-a", "ok-b"] and qa == qb
    wait_for(
        lambda: all(
            r["replica_id"].startswith("ok-") or r["replica_id"] == "fz-manager"
            for r in lh.status()["replicas"]
        ),
        timeout=3,
        what="fuzz replicas forgotten",
    )
    m = ManagerClient(ms.address(), 5.0)
    r0, r1 = parallel(
        [lambda: m._quorum(0, 7, "m0", False, 5.0), lambda: m._quorum(1, 7, "m1", False, 5.0)]
    )
    assert r0.replica_ids == r1.replica_ids == ["fz-manager"], (r0, r1)
    assert r0.max_step == 7 and not r0.heal and r0.store_address == "store"
    assert m._checkpoint_metadata(1, 2.0) == "m1"
    assert parallel(
        [lambda: m.should_commit(0, 7, True, 5.0), lambda: m.should_commit(1, 7, True, 5.0)]
    ) == [True, True]
    assert all(code == 1 for code in kills)
