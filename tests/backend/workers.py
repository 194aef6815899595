"""Worker functions run in child processes by tests/procs.py."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore

import ft
from tests.procs import connect_store

ADDR = "127.0.0.1"


def ft_group(rank, world_size, port, prefix="g0", timeout_s=20.0, num_lanes=2):
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s), num_lanes=num_lanes)
    pg.configure(f"{ADDR}:{port}/{prefix}", "test", rank, world_size)
    return pg


def _data(rank, world_size, dtype, n=7, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 3).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _run_cases(pg, rank, ws, dtype):
    """Every collective once; returns {name: output tensors}. AVG is checked
    against SUM / world_size computed the same way."""
    out = {}
    R = dist.ReduceOp
    ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX] + ([R.AVG] if dtype.is_floating_point else [])
    for op in ops:
        t = _data(rank, ws, dtype)
        if op == R.AVG and not getattr(pg, "_is_ft", False):
            pg.allreduce([t], dist.AllreduceOptions()).wait()  # SUM
            t.div_(ws)
        else:
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            pg.allreduce([t], opts).wait()
        out[f"allreduce_{op}"] = [t]
    ts = [_data(rank, ws, dtype, n=5, salt=1), _data(rank, ws, dtype, n=3, salt=2)]
    pg.allreduce_coalesced(ts, dist.AllreduceCoalescedOptions()).wait()
    out["allreduce_coalesced"] = ts
    for root in range(ws):
        t = _data(rank, ws, dtype, salt=3)
        o = dist.BroadcastOptions()
        o.rootRank = root
        pg.broadcast([t], o).wait()
        out[f"broadcast_{root}"] = [t]
        t = _data(rank, ws, dtype, salt=4)
        o = dist.ReduceOptions()
        o.rootRank = root
        pg.reduce([t], o).wait()
        if rank == root:
            out[f"reduce_{root}"] = [t]
    outs = [[torch.zeros(7, dtype=dtype) for _ in range(ws)]]
    pg.allgather(outs, [_data(rank, ws, dtype)]).wait()
    out["allgather"] = outs[0]
    big = torch.zeros(7 * ws, dtype=dtype)
    pg._allgather_base(big, _data(rank, ws, dtype)).wait()
    out["all_gather_into_tensor"] = [big]
    # gather / scatter to/from root 0
    o = dist.GatherOptions()
    o.rootRank = 0
    gouts = [[torch.zeros(7, dtype=dtype) for _ in range(ws)]] if rank == 0 else []
    pg.gather(gouts, [_data(rank, ws, dtype, salt=5)], o).wait()
    if rank == 0:
        out["gather"] = gouts[0]
    o = dist.ScatterOptions()
    o.rootRank = 0
    sout = torch.zeros(7, dtype=dtype)
    sin = [[_data(r, ws, dtype, salt=6) for r in range(ws)]] if rank == 0 else []
    pg.scatter([sout], sin, o).wait()
    out["scatter"] = [sout]
    rs_out = torch.zeros(4, dtype=dtype)
    pg.reduce_scatter([rs_out], [[_data(rank, ws, dtype, n=4, salt=7 + r) for r in range(ws)]],
                      dist.ReduceScatterOptions()).wait()
    out["reduce_scatter"] = [rs_out]
    rsb = torch.zeros(4, dtype=dtype)
    pg._reduce_scatter_base(rsb, _data(rank, ws, dtype, n=4 * ws, salt=8),
                            dist.ReduceScatterOptions()).wait()
    out["reduce_scatter_tensor"] = [rsb]
    a2a_out = torch.zeros(3 * ws, dtype=dtype)
    pg.alltoall_base(a2a_out, _data(rank, ws, dtype, n=3 * ws, salt=9), [], [],
                     dist.AllToAllOptions()).wait()
    out["all_to_all_single"] = [a2a_out]
    # send/recv around a ring
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    recv_t = torch.zeros(6, dtype=dtype)
    sw = pg.send([_data(rank, ws, dtype, n=6, salt=10)], nxt, 3)
    rw = pg.recv([recv_t], prv, 3)
    sw.wait()
    rw.wait()
    out["send_recv"] = [recv_t]
    pg.barrier().wait()
    return out


def collectives_vs_gloo(rank, world_size, port, dtypes):
    store = connect_store(port)
    pg = ft_group(rank, world_size, port)
    pg._is_ft = True
    ref = dist.ProcessGroupGloo(PrefixStore("ref", store), rank, world_size, timedelta(seconds=20))
    report = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        got = _run_cases(pg, rank, world_size, dtype)
        want = _run_cases(ref, rank, world_size, dtype)
        assert got.keys() == want.keys()
        for case in got:
            same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got[case], want[case]))
            report[f"{name}/{case}"] = same
    return report


def torch_api_on_ft(rank, world_size, port, init_method=None):
    """init_process_group("ft") and torch's own collective functions."""
    if init_method:
        dist.init_process_group("ft", init_method=init_method, rank=rank, world_size=world_size)
    else:
        store = connect_store(port)
        dist.init_process_group("ft", store=PrefixStore("default", store), rank=rank,
                                world_size=world_size)
    try:
        res = {"backend": dist.get_backend(), "size": dist.get_world_size(), "rank": dist.get_rank()}
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        res["all_reduce"] = t
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        res["avg"] = t
        lst = [torch.zeros(2) for _ in range(world_size)]
        dist.all_gather(lst, torch.full((2,), float(rank)))
        res["all_gather"] = torch.stack(lst)
        o = torch.zeros(2 * world_size)
        dist.all_gather_into_tensor(o, torch.full((2,), float(rank)))
        res["all_gather_into_tensor"] = o
        o = torch.zeros(2)
        dist.reduce_scatter_tensor(o, torch.arange(2.0 * world_size))
        res["reduce_scatter_tensor"] = o
        o = torch.zeros(2)
        dist.reduce_scatter(o, [torch.full((2,), float(r)) for r in range(world_size)])
        res["reduce_scatter"] = o
        b = torch.full((2,), float(rank))
        dist.broadcast(b, src=world_size - 1)
        res["broadcast"] = b
        a2a = torch.zeros(world_size)
        dist.all_to_all_single(a2a, torch.arange(float(world_size)) + 10 * rank)
        res["all_to_all_single"] = a2a
        r = torch.full((2,), float(rank + 1))
        dist.reduce(r, dst=0)
        res["reduce"] = r
        g = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
        dist.gather(torch.full((1,), float(rank)), g, dst=0)
        res["gather"] = None if g is None else torch.cat(g)
        s = torch.zeros(1)
        dist.scatter(s, [torch.full((1,), float(i)) for i in range(world_size)] if rank == 0 else None, src=0)
        res["scatter"] = s
        if rank == 0:
            dist.send(torch.full((2,), 7.0), dst=1)
        elif rank == 1:
            x = torch.zeros(2)
            dist.recv(x, src=0)
            res["recv"] = x
        dist.barrier()
        w = dist.all_reduce(torch.ones(1), async_op=True)
        res["future"] = w.get_future().wait()[0]
        res["completed"] = w.is_completed() and w.exception() is None
        return res
    finally:
        dist.destroy_process_group()


def _ddp_run(pg, steps=8, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    rank = pg.rank()
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        y = torch.randn(4, 2, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"params": [p.detach().clone() for p in model.parameters()], "losses": losses}


def ddp_ft_vs_gloo(rank, world_size, port):
    store = connect_store(port)
    pg = ft_group(rank, world_size, port)
    dist.init_process_group("ft", store=PrefixStore("default", store), rank=rank, world_size=world_size)
    ref = dist.new_group(backend="gloo")  # torch's own Gloo ProcessGroup
    try:
        return {
            "gloo": _ddp_run(ref),
            "ft_facade": _ddp_run(pg),
            "ft_init": _ddp_run(dist.group.WORLD),
        }
    finally:
        dist.destroy_process_group()
