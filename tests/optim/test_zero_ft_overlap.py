"""FaultTolerantZeroRedundancyOptimizer(overlap_with_ddp=True) with FaultTolerantZeroDDP, in
one process: two replica groups on threads (real lighthouse, Managers, Gloo), each training on
its own batches. The kill -9 test with real processes is in test_zero_ft.py.
"""

from __future__ import annotations

import threading
import types
from typing import Any, Dict, List, Optional

import pytest
import torch

from tests.manager.inproc import in_threads, lighthouse, make_manager, values
from tests.optim._zero_ft_worker import make_model

N = 2
STEPS = 5
BUCKET_MB = 0.0001  # 104 bytes: 3 DDP buckets, (2.bias, 2.weight), (0.bias,), (0.weight,)
_SEED = threading.Lock()  # make_model seeds the global generator: one thread at a time


def batch(step: int, replica: int):
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def snapshot(opt: Any, model: torch.nn.Module, manager: Any) -> Dict[str, Any]:
    return {
        "step": manager.current_step(),
        "params": [p.detach().clone() for p in model.parameters()],
        "all": opt.shard_state("all"),
        "owned": opt.owned_indices,
        "standby": opt.standby_indices,
    }


def run_pair(
    overlap: bool,
    fail_at: Optional[int] = None,
    interleaved: bool = True,
    local_error_at: Optional[int] = None,
):
    """N replica groups train STEPS iterations; at iteration ``fail_at`` every group reports an
    error just before its vote (after the overlapped staging ran), so the step does not
    commit. At iteration ``local_error_at`` group 0 alone reports one right after its forward
    pass (a NaN loss only it sees), before backward. Returns each group's snapshots: before
    the loop and after every ``step()``, with the Manager's error for the step."""
    import ft
    from ft.optim import FaultTolerantZeroDDP, FaultTolerantZeroRedundancyOptimizer

    lh = lighthouse(min_replicas=N)

    def replica(r: int) -> Dict[str, Any]:
        m = make_manager(lh.address(), f"ov{int(overlap)}-{r}", use_async_quorum=False)
        try:
            with _SEED:
                model = make_model()
            m.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
            opt = FaultTolerantZeroRedundancyOptimizer(
                m, model.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=1e-2
            )
            if overlap:
                ddp = FaultTolerantZeroDDP(
                    m, model, opt, interleaved=interleaved, bucket_cap_mb=BUCKET_MB
                )
            else:
                ddp = ft.DistributedDataParallel(m, model, bucket_cap_mb=BUCKET_MB)
            hist: List[Dict[str, Any]] = [snapshot(opt, model, m)]
            staged_in_backward: List[int] = []
            # Buckets staged when the first layer's weight gradient (the last one of backward,
            # alone in the last bucket) is being computed: the overlap with backward itself.
            mid: List[int] = []
            if overlap:
                model[0].weight.register_hook(lambda g: mid.append(len(opt.overlap.done)))
            for it in range(STEPS):
                opt.zero_grad()
                x, y = batch(m.current_step(), r)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                if it == local_error_at and r == 0:
                    m.report_error(RuntimeError("injected: a NaN loss seen by this group only"))
                loss.backward()
                staged_in_backward.append(len(opt.overlap.done) if overlap else 0)
                real = m.should_commit
                if it == fail_at:

                    def failing(timeout: Any = None, real: Any = real) -> bool:
                        m.report_error(RuntimeError("injected"))
                        return real(timeout)

                    m.should_commit = failing  # type: ignore[method-assign]
                opt.step()
                m.should_commit = real  # type: ignore[method-assign]
                hist.append(snapshot(opt, model, m))
                hist[-1]["errored"] = m.errored()
            return {"hist": hist, "staged": staged_in_backward, "mid": mid}
        finally:
            m.shutdown(wait=False)

    try:
        return values(in_threads([lambda r=r: replica(r) for r in range(N)], timeout=60))
    finally:
        lh.shutdown()


def assert_same(a: Dict[str, Any], b: Dict[str, Any], what: str) -> None:
    assert a["step"] == b["step"], what
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y), what
    assert a["all"].keys() == b["all"].keys(), what
    for i in a["all"]:
        assert a["all"][i].keys() == b["all"][i].keys(), (what, i)
        for k, v in a["all"][i].items():
            assert torch.equal(v, b["all"][i][k]), (what, i, k)


@pytest.mark.parametrize("interleaved", [True, False])
def test_overlap_equals_step_after_backward(interleaved: bool) -> None:
    """Bitwise (tolerance 0): every bucket's shards are stepped with the same kernels on the
    same averaged gradients as the step after backward, only earlier and into staging."""
    plain = run_pair(overlap=False)
    over = run_pair(overlap=True, interleaved=interleaved)
    for r in range(N):
        # every bucket was staged inside backward, before step(); interleaved, the first
        # while backward was still computing gradients
        assert over[r]["staged"] == [3] * STEPS, over[r]["staged"]
        assert over[r]["mid"] == [1 if interleaved else 0] * STEPS, over[r]["mid"]
        for s, (a, b) in enumerate(zip(plain[r]["hist"], over[r]["hist"])):
            assert_same(a, b, f"replica {r} after iteration {s}")
        last = over[r]["hist"][-1]
        assert last["step"] == STEPS
        assert sorted(last["owned"] + last["standby"]) == [0, 1, 2, 3]  # N=2: buddy of all
    for x, y in zip(over[0]["hist"][-1]["params"], over[1]["hist"][-1]["params"]):
        assert torch.equal(x, y)


