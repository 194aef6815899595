"""World-size-1 NCCL collectives on the ft backend, checked against torch ops."""

import pytest
import torch
import torch.distributed as dist

from tests.gpu._util import Store, nccl_pg

OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64]


@pytest.fixture(scope="module")
def store():
    return Store()


@pytest.fixture(scope="module")
def pg(store):
    pg = nccl_pg(store)
    yield pg
    pg.shutdown()


def sample(dtype, n=1000):
    g = torch.Generator(device="cpu").manual_seed(n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g).to(dtype)
    else:
        x = torch.randint(-50, 50, (n,), generator=g).to(dtype)
    return x.cuda()


def test_configured_eagerly_with_timings(pg):
    assert pg.backend.cuda_device == torch.cuda.current_device()
    t = pg.last_reconfigure_timings()
    assert t["nccl_ms"] > 0 and t["total_ms"] >= t["nccl_ms"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS), ids=str)
def test_allreduce(pg, op, dtype):
    x = sample(dtype)
    if op == "avg" and not dtype.is_floating_point:
        with pytest.raises(TypeError):
            dist.all_reduce(x.clone(), op=OPS[op], group=pg)
        return
    t = x.clone()
    dist.all_reduce(t, op=OPS[op], group=pg)
    torch.cuda.synchronize()
    # world size 1: every reduction of one contribution is that contribution
    expected = (
        torch.stack([x]).sum(0) if op != "avg" else torch.stack([x]).float().mean(0).to(dtype)
    )
    assert torch.equal(t, expected.to(dtype)), (op, dtype)


def test_allreduce_coalesced(pg):
    a, b = sample(torch.float32, 10), sample(torch.float32, 33)
    ta, tb = a.clone(), b.clone()
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce_coalesced([ta, tb], opts).wait()
    torch.cuda.synchronize()
    assert torch.equal(ta, a) and torch.equal(tb, b)


def test_all_gather_and_into_tensor(pg):
    x = sample(torch.float32, 64)
    out = [torch.empty_like(x)]
    dist.all_gather(out, x, group=pg)
    flat = torch.empty(64, device="cuda")
    dist.all_gather_into_tensor(flat, x, group=pg)
    torch.cuda.synchronize()
    assert torch.equal(out[0], x) and torch.equal(flat, x)


def test_reduce_scatter_and_tensor(pg):
    x = sample(torch.bfloat16, 64)
    out = torch.empty_like(x)
    dist.reduce_scatter(out, [x], group=pg)
    out2 = torch.empty_like(x)
    dist.reduce_scatter_tensor(out2, x, group=pg)
    torch.cuda.synchronize()
    assert torch.equal(out, x) and torch.equal(out2, x)


def test_broadcast_and_all_to_all(pg):
    x = sample(torch.int64, 12)
    b = x.clone()
    dist.broadcast(b, group_src=0, group=pg)  # src= is a global rank: needs a registered group
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=pg)
    out2 = torch.empty_like(x)
    dist.all_to_all_single(out2, x, output_split_sizes=[12], input_split_sizes=[12], group=pg)
    torch.cuda.synchronize()
    assert torch.equal(b, x) and torch.equal(out, x) and torch.equal(out2, x)


def test_barrier_and_future(pg):
    dist.barrier(group=pg, device_ids=[torch.cuda.current_device()])
    x = torch.ones(4, device="cuda")
    work = dist.all_reduce(x, group=pg, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(fut.wait(), torch.full((4,), 2.0, device="cuda"))


def test_lanes(pg):
    import ft

    for k in range(pg.num_lanes):
        with ft.lane(k):
            t = torch.full((8,), float(k), device="cuda")
            dist.all_reduce(t, group=pg)
            torch.cuda.synchronize()
            assert torch.equal(t, torch.full((8,), float(k), device="cuda"))


def test_cpu_and_cuda_on_one_group(pg):
    c = torch.ones(3)
    g = torch.ones(3, device="cuda")
    dist.all_reduce(c, group=pg)
    dist.all_reduce(g, group=pg)
    torch.cuda.synchronize()
    assert torch.equal(c, torch.ones(3)) and torch.equal(g.cpu(), torch.ones(3))


def test_unsupported_op_raises_before_sending(pg):
    x = torch.ones(3, device="cuda", dtype=torch.int32)
    with pytest.raises((NotImplementedError, RuntimeError)):
        dist.all_reduce(x, op=dist.ReduceOp.BAND, group=pg)
    assert pg.errored() is None
