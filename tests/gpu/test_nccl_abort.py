"""The abort contract on CUDA: nothing queued on a lane stream writes into a caller's tensor
after abort() (or the reconfigure that aborts in place) returned, and the Reaper aborts the
generations left to it concurrently."""

import statistics
import time

import pytest
import torch
import torch.distributed as dist

from tests.gpu._util import Store, nccl_pg, sleep_cycles, wait_until


@pytest.mark.parametrize("how", ["abort", "reconfigure"])
def test_no_write_into_outputs_after_abort_returns(how):
    store = Store()
    pg = nccl_pg(store)
    try:
        x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
        outs = [torch.full_like(x, -1.0)]
        # Load every kernel used below first (a first launch can synchronize the device,
        # which would wait out the sleep): the gather, its copy-out, clone.
        warm = [torch.empty_like(x)]
        dist.all_gather(warm, x, group=pg)
        warm[0].clone()
        torch.cuda.synchronize()

        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(sleep_cycles(1.5))
            # The lane stream waits for the side stream, so the gather and the copy-out of
            # its flat buffer into outs[0] stay queued there behind the sleep.
            dist.all_gather(outs, x, group=pg, async_op=True)
        t0 = time.monotonic()
        if how == "abort":
            pg.abort()
        else:
            # The lane is busy, so the old generation is aborted in place.
            pg.configure(store.addr(), "gpu-test", 0, 1)
        took = time.monotonic() - t0
        # On the default stream, which does not wait for the side stream: a copy of
        # outs[0] as it is right after abort() returned.
        snapshot = outs[0].clone()
        torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()  # the side stream and the lane stream too
        assert torch.equal(outs[0], snapshot), (
            f"work queued on the lane stream wrote into the output after {how} returned "
            f"(it took {took:.2f}s)"
        )
        assert took < 10.0, f"{how} took {took:.1f}s"
    finally:
        pg.shutdown()


def _reaping_time(pg, store, n):
    """Seconds the Reaper needs, beyond the configure() calls themselves, to tear down the
    `n` generations that n reconfigures of idle lanes leave to it (their NCCL aborts
    deferred)."""

    def settled():
        return pg.backend._reaper_pending() == 0

    assert wait_until(settled, 60.0)
    t0 = time.monotonic()
    configuring = 0.0
    for _ in range(n):
        c0 = time.monotonic()
        pg.configure(store.addr(), "gpu-test", 0, 1)
        configuring += time.monotonic() - c0
    assert wait_until(settled, 60.0, interval_s=0.005)
    return time.monotonic() - t0 - configuring


def test_reaper_aborts_deferred_generations_concurrently():
    store = Store()
    pg = nccl_pg(store, num_lanes=2)  # communicators created eagerly by configure()
    try:
        _reaping_time(pg, store, 2)  # warm-up: NCCL's one-time setup
        single = statistics.median(_reaping_time(pg, store, 1) for _ in range(3))
        n = 4  # at most this many generations wait for the Reaper with a deferred abort
        total = _reaping_time(pg, store, n)
        print(f"reaping {n} generations took {total:.2f}s; one took {single:.2f}s")
        # One at a time would take about n x single.
        assert total < 0.6 * n * single, (total, single)
    finally:
        pg.shutdown()


def test_no_write_after_abort_without_revoke_too():
    # Where the linked NCCL has ncclCommRevoke, abort() uses it; the other path (ncclCommAbort
    # in place, as with an older NCCL) must keep the same guarantee. The choice is made once
    # per process, so that path runs in a child with FT_NCCL_REVOKE=0.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, FT_NCCL_REVOKE="0")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_no_write_into_outputs_after_abort_returns",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_revoke_is_used_where_the_linked_nccl_has_it():
    from ft import _C

    version = _C.nccl_version()
    assert _C.nccl_revoke_available() == (tuple(version) >= (2, 28, 7)), version