def test_overlap_failed_commit_changes_nothing() -> None:
    """A step whose shards were stepped into staging during backward, then not committed:
    parameters, owned and standby state are bitwise as before it; training then continues
    exactly as a run whose step failed without overlap."""
    fail = 2
    over = run_pair(overlap=True, fail_at=fail)
    plain = run_pair(overlap=False, fail_at=fail)
    for r in range(N):
        before, after = over[r]["hist"][fail], over[r]["hist"][fail + 1]
        assert over[r]["staged"][fail] == 3  # the failed step did stage its buckets
        assert before["step"] == after["step"] == fail
        assert_same(before, after, f"replica {r}: failed step")
        assert before["standby"], "N=2: each replica holds a standby shard"
        for s, (a, b) in enumerate(zip(plain[r]["hist"], over[r]["hist"])):
            assert_same(a, b, f"replica {r} after iteration {s}")
        assert over[r]["hist"][-1]["step"] == STEPS - 1


@pytest.mark.parametrize("overlap", [False, True], ids=["after_backward", "overlapped"])
def test_error_on_one_group_fails_the_step_on_every_group_at_once(overlap: bool) -> None:
    """Group 0 alone reports an error (report_error: it leaves the process group usable). It
    still takes part in the step's parameter exchange, sending zeros, so group 1, which knows
    nothing of the error, is not left waiting for that exchange until its op timeout (10 s).
    Group 1 sees that participant 0 sent no stepped shards and refuses the step (committing
    it would take zeros for participant 0's shards); training goes on exactly as when every
    group fails the step (bitwise)."""
    fail = 2
    local = run_pair(overlap=overlap, local_error_at=fail)
    everywhere = run_pair(overlap=overlap, fail_at=fail)
    assert "NaN loss" in str(local[0]["hist"][fail + 1]["errored"])
    peer_error = str(local[1]["hist"][fail + 1]["errored"])
    assert "participant(s) [0] sent no stepped shards" in peer_error, peer_error
    for r in range(N):
        before, after = local[r]["hist"][fail], local[r]["hist"][fail + 1]
        assert before["step"] == after["step"] == fail
        assert_same(before, after, f"replica {r}: failed step")
        for s, (a, b) in enumerate(zip(everywhere[r]["hist"], local[r]["hist"])):
            assert_same(a, b, f"replica {r} after iteration {s}")
        assert local[r]["hist"][-1]["step"] == STEPS - 1
    assert_same(local[0]["hist"][-1], local[1]["hist"][-1], "the groups at the end")


def test_overlap_argument_checks() -> None:
    from ft.optim import (
        FaultTolerantZeroDDP,
        FaultTolerantZeroRedundancyOptimizer,
        ZeroRedundancyOptimizer,
    )

    params = [torch.nn.Parameter(torch.ones(2))]
    # Async quorum: the layout could not be fixed before backward (see the docstring).
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        FaultTolerantZeroRedundancyOptimizer(
            types.SimpleNamespace(use_async_quorum=True),
            params,
            torch.optim.Adam,
            overlap_with_ddp=True,
            lr=0.1,
        )
    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "solo", use_async_quorum=False)
    try:
        model = make_model()
        plain = FaultTolerantZeroRedundancyOptimizer(m, model.parameters(), torch.optim.Adam)
        with pytest.raises(ValueError, match="overlap_with_ddp=True"):
            FaultTolerantZeroDDP(m, model, plain)
        with pytest.raises(TypeError, match="FaultTolerantZeroRedundancyOptimizer"):
            FaultTolerantZeroDDP(m, model, ZeroRedundancyOptimizer)
        over = FaultTolerantZeroRedundancyOptimizer(
            m, model.parameters(), torch.optim.Adam, overlap_with_ddp=True, state_key="z2"
        )
        with pytest.raises(ValueError, match="same Manager"):
            FaultTolerantZeroDDP(object(), model, over)
        ddp = FaultTolerantZeroDDP(m, model, over)
        with pytest.raises(ValueError, match="already attached"):
            FaultTolerantZeroDDP(m, model, over)
        # One backward pass per step: a second one through the hooks is refused.
        x = torch.randn(4, 16)
        over.zero_grad()
        ddp(x).sum().backward()
        with pytest.raises(RuntimeError, match="ready twice"):
            ddp(x).sum().backward()
    finally:
        m.shutdown(wait=False)
        lh.shutdown()
