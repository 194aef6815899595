"""NCCL init deadlines, abort during init, and reconfigure leaks."""

import gc
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ft
from tests.gpu._util import Store, cpu_peer, nccl_pg, wait_until


def test_world2_init_missing_peer_aborts_at_deadline():
    store = Store()
    addr = store.addr()
    peer, _ = cpu_peer(addr, 1, 2)  # Gloo only: never joins the NCCL init
    pg = nccl_pg(store, timeout_s=5.0, configure=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="NCCL"):
        pg.configure(addr, "gpu-test", 0, 2)
    took = time.monotonic() - t0
    assert 3.0 < took < 15.0, took
    assert pg.errored() is not None
    # The group recovers with a reconfigure.
    pg.configure(store.addr(), "gpu-test", 0, 1)
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x, group=pg)
    torch.cuda.synchronize()
    assert pg.errored() is None and torch.equal(x.cpu(), torch.ones(4))
    pg.shutdown()


def test_abort_during_init():
    store = Store()
    addr = store.addr()
    cpu_peer(addr, 1, 2)
    pg = nccl_pg(store, timeout_s=60.0, configure=False)
    timer = threading.Timer(1.5, pg.abort)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        pg.configure(addr, "gpu-test", 0, 2)
    took = time.monotonic() - t0
    assert took < 10.0, f"abort() took {took:.1f}s to end the NCCL init"
    assert pg.errored() is not None
    pg.shutdown()


def test_lazy_init_missing_peer_fails_op_at_deadline():
    store = Store()
    addr = store.addr()
    cpu_peer(addr, 1, 2)
    pg = ft.ProcessGroupGloo(timeout=__import__("datetime").timedelta(seconds=4))
    pg.configure(addr, "gpu-test", 0, 2)  # no eager NCCL: the CUDA op connects
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(2, device="cuda"), group=pg)
    assert time.monotonic() - t0 < 12.0
    assert pg.errored() is not None
    pg.shutdown()


def test_50_reconfigures_leak_no_memory_or_streams():
    store = Store()
    pg = nccl_pg(store, num_lanes=2)
    x = torch.arange(1 << 16, device="cuda", dtype=torch.float32)

    def cycle():
        pg.configure(store.addr(), "gpu-test", 0, 1)
        for k in range(pg.num_lanes):
            with ft.lane(k):
                out = torch.zeros_like(x)  # only a gather that ran fills it
                dist.all_gather_into_tensor(out, x, group=pg)
                torch.cuda.synchronize()
                assert torch.equal(out, x), f"lane {k}'s gather did not run"

    def settled():
        gc.collect()
        return pg.backend._reaper_pending() == 0 and ft._C._nccl_live_streams() <= pg.num_lanes

    # Old generations' communicators are aborted by the reaper, up to 4 generations at a
    # time (ncclCommAbort: ~750 ms each on an H200; at most 4 wait there), so a tight loop
    # leaves a backlog to settle.
    for _ in range(10):  # warm-up: caches, NCCL's own one-time allocations
        cycle()
    assert wait_until(settled, 120.0)
    free0, _ = torch.cuda.mem_get_info()
    alloc0 = torch.cuda.memory_allocated()
    timings = []
    for _ in range(50):
        cycle()
        timings.append(pg.last_reconfigure_timings())
    t_settle = time.monotonic()
    assert wait_until(settled, 120.0), ft._C._nccl_live_streams()
    print(f"reaper settled {time.monotonic() - t_settle:.1f}s after the 50th reconfigure")
    free1, _ = torch.cuda.mem_get_info()
    assert torch.cuda.memory_allocated() == alloc0
    assert free0 - free1 < 256 << 20, f"device memory fell by {(free0 - free1) >> 20} MiB"
    assert torch.equal(x, torch.arange(1 << 16, device="cuda", dtype=torch.float32))
    assert all(t["nccl_ms"] > 0 for t in timings)
    med = sorted(t["total_ms"] for t in timings)[len(timings) // 2]
    print(f"reconfigure median total {med:.1f} ms; last {timings[-1]}")
    pg.shutdown()
