"""Table tests of the pure algorithms in ft.coordination.quorum (docs/design.md, "The quorum rule", "Who takes part in a step")."""

import pytest

from ft.coordination.quorum import (
    GroupRequest,
    LighthouseOptions,
    Quorum,
    QuorumMember,
    compute_quorum_result,
    merge_group_requests,
    next_quorum_id,
    participation,
    quorum_compute,
    subscriber_replica,
)

OPTS = LighthouseOptions(min_replicas=2, join_timeout_s=10.0, heartbeat_timeout_s=5.0)
NOW = 100.0


def m(rid, step=0, shrink_only=False, commit_failures=0, store=None):
    return QuorumMember(
        replica_id=rid,
        address=f"addr-{rid}",
        store_address=store or f"store-{rid}",
        step=step,
        world_size=1,
        shrink_only=shrink_only,
        commit_failures=commit_failures,
    )


def state(participants, heartbeats, joined=None):
    """participants: list of members or ids; heartbeats: {id: age_s}."""
    joined = joined or {}
    parts = {}
    for p in participants:
        p = m(p) if isinstance(p, str) else p
        parts[p.replica_id] = (NOW - joined.get(p.replica_id, 0.0), p)
    hbs = {rid: NOW - age for rid, age in heartbeats.items()}
    return parts, hbs


def prev_quorum(*ids, qid=7):
    return Quorum(quorum_id=qid, participants=tuple(m(i) for i in ids))


# (name, participants, heartbeat ages, joined ago, prev quorum ids, opts, expected ids or None, reason substring)
QUORUM_CASES = [
    ("no participants", [], {}, {}, None, OPTS, None, "no participants"),
    (
        "all heartbeating join",
        ["b", "a"],
        {"a": 0, "b": 0},
        {},
        None,
        OPTS,
        ["a", "b"],
        "all 2 heartbeating",
    ),
    ("below min_replicas", ["a"], {"a": 0}, {}, None, OPTS, None, "min_replicas"),
    (
        "min_replicas=1 single",
        ["a"],
        {"a": 0},
        {},
        None,
        LighthouseOptions(1, 10.0, 5.0),
        ["a"],
        "all 1",
    ),
    (
        "expired heartbeat is not healthy",
        ["a", "b", "c"],
        {"a": 0, "b": 0, "c": 6},
        {},
        None,
        OPTS,
        ["a", "b"],
        "all 2",
    ),
    (
        "participant without heartbeat entry ignored",
        ["a", "b", "z"],
        {"a": 0, "b": 0},
        {},
        None,
        OPTS,
        ["a", "b"],
        "all 2",
    ),
    (
        "straggler: wait for join timeout",
        ["a", "b"],
        {"a": 0, "b": 0, "c": 0},
        {"a": 3, "b": 1},
        None,
        OPTS,
        None,
        "join timeout in 7.0s",
    ),
    (
        "straggler: join timeout elapsed",
        ["a", "b"],
        {"a": 0, "b": 0, "c": 0},
        {"a": 10, "b": 1},
        None,
        OPTS,
        ["a", "b"],
        "join timeout elapsed",
    ),
    (
        "split brain: 2 of 4 heartbeating",
        ["a", "b"],
        {"a": 0, "b": 0, "c": 0, "d": 0},
        {"a": 60, "b": 60},
        None,
        OPTS,
        None,
        "split-brain",
    ),
    (
        "split brain: 3 of 5 ok after join timeout",
        ["a", "b", "c"],
        {"a": 0, "b": 0, "c": 0, "d": 0, "e": 0},
        {"a": 60},
        None,
        OPTS,
        ["a", "b", "c"],
        "join timeout elapsed",
    ),
    (
        "fast path ignores min_replicas and join wait",
        ["a"],
        {"a": 0, "b": 0, "c": 0},
        {},
        ["a"],
        OPTS,
        ["a"],
        "fast path",
    ),
    (
        "fast path includes new joiners",
        ["a", "b", "n"],
        {"a": 0, "b": 0, "n": 0, "x": 0},
        {},
        ["a", "b"],
        OPTS,
        ["a", "b", "n"],
        "fast path",
    ),
    (
        "no fast path when a member is missing",
        ["a", "n"],
        {"a": 0, "b": 0, "n": 0},
        {},
        ["a", "b"],
        OPTS,
        None,
        "join timeout",
    ),
    (
        "no fast path when a member's heartbeat expired",
        ["a", "b"],
        {"a": 0, "b": 9},
        {},
        ["a", "b"],
        OPTS,
        None,
        "min_replicas",
    ),
    (
        "member died: survivors after heartbeat expiry",
        ["a", "c"],
        {"a": 0, "b": 9, "c": 0},
        {},
        ["a", "b", "c"],
        OPTS,
        ["a", "c"],
        "all 2",
    ),
    (
        "shrink_only drops new joiners (fast path)",
        [m("a", shrink_only=True), "b", "n"],
        {"a": 0, "b": 0, "n": 0},
        {},
        ["a", "b"],
        OPTS,
        ["a", "b"],
        "fast path",
    ),
    (
        "shrink_only below min_replicas waits",
        [m("a", shrink_only=True), "n"],
        {"a": 0, "n": 0},
        {},
        ["a", "b"],
        OPTS,
        None,
        "min_replicas",
    ),
    (
        "shrink_only without prev quorum has no effect",
        [m("a", shrink_only=True), "n"],
        {"a": 0, "n": 0},
        {},
        None,
        OPTS,
        ["a", "n"],
        "all 2",
    ),
    (
        "shrink_only by an unhealthy participant is ignored",
        [m("z", shrink_only=True), "a", "n"],
        {"a": 0, "n": 0, "z": 9},
        {},
        ["a"],
        OPTS,
        ["a", "n"],
        "fast path",
    ),
]


