"""The native lighthouse answers steady quorum rounds in C++ (csrc/grpc_server/steady_quorum.hpp):
a round in which exactly the previous quorum's members ask again, each with nothing changed but
its step. These tests hold it to the rule it stands in for (ft/coordination/quorum.py, the
specification) and check that every other round, and every event that changes the rule's
answer, still reaches Python at once: a joiner, changed fields, a killed member, a member that
does not ask within a tick, a caller that gives up, shutdown.

Also here: the native decoder of a quorum answer (csrc/grpc_server/quorum_wire.cpp) against
protobuf's parse."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.coordination import CoordinationError, LighthouseClient, LighthouseServer, wire
from ft.coordination._proto import torchft_pb2 as pb
from ft.coordination.quorum import (
    LighthouseOptions,
    Quorum,
    QuorumMember,
    next_quorum_id,
    quorum_compute,
)
from ft.coordination.rpc_server import native_available
from tests.coordination._helpers import parallel
from tests.procs import wait_for

pytestmark = pytest.mark.skipif(
    not native_available(), reason="native gRPC server not built (no gRPC C++)"
)

SECRET = "steady-quorum-test-secret-0123456789abcdef"


def native():
    from ft.coordination import _grpc_server

    return _grpc_server


@pytest.fixture
def lighthouse_factory(monkeypatch):
    """``make(min_replicas, secret=False, **kwargs) -> (lh, python_quorums)``: a native
    lighthouse, and the replica id of every Quorum request Python takes on (from its handler,
    or taken back from the native round), in order."""
    from ft.coordination import lighthouse as lighthouse_module

    python_quorums = []
    waiter = lighthouse_module._Waiter

    def counted_waiter(replica_id, call, deadline):
        python_quorums.append(replica_id)
        return waiter(replica_id, call, deadline)

    monkeypatch.setattr(lighthouse_module, "_Waiter", counted_waiter)
    made = []

    def make(min_replicas=2, secret=False, **kw):
        kw.setdefault("join_timeout_ms", 60_000)
        kw.setdefault("quorum_tick_ms", 20)
        kw.setdefault("heartbeat_timeout_ms", 5000)
        lh = LighthouseServer(
            "127.0.0.1:0",
            min_replicas,
            transport="native",
            http_bind="",
            secret=SECRET if secret else None,
            **kw,
        )
        made.append(lh)
        return lh, python_quorums

    try:
        yield make
    finally:
        for lh in made:
            lh.shutdown(0.1)


def client(lh, secret=False):
    return LighthouseClient(lh.address(), 5.0, secret=SECRET if secret else None)


def ids(q):
    return [p.replica_id for p in q.participants]


def ask_all(c, steps, timeout=10.0, **kw):
    """Every replica of ``steps`` (id -> step) asks at once; their (equal) answer."""
    qs = parallel(
        [lambda r=r, s=s: c.quorum(r, timeout, step=s, **kw) for r, s in steps.items()], 20
    )
    for q in qs:
        assert not isinstance(q, BaseException), q
        assert q == qs[0]
    return qs[0]


def ask_in_turn(c, asks, gap=0.05):
    """Each (replica id, step) of ``asks`` asks ``gap`` seconds after the one before it, all
    waiting together; their answers (or exceptions), in order."""
    return parallel(
        [
            lambda i=i, r=r, s=s: (time.sleep(i * gap), c.quorum(r, 10.0, step=s))[1]
            for i, (r, s) in enumerate(asks)
        ],
        20,
    )


# --- live rounds -----------------------------------------------------------------------------
@pytest.mark.parametrize("secret", [False, True], ids=["open", "secret"])
def test_steady_rounds_are_answered_natively_as_python_would(lighthouse_factory, secret):
    lh, python_quorums = lighthouse_factory(3, secret=secret)
    c = client(lh, secret)
    first = ask_all(c, {"c": 0, "a": 0, "b": 0}, address="")
    assert ids(first) == ["a", "b", "c"] and sorted(python_quorums) == ["a", "b", "c"]
    python_quorums.clear()
    previous = first
    for step in range(1, 6):
        q = ask_all(c, {"a": step, "b": step + 1, "c": step})
        # Same members, same quorum id, sorted, each as it asked: the rule's fast path.
        assert q.quorum_id == first.quorum_id and ids(q) == ["a", "b", "c"]
        assert [p.step for p in q.participants] == [step, step + 1, step]
        assert q.created >= previous.created
        previous = q
    assert python_quorums == [], "a steady round reached Python"
    st = lh.status()
    assert st["stats"]["quorums_issued"] == 6
    assert st["quorum"]["quorum_id"] == first.quorum_id
    assert {m["replica_id"]: m["step"] for m in st["quorum"]["members"]} == {
        "a": 5,
        "b": 6,
        "c": 5,
    }
    assert all(m["alive"] for m in st["quorum"]["members"])


def test_a_joiner_sends_the_held_round_to_python(lighthouse_factory):
    lh, python_quorums = lighthouse_factory(2)
    c = client(lh)
    first = ask_all(c, {"a": 0, "b": 0})
    python_quorums.clear()
    with_joiner = ask_in_turn(c, [("a", 1), ("joiner", 0), ("b", 1)])
    for q in with_joiner:
        assert not isinstance(q, BaseException), q
        assert ids(q) == ["a", "b", "joiner"]
        assert q.quorum_id > first.quorum_id  # membership changed: a new id
    assert sorted(python_quorums) == ["a", "b", "joiner"]


@pytest.mark.parametrize(
    "change, check",
    [
        (dict(commit_failures=1), lambda q, first: q.quorum_id > first.quorum_id),
        (dict(address="moved:1"), lambda q, first: q.participants[0].address == "moved:1"),
        (dict(data={"k": 1}), lambda q, first: q.participants[0].data == {"k": 1}),
        (dict(shrink_only=True), lambda q, first: q.participants[0].shrink_only),
    ],
    ids=["commit_failures", "address", "data", "shrink_only"],
)
def test_a_member_that_changed_anything_but_its_step_goes_to_python(
    lighthouse_factory, change, check
):
    lh, python_quorums = lighthouse_factory(2)
    c = client(lh)
    first = ask_all(c, {"a": 0, "b": 0})
    python_quorums.clear()
    qa, qb = parallel(
        [lambda: c.quorum("a", 10.0, step=1, **change), lambda: c.quorum("b", 10.0, step=1)], 20
    )
    assert qa == qb and ids(qa) == ["a", "b"] and check(qa, first)
    assert sorted(python_quorums) == ["a", "b"]


def test_a_second_request_of_one_member_goes_to_python(lighthouse_factory):
    lh, python_quorums = lighthouse_factory(2)
    c = client(lh)
    ask_all(c, {"a": 0, "b": 0})
    python_quorums.clear()
    results = ask_in_turn(c, [("a", 1), ("a", 1), ("b", 1)])
    assert all(not isinstance(q, BaseException) and ids(q) == ["a", "b"] for q in results)
    assert sorted(python_quorums) == ["a", "a", "b"]


def test_a_killed_member_releases_the_held_round_at_once(lighthouse_factory, children):
    """The victim's process is kill -9'd while the other member's request is held in C++: its
    subscription drops, the held request goes to Python, and the survivor gets a quorum
    without it long before a tick (3 s) or the heartbeat timeout (5 s)."""
    lh, _ = lighthouse_factory(1, quorum_tick_ms=3000, heartbeat_timeout_ms=5000)
    c = client(lh)
    c.heartbeat("a", timeout=5.0)
    victim = children("subscriber", "victim", lh.address())
    victim.ready_line()
    first = c.quorum("a", 10.0)  # the victim's request is already waiting (or arrives)
    if ids(first) != ["a", "victim"]:
        first = c.quorum("a", 10.0)
    assert ids(first) == ["a", "victim"]
    wait_for(lambda: "QUORUM" in victim.lines, what="the victim's quorum answer")
    got = []
    t = threading.Thread(target=lambda: got.append(c.quorum("a", 20.0, step=1)), daemon=True)
    t.start()
    wait_for(lambda: lh._server.steady_held_age() > 0, what="a's request held natively")
    t0 = time.monotonic()
    victim.proc.kill()
    victim.proc.wait(5)
    t.join(10)
    assert got and ids(got[0]) == ["a"], got
    assert time.monotonic() - t0 < 1.5


def test_a_round_that_does_not_complete_within_a_tick_gets_the_join_timeout(
    lighthouse_factory,
):
    """c heartbeats but does not ask: a and b are held, handed to Python after a tick, and
    issued without c once the join timeout has passed since they arrived, not since the
    hand-over. Ticks every 0.3 s, join timeout 0.4 s: counted from arrival, the quorum comes
    at the first tick after 0.4 s (before 0.7 s); counted from the hand-over (0.3-0.6 s) it
    would come at 0.9 s or later."""
    lh, python_quorums = lighthouse_factory(2, quorum_tick_ms=300, join_timeout_ms=400)
    c = client(lh)
    for rid in "abc":
        c.heartbeat(rid, timeout=5.0)  # none goes ahead without the others
    ask_all(c, {"a": 0, "b": 0, "c": 0})
    python_quorums.clear()
    stop = threading.Event()

    def heartbeat_c():
        while not stop.is_set():
            c.heartbeat("c", timeout=1.0)
            stop.wait(0.03)

    hb = threading.Thread(target=heartbeat_c, daemon=True)
    hb.start()
    try:
        t0 = time.monotonic()
        qa, qb = parallel(
            [lambda: c.quorum("a", 10.0, step=1), lambda: c.quorum("b", 10.0, step=1)], 20
        )
        took = time.monotonic() - t0
    finally:
        stop.set()
        hb.join(5)
    assert qa == qb and ids(qa) == ["a", "b"]
    assert sorted(python_quorums) == ["a", "b"]
    assert 0.4 <= took < 0.85, took


def test_a_held_caller_that_gives_up_is_dropped_and_the_next_round_completes(
    lighthouse_factory,
):
    lh, python_quorums = lighthouse_factory(2, quorum_tick_ms=5000)
    c = client(lh)
    first = ask_all(c, {"a": 0, "b": 0})
    with pytest.raises((TimeoutError, CoordinationError)):
        c.quorum("a", 0.3, step=1, retries=0)
    wait_for(lambda: lh._server.steady_held_age() == 0, what="the cancelled call dropped")
    python_quorums.clear()
    q = ask_all(c, {"a": 2, "b": 2})
    assert q.quorum_id == first.quorum_id and [p.step for p in q.participants] == [2, 2]
    assert python_quorums == []


def test_a_held_call_near_its_deadline_gets_pythons_explanation(lighthouse_factory):
    lh, _ = lighthouse_factory(2, quorum_tick_ms=20)
    c = client(lh)
    ask_all(c, {"a": 0, "b": 0})
    with pytest.raises((TimeoutError, CoordinationError)) as e:
        c.quorum("a", 0.5, step=1, retries=0)
    assert "no quorum for a before its deadline" in str(e.value)


def test_shutdown_answers_held_calls_unavailable(lighthouse_factory):
    lh, _ = lighthouse_factory(2, quorum_tick_ms=5000)
    c = client(lh)
    ask_all(c, {"a": 0, "b": 0})
    got = []

    def ask():
        try:
            got.append(c.quorum("a", 10.0, step=1, retries=0))
        except Exception as e:  # noqa: BLE001
            got.append(e)

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    wait_for(lambda: lh._server.steady_held_age() > 0, what="a's request held natively")
    lh.shutdown(0.5)
    t.join(10)
    assert len(got) == 1 and isinstance(got[0], CoordinationError), got
    assert got[0].code == grpc.StatusCode.UNAVAILABLE and "shutting down" in str(got[0])


def test_the_load_generators_rounds_are_quorum_rounds(lighthouse_factory):
    """bench/quorum_vs_torchft.py's C++ clients (LoadGenerator.run_rounds): every call of
    every round is answered, the first round by Python and the rest natively."""
    from ft.coordination import _rpc

    lh, python_quorums = lighthouse_factory(4)
    bodies = [request(pb.QuorumMember(replica_id=f"g{i}", step=1)) for i in range(4)]
    gen = _rpc.native.LoadGenerator(_rpc.grpc_target(lh.address()), _rpc.CHANNEL_OPTIONS, 4, 10.0)
    r = gen.run_rounds("/torchft.LighthouseService/Quorum", bodies, 5, 10.0)
    del gen
    assert r["failed"] == 0 and r["first_error"] == ""
    assert len(r["round_s"]) == 5 and all(t > 0 for t in r["round_s"])
    assert sorted(python_quorums) == ["g0", "g1", "g2", "g3"]
    assert lh.status()["stats"]["quorums_issued"] == 5


# --- the rule, against quorum.py ---------------------------------------------------------------
def identity(m: pb.QuorumMember) -> bytes:
    out = pb.QuorumMember()
    out.CopyFrom(m)
    out.ClearField("step")
    return out.SerializeToString()


def request(m: pb.QuorumMember) -> bytes:
    return pb.LighthouseQuorumRequest(requester=m).SerializeToString()


MEMBER = st.builds(
    pb.QuorumMember,
    replica_id=st.sampled_from(["a", "b", "c", "d", "e"]),
    address=st.sampled_from(["", "h:1", "h:2"]),
    store_address=st.sampled_from(["", "s:1"]),
    step=st.integers(0, 2**40),
    world_size=st.integers(0, 4),
    data=st.sampled_from(["", '{"x": 1}']),
)


@st.composite
def rounds(draw):
    """(previous quorum's members, requests as (member, bytes)) with a mix of steady
    requests and everything else the rule must leave to Python."""
    prev = draw(st.lists(MEMBER, min_size=1, max_size=4, unique_by=lambda m: m.replica_id))
    by_id = {m.replica_id: m for m in prev}
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        kind = draw(
            st.sampled_from(
                ["steady"] * 6 + ["stranger", "changed", "commit_failures", "shrink", "garbage"]
            )
        )
        base = draw(st.sampled_from(sorted(by_id)))
        m = pb.QuorumMember()
        m.CopyFrom(by_id[base])
        m.step = draw(st.integers(0, 2**40))
        if kind == "stranger":
            m.replica_id = "stranger"
        elif kind == "changed":
            m.address = m.address + "-moved"
        elif kind == "commit_failures":
            m.commit_failures = 1
        elif kind == "shrink":
            m.shrink_only = True
        body = request(m) if kind != "garbage" else request(m) + b"\xff"
        reqs.append((m, body))
    return prev, reqs


def to_member(m: pb.QuorumMember) -> QuorumMember:
    return wire.member_from_pb(m)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds())
def test_the_native_rule_agrees_with_quorum_py(case):
    """Replaying the requests in order: while the native rule holds requests, quorum.py (with
    every previous member heartbeating, as the lighthouse guarantees while it is armed) has no
    quorum to issue; when it answers, quorum.py issues the same members, by its fast path,
    under the same id; once it hands a request to Python, every later one goes there too."""
    prev_members, reqs = case
    qid = 41
    prev = Quorum(quorum_id=qid, participants=tuple(to_member(m) for m in prev_members))
    opts = LighthouseOptions(min_replicas=1, join_timeout_s=60.0, heartbeat_timeout_s=5.0)
    outcomes = native().steady_quorum_rule(
        qid, {m.replica_id: identity(m) for m in prev_members}, [b for _, b in reqs]
    )
    assert len(outcomes) == len(reqs)
    now = 100.0
    heartbeats = {m.replica_id: now for m in prev_members}
    participants = {}
    handed = False
    for (m, _body), (outcome, answer) in zip(reqs, outcomes):
        if handed:
            assert outcome == "python"
            continue
        if outcome == "python":
            handed = True
            continue
        participants[m.replica_id] = (now, to_member(m))
        decision = quorum_compute(now, participants, {**heartbeats}, prev, opts)
        if outcome == "held":
            assert not decision.ready, decision.reason
            continue
        assert outcome == "answered"
        assert decision.ready and decision.fast_path
        assert next_quorum_id(prev, qid, decision.members) == (qid, "unchanged")
        got = wire.quorum_from_response(answer)
        assert got.quorum_id == qid
        assert got.participants == decision.members
        participants = {}


def test_the_native_rule_on_quorum_py_tables():
    """quorum.py's own table (tests/coordination/test_quorum_rules.py), replayed through the
    native rule wherever it can apply: a previous quorum whose members all heartbeat (else
    the lighthouse has taken the round back). The native rule answers only what the table
    issues by its fast path, leaves every stranger or changed member to Python, and holds
    only where the table waits or would issue after the join timeout (which Python decides
    once the round is handed over at a tick)."""
    from tests.coordination import test_quorum_rules as rules

    checked = 0
    for name, participants, hb, _joined, prev_ids, opts, expected, reason in rules.QUORUM_CASES:
        if not prev_ids:
            continue
        if any(hb.get(rid, float("inf")) >= opts.heartbeat_timeout_s for rid in prev_ids):
            continue  # a member failed: the lighthouse has disarmed the native round
        prev = rules.prev_quorum(*prev_ids)
        members = [rules.m(p) if isinstance(p, str) else p for p in participants]
        outcomes = [
            o
            for o, _ in native().steady_quorum_rule(
                prev.quorum_id,
                {x.replica_id: identity(wire.member_to_pb(x)) for x in prev.participants},
                [
                    request(wire.member_to_pb(x))
                    for x in sorted(members, key=lambda x: x.replica_id)
                ],
            )
        ]
        by_prev = {x.replica_id: x for x in prev.participants}
        plain = all(x.replica_id in by_prev and x == by_prev[x.replica_id] for x in members)
        if not plain:
            assert "python" in outcomes, name
        elif outcomes and outcomes[-1] == "answered":
            assert expected == sorted(prev_ids) and "fast path" in reason, name
        else:
            assert expected is None or "join timeout" in reason, name
        checked += 1
    assert checked >= 3


def test_the_native_rule_table():
    """The cases by name (the property test above covers their mixtures)."""
    a = pb.QuorumMember(replica_id="a", address="h:1", step=3)
    b = pb.QuorumMember(replica_id="b", address="h:2", step=3)
    ids_ = {"a": identity(a), "b": identity(b)}

    def outcomes(*bodies):
        return [o for o, _ in native().steady_quorum_rule(9, ids_, list(bodies))]

    def ask(m, **change):
        out = pb.QuorumMember()
        out.CopyFrom(m)
        for k, v in change.items():
            setattr(out, k, v)
        return request(out)

    assert outcomes(ask(a, step=4), ask(b, step=4)) == ["held", "answered"]
    assert outcomes(ask(a, step=4), ask(b, step=4), ask(b, step=5)) == [
        "held",
        "answered",
        "held",
    ]  # still armed for the next round
    assert outcomes(ask(a, step=4), ask(a, step=5)) == ["held", "python"]  # a twice
    assert outcomes(ask(a, step=4), ask(b, address="x")) == ["held", "python"]
    assert outcomes(ask(a, commit_failures=1)) == ["python"]
    assert outcomes(ask(a, shrink_only=True)) == ["python"]
    assert outcomes(ask(a, replica_id="c")) == ["python"]
    assert outcomes(ask(a) + b"\x00") == ["python"]  # trailing garbage
    assert outcomes(b"") == ["python"]  # no requester
    negative = pb.QuorumMember()
    negative.CopyFrom(a)
    negative.step = -1
    assert outcomes(request(negative)) == ["python"]  # Python says what is wrong
    # Tags and lengths longer than protobuf takes (5 bytes): left to Python, which refuses
    # them (here a step tag padded to 6 bytes).
    member = pb.QuorumMember(replica_id="a", address="h:1").SerializeToString()
    step_4 = b"\x20\x04"  # field 4, varint 4
    plain = b"\x0a" + bytes([len(member) + 2]) + member + step_4
    assert pb.LighthouseQuorumRequest.FromString(plain).requester.step == 4
    assert outcomes(plain, ask(b, step=4)) == ["held", "answered"]
    padded_tag = b"\xa0\x80\x80\x80\x80\x00\x04"  # the same field, its tag in 6 bytes
    padded = b"\x0a" + bytes([len(member) + 7]) + member + padded_tag
    with pytest.raises(DecodeError):
        pb.LighthouseQuorumRequest.FromString(padded)
    assert outcomes(padded) == ["python"]
    assert native().steady_identity(padded) is None
    # A step-only request is the identity plus the step: the identity is what Python
    # serializes with step cleared, and the native parser agrees on it.
    assert native().steady_identity(ask(a, step=77)) == ("a", 77, identity(a))


def test_rounds_of_a_replaced_quorum_count_but_do_not_replace_it():
    """Rounds the server answered for a quorum Python has since replaced (read late) are
    counted, but never become the current quorum."""
    from ft.coordination.lighthouse import _LighthouseState

    class Server:
        def __init__(self, rounds):
            self.rounds = rounds

        def steady_rounds(self):
            r, self.rounds = self.rounds, (0, 0, [], [], 0)
            return r

        def steady_take(self):
            return []

    state = _LighthouseState(LighthouseOptions(min_replicas=1), 0.1, 1.0, None)
    current = Quorum(quorum_id=7, participants=(QuorumMember("a", step=3),))
    state.prev = current
    old = pb.QuorumMember(replica_id="a", step=1).SerializeToString()
    state.steady = Server((6, 2, [0.001, 0.002], [old], 1))
    with state.lock:
        state._sync_steady_rounds_locked()
    assert state.prev is current and state.stats.quorums_issued == 2
    new = pb.QuorumMember(replica_id="a", step=4).SerializeToString()
    state.steady = Server((7, 1, [0.001], [new], 2_000_000_000))
    with state.lock:
        state._sync_steady_rounds_locked()
    assert state.prev.quorum_id == 7 and state.prev.participants[0].step == 4
    assert state.stats.native_rounds == 3


# --- decoding answers -------------------------------------------------------------------------
TEXT = st.text(max_size=8)
WIRE_MEMBER = st.builds(
    pb.QuorumMember,
    replica_id=TEXT,
    address=TEXT,
    store_address=TEXT,
    step=st.integers(-(2**63), 2**63 - 1),
    world_size=st.integers(0, 2**64 - 1),
    shrink_only=st.booleans(),
    data=st.one_of(st.just(""), TEXT, st.builds(json.dumps, st.dictionaries(TEXT, st.integers()))),
    commit_failures=st.integers(-(2**63), 2**63 - 1),
    reconfigure_handles=st.lists(TEXT, max_size=3),
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(WIRE_MEMBER, max_size=6),
    st.integers(-(2**63), 2**63 - 1),
    st.one_of(st.none(), st.tuples(st.integers(0, 253402300799), st.integers(0, 999999999))),
    st.binary(max_size=6),
)
def test_the_native_decoder_agrees_with_protobuf(members, quorum_id, created, junk):
    q = pb.Quorum(quorum_id=quorum_id, participants=members)
    if created is not None:
        q.created.seconds, q.created.nanos = created
    data = pb.LighthouseQuorumResponse(quorum=q).SerializeToString()
    got = wire.quorum_from_response(data)
    want = wire.quorum_from_pb(pb.LighthouseQuorumResponse.FromString(data).quorum)
    assert got == want
    assert [m.__dict__ for m in got.participants] == [m.__dict__ for m in want.participants]
    if created is not None:
        assert got.created == want.created
    # Arbitrary bytes after it: the same answer, or the same refusal, as protobuf's.
    try:
        want2 = wire.quorum_from_pb(pb.LighthouseQuorumResponse.FromString(data + junk).quorum)
    except Exception as e:  # noqa: BLE001
        with pytest.raises(type(e)):
            wire.quorum_from_response(data + junk)
    else:
        got2 = wire.quorum_from_response(data + junk)
        assert got2 == want2


def test_the_native_decoder_leaves_the_unusual_to_protobuf():
    decode = native().decode_quorum_response
    m = pb.QuorumMember(replica_id="a", step=1)
    q = pb.Quorum(quorum_id=3, participants=[m])
    good = pb.LighthouseQuorumResponse(quorum=q).SerializeToString()
    assert decode(good, QuorumMember, wire._data_from_wire)[0] == 3
    # Invalid UTF-8 in a string field: protobuf raises, so the native decoder declines.
    bad_utf8 = good.replace(b"\x0a\x01a", b"\x0a\x01\xff")
    assert decode(bad_utf8, QuorumMember, wire._data_from_wire) is None
    with pytest.raises(DecodeError):
        wire.quorum_from_response(bad_utf8)
    # Field number 0 is not a field: protobuf raises, the native decoder declines.
    field_zero = good + b"\x00\x00"
    assert decode(field_zero, QuorumMember, wire._data_from_wire) is None
    with pytest.raises(DecodeError):
        wire.quorum_from_response(field_zero)
    # A tag padded beyond 5 bytes: protobuf raises, the native decoder declines.
    padded = b"\x0a\x07" + b"\x88\x80\x80\x80\x80\x00\x05"  # quorum_id 5, its tag in 6 bytes
    assert decode(padded, QuorumMember, wire._data_from_wire) is None
    with pytest.raises(DecodeError):
        wire.quorum_from_response(padded)
    # Two quorum fields merge in protobuf: left to it, and the answers agree.
    twice = good + good
    assert decode(twice, QuorumMember, wire._data_from_wire) is None
    assert wire.quorum_from_response(twice) == wire.quorum_from_pb(
        pb.LighthouseQuorumResponse.FromString(twice).quorum
    )
