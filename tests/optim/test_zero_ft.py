"""FaultTolerantZeroRedundancyOptimizer: real lighthouse, Managers and processes (kill -9)."""

from __future__ import annotations

import signal
from typing import Any, Dict, List, Tuple

import torch

from tests.manager.inproc import lighthouse, make_manager
from tests.optim._zero_ft_worker import batch, make_model, round_grad
from tests.procs import free_port, wait_progress

TARGET = "tests.optim._zero_ft_worker:train"
RTOL, ATOL = 1e-4, 1e-6  # averaged gradients are (g+..+g)/N, not bitwise g


def reference(steps: int, exact_grads: bool = False) -> List[Dict[str, Any]]:
    """Plain Adam over the whole model: params and per-index state after each step (with the
    workers' gradient rounding if ``exact_grads``)."""
    model = make_model()
    if exact_grads:
        for p in model.parameters():
            p.register_hook(round_grad)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    out = [{"params": [p.detach().clone() for p in params], "state": {}}]
    for s in range(steps):
        opt.zero_grad()
        x, y = batch(s)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        out.append(
            {
                "params": [p.detach().clone() for p in params],
                "state": {
                    i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params)
                },
            }
        )
    return out


def assert_state_close(
    got: Dict[str, Any], want: Dict[str, Any], what: str, exact: bool = False
) -> None:
    """``step`` bitwise, the other entries within RTOL/ATOL (bitwise too with ``exact``)."""
    assert got.keys() == want.keys(), (what, got.keys(), want.keys())
    for k, v in want.items():
        if exact or k == "step":
            assert torch.equal(got[k], v), (what, k, got[k], v)
        else:
            torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=what)


def test_failed_commit_leaves_state_untouched() -> None:
    from ft.optim import FaultTolerantZeroRedundancyOptimizer

    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "solo", use_async_quorum=False)
    try:
        model = make_model()
        opt = FaultTolerantZeroRedundancyOptimizer(m, model.parameters(), torch.optim.Adam, lr=1e-2)
        params = list(model.parameters())

        def grads(step: int) -> None:
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()

        grads(0)
        opt.step()  # committed: state exists
        assert m.current_step() == 1
        before_p = [p.detach().clone() for p in params]
        before_s = opt.shard_state("all")
        grads(1)
        real = m.should_commit

        def failing(timeout: Any = None) -> bool:  # the owned shard was already stepped
            m.report_error(RuntimeError("injected"))
            return real(timeout)

        m.should_commit = failing  # type: ignore[method-assign]
        opt.step()
        m.should_commit = real  # type: ignore[method-assign]
        assert m.current_step() == 1
        for a, b in zip(before_p, params):
            assert torch.equal(a, b)
        after_s = opt.shard_state("all")
        assert after_s.keys() == before_s.keys()
        for i in before_s:
            for k, v in before_s[i].items():
                assert torch.equal(v, after_s[i][k]), (i, k)
        # the retried step gives exactly the plain-Adam result (N=1: gradients are not averaged)
        grads(1)
        opt.step()
        assert m.current_step() == 2
        ref = reference(2)
        for a, b in zip(ref[2]["params"], params):
            assert torch.equal(a, b)
        for i, st in opt.shard_state("owned").items():
            for k, v in ref[2]["state"][i].items():
                assert torch.equal(st[k], v), (i, k)
    finally:
        m.shutdown(wait=False)
        lh.shutdown()


def kill_restart(replicas, **worker_kw: Any) -> Tuple[List[Dict[str, Any]], int, int]:
    """3 replica groups train; replica 1 is killed with SIGKILL mid-run, the other two go on
    for 3 steps, then it restarts (new port), heals and all three train 3 more steps.
    Returns the survivors' and the restarted replica's results, the step at the kill and the
    final step."""
    n = 3
    keys = [f"step/{r}" for r in range(n)]
    ports = [free_port() for _ in range(n)]
    w = replicas(
        TARGET,
        n,
        ranks=[],
        lighthouse=dict(min_replicas=1, heartbeat_timeout_ms=1500, join_timeout_ms=500),
        **worker_kw,
    )
    store = w.store
    for r in range(n):
        w.spawn(r, port=ports[r])
    wait_progress(store, keys, 4, 90, w)
    victim = w.by_rank(1)
    victim.signal(signal.SIGKILL)
    victim.proc.wait(10)
    kill_step = max(int(store.get(k)) for k in keys)
    survivors = [keys[0], keys[2]]
    wait_progress(store, survivors, kill_step + 3, 60, w)
    store.delete_key("step/1")
    w.spawn(1, port=free_port())
    wait_progress(store, keys, kill_step + 4, 60, w)
    stop = max(int(store.get(k)) for k in keys) + 3
    store.set("stop_at", str(stop))
    live = [c for c in w.children if c is not victim]
    return w.join(60, live), kill_step, stop