@pytest.mark.parametrize(
    "name,participants,hb,joined,prev,opts,expected,reason",
    QUORUM_CASES,
    ids=[c[0] for c in QUORUM_CASES],
)
def test_quorum_compute(name, participants, hb, joined, prev, opts, expected, reason):
    parts, hbs = state(participants, hb, joined)
    d = quorum_compute(NOW, parts, hbs, prev_quorum(*prev) if prev else None, opts)
    got = None if d.members is None else [x.replica_id for x in d.members]
    assert got == expected, d.reason
    assert reason in d.reason
    assert d.ready == (expected is not None)


# (name, prev ids, new members, current id, expected id, why substring)
ID_CASES = [
    ("first quorum", None, [m("a")], 41, 42, "first"),
    ("unchanged", ["a", "b"], [m("b"), m("a")], 42, 42, "unchanged"),
    ("joined", ["a"], [m("a"), m("b")], 42, 43, "joined: b"),
    ("left", ["a", "b"], [m("a")], 42, 43, "left: b"),
    ("restarted replica (new uuid)", ["a:1", "b:1"], [m("a:1"), m("b:2")], 42, 43, "joined: b:2"),
    ("commit failures", ["a", "b"], [m("a"), m("b", commit_failures=2)], 42, 43, "commit failures"),
    ("step changes do not bump", ["a", "b"], [m("a", step=9), m("b", step=9)], 42, 42, "unchanged"),
]


@pytest.mark.parametrize(
    "name,prev,members,current,expected,why", ID_CASES, ids=[c[0] for c in ID_CASES]
)
def test_next_quorum_id(name, prev, members, current, expected, why):
    qid, reason = next_quorum_id(prev_quorum(*prev) if prev else None, current, members)
    assert qid == expected
    assert why in reason


def _answers(steps, group_rank, init_sync=True):
    members = [m(f"r{i}", step=s) for i, s in enumerate(steps)]
    return {
        mm.replica_id: compute_quorum_result(5, members, mm.replica_id, group_rank, init_sync)
        for mm in members
    }


def test_worked_example_group_rank_0():
    # steps [r0:0, r1:1, r2:0, r3:1, r4:0]: r0 heals from r1, r1 sends to [0, 4], r3 sends to [2].
    a = _answers([0, 1, 0, 1, 0], group_rank=0)
    assert a["r0"].heal and a["r0"].recover_src_replica_rank == 1
    assert a["r0"].recover_src_manager_address == "addr-r1"
    assert a["r2"].heal and a["r2"].recover_src_replica_rank == 3
    assert a["r4"].heal and a["r4"].recover_src_replica_rank == 1
    assert not a["r1"].heal and a["r1"].recover_dst_replica_ranks == [0, 4]
    assert not a["r3"].heal and a["r3"].recover_dst_replica_ranks == [2]
    for rid, r in a.items():
        assert r.quorum_id == 5
        assert r.replica_world_size == 5
        assert r.replica_rank == int(rid[1:])
        assert r.max_step == 1
        assert r.max_world_size == 2
        assert r.replica_ids == ["r0", "r1", "r2", "r3", "r4"]
        assert r.store_address == "store-r1"  # max_participants[0 % 2]
    assert a["r1"].max_replica_rank == 0 and a["r3"].max_replica_rank == 1
    assert a["r0"].max_replica_rank is None
    assert a["r0"].recover_dst_replica_ranks == []
    assert a["r1"].recover_src_replica_rank is None and a["r1"].recover_src_manager_address == ""


