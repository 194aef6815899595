"""Pure schedule tables and quick single-process unit tests of LocalSGD and
DiLoCo logic against the in-thread FakeManager (tests/diloco/fake_manager.py).
The multi-process tests with real servers are in test_diloco_mp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ft.local_sgd import (
    DiLoCo,
    LocalSGD,
    _fold_index,
    _WeightedSum,
    contributions_after,
    fragment_for_step,
    join_starts,
    streaming_plan,
    streaming_schedule,
)
from tests.diloco.fake_manager import FakeGroup, FakeManager, run_replicas


# -- the schedule, as tables -------------------------------------------------


@pytest.mark.parametrize(
    "sync_every,n,tau,period,prepare_at",
    [(4, 1, 0, 4, 4), (4, 2, 0, 2, 2), (4, 2, 1, 2, 1), (6, 3, 1, 2, 1), (20, 1, 5, 20, 15)],
)
def test_plan_table(sync_every, n, tau, period, prepare_at):
    plan = streaming_plan(sync_every, n, tau)
    assert (plan.period, plan.prepare_at) == (period, prepare_at)


@pytest.mark.parametrize(
    "sync_every,n,tau", [(5, 2, 0), (4, 2, 2), (4, 2, -1), (0, 1, 0), (4, 0, 0)]
)
def test_plan_rejects(sync_every, n, tau):
    with pytest.raises(ValueError):
        streaming_plan(sync_every, n, tau)


def _timeline(sync_every, n, tau, steps, fail_syncs=()):
    """Simulates the hook: which (inner step, action, fragment) happen, with
    the manager step advancing on every commit except the failing ones."""
    plan = streaming_plan(sync_every, n, tau)
    local, mstep, out, pending, syncs = 0, 0, [], None, 0
    for s in range(1, steps + 1):
        local += 1
        prep, sync = streaming_schedule(local, plan)
        if prep:
            pending = fragment_for_step(mstep, n)
            out.append((s, "send", pending))
        if sync:
            local = 0
            ok = syncs not in fail_syncs
            out.append((s, "commit" if ok else "fail", pending))
            syncs += 1
            mstep += ok
    return out


@pytest.mark.parametrize(
    "sync_every,n,tau,steps,fail_syncs,timeline",
    [
        # plain DiLoCo, H=3
        (3, 1, 0, 6, (), "3 send 0, 3 commit 0, 6 send 0, 6 commit 0"),
        # streaming, 2 fragments, H=4 (P=2), tau=1: send one step before the sync
        (
            4,
            2,
            1,
            8,
            (),
            "1 send 0, 2 commit 0, 3 send 1, 4 commit 1, 5 send 0, 6 commit 0, 7 send 1, 8 commit 1",
        ),
        # a failed commit retries the same fragment (the manager step did not move)
        (
            4,
            2,
            0,
            8,
            {1},
            "2 send 0, 2 commit 0, 4 send 1, 4 fail 1, 6 send 1, 6 commit 1, 8 send 0, 8 commit 0",
        ),
    ],
)
def test_timeline_table(sync_every, n, tau, steps, fail_syncs, timeline):
    """``timeline``: the (inner step, action, fragment) triples, as "step action fragment"."""
    expected = [(int(s), a, int(f)) for s, a, f in (e.split() for e in timeline.split(", "))]
    assert _timeline(sync_every, n, tau, steps, fail_syncs=fail_syncs) == expected


# -- the DiLoCo update, by hand ------------------------------------------------


class Scalar(nn.Module):
    def __init__(self, w: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w], dtype=torch.float64))

    def forward(self) -> torch.Tensor:
        # LocalSGD/DiLoCo join at the first forward of a module they wrap.
        return self.w


def _quad_step(model, opt, target):
    opt.zero_grad()
    (0.5 * (model() - target) ** 2).sum().backward()
    opt.step()


def test_diloco_numeric_regression():
    """Two replicas, w0 = 1, loss 0.5 (w - t)^2 with t = 0 (replica 0) and
    t = 4 (replica 1); inner SGD lr 0.5 (w <- 0.5 w + 0.5 t), H = 2; outer SGD
    lr 0.7, momentum 0.9, Nesterov.

    Outer step 1: r0 1 -> 0.5 -> 0.25, pseudo 0.75; r1 1 -> 2.5 -> 3.25,
      pseudo -2.25; avg g = -0.75; buf = g; nesterov d = g + 0.9 buf = -1.425;
      w = 1 - 0.7 d = 1.9975.
    Outer step 2: r0 1.9975 -> 0.99875 -> 0.499375, pseudo 1.498125;
      r1 -> 2.99875 -> 3.499375, pseudo -1.501875; g = -0.001875;
      buf = 0.9 (-0.75) + g = -0.676875; d = g + 0.9 buf = -0.6110625;
      w = 1.9975 + 0.42774375 = 2.42524375.
    """

    def body(rank, group):
        m = FakeManager(group, rank)
        model = Scalar(1.0)
        inner = torch.optim.SGD(model.parameters(), lr=0.5)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        traj = []
        with DiLoCo(m, [model], inner, outer, sync_every=2):
            for s in range(4):
                _quad_step(model, inner, 4.0 * rank)
                if s % 2 == 1:
                    traj.append(model.w.item())
        return traj, outer.state_dict()["state"][0]["momentum_buffer"].item()

    for traj, buf in run_replicas(2, body):
        assert traj == pytest.approx([1.9975, 2.42524375], abs=1e-12)
        assert buf == pytest.approx(-0.676875, abs=1e-12)


def test_streaming_alpha_merge_by_hand():
    """One replica (avg = identity), two scalar fragments a, b (both start at
    1), loss 0.5 a^2 + 0.5 b^2, inner SGD lr 0.5 (x <- 0.5 x), sync_every 2
    (P = 1, tau = 0), one shared outer plain SGD lr 0.5, alpha = 0.5.

    join (first forward): a quorum only (the only group is joining): no sync, no commit.
    step 1: local a, b = 0.5, 0.5; fragment 0 syncs (manager step 0, as in torchft):
      pseudo 1 - 0.5 = 0.5, global a = 1 - 0.5 * 0.5 = 0.75,
      merged a = 0.5 * 0.75 + 0.5 * 0.5 = 0.625; b untouched (0.5).
    step 2: local a, b = 0.3125, 0.25; fragment 1 syncs: pseudo 1 - 0.25 = 0.75,
      global b = 1 - 0.5 * 0.75 = 0.625, merged b = 0.5 * 0.625 + 0.5 * 0.25 = 0.4375.
    """

    def body(rank, group):
        m = FakeManager(group, rank)
        a, b = Scalar(1.0), Scalar(1.0)
        params = list(a.parameters()) + list(b.parameters())
        inner = torch.optim.SGD(params, lr=0.5)
        outer = torch.optim.SGD(params, lr=0.5)
        out = []
        with DiLoCo(m, [a, b], inner, outer, sync_every=2, fragment_update_alpha=0.5):
            for _ in range(2):
                inner.zero_grad()
                (0.5 * a() ** 2 + 0.5 * b() ** 2).sum().backward()
                inner.step()
                out.append((a.w.item(), b.w.item()))
        return out

    (out,) = run_replicas(1, body)
    assert out == [(0.625, 0.5), (0.3125, 0.4375)]  # exact in binary


def test_failed_commit_drops_fragment_progress_and_counts_once():
    # One allreduce per sync (the weight rides in the scalar's tensor); call 0 is the join's
    # count of groups at their sync (none: both start), call 1 the first sync's.
    def body(rank, group):
        m = FakeManager(group, rank, fail_calls={1} if rank == 0 else set())
        a, b = Scalar(1.0), Scalar(1.0)
        params = list(a.parameters()) + list(b.parameters())
        inner = torch.optim.SGD(params, lr=0.5)
        outer = [torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)]
        seen = []
        with DiLoCo(m, [a, b], inner, outer, sync_every=2) as d:
            for _ in range(3):
                inner.zero_grad()
                (0.5 * a() ** 2 + 0.5 * b() ** 2).sum().backward()
                inner.step()
                seen.append((a.w.item(), b.w.item()))
        return seen, m.commit_failures, m.step, d.failed_commits, m.lanes

    for seen, failures, step, dfail, lanes in run_replicas(2, body):
        # join: no sync. step 1: frag 0's sync fails -> a back to its backup 1.0 (b = 0.5
        # local). step 2: frag 0 again (the step did not advance): a 1 -> 0.5 -> pseudo 0.5
        # -> a = 0.5 (step 1). step 3: frag 1: b 1 -> 0.125 -> pseudo 0.875 -> b = 0.125.
        assert seen == [(1.0, 0.5), (0.5, 0.25), (0.25, 0.125)]
        assert (failures, dfail, step) == (1, 1, 2)
        assert lanes == [0, 0, 0, 1]  # the count on fragment 0's lane; each fragment its own


@pytest.mark.parametrize("tau", [0, 1])
def test_comm_wait_seconds_counts_only_the_unhidden_wait(tau):
    """Each allreduce takes 50 ms to finish after it is issued (a slow link). With tau=0 the
    sync waits for all of it; with tau=1 a 100 ms inner step runs in between and hides it."""
    import time as _time

    class SlowLink(FakeManager):
        def allreduce(self, t, should_quantize=False, reduce_op=None):
            done_at = _time.perf_counter() + 0.05

            class Work:
                def wait(self_inner):
                    _time.sleep(max(0.0, done_at - _time.perf_counter()))
                    return True

            return Work()

    m = SlowLink(FakeGroup(1), 0)
    a, b = Scalar(1.0), Scalar(1.0)
    params = list(a.parameters()) + list(b.parameters())
    inner = torch.optim.SGD(params, lr=0.5)
    outer = torch.optim.SGD(params, lr=1.0)
    with DiLoCo(m, [a, b], inner, outer, sync_every=4, fragment_sync_delay=tau) as d:
        for _ in range(4):
            inner.zero_grad()
            (0.5 * a() ** 2 + 0.5 * b() ** 2).sum().backward()
            _time.sleep(0.1)  # the inner step's compute
            inner.step()
    assert d.syncs == 2  # the join round (the only group, joining) syncs nothing
    if tau == 0:
        assert d.comm_wait_seconds >= 2 * 0.045, d.comm_wait_seconds
    else:
        assert d.comm_wait_seconds < 0.02, d.comm_wait_seconds


def test_diloco_rejects_async_and_shares_the_lanes_there_are():
    model = Scalar(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        DiLoCo(FakeManager(FakeGroup(1), 0, use_async_quorum=True), [model], opt, opt, 2)
    # More fragments than lanes: fragment f syncs on lane f % num_lanes (torchft accepts it).
    frags = [Scalar(float(i)) for i in range(5)]
    d = DiLoCo(FakeManager(FakeGroup(1), 0, num_lanes=2), frags, opt, opt, 5)
    assert [d.lane_for(f) for f in range(5)] == [0, 1, 0, 1, 0]


def test_bucketization_switch_and_default_cap_follow_torchft(monkeypatch):
    from ft.local_sgd import DEFAULT_BUCKET_CAP_MB

    assert DEFAULT_BUCKET_CAP_MB == 1024  # torchft: 1 GiB per bucket
    model = Scalar(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.delenv("TORCHFT_USE_BUCKETIZATION", raising=False)
    assert not LocalSGD(FakeManager(FakeGroup(1), 0), model, opt, 2)._use_bucketization
    monkeypatch.setenv("TORCHFT_USE_BUCKETIZATION", "True")
    assert LocalSGD(FakeManager(FakeGroup(1), 0), model, opt, 2)._use_bucketization
    assert DiLoCo(FakeManager(FakeGroup(1), 0), [model], opt, opt, 2)._use_bucketization


@pytest.mark.parametrize("keep_backup", [False, True])
def test_localsgd_commit_and_failed_sync(keep_backup):
    def body(rank, group):
        # one allreduce per sync (the weight rides in the scalar's tensor); call 0 is the join
        m = FakeManager(group, rank, fail_calls={2} if rank == 1 else set())
        model = Scalar(1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        vals = []
        with LocalSGD(m, model, opt, sync_every=2, keep_backup=keep_backup) as algo:
            for _ in range(4):
                _quad_step(model, opt, 4.0 * rank)
                vals.append(model.w.item())
        return vals, m.commit_failures, algo._backup is not None, sorted(m.state_fns)

    (v0, f0, b0, s0), (v1, f1, b1, s1) = run_replicas(2, body)
    # sync 1 (step 2): r0 0.25, r1 3.25 -> avg 1.75 committed.
    assert v0[:3] == [0.5, 1.75, 0.875] and v1[:3] == [2.5, 1.75, 2.875]
    assert f0 == f1 == 1
    if keep_backup:
        # sync 2 (step 4) fails -> both put back the committed 1.75; the backup heals.
        assert v0[3] == v1[3] == 1.75 and b0 and b1 and s0 == s1 == ["LocalSGD"]
    else:
        # torchft's LocalSGD: a failed sync leaves the local values; no backup is kept.
        assert (v0[3], v1[3]) == (0.4375, 3.4375) and not b0 and not b1 and s0 == s1 == []


def test_localsgd_warmup_syncs_every_step():
    def body(rank, group):
        m = FakeManager(group, rank)
        model = Scalar(1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        with LocalSGD(m, model, opt, sync_every=100, warmup_steps=2):
            for _ in range(3):
                _quad_step(model, opt, 4.0 * rank)
        return m.step, model.w.item()

    (s0, w0), (s1, w1) = run_replicas(2, body)
    # join: nothing to average; warmup: step 1 avg(0.5, 2.5) = 1.5; step 2 avg(0.75, 2.75)
    # = 1.75; step 3 local. Three commits: the join round and two warmup syncs.
    assert s0 == s1 == 3
    assert (w0, w1) == (0.875, 2.875)


# -- who contributes to a sync -------------------------------------------------


F, T = False, True


@pytest.mark.parametrize(
    "before,event,fragment,after",
    [
        ((F, F), "start", None, (T, T)),  # every group was joining: every fragment counts
        ((F, F), "sync", 0, (T, F)),  # a late joiner's join round at fragment 0: 1 partial
        ((F, F), "sync", 1, (F, T)),
        ((T, F), "sync", 1, (T, T)),  # ... until fragment 1 has synced once
        ((T, T), "sync", 1, (T, T)),  # the fault-free path
        ((T, T), "heal", None, (F, F)),  # a heal restarts every fragment mid-interval
        ((T,), "heal", None, (F,)),
        ((F,), "sync", 0, (T,)),
    ],
)
def test_contributions_table(before, event, fragment, after):
    assert contributions_after(before, event, fragment) == after


@pytest.mark.parametrize(
    "quorum_changed,groups_syncing,starts",
    [
        # Everyone starts at step 0: the job's first quorum (new to every group), nobody at a
        # sync: no allreduce, no commit; the first sync is torchft's (manager step 0).
        (T, 0.0, T),
        # The join quorum repeats the group's previous one (a loop that ran its own quorum
        # first): the same groups, all joining; nothing is exchanged.
        (F, None, T),
        # A late joiner: the others are at their sync; it takes part, contributing nothing.
        (T, 1.0, F),
        (T, 3.0, F),
        # The count could not be exchanged (the step fails): the sync path, as the others.
        (T, None, F),
    ],
)
def test_join_starts_table(quorum_changed, groups_syncing, starts):
    assert join_starts(quorum_changed, groups_syncing) is starts


@pytest.mark.parametrize("args", [((T, T), "sync", None), ((T, T), "sync", 2), ((T,), "join", 0)])
def test_contributions_rejects(args):
    with pytest.raises(ValueError):
        contributions_after(*args)


@pytest.mark.parametrize(
    "dtypes_sizes,want",
    [
        ([(torch.float32, 10), (torch.float64, 3), (torch.bfloat16, 1)], 1),
        ([(torch.float32, 5), (torch.float32, 2)], 1),
        ([(torch.bfloat16, 5), (torch.float16, 2)], None),  # a count is not exact there
        ([], None),
    ],
)
def test_fold_index_table(dtypes_sizes, want):
    assert _fold_index([torch.zeros(n, dtype=d) for d, n in dtypes_sizes]) == want


@pytest.mark.parametrize("quantize", [False, True])
def test_weighted_sum_averages_over_contributors_only(quantize):
    """3 replicas, weights 1, 0, 1: the one with weight 0 sends zeros and every replica
    divides by 2. The weight rides in the smallest fp32 tensor (one allreduce per tensor);
    with quantization it is an allreduce of its own."""

    def body(rank, group):
        m = FakeManager(group, rank)
        w = 0.0 if rank == 1 else 1.0
        big = torch.full((4, 3), float(rank + 1)) * w
        small = torch.full((2,), 10.0 * (rank + 1)) * w
        s = _WeightedSum(m, [big, small], w, quantize, None, False)
        s.wait()
        return s.total(), [t.clone() for t in s.tensors], m.calls

    for total, (big, small), calls in run_replicas(3, body):
        assert total == 2.0 and calls == (3 if quantize else 2)
        assert torch.equal(big / total, torch.full((4, 3), 2.0))  # (1 + 3) / 2
        assert torch.equal(small / total, torch.full((2,), 20.0)) and small.shape == (2,)


class _HealOnce(FakeManager):
    """A FakeManager whose quorum number ``heal_at`` is a heal: every registered state is
    loaded (here the replica's own, which the fragments' backups share with the others)."""

    def __init__(self, *args, heal_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.heal_at = heal_at

    def start_quorum(self, **kw) -> None:
        super().start_quorum(**kw)
        if self.quorums == self.heal_at:
            for load, save in self.state_fns.values():
                load(save())


def test_diloco_healed_group_restarts_from_backups_and_sends_nothing():
    """w0 = 1, loss 0.5 (w - t)^2 (t = 0 on replica 0, 4 on replica 1), inner SGD lr 0.5,
    sync_every 1, outer SGD lr 1 with momentum 0.5 (buf <- 0.5 buf + g; w <- w - buf).

    join: both groups are joining: a quorum only, no sync (the outer optimizer holds no state).
    sync 1: local 0.5 and 2.5, pseudo 0.5 and -1.5, g = -0.5: buf = -0.5, w = 1.5.
    sync 2: replica 1 heals in its quorum: its parameter goes back to the backup 1.5 and it
      sends zeros with weight 0; replica 0: local 0.75, pseudo 0.75, g = 0.75 / 1:
      buf = -0.25 + 0.75 = 0.5, w = 1.0.
    sync 3: both count again: local 0.5 and 2.5, g = (0.5 - 1.5) / 2 = -0.5:
      buf = 0.25 - 0.5 = -0.25, w = 1.25.
    """

    def body(rank, group):
        m = _HealOnce(group, rank, heal_at=3 if rank == 1 else 0)
        model = Scalar(1.0)
        inner = torch.optim.SGD(model.parameters(), lr=0.5)
        outer = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.5)
        traj, counts = [], []
        with DiLoCo(m, [model], inner, outer, sync_every=1) as d:
            model()  # the first forward runs the join
            counts.append(d.contributors)
            outer_state_after_join = len(outer.state)
            for _ in range(3):
                _quad_step(model, inner, 4.0 * rank)
                traj.append(model.w.item())
                counts.append(d.contributors)
        return traj, counts, outer_state_after_join

    for traj, counts, outer_state in run_replicas(2, body):
        assert outer_state == 0
        assert counts == [None, 2.0, 1.0, 2.0]
        assert traj == [1.5, 1.0, 1.25]  # exact in binary


def test_localsgd_group_whose_step_moves_in_the_quorum_contributes_nothing():
    """3 replicas; replica 2's second sync is a heal (its step jumps in the quorum): it sends
    zeros and every replica takes the average of replicas 0 and 1."""

    class StepJump(FakeManager):
        def start_quorum(self, **kw) -> None:
            super().start_quorum(**kw)
            if self.rank == 2 and self.quorums == 2:
                self.step += 1  # a heal sets the step the others are at
                self.jumped = True

        def should_commit(self, timeout=None) -> bool:
            if getattr(self, "jumped", False):
                self.jumped = False
                self.step -= 1  # the fake's commit barrier keys on the step: stay in line
            return super().should_commit(timeout)

    def body(rank, group):
        m = StepJump(group, rank)
        model = Scalar(float(rank))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with LocalSGD(m, model, opt, sync_every=1) as algo:
            model()  # the first forward runs the join
            joined = (model.w.item(), algo.contributors)
            model.w.data.fill_(10.0 * (rank + 1))
            opt.zero_grad()
            model.w.sum().backward()
            opt.step()
            return joined, model.w.item(), algo.contributors

    for joined, w, count in run_replicas(3, body):
        assert joined[1] == 0.0  # the join round: nobody contributes, parameters unchanged
        assert w == 15.0 and count == 2.0  # (10 + 20) / 2: replica 2's 30 is not in it


def _wrap(algorithm, manager, model, inner):
    if algorithm == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=1.0)
        return DiLoCo(manager, [model], inner, outer, sync_every=4)
    return LocalSGD(manager, model, inner, sync_every=4)


@pytest.mark.parametrize("algorithm", ["localsgd", "diloco"])
def test_join_runs_at_the_first_forward_after_the_context_is_bound(algorithm):
    """The join's quorum (and heal) runs at the first forward of a wrapped module, not at
    ``__enter__``: state-dict functions that read the bound context object (``with DiLoCo(...)
    as self.diloco``, as torchft's trainers do) work during its heal. Without a forward first,
    it runs before the first optimizer step."""

    def body(rank, group):
        m = FakeManager(group, rank)
        model = Scalar(1.0)
        inner = torch.optim.SGD(model.parameters(), lr=0.5)
        seen = {}
        with _wrap(algorithm, m, model, inner):
            seen["after enter"] = m.quorums
            model()
            seen["after first forward"] = m.quorums
            model()
            seen["after second forward"] = m.quorums
        with _wrap(algorithm, m, model, inner):
            model.w.grad = torch.ones_like(model.w)
            before = m.quorums
            inner.step()  # no forward first: the join precedes the update
            seen["step without forward"] = m.quorums - before
        return seen

    (seen,) = run_replicas(1, body)
    assert seen == {
        "after enter": 0,
        "after first forward": 1,
        "after second forward": 1,
        "step without forward": 1,
    }
