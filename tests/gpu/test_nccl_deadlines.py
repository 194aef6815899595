"""One deadline: a CUDA op's own timeout, and the group's after set_timeout(), bound it on the
NCCL lane, not the timeout the group was created with."""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ft
from tests.gpu._util import Store, cpu_peer

CREATED_S = 60.0  # the group's timeout at creation: no op below may wait that long


def _fails_within(fn, low_s, high_s):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        fn()
    took = time.monotonic() - t0
    assert low_s < took < high_s, f"failed after {took:.1f}s, expected {low_s}-{high_s}s"


def test_per_op_timeout_and_set_timeout_reach_the_nccl_lane():
    store = Store()
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=CREATED_S))  # lanes connect lazily
    try:
        # Rank 1 is a CPU-only peer: it never joins the NCCL init, so the CUDA op's lazy
        # connect waits until the op's deadline.
        addr = store.addr()
        cpu_peer(addr, 1, 2)
        pg.configure(addr, "gpu-test", 0, 2)
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=2)
        _fails_within(lambda: pg.allreduce([torch.ones(2, device="cuda")], opts).wait(), 1.5, 12.0)
        assert "deadline" in str(pg.errored()), pg.errored()

        # set_timeout() after configure(): the next op (no timeout of its own) uses it.
        addr = store.addr()
        cpu_peer(addr, 1, 2)
        pg.configure(addr, "gpu-test", 0, 2)
        pg.set_timeout(timedelta(seconds=3))
        _fails_within(lambda: dist.all_reduce(torch.ones(2, device="cuda"), group=pg), 2.5, 13.0)
        assert "deadline" in str(pg.errored()), pg.errored()

        # The group recovers with a reconfigure.
        pg.configure(store.addr(), "gpu-test", 0, 1)
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x, group=pg)
        torch.cuda.synchronize()
        assert pg.errored() is None and torch.equal(x.cpu(), torch.ones(4))
    finally:
        pg.shutdown()
