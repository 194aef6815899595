"""Lane and stream semantics of the NCCL path."""

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

import ft
from tests.gpu._util import Store, nccl_pg, sleep_cycles, wait_until


@contextlib.contextmanager
def nccl_group(**kw: Any) -> Iterator[Any]:
    """A one-rank NCCL process group of ft (``kw``: ``nccl_pg``'s), shut down on exit."""
    pg = nccl_pg(Store(), **kw)
    try:
        yield pg
    finally:
        pg.shutdown()


def test_wait_does_not_block_cpu_and_events_order_streams():
    with nccl_group() as pg:
        x = torch.ones(1 << 20, device="cuda")
        # Load every kernel used below first: CUDA loads a kernel's module on its first
        # launch, which synchronizes the device and would block the CPU behind the sleep
        # (seen on the H200: the first x.mul_ waited out the whole sleep).
        dist.all_reduce(x.mul_(1) + 1, group=pg)
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles(1.0))  # caller's stream busy ~1 s
        x.mul_(2)  # queued behind the sleep: the op must see 2s
        t0 = time.monotonic()
        work = dist.all_reduce(x, group=pg, async_op=True)
        work.wait()  # stream-ordered: returns at once
        waited = time.monotonic() - t0
        y = x + 1  # on the caller's stream, after the op's completion event
        assert waited < 0.3, f"wait() blocked the CPU for {waited:.2f}s"
        assert not work.is_completed()
        torch.cuda.synchronize()
        assert torch.equal(y, torch.full_like(x, 3.0))
        assert wait_until(work.is_completed, 5.0)


def test_synchronize_blocks_cpu():
    with nccl_group() as pg:
        x = torch.ones(16, device="cuda")
        torch.cuda._sleep(sleep_cycles(0.5))
        work = dist.all_reduce(x, group=pg, async_op=True)
        t0 = time.monotonic()
        work.synchronize()
        assert time.monotonic() - t0 > 0.2
        assert work.is_completed()


def test_lanes_are_independent():
    with nccl_group(num_lanes=2) as pg:
        slow_stream = torch.cuda.Stream()
        a = torch.ones(1 << 16, device="cuda")
        b = torch.ones(1 << 16, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(slow_stream):
            torch.cuda._sleep(sleep_cycles(2.0))
            with ft.lane(0):
                slow = dist.all_reduce(a, group=pg, async_op=True)
        with ft.lane(1):
            fast = dist.all_reduce(b, group=pg, async_op=True)
        t0 = time.monotonic()
        fast.get_future().wait()
        took = time.monotonic() - t0
        assert took < 1.0, f"lane 1 waited {took:.2f}s behind lane 0"
        assert not slow.is_completed()
        torch.cuda.synchronize()
        assert wait_until(slow.is_completed, 5.0)


def test_future_is_cuda_aware():
    with nccl_group() as pg:
        x = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(sleep_cycles(0.3))
        fut = dist.all_reduce(x, group=pg, async_op=True).get_future()
        # A callback's value is ready on the stream it runs on.
        doubled = fut.then(lambda f: f.value()[0] * 2).wait()
        torch.cuda.synchronize()
        assert torch.equal(doubled, torch.full_like(x, 2.0))


def test_tensor_freed_while_op_in_flight_is_not_reused_early():
    with nccl_group() as pg:
        torch.cuda._sleep(sleep_cycles(0.5))
        x = torch.ones(1 << 20, device="cuda")
        work = dist.all_reduce(x, group=pg, async_op=True)
        ptr = x.data_ptr()
        del x  # recordStream keeps the block reserved for the lane stream
        y = torch.zeros(1 << 20, device="cuda")
        assert y.data_ptr() != ptr or work.is_completed()
        torch.cuda.synchronize()