def check_shards(
    results: List[Dict[str, Any]], ref: List[Dict[str, Any]], kill_step: int, stop: int, exact: bool
) -> None:
    """What every kill-restart run must show (``assert_state_close(..., exact)``):

    - staleness bound 0: every shard entry any replica holds after a committed step (owned
      and buddy copy alike) is the no-failure reference's state at that very step;
    - every replica ends at ``stop`` with all three participating, the final owned shards hold
      each parameter exactly once, and together they are the reference's final state;
    - the restarted replica healed: it did not start over from step 0."""
    P = len(ref[0]["params"])
    for res in results:
        assert res["history"], res["rank"]
        for h in res["history"]:
            for which in ("owned", "standby"):
                for i, st in h[which].items():
                    assert_state_close(
                        st,
                        ref[h["step"]]["state"][i],
                        f"replica {res['rank']} step {h['step']} {which} {i}",
                        exact,
                    )
    assert {r["step"] for r in results} == {stop}
    final = [r["history"][-1] for r in results]
    assert all(h["step"] == stop and h["n"] == 3 for h in final), [
        (h["step"], h["n"]) for h in final
    ]
    union: Dict[int, Any] = {}
    for h in final:
        for i, st in h["owned"].items():
            assert i not in union
            union[i] = st
    assert sorted(union) == list(range(P))
    for i, st in union.items():
        assert_state_close(st, ref[stop]["state"][i], f"final union {i}", exact)
    restarted = [r for r in results if r["rank"] == 1][0]
    assert restarted["history"][0]["step"] > kill_step


def test_kill_restart_keeps_every_shard(replicas) -> None:
    results, kill_step, stop = kill_restart(replicas)
    ref = reference(stop)
    P = len(ref[0]["params"])
    check_shards(results, ref, kill_step, stop, exact=False)
    # While one replica was down, the two survivors together held every parameter's state.
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    for res in results:
        for h in res["history"]:
            by_step.setdefault(h["step"], []).append(h)
    two = [
        s
        for s, hs in by_step.items()
        if s > kill_step and all(h["n"] == 2 for h in hs) and len(hs) == 2
    ]
    assert two, sorted((s, [h["n"] for h in hs]) for s, hs in by_step.items())
    for s in two:
        owned = [i for h in by_step[s] for i in h["owned"]]
        assert sorted(owned) == list(range(P)), (s, owned)
        for h in by_step[s]:  # and each also held the other's shard (the buddy copy, N=2)
            assert sorted(list(h["owned"]) + list(h["standby"])) == list(range(P))
    # End: identical parameters everywhere, equal to the reference.
    for r in results[1:]:
        for a, b in zip(results[0]["params"], r["params"]):
            assert torch.equal(a, b)
    for a, b in zip(results[0]["params"], ref[stop]["params"]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # 3 -> 2 replicas moved state to the new owners/buddies (the restarted replica may get
    # all it needs from its heal: with N=2 each survivor holds every shard)
    assert sum(r["stats"]["migrated_bytes"] for r in results) > 0


def test_kill_restart_overlap_bitwise(replicas) -> None:
    """The overlapped mode (FaultTolerantZeroDDP, 3 buckets, staging during backward), one
    replica killed with SIGKILL while it trains (often mid-backward, with staged shards and
    exchanges in flight), restarted, healed. The gradients are rounded to bfloat16 precision
    (exactly averaged over 2 or 3 replicas), so the fault-free reference is plain Adam and
    every comparison is bitwise: every shard (owned and buddy copy) after every committed
    step on every replica, the final parameters on every replica, and the consolidated final
    state."""
    results, kill_step, stop = kill_restart(
        replicas,
        overlap=True,
        exact_grads=True,
        bucket_cap_mb=0.0001,
        step_sleep=0.02,
        backward_sleep=0.03,
    )
    ref = reference(stop, exact_grads=True)
    staged = [(r["rank"], h["step"], h["staged"]) for r in results for h in r["history"]]
    assert all(n == 3 for _, _, n in staged), staged  # overlap was on
    check_shards(results, ref, kill_step, stop, exact=True)
    assert any(h["n"] == 2 for res in results for h in res["history"])  # it ran degraded
    for r in results:
        for a, b in zip(r["params"], ref[stop]["params"]):
            assert torch.equal(a, b), r["rank"]


def test_functional_optimizer_refused() -> None:
    """A functional optimizer needs explicit gradients, which this class never passes (it
    steps torch.optim optimizers, also with overlap): refused with torch's error type."""
    import pytest

    from ft.optim import FaultTolerantZeroRedundancyOptimizer, FunctionalAdam

    params = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="functional optimizer"):
        FaultTolerantZeroRedundancyOptimizer(None, params, FunctionalAdam, lr=0.1)
