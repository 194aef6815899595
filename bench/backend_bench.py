"""ft backend vs torch's ProcessGroupGloo, side by side in one run.

    python -m bench.backend_bench [--iters 30] [--sizes 4KiB,1MiB,16MiB,64MiB]
    python -m bench.backend_bench --cuda [--json F]   # on a GPU machine: bench/backend_bench_cuda.py

2 ranks on loopback (each a separate process). Reports, per size, the median
allreduce latency of torch's Gloo and of ft (interleaved, same tensors) and
their ratio; the median reconfigure latency at world 2 and 4; and the time
from abort() until every pending Work has failed.

Results: docs/benchmarks.md, "Backend".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20}


def worker(mode: str, rank: int, world: int, port: int, iters: int, sizes: list) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore

    import ft

    store = TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    out = {}
    if mode == "allreduce":
        ref = dist.ProcessGroupGloo(PrefixStore("ref", store), rank, world, timedelta(seconds=60))
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=60))
        pg.configure(f"127.0.0.1:{port}/ft", "bench", rank, world)
        opts = dist.AllreduceOptions()
        for name in sizes:
            t = torch.ones(SIZES[name] // 4)
            n = iters if SIZES[name] >= (16 << 20) else iters * 4
            for _ in range(3):  # warm up both
                ref.allreduce([t], opts).wait()
                pg.allreduce([t], opts).wait()
            times = {"gloo": [], "ft": []}
            for i in range(n):
                # Alternate which goes first so drift hits both alike.
                order = [("gloo", ref), ("ft", pg)] if i % 2 == 0 else [("ft", pg), ("gloo", ref)]
                for label, group in order:
                    start = time.perf_counter()
                    group.allreduce([t], opts).wait()
                    times[label].append(time.perf_counter() - start)
            out[name] = {k: statistics.median(v) for k, v in times.items()}
    elif mode == "reconfigure":
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=60))
        times = []
        for i in range(iters + 5):
            start = time.perf_counter()
            pg.configure(f"127.0.0.1:{port}/rc{i}", "bench", rank, world)
            elapsed = time.perf_counter() - start
            if i >= 5:
                times.append(elapsed)
        out["median"] = statistics.median(times)
    elif mode == "abort":
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=60), num_lanes=2)
        results = []
        for i in range(iters):
            pg.configure(f"127.0.0.1:{port}/ab{i}", "bench", rank, world)
            if rank == 1:
                store.wait([f"ab{i}/done"], timedelta(seconds=60))
                continue
            works = []
            for k in range(4):  # the peer never joins these
                with ft.lane(k % 2):
                    works.append(pg.allreduce([torch.ones(1024)], dist.AllreduceOptions()))
            time.sleep(0.02)
            start = time.perf_counter()
            pg.abort()
            for w in works:
                try:
                    w.wait()
                except Exception:
                    pass
            results.append(time.perf_counter() - start)
            store.set(f"ab{i}/done", "1")
        if results:
            out["median"] = statistics.median(results)
            out["max"] = max(results)
    return out


def run(mode: str, world: int, iters: int, sizes: list) -> list:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    procs = []
    for rank in range(world):
        args = json.dumps([mode, rank, world, store.port, iters, sizes])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "bench.backend_bench", "--worker", args],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    try:
        return [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def main() -> None:
    if "--cuda" in sys.argv[1:]:
        # The CUDA mode (ft's NCCL lanes vs torch's ProcessGroupNCCL at world 1) lives in
        # its own module: it needs a GPU and none of the loopback worker machinery below.
        sys.argv.remove("--cuda")
        from bench import backend_bench_cuda

        sys.exit(backend_bench_cuda.main())
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*json.loads(args.worker))))
        return
    sizes = args.sizes.split(",")
    print(f"# ft backend vs torch ProcessGroupGloo, 2 ranks on loopback, {os.cpu_count()} cores")
    print("| size | torch Gloo median | ft median | ft / Gloo |")
    print("|---|---|---|---|")
    r0 = run("allreduce", 2, args.iters, sizes)[0]
    for name in sizes:
        g, f = r0[name]["gloo"], r0[name]["ft"]
        print(f"| {name} | {g * 1e3:.3f} ms | {f * 1e3:.3f} ms | {f / g:.3f} |")
    for world in (2, 4):
        med = max(r["median"] for r in run("reconfigure", world, args.iters, sizes))
        print(f"reconfigure latency, world {world}: median {med * 1e3:.2f} ms")
    ab = run("abort", 2, max(5, args.iters // 3), sizes)[0]
    print(
        f"abort() to every pending Work failed (4 pending ops on 2 lanes): "
        f"median {ab['median'] * 1e3:.2f} ms, max {ab['max'] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
