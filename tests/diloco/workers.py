"""Child-process workers for tests/diloco (run by tests/procs.py)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import ft
from ft.collectives import BucketedAllreduce, allreduce_quantized

ADDR = "127.0.0.1"


def wchar() -> int:
    """Bytes this process has written with write()/writev() (Gloo's sockets)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def _group(rank, world_size, port, lanes=2):
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=20), num_lanes=lanes)
    pg.configure(f"{ADDR}:{port}/diloco", "test", rank, world_size)
    return pg


def _mixed(rank):
    g = torch.Generator().manual_seed(rank)
    return [
        torch.randn(3, 3, generator=g),
        torch.randn(3, 3, generator=g),
        torch.randn(11, generator=g, dtype=torch.float64),  # larger than the cap
        torch.randint(-9, 9, (5,), generator=g).to(torch.int32),
        torch.randn(2, generator=g).to(torch.bfloat16),
        torch.randn(1, generator=g),
    ]


def bucketed(rank, world_size, port, cap_bytes_list):
    """Bucketed SUM vs one plain allreduce per tensor, for several caps."""
    pg = _group(rank, world_size, port)
    out = {}
    for cap in cap_bytes_list:
        got = _mixed(rank)
        h = BucketedAllreduce(got, lambda b: pg.allreduce([b]), cap)
        h.wait()
        want = _mixed(rank)
        for t in want:
            pg.allreduce([t]).wait()
        out[cap] = (h.num_buckets, all(torch.equal(a, b) for a, b in zip(got, want)))
    return out


def quantized(rank, world_size, port, n, lane_index=1, wire="int8"):
    """Quantized vs fp32 allreduce (SUM and AVG) and the bytes each sends."""
    wire_dtype = getattr(torch, wire)
    pg = _group(rank, world_size, port)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, generator=g)
    res = {}
    with ft.lane(lane_index):
        pg.allreduce([torch.zeros(8)]).wait()  # warm the lane
        for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
            ref = x.clone()
            b0 = wchar()
            pg.allreduce([ref]).wait()
            fp32_bytes = wchar() - b0
            if op == dist.ReduceOp.AVG:
                ref /= world_size
            parts = [x[: n // 3].clone(), x[n // 3 :].clone().to(torch.float64)]
            b0 = wchar()
            allreduce_quantized(parts, op, pg, wire_dtype=wire_dtype).wait()
            q_bytes = wchar() - b0
            got = torch.cat([parts[0], parts[1].float()])
            err = ((got - ref).abs().mean() / ref.abs().mean()).item()
            res[name] = dict(
                err=err, fp32_bytes=fp32_bytes, q_bytes=q_bytes, digest=got.double().sum().item()
            )
    return res