def test_worked_example_group_rank_1_rotates_sources():
    a = _answers([0, 1, 0, 1, 0], group_rank=1)
    # i-th recovering member heals from up_to_date[(i + 1) % 2]
    assert a["r0"].recover_src_replica_rank == 3
    assert a["r2"].recover_src_replica_rank == 1
    assert a["r4"].recover_src_replica_rank == 3
    assert a["r1"].recover_dst_replica_ranks == [2]
    assert a["r3"].recover_dst_replica_ranks == [0, 4]
    assert all(r.store_address == "store-r3" for r in a.values())  # max_participants[1 % 2]


# (name, steps, group_rank, init_sync, expected heal flags, expected src ranks, expected
# donors: the replica ranks in every member's heal_donors)
HEAL_CASES = [
    ("all equal, step>0: nobody heals", [4, 4, 4], 0, True, [False] * 3, [None] * 3, []),
    (
        "init_sync at step 0: all but primary heal",
        [0, 0, 0],
        0,
        True,
        [False, True, True],
        [None, 0, 0],
        [0],
    ),
    (
        "init_sync at step 0, group rank 1: primary is r1",
        [0, 0, 0],
        1,
        True,
        [True, False, True],
        [1, None, 1],
        [1],
    ),
    ("no init_sync at step 0: nobody heals", [0, 0, 0], 0, False, [False] * 3, [None] * 3, []),
    ("one behind", [3, 2, 3], 0, True, [False, True, False], [None, 0, None], [0, 2]),
    ("one behind, group rank 1", [3, 2, 3], 1, True, [False, True, False], [None, 2, None], [0, 2]),
    ("one behind, one donor", [3, 2], 0, True, [False, True], [None, 0], [0]),
    ("single member", [7], 3, True, [False], [None], []),
    (
        "one ahead of many",
        [1, 1, 5, 1],
        0,
        False,
        [True, True, False, True],
        [2, 2, None, 2],
        [2],
    ),
    (
        "three up to date, two behind",
        [6, 2, 6, 0, 6],
        1,
        True,
        [False, True, False, True, False],
        [None, 2, None, 4, None],
        [0, 2, 4],
    ),
]


@pytest.mark.parametrize(
    "name,steps,gr,init_sync,heal,src,donors", HEAL_CASES, ids=[c[0] for c in HEAL_CASES]
)
def test_heal_assignment(name, steps, gr, init_sync, heal, src, donors):
    a = _answers(steps, gr, init_sync)
    assert [a[f"r{i}"].heal for i in range(len(steps))] == heal
    assert [a[f"r{i}"].recover_src_replica_rank for i in range(len(steps))] == src
    # Every recovering member is somebody's destination, exactly once.
    dsts = sorted(d for r in a.values() for d in r.recover_dst_replica_ranks)
    assert dsts == [i for i, h in enumerate(heal) if h]
    # Every member is told the same donors: the up-to-date ones, with their addresses; the
    # assigned source is always one of them.
    want = [(i, f"addr-r{i}") for i in donors]
    assert all(r.heal_donors == want for r in a.values()), {k: r.heal_donors for k, r in a.items()}
    assert all(s in donors for s in src if s is not None)


def test_participants_are_sorted_and_commit_failures_max():
    members = [m("c", 1, commit_failures=1), m("a", 1), m("b", 1, commit_failures=3)]
    r = compute_quorum_result(1, members, "b", 0)
    assert r.replica_ids == ["a", "b", "c"] and r.replica_rank == 1
    assert r.commit_failures == 3


def test_not_a_member_raises():
    with pytest.raises(ValueError, match="not a member"):
        compute_quorum_result(1, [m("a")], "zz", 0)


MERGE_CASES = [
    ("agree", [GroupRequest(0, 5), GroupRequest(1, 5)], 2, (5, False, True, 0)),
    ("lagging rank -> min step", [GroupRequest(0, 5), GroupRequest(1, 4)], 2, (4, False, True, 0)),
    (
        "shrink_only any",
        [GroupRequest(0, 1, shrink_only=True), GroupRequest(1, 1)],
        2,
        (1, True, True, 0),
    ),
    (
        "init_sync any",
        [GroupRequest(0, 0, init_sync=False), GroupRequest(1, 0, init_sync=True)],
        2,
        (0, False, True, 0),
    ),
    ("init_sync none", [GroupRequest(0, 0, init_sync=False)], 1, (0, False, False, 0)),
    (
        "commit failures max",
        [GroupRequest(0, 1, commit_failures=1), GroupRequest(1, 1, commit_failures=4)],
        2,
        (1, False, True, 4),
    ),
]


