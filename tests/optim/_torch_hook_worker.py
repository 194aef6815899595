"""A rank that hands ft's ZeroRedundancyOptimizer to torch's own DDP-overlap hooks (run by
tests/optim/test_zero_overlap.py through tests.procs.Workers)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn


def torch_hooks_refused(rank: int, world_size: int, port: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
        hook_with_zero_step,
        hook_with_zero_step_interleaved,
    )
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ft  # noqa: F401  (registers the "ft" backend)
    from ft.optim import ZeroRedundancyOptimizer

    from tests.procs import connect_store

    store = dist.PrefixStore("torch-hooks", connect_store(port))
    dist.init_process_group(
        "ft", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    try:
        torch.manual_seed(0)
        model = DDP(nn.Linear(4, 4))
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, lr=0.1, overlap_with_ddp=True
        )
        out = {}
        for name, make in (
            ("step", hook_with_zero_step),
            ("interleaved", hook_with_zero_step_interleaved),
        ):
            try:
                model.register_comm_hook(None, make(allreduce_hook, model, zero))
                out[name] = "registered"
            except TypeError as e:
                out[name] = str(e)
        # Nothing ran inside backward, and the model still trains with ft's own hooks.
        from ft.optim.zero_hooks import hook_with_zero_step as ft_hook

        model.register_comm_hook(None, ft_hook(allreduce_hook, model, zero))
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            zero.step()
        out["trained"] = True
        return out
    finally:
        dist.destroy_process_group()
