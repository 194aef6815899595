"""Worker functions (run in child processes by tests/procs.py) for the torchft-surface tests."""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, List

import torch
import torch.distributed as dist

import ft
from ft.collectives import allocate_reduce_scatter_output, reduce_scatter_quantized

SHAPES = [(5,), (3, 4), (7, 2)]


def rs_inputs(rank: int) -> List[torch.Tensor]:
    """Rank ``rank``'s inputs (deterministic, so the test can recompute every rank's)."""
    g = torch.Generator().manual_seed(7000 + rank)
    return [torch.randn(*shape, generator=g) * (1 + i) for i, shape in enumerate(SHAPES)]


def reduce_scatter_quantized_vs_plain(rank: int, world_size: int, port: int) -> Dict[str, object]:
    """The quantized reduce-scatter (SUM and AVG) next to a plain fp32 reduce-scatter of the
    same padded layout, on an ft group."""
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20))
    pg.configure(f"127.0.0.1:{port}/rs", "test", rank, world_size)
    inputs = rs_inputs(rank)
    out: Dict[str, object] = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        output, padded = allocate_reduce_scatter_output(inputs, world_size)
        work = reduce_scatter_quantized(output, inputs, op, pg)
        work.wait()
        out[name] = output.clone()
    # The plain reference: row d of `send` is rank d's share (its rows of each padded input).
    shares = [s.numel() // world_size for s in padded]
    send = torch.zeros(world_size, sum(shares))
    off = 0
    for t, size, share in zip(inputs, padded, shares):
        rows = torch.zeros(size)
        rows[: t.shape[0]] = t.reshape(t.shape[0], *size[1:])
        send[:, off : off + share] = rows.view(world_size, share)
        off += share
    plain = torch.empty(sum(shares))
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg._reduce_scatter_base(plain, send.view(-1), opts).wait()
    out["plain_sum"] = plain
    out["padded"] = [tuple(s) for s in padded]
    pg.shutdown()
    return out
