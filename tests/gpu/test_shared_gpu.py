"""Two ranks of one group on one GPU: NCCL cannot make that communicator, so the ft backend
carries the lane's CUDA collectives host-staged over Gloo (or refuses them, on request).

The two ranks are threads of this process, each with its own ft process group, both on
cuda:0. The staging itself (copies, Gloo, copy back of the outputs only) is also tested on CPU
tensors in tests/backend/test_collectives.py::test_host_staged_collectives_match_torch_gloo.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.gpu._util import Store

WORLD = 2


@pytest.fixture(scope="module")
def store():
    return Store()


def run_ranks(fn, timeout_s: float = 60.0):
    results: dict = {}

    def one(rank: int) -> None:
        torch.cuda.set_device(0)
        try:
            results[rank] = fn(rank)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            results[rank] = e

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
    return [results[r] for r in range(WORLD)]


def test_two_ranks_on_one_gpu_run_host_staged(store):
    import ft

    addr = store.addr()

    def rank_fn(rank: int):
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=30))
        pg.configure(addr, "shared", rank, WORLD)
        try:
            t = torch.full((1 << 20,), float(rank + 1), device="cuda")
            pg.allreduce([t], dist.AllreduceOptions()).wait()
            avg = torch.full((4,), float(rank), device="cuda")
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.AVG
            pg.allreduce([avg], opts).wait()
            outs = [[torch.zeros(3, device="cuda") for _ in range(WORLD)]]
            src = torch.full((3,), float(rank), device="cuda")
            pg.allgather(outs, [src]).wait()
            torch.cuda.synchronize()
            return {
                "sum": t.cpu(),
                "avg": avg.cpu(),
                "gathered": [x.cpu() for x in outs[0]],
                "src": src.cpu(),
                "staged": pg.backend.host_staged_ops,
            }
        finally:
            pg.shutdown()

    results = run_ranks(rank_fn)
    for rank, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert torch.equal(r["sum"], torch.full((1 << 20,), 3.0))
        assert torch.equal(r["avg"], torch.full((4,), 0.5))
        assert [x.tolist() for x in r["gathered"]] == [[0.0] * 3, [1.0] * 3]
        assert torch.equal(r["src"], torch.full((3,), float(rank)))  # inputs are not written
        assert r["staged"] == 3


def test_shared_gpu_error_policy_refuses_with_the_ranks_named(store):
    import ft

    addr = store.addr()

    def rank_fn(rank: int):
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=30), shared_gpu="error")
        pg.configure(addr, "shared-error", rank, WORLD)
        try:
            with pytest.raises(ValueError, match="ranks 0 and 1 are on one GPU"):
                pg.allreduce([torch.ones(4, device="cuda")], dist.AllreduceOptions())
            # The refusal sent nothing: the group stays usable for CPU tensors.
            t = torch.ones(2)
            pg.allreduce([t], dist.AllreduceOptions()).wait()
            return t
        finally:
            pg.shutdown()

    for r in run_ranks(rank_fn):
        assert not isinstance(r, BaseException), r
        assert torch.equal(r, torch.full((2,), 2.0))
