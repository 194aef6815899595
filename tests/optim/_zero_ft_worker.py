"""Child process for tests/optim/test_zero_ft.py (run through tests.procs.Workers).

One replica group of one rank: ft.Manager (sync quorum) + ft.DistributedDataParallel +
FaultTolerantZeroRedundancyOptimizer(Adam). Every replica trains on the same batch per step
(it depends only on the step), so the averaged gradient does not depend on the participant
count and a plain single-process Adam run is the no-failure reference. After every committed
step the replica records its owned and standby shard state; progress goes to the test store
as ``step/{rank}``. Stops when the committed step reaches the store's ``stop_at``.

``overlap=True``: the optimizer is built with ``overlap_with_ddp=True`` and the model wrapped in
``FaultTolerantZeroDDP`` (``bucket_cap_mb`` small enough for several buckets), and
``backward_sleep`` seconds pass inside backward (in the hook of the first layer's weight, whose
bucket is the last: earlier buckets are staged and exchanged by then), so a kill lands
mid-backward as often as between backward and the vote. ``exact_grads=True`` rounds every
gradient to bfloat16 precision before it is averaged, so the average over 2 or 3 replicas of
identical gradients is exact and the run is bitwise the plain single-process Adam run.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List

import torch

from tests.manager.inproc import make_manager
from tests.procs import worker_store


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def round_grad(g: torch.Tensor) -> torch.Tensor:
    """``g`` with 8 significant bits: a sum of up to 4 copies of it is exact in fp32."""
    return g.to(torch.bfloat16).to(g.dtype)


def batch(step: int):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)


def train(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    port: int,
    step_sleep: float = 0.05,
    max_iters: int = 400,
    overlap: bool = False,
    exact_grads: bool = False,
    bucket_cap_mb: float = 25.0,
    backward_sleep: float = 0.0,
) -> Dict[str, Any]:
    import ft
    from ft.optim import FaultTolerantZeroDDP, FaultTolerantZeroRedundancyOptimizer

    store = worker_store(store_port)
    model = make_model()
    manager = make_manager(  # on Gloo, 10 s timeouts
        lh_addr,
        f"r{rank}",
        store_port=port,
        use_async_quorum=False,
        quorum_timeout=timedelta(seconds=15),
    )
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    if exact_grads:
        for p in model.parameters():
            p.register_hook(round_grad)
    if backward_sleep:
        model[0].weight.register_hook(lambda g: time.sleep(backward_sleep))
    opt = FaultTolerantZeroRedundancyOptimizer(
        manager, model.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=1e-2
    )
    if overlap:
        ddp = FaultTolerantZeroDDP(manager, model, opt, bucket_cap_mb=bucket_cap_mb)
    else:
        ddp = ft.DistributedDataParallel(manager, model, bucket_cap_mb=bucket_cap_mb)
    store.set(f"ready/{rank}", "1")
    history: List[Dict[str, Any]] = []
    stop_at = 10**9
    for _ in range(max_iters):
        if store.check(["stop_at"]):
            stop_at = int(store.get("stop_at"))
        if manager.current_step() >= stop_at:
            break
        opt.zero_grad()
        step = manager.current_step()
        x, y = batch(step)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        staged = len(opt.overlap.done) if overlap else 0  # buckets staged during backward
        if step_sleep:
            time.sleep(step_sleep)
        opt.step()
        if manager.current_step() == step + 1:
            history.append(
                {
                    "step": step + 1,
                    "n": manager.num_participants(),
                    "rank": manager.participating_rank(),
                    "owned": opt.shard_state("owned"),
                    "standby": opt.shard_state("standby"),
                    "bytes": opt.state_bytes(),
                    "staged": staged,
                }
            )
        store.set(f"step/{rank}", str(manager.current_step()))
    out = {
        "rank": rank,
        "step": manager.current_step(),
        "params": [p.detach().clone() for p in model.parameters()],
        "history": history,
        "stats": dict(opt.stats),
    }
    manager.shutdown(wait=False)
    return out
