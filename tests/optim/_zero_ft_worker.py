"""Child process for tests/optim/test_zero_ft.py (run through tests.procs.Workers).

One replica group of one rank: ft.Manager (sync quorum) + ft.DistributedDataParallel +
FaultTolerantZeroRedundancyOptimizer(Adam). Every replica trains on the same batch per step
(it depends only on the step), so the averaged gradient does not depend on the participant
count and a plain single-process Adam run is the no-failure reference. After every committed
step the replica records its owned and standby shard state; progress goes to the test store
as ``step/{rank}``. Stops when the committed step reaches the store's ``stop_at``.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch

from tests.procs import connect_store


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


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
) -> Dict[str, Any]:
    import ft
    from ft.checkpointing import HTTPTransport
    from ft.optim import FaultTolerantZeroRedundancyOptimizer

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    store = connect_store(store_port)
    model = make_model()
    to = timedelta(seconds=10)
    pg = ft.ProcessGroupGloo(timeout=to)
    manager = ft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        use_async_quorum=False,
        timeout=to,
        quorum_timeout=timedelta(seconds=15),
        connect_timeout=to,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        lighthouse_addr=lh_addr,
        replica_id=f"r{rank}",
        hostname="127.0.0.1",
        checkpoint_transport=HTTPTransport(timeout=to, num_chunks=0, advertise_host="127.0.0.1"),
    )
    manager.register_state_dict_fn("model", model.load_state_dict, model.state_dict)
    ddp = ft.DistributedDataParallel(manager, model)
    opt = FaultTolerantZeroRedundancyOptimizer(
        manager, model.parameters(), torch.optim.Adam, lr=1e-2
    )
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
