"""ft.optim.post_localsgd: PostLocalSGDOptimizer, PeriodicModelAverager (bitwise torch's on the
"ft" backend) and FaultTolerantModelAverager (in-thread FakeManager units; real processes,
lighthouse and Managers for kill -9 + restart). Every wait is bounded, every child reaped."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
from torch import nn

from ft.optim.post_localsgd import (
    STATE_KEY,
    FaultTolerantModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
)
from tests.diloco.fake_manager import FakeGroup, FakeManager, run_replicas
from ft.utils.deadline import Deadline
from tests.procs import Workers, kill_at_counter, max_step, wait_progress

WORKER = "tests.optim._post_localsgd_worker"

# Importing torch.distributed.optim scripts its functional optimizers, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


# --------------------------------------------------------------------------- optimizer wrapper


class _RecordingAverager:
    def __init__(self) -> None:
        self.step = 0
        self.calls: List[Any] = []

    def average_parameters(self, params) -> None:
        self.calls.append(params)
        self.step += 1


def _model_opt():
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def test_optimizer_steps_then_averages_param_groups():
    m, inner = _model_opt()
    avg = _RecordingAverager()
    opt = PostLocalSGDOptimizer(inner, avg)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults and repr(opt) == repr(inner)
    before = m.weight.detach().clone()
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert not torch.equal(before, m.weight)  # the local step ran ...
    assert avg.calls == [inner.param_groups]  # ... then the averager got the param groups
    opt.zero_grad()
    assert m.weight.grad is None
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    assert opt.param_groups[-1]["params"] == [extra]


def test_state_dict_carries_the_averager_step_and_lr_schedulers_work():
    m, inner = _model_opt()
    avg = _RecordingAverager()
    opt = PostLocalSGDOptimizer(inner, avg)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    sd = opt.state_dict()
    assert sd["step"] == 3 and set(sd) == {"state", "param_groups", "step"}

    m2, inner2 = _model_opt()
    opt2 = PostLocalSGDOptimizer(inner2, _RecordingAverager())
    opt2.load_state_dict(sd)
    assert opt2.averager.step == 3
    assert torch.equal(
        inner2.state_dict()["state"][0]["momentum_buffer"], sd["state"][0]["momentum_buffer"]
    )
    no_step = {k: v for k, v in sd.items() if k != "step"}
    with pytest.warns(UserWarning, match="no averager step counter"):
        opt2.load_state_dict(no_step)
    assert opt2.averager.step == 0


def test_bad_arguments():
    m, inner = _model_opt()
    with pytest.raises(TypeError, match="torch.optim.Optimizer instance"):
        PostLocalSGDOptimizer(m, _RecordingAverager())
    with pytest.raises(TypeError, match="model averager"):
        PostLocalSGDOptimizer(inner, object())
    group = object()  # a non-None group: no default process group needed for these checks
    with pytest.raises(ValueError, match="period must be an int >= 1, got 0"):
        PeriodicModelAverager(0, process_group=group)
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 0, got -1"):
        PeriodicModelAverager(2, -1, process_group=group)
    with pytest.warns(UserWarning, match="period=1"):
        PeriodicModelAverager(1, process_group=group)
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            PeriodicModelAverager(2)
    avg = PeriodicModelAverager(2, process_group=group)
    with pytest.raises(ValueError, match="none of the given parameters has a .grad"):
        avg.average_parameters(m.parameters())  # due at step 0, but nothing has a gradient
    with pytest.raises(TypeError, match="parameters or optimizer param groups"):
        PeriodicModelAverager(2, process_group=group).average_parameters([3])


@pytest.mark.parametrize(
    "period,warmup,due",
    [
        (3, 0, [0, 3, 6, 9]),
        (3, 2, [2, 5, 8]),
        (4, 5, [5, 9]),
        (2, 1, [1, 3, 5, 7, 9]),
    ],
)
def test_schedule_is_torchs(monkeypatch, period, warmup, due):
    import ft.optim.post_localsgd as mod

    seen: List[int] = []
    avg = PeriodicModelAverager(period, warmup, process_group=object())
    monkeypatch.setattr(mod, "_average_flat", lambda params, group: seen.append(avg.step))
    for _ in range(10):
        avg.average_parameters([])
    assert seen == due and avg.step == 10


# --------------------------------------------------------------------------- FT averager, units


def _ft_replica(
    rank: int, group: FakeGroup, fail_calls=frozenset(), calls: int = 6, join: bool = False
) -> Dict[str, Any]:
    torch.manual_seed(rank)  # different weights per replica
    model = nn.Linear(3, 2)
    mgr = FakeManager(group, rank, fail_calls=set(fail_calls))
    avg = FaultTolerantModelAverager(mgr, model, period=2, warmup_steps=1)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), avg)
    sent: List[int] = []
    real_start = mgr.start_quorum

    def start_quorum(**kw):
        sent.append(mgr.state_fns[STATE_KEY][1]()["step"])  # what a healing peer would get
        real_start(**kw)

    mgr.start_quorum = start_quorum  # type: ignore[method-assign]
    if join:
        avg.join()
    trace = []
    for i in range(calls):
        x = torch.full((1, 3), float(rank + i))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        trace.append(
            (
                avg.step,
                avg.rounds,
                avg.last_committed,
                [p.detach().clone() for p in model.parameters()],
            )
        )
    return {
        "trace": trace,
        "sent": sent,
        "keys": sorted(mgr.state_fns),
        "mgr_step": mgr.step,
        "failed": avg.failed_rounds,
    }


def test_ft_rounds_follow_torchs_schedule_and_commit_everywhere():
    a, b = run_replicas(2, lambda r, g: _ft_replica(r, g))
    assert a["keys"] == ["FaultTolerantModelAverager", "LocalSGD"]
    # warmup 1, period 2: rounds at counters 1, 3, 5 -> after calls 2, 4, 6
    assert [t[1] for t in a["trace"]] == [0, 1, 1, 2, 2, 3]
    assert a["sent"] == [2, 4, 6]  # a healing peer gets the counter as it is after the round
    assert a["mgr_step"] == 3 and a["failed"] == 0
    for (sa, ra, ca, _), (sb, rb, cb, _) in zip(a["trace"], b["trace"]):
        assert (sa, ra, ca) == (sb, rb, cb)
    for i in (1, 3, 5):  # right after each round: both replicas hold the average
        assert all(torch.equal(x, y) for x, y in zip(a["trace"][i][3], b["trace"][i][3]))
    assert not all(torch.equal(x, y) for x, y in zip(a["trace"][2][3], b["trace"][2][3]))


def test_ft_failed_round_is_applied_nowhere():
    # 2 tensors per round; allreduce call 2 is the first of round 2 (replica 0 fails it)
    a, b = run_replicas(2, lambda r, g: _ft_replica(r, g, fail_calls={2} if r == 0 else ()))
    assert [t[2] for t in a["trace"]][1::2] == [True, False, True]
    assert a["failed"] == b["failed"] == 1 and a["mgr_step"] == b["mgr_step"] == 2
    after_first, after_failed = a["trace"][1][3], a["trace"][3][3]
    # the failed round restored the last committed average on both replicas
    assert all(torch.equal(x, y) for x, y in zip(after_first, after_failed))
    assert all(torch.equal(x, y) for x, y in zip(after_failed, b["trace"][3][3]))
    assert [t[0] for t in a["trace"]] == [t[0] for t in b["trace"]] == [1, 2, 3, 4, 5, 6]


def test_ft_join_retries_until_a_round_commits():
    # replica 1 fails the first join round's allreduce: the join runs a second one
    a, b = run_replicas(
        2, lambda r, g: _ft_replica(r, g, fail_calls={0} if r == 1 else (), calls=2, join=True)
    )
    assert a["sent"][:2] == [0, 0]  # join rounds leave the counter alone
    assert a["failed"] == b["failed"] == 1 and a["mgr_step"] == 2
    assert all(torch.equal(x, y) for x, y in zip(a["trace"][1][3], b["trace"][1][3]))


def test_ft_join_gives_up_with_a_clear_error():
    def body(r, g):
        torch.manual_seed(0)
        avg = FaultTolerantModelAverager(FakeManager(g, r, fail_calls={0, 2}), nn.Linear(2, 1), 2)
        with pytest.raises(RuntimeError, match="2 averaging rounds in a row did not commit"):
            avg.join(max_attempts=2)
        return True

    assert run_replicas(2, body) == [True, True]


def test_ft_rejects_foreign_parameters_and_non_modules():
    mgr = FakeManager(FakeGroup(1), 0)
    model = nn.Linear(2, 1)
    avg = FaultTolerantModelAverager(mgr, model, period=2)
    with pytest.raises(ValueError, match=r"shape \(3,\) that is not a trainable parameter"):
        avg.average_parameters([nn.Parameter(torch.zeros(3))])
    assert avg.step == 0
    with pytest.raises(TypeError, match="nn.Module"):
        FaultTolerantModelAverager(FakeManager(FakeGroup(1), 0), list(model.parameters()), 2)
    frozen = nn.Linear(2, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        FaultTolerantModelAverager(FakeManager(FakeGroup(1), 0), frozen, 2)


# --------------------------------------------------------------------------- multi-process


def test_equivalence_with_torch_on_ft_backend():
    """ft's PostLocalSGDOptimizer + PeriodicModelAverager (and each mixed with torch's) vs
    torch's, 2 ranks over the "ft" backend, different data per rank, 10 steps with a 2-step
    warmup and period 3, an fp64 and a gradient-less parameter: bitwise equal after every
    step; then ft's optimizer resumes from torch's state dict without a new warmup."""
    with Workers(f"{WORKER}:equivalence", 2, steps=10, period=3, warmup=2) as w:
        r0, r1 = w.join(timeout=60)
    for rank, res in enumerate((r0, r1)):
        assert res["backend"] == "ft"
        for name, eq in res["per_step"].items():
            assert all(eq), (
                f"rank {rank} {name}: differs from torch at steps "
                f"{[i for i, e in enumerate(eq) if not e]}"
            )
        assert res["steps"] == {n: 10 for n in res["per_step"]} and res["torch_step"] == 10
        assert res["direct_equal"] and res["resume_equal"] and res["resumed_step"] == 10
        assert torch.equal(res["unused"], torch.full((4,), float(rank + 1)))  # never averaged
    # the last round is at step index 8; step 9 is local, so the ranks differ at the end
    assert not torch.equal(r0["params"]["l1.weight"], r1["params"]["l1.weight"])


def _kill_mid_period(store, w: Workers, rank: int, period: int, warmup: int, timeout: float) -> int:
    """SIGKILLs child ``rank`` between two rounds: at least one local step done since the last
    round and the call in progress not a round (``kill_at_counter``); returns its counter."""

    def mid(c: int) -> bool:  # c = the counter after the last completed call
        return c > warmup and (c - warmup) % period >= 2

    c = kill_at_counter(store, w.by_rank(rank), f"count/{rank}", mid, timeout)
    assert c is not None, f"group {rank} never reached the middle of a period within {timeout}s"
    return c


def _committed(res: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    return {r["step"]: r for r in res["rounds"] if r["committed"]}


def _wait_heartbeating(lh, n: int, timeout: float) -> None:
    deadline = Deadline.after(timeout)
    while sum(r["alive"] for r in lh.status()["replicas"]) < n:
        assert not deadline.expired, f"the lighthouse did not see {n} heartbeating groups"
        deadline.sleep(0.02)


def test_kill9_mid_period_restart_heals_and_all_groups_end_identical(replicas):
    """3 replica groups (ft.Manager, real lighthouse): one injected failed round, then group 1
    is killed -9 in the middle of a period and restarted with different initial weights. The
    failed round is applied nowhere, survivors keep averaging, the restarted group heals in
    its join round before its first local step, and all groups end bitwise identical."""
    period, warmup, fail_at = 4, 2, 2
    # join_timeout: the first quorum waits for all three groups even on a loaded machine (a
    # dead group stops counting once its heartbeat expires, after 1 s)
    keys = [f"step/{g}" for g in range(3)]
    survivors = [keys[0], keys[2]]
    w = replicas(
        f"{WORKER}:ft_train",
        3,
        lighthouse=dict(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=2000),
        period=period,
        warmup=warmup,
        step_sleep=0.03,
        fail_at=fail_at,
        wait_ready=3,
    )
    store = w.store
    _wait_heartbeating(w.lh, 3, 60)
    store.set("go", "1")
    wait_progress(store, keys, fail_at + 2, 60, w)  # past the failed round
    _kill_mid_period(store, w, 1, period, warmup, timeout=30)
    base = max_step(store, survivors)
    wait_progress(store, survivors, base + 2, 30, w)  # survivors average without it
    store.delete_key("step/1")
    store.delete_key("count/1")
    w.spawn(1, seed=1, wait_ready=0)
    spawned_at = max_step(store, survivors)
    wait_progress(store, keys, spawned_at + 1, 60, w)  # it joined a round with them
    store.set("stop_at", str(max_step(store, keys) + 2))
    g0, g1, g2 = w.join(60, [w.by_rank(0), w.by_rank(1), w.by_rank(2)])

    # All groups end bitwise identical: model, optimizer param groups, averager counter, step.
    assert g0["step"] == g1["step"] == g2["step"]
    for other in (g1, g2):
        for k, v in g0["model"].items():
            assert torch.equal(v, other["model"][k]), k
        assert other["opt_step"] == g0["opt_step"] and other["param_groups"] == g0["param_groups"]

    # Every committed round left the same model on every group that took part.
    c0, c1, c2 = _committed(g0), _committed(g1), _committed(g2)
    assert g0["joined"]["step"] == g2["joined"]["step"], (
        {k: v for k, v in g0["joined"].items() if "join" in k or k == "step"},
        {k: v for k, v in g2["joined"].items() if "join" in k or k == "step"},
    )
    assert set(c1) <= set(c0) and set(c0) == set(c2), (sorted(c0), sorted(c2))
    for s, r in c0.items():
        for other in (c1, c2):
            if s in other:
                assert other[s]["model"] == r["model"] and other[s]["counter"] == r["counter"], s

    # The injected failure: one failed round on each original group, applied nowhere (the
    # parameters went back to the previous round's average on both survivors).
    assert g0["injected"] == [fail_at]
    restored = []
    for g in (g0, g2):
        failed = [i for i, r in enumerate(g["rounds"]) if not r["committed"]]
        assert len(failed) == 1 and g["rounds"][failed[0]]["step"] == fail_at, g["rounds"]
        i = failed[0]
        assert g["rounds"][i]["model"] == g["rounds"][i - 1]["model"]
        restored.append(g["rounds"][i]["model"])
    assert restored[0] == restored[1]

    # Survivors averaged by themselves while group 1 was down, and with it afterwards.
    parts = [r["participants"] for r in g0["rounds"] if r["committed"]]
    assert 2 in parts and parts[-1] == 3, parts

    # The restarted group healed in its join round and never trained from a stale model.
    j = g1["joined"]
    assert j["loads"] >= 1 and j["step"] > base, j
    assert j["model"] == c0[j["step"]]["model"]  # the committed average of that round
    assert j["counter"] == c0[j["step"]]["counter"]
    assert g1["pre_step"][0] == j["model"]  # its first local step started from it
    assert j["inner"] in {c0[j["step"]]["inner"], c2[j["step"]]["inner"]}  # a survivor's Adam
