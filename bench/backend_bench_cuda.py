"""CUDA mode of the backend benchmark: ``python -m bench.backend_bench --cuda [--json F]`` on a GPU
machine (tests/gpu/run_on_device.sh runs it).

At world size 1 on one GPU:
  * launch overhead: CPU time to issue an allreduce (issue -> Work returned) and the
    end-to-end time (issue -> stream synchronized), ft's NCCL lane vs torch's
    ProcessGroupNCCL, for a few sizes;
  * reconfigure cost: ft's configure() on CUDA (abort the old generation's NCCL
    communicators, connect Gloo, create the new NCCL communicators), step by step.

Prints a table and writes JSON with --json.

Results: docs/benchmarks.md, "Backend on CUDA".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

SIZES = {"4KiB": 1 << 10, "1MiB": 1 << 18, "64MiB": 1 << 24}  # float32 elements


def time_allreduce(allreduce, x, iters: int):
    for _ in range(10):
        allreduce(x)
    torch.cuda.synchronize()
    issue = []
    t_start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        allreduce(x)
        issue.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    total = time.perf_counter() - t_start
    return {
        "issue_us_median": statistics.median(issue) * 1e6,
        "end_to_end_us_per_op": total / iters * 1e6,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--reconfigures", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    import ft

    if not ft._C.has_nccl:
        print("ft was built without NCCL")
        return 1
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "nccl": list(ft._C.nccl_version()),
        "launch": {},
        "reconfigure": {},
    }

    pg = ft.ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{port}/bench-0", "bench", 0, 1)
    torch_pg = dist.ProcessGroupNCCL(dist.PrefixStore("torch-nccl", store), 0, 1)

    def ft_allreduce(x):
        pg.allreduce([x], dist.AllreduceOptions()).wait()

    def torch_allreduce(x):
        torch_pg.allreduce([x], dist.AllreduceOptions()).wait()

    for name, n in SIZES.items():
        x = torch.ones(n, device="cuda")
        iters = args.iters if n < (1 << 20) else max(20, args.iters // 10)
        results["launch"][name] = {
            "ft": time_allreduce(ft_allreduce, x, iters),
            "torch_nccl": time_allreduce(torch_allreduce, x, iters),
        }

    # Reconfigure cost in the two cases the backend tells apart: the old generation's
    # kernels have finished (its communicators are aborted later, by the reaper), or one
    # is still running (stopped before configure() returns: with ncclCommRevoke where the
    # linked NCCL has it, the teardown then left to the reaper; else ncclCommAbort in place).
    from ft import _C

    results["nccl_revoke"] = bool(_C.nccl_revoke_available())
    x = torch.ones(1024, device="cuda")
    sleep_cycles = int(0.05 * torch.cuda.get_device_properties(0).clock_rate * 1000)
    for case, n in (("idle", args.reconfigures), ("op_in_flight", max(3, args.reconfigures // 4))):
        steps = []
        for i in range(n):
            pg.configure(f"127.0.0.1:{port}/bench-{case}-{i}", "bench", 0, 1)
            steps.append(pg.last_reconfigure_timings())
            if case == "op_in_flight":
                torch.cuda._sleep(sleep_cycles)  # keeps the next allreduce queued
            dist.all_reduce(x, group=pg)
            if case == "idle":
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        results["reconfigure"][case] = {
            key: {
                "median": sorted(s[key] for s in steps)[len(steps) // 2],
                "max": max(s[key] for s in steps),
            }
            for key in ("abort_ms", "gloo_ms", "nccl_ms", "total_ms")
        }
        t0 = time.perf_counter()
        while pg.backend._reaper_pending() and time.perf_counter() - t0 < 120:
            time.sleep(0.01)
        results["reconfigure"][case]["reaper_drain_s"] = time.perf_counter() - t0

    print(
        f"{'size':>6} {'ft issue us':>12} {'torch issue us':>15} {'ratio':>6} "
        f"{'ft e2e us':>10} {'torch e2e us':>13} {'ratio':>6}"
    )
    for name, r in results["launch"].items():
        ft_r, th = r["ft"], r["torch_nccl"]
        r["issue_ratio"] = ft_r["issue_us_median"] / th["issue_us_median"]
        r["end_to_end_ratio"] = ft_r["end_to_end_us_per_op"] / th["end_to_end_us_per_op"]
        print(
            f"{name:>6} {ft_r['issue_us_median']:12.1f} {th['issue_us_median']:15.1f} "
            f"{r['issue_ratio']:6.2f} {ft_r['end_to_end_us_per_op']:10.1f} "
            f"{th['end_to_end_us_per_op']:13.1f} {r['end_to_end_ratio']:6.2f}"
        )
    print(f"busy communicators stopped with ncclCommRevoke: {results['nccl_revoke']}")
    print("reconfigure (ms):", json.dumps(results["reconfigure"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    pg.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
