"""In-place reconfigure: shrink, grow with a replacement process, world 1, leaks."""

import signal
from datetime import timedelta

import torch

from tests.procs import Workers, make_store


def test_shrink_3_to_2_then_world_1():
    plan = [
        ["a", {0: 0, 1: 1, 2: 2}, 3],
        ["b", {0: 0, 1: 1}, 2],  # rank 2 leaves
        ["c", {1: 0}, 1],  # rank 1 alone, as rank 0 of 1; rank 0 leaves
    ]
    with Workers("tests.backend.workers:reconfigure_sequence", 3, plan=plan) as w:
        r0, r1, r2 = w.join(timeout=60)
    assert [x[:3] for x in r2] == [("a", 2, 3)]
    assert torch.equal(r2[0][3], torch.full((2,), 6.0))
    assert [x[:3] for x in r0] == [("a", 0, 3), ("b", 0, 2)]
    assert torch.equal(r0[1][3], torch.full((2,), 3.0))
    assert [x[:3] for x in r1] == [("a", 1, 3), ("b", 1, 2), ("c", 0, 1)]
    assert torch.equal(r1[2][3], torch.full((2,), 1.0))


def test_grow_2_to_3_with_a_late_joiner():
    store = make_store()
    plan = [["a", {0: 0, 1: 1}, 2], ["b", {0: 0, 1: 1}, 3]]
    with Workers("tests.backend.workers:reconfigure_sequence", 2, store=store, plan=plan) as w:
        late = w.spawn(2, target="tests.backend.workers:join_late", prefix="b", new_rank=2, ws=3)
        r0, r1 = w.join(timeout=60, children=w.children[:2])
        (rl,) = w.join(timeout=30, children=[late])
    for r in (r0, r1):
        assert [x[2] for x in r] == [2, 3]
        assert torch.equal(r[1][3], torch.full((2,), 6.0))
    assert rl[0][1:3] == (2, 3) and torch.equal(rl[0][3], torch.full((2,), 6.0))


def test_replace_a_killed_peer_with_a_new_process():
    store = make_store()
    with Workers("tests.backend.workers:survivor_after_kill", 3, store=store, ranks=[]) as w:
        survivors = [w.spawn(0), w.spawn(1)]
        victim = w.spawn(2, target="tests.backend.workers:victim")
        store.wait(["ready/0", "ready/1", "ready/2"], timedelta(seconds=30))
        victim.signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        store.set("killed", "1")
        newcomer = w.spawn(2, target="tests.backend.workers:replacement")
        results = w.join(timeout=60, children=survivors + [newcomer])
    for r in results[:2]:
        assert r["failure"] is not None  # the op with the dead peer failed
    for r in results:
        assert torch.equal(r["result"], torch.full((2,), 6.0))


def test_200_reconfigures_leak_no_threads_fds_or_memory():
    with Workers("tests.backend.workers:reconfigure_leak", 2, rounds=200) as w:
        results = w.join(timeout=180)
    # A leak of one thread or fd per reconfigure would show up as +200; the
    # slack covers what the current generation's teardown may still hold.
    for r in results:
        b, a = r["before"], r["after"]
        assert a["threads"] <= b["threads"] + 2, r
        assert a["fds"] <= b["fds"] + 4, r
        assert a["rss_kb"] - b["rss_kb"] < 20 * 1024, r  # < 20 MiB over 200 generations


def test_configure_after_shutdown_builds_a_new_generation():
    # torchft's process groups reconfigure after shutdown(); ft's do too.
    with Workers("tests.backend.workers:configure_after_shutdown", 2) as w:
        results = w.join(timeout=60)
    for t, after_shutdown, u, errored in results:
        assert torch.equal(t, torch.full((3,), 2.0))
        assert after_shutdown is not None  # ops between shutdown and configure fail
        assert torch.equal(u, torch.full((3,), 3.0))
        assert errored is None