@pytest.mark.parametrize("name,reqs,ws,expected", MERGE_CASES, ids=[c[0] for c in MERGE_CASES])
def test_merge_group_requests(name, reqs, ws, expected):
    assert merge_group_requests({r.group_rank: r for r in reqs}, ws) == expected


def test_merge_group_requests_needs_every_rank():
    with pytest.raises(ValueError, match="0..1"):
        merge_group_requests({0: GroupRequest(0, 1)}, 2)


# (name, member steps, init_sync, async quorum, allow_heal, spares_above,
#  expected (rank, contributors, commit_size) per member, in replica order)
PARTICIPATION_CASES = [
    (
        "async, init_sync, step 0: primary contributes, all commit",
        [0, 0],
        True,
        True,
        True,
        None,
        [(0, 1, 2), (None, 1, 2)],
    ),
    (
        "async, init_sync, step 0, 3 groups",
        [0, 0, 0],
        True,
        True,
        True,
        None,
        [(0, 1, 3), (None, 1, 3), (None, 1, 3)],
    ),
    (
        "async, no init_sync, step 0: everyone",
        [0, 0, 0],
        False,
        True,
        True,
        None,
        [(0, 3, 3), (1, 3, 3), (2, 3, 3)],
    ),
    (
        "sync, init_sync, step 0: all heal first, all take part",
        [0, 0],
        True,
        False,
        True,
        None,
        [(0, 2, 2), (1, 2, 2)],
    ),
    (
        "async, one behind sits out",
        [5, 3, 5],
        True,
        True,
        True,
        None,
        [(0, 2, 2), (None, 2, 2), (1, 2, 2)],
    ),
    (
        "sync, one behind heals first",
        [5, 3, 5],
        True,
        False,
        True,
        None,
        [(0, 3, 3), (1, 3, 3), (2, 3, 3)],
    ),
    (
        "no heal allowed, step 0: max-step members",
        [0, 0],
        True,
        False,
        False,
        None,
        [(0, 2, 2), (1, 2, 2)],
    ),
    ("no heal allowed, one behind", [2, 1], True, True, False, None, [(0, 1, 1), (None, 1, 1)]),
    (
        "spares: 3 up to date, 2 take part",
        [4, 4, 4],
        True,
        True,
        True,
        2,
        [(0, 2, 2), (1, 2, 2), (None, 2, 2)],
    ),
    (
        "spares at step 0 with init_sync",
        [0, 0, 0],
        True,
        True,
        True,
        2,
        [(0, 1, 2), (None, 1, 2), (None, 1, 2)],
    ),
]


@pytest.mark.parametrize(
    "name,steps,init_sync,async_q,allow_heal,spares,expected",
    PARTICIPATION_CASES,
    ids=[c[0] for c in PARTICIPATION_CASES],
)
def test_participation(name, steps, init_sync, async_q, allow_heal, spares, expected):
    a = _answers(steps, 0, init_sync)
    got = []
    for i in range(len(steps)):
        p = participation(
            a[f"r{i}"],
            use_async_quorum=async_q,
            allow_heal=allow_heal,
            init_sync=init_sync,
            spares_above=spares,
        )
        got.append((p.rank, p.contributors, p.commit_size))
    assert got == expected


@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("async_q", [False, True])
@pytest.mark.parametrize("init_sync", [False, True])
def test_participation_step0_commits_when_quorum_is_large_enough(groups, async_q, init_sync):
    """At step 0 every member of the quorum counts toward min_replica_size, in every mode: a
    job whose quorum holds min_replica_size replicas can always commit its first step."""
    a = _answers([0] * groups, 0, init_sync)
    for r in a.values():
        p = participation(r, use_async_quorum=async_q, allow_heal=True, init_sync=init_sync)
        assert p.enough(groups) and not p.enough(groups + 1)
        assert p.contributors >= 1


@pytest.mark.parametrize(
    "subscriber,replica",
    [
        ("g0:uuid-1/0", "g0:uuid-1"),  # as ft.Manager subscribes
        ("a/b:c/12", "a/b:c"),  # the last "/" splits
        ("g0:uuid-1", None),  # no rank
        ("/3", None),  # no replica
        ("g0/x", None),  # a rank that is not a number
        ("", None),
    ],
)
def test_which_subscribers_stand_for_a_replica(subscriber, replica):
    assert subscriber_replica(subscriber) == replica
