"""Benchmark: ft.optim.ZeroRedundancyOptimizer vs torch's, side by side on one process group.

    python -m bench.zero_bench [--world 3] [--iters 20] [--backend gloo|ft]
    python -m bench.zero_bench --ft [--world 3] [--iters 5]    # fault-tolerant mode
    python -m bench.zero_bench --ft --ft-iters 8 [--blocks 4 --d 256 --ffn 1024]  # + overlap
    python -m bench.zero_bench --overlap [--world 2] [--iters 10] [--blocks 6 --d 512 --ffn 1536]

Overlap mode (``--overlap``, always the "ft" backend: torch's overlapped ZeRO refuses Gloo)
times whole training iterations (zero_grad, forward, backward, and ``step()`` where there is
one) of torch's DDP (``--bucket-mb`` buckets, batch ``--batch``) with four optimizers, each on
its own copy of the model, in rotating order, after a barrier: ft's ZeRO stepped after
backward, ft's ZeRO overlapped through ``ft.optim.zero_hooks.hook_with_zero_step`` and
``hook_with_zero_step_interleaved``, and torch's ZeRO overlapped through torch's
``hook_with_zero_step``. The first ``--warmup`` (>= 3) iterations are not timed (the overlapped
ones learn DDP's buckets there). Reported: the median iteration (slowest rank), each
configuration's ratio to torch's overlapped one, the median of the per-iteration ratios
("paired"), and whether ft's and torch's overlapped runs ended with bitwise-equal parameters.

Starts ``--world`` ranks on loopback (one process each, 1 thread each). Every rank builds the
same model of about 9.5M parameters (6 MLP blocks, d=512, ffn=1536, LayerNorm) twice. One copy
gets ft's ZeRO (Adam) and the other gets torch's (Adam), both on the same group. Gradients are
filled once with fixed random values. Each iteration times one ``step()`` of each optimizer, in
alternating order, after a barrier. An iteration's time is the slowest rank's. The report gives
the median over iterations for ``parameters_as_bucket_view`` False and True, the ratio of the
medians (ft / torch), and the median of the per-iteration ratios ("paired": each pair of
steps ran back to back, so it is less sensitive to load changes on a shared machine).

Memory: the bytes of optimizer state (the tensors in ``optimizer.state``) per rank, after the
steps, against a plain ``torch.optim.Adam`` over the whole model. Adam allocates its state at
the first step and never grows it, so this is also the peak of persistent state.

Fault-tolerant mode (``--ft``) first measures memory and bytes on the wire with filled
gradients (``--iters`` steps), then, with ``--ft-iters N > 0``, times whole training iterations
(zero_grad, forward, backward, step) of FaultTolerantZeroRedundancyOptimizer in three
configurations, each over its own lighthouse and Managers (sync quorum), one thread per replica:
stepped after backward (``ft.DistributedDataParallel``), and overlapped through
``FaultTolerantZeroDDP`` with ``interleaved=False`` and ``interleaved=True``. They run in a new
order every iteration (the same on every replica, after a barrier), ``--warmup`` iterations
untimed; reported: the median iteration and ``step()`` time of the slowest replica, the ratio to
stepping after backward (of the medians, and "paired": the median of per-iteration ratios), and
whether all configurations ended with bitwise-equal parameters.

Results: docs/benchmarks.md, "ZeRO".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.optim._zero_worker import state_bytes  # one count of optimizer state bytes


def make_model(blocks: int = 6, d: int = 512, ffn: int = 1536) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(d, ffn), nn.GELU(), nn.Linear(ffn, d), nn.LayerNorm(d)]
    return nn.Sequential(*layers)


def in_threads(run, world: int) -> None:
    """``run(r)`` for each replica r in a thread of its own; returns when all have ended."""
    import threading

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def fill_grads(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def timed_step(opt) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def worker(
    rank: int,
    world: int,
    port: int,
    backend: str,
    warmup: int,
    iters: int,
    dims: tuple = (6, 512, 1536),
) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from ft.optim import ZeroRedundancyOptimizer as FtZero

    torch.set_num_threads(1)
    if backend == "ft":
        import ft  # noqa: F401  (registers the "ft" backend)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    report = {"world": world, "backend": backend, "configs": {}}
    try:
        base = make_model(*dims)
        n_params = sum(p.numel() for p in base.parameters())
        report["params"] = n_params
        for bucket in (False, True):
            m_ft, m_t = copy.deepcopy(base), copy.deepcopy(base)
            fill_grads(m_ft)
            fill_grads(m_t)
            z_ft = FtZero(
                m_ft.parameters(), torch.optim.Adam, lr=1e-4, parameters_as_bucket_view=bucket
            )
            z_t = TorchZero(
                m_t.parameters(), torch.optim.Adam, lr=1e-4, parameters_as_bucket_view=bucket
            )
            times = {"ft": [], "torch": []}
            for i in range(warmup + iters):
                order = [("ft", z_ft), ("torch", z_t)]
                if i % 2:
                    order.reverse()
                for name, opt in order:
                    t = timed_step(opt)
                    if i >= warmup:
                        times[name].append(t)
            # The slowest rank defines an iteration's time.
            t_all = torch.tensor([times["ft"], times["torch"]], dtype=torch.float64)
            dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
            ft_med = statistics.median(t_all[0].tolist())
            t_med = statistics.median(t_all[1].tolist())
            # Paired: the two steps of one iteration ran back to back, under the same load.
            paired = statistics.median((t_all[0] / t_all[1]).tolist())
            mine = torch.tensor(
                [state_bytes(z_ft.optim), state_bytes(z_t.optim)], dtype=torch.int64
            )
            per_rank = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(per_rank, mine)
            same = all(torch.equal(a, b) for a, b in zip(m_ft.parameters(), m_t.parameters()))
            report["configs"][f"bucket_view={bucket}"] = {
                "ft_ms": ft_med * 1e3,
                "torch_ms": t_med * 1e3,
                "ratio": ft_med / t_med,
                "paired_ratio": paired,
                "ft_state_bytes_per_rank": [int(t[0]) for t in per_rank],
                "torch_state_bytes_per_rank": [int(t[1]) for t in per_rank],
                "params_bitwise_equal": same,
            }
        if rank == 0:
            plain_model = copy.deepcopy(base)
            fill_grads(plain_model)
            plain = torch.optim.Adam(plain_model.parameters(), lr=1e-4)
            plain.step()
            report["plain_adam_state_bytes"] = state_bytes(plain)
            print("RESULT " + json.dumps(report), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


OVERLAP_CONFIGS = ("ft", "ft_overlap", "ft_overlap_interleaved", "torch_overlap")


def shuffled_iterations(n: int, configs: tuple, seed: int, batch: int, d: int):
    """Yields, per iteration, its index, a random batch ``(x, y)`` and ``configs`` in a fresh
    order, the same on every rank (seeded by the index): no config always runs right after
    the same other one."""
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(batch, d, generator=g)
        y = torch.randn(batch, d, generator=g)
        order = list(configs)
        random.Random(i).shuffle(order)
        yield i, x, y, order


def overlap_worker(rank: int, world: int, port: int, args) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
        hook_with_zero_step as torch_hook,
    )
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ft  # noqa: F401  (registers the "ft" backend)
    from ft.optim import ZeroRedundancyOptimizer as FtZero
    from ft.optim.zero_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        "ft", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        base = make_model(args.blocks, args.d, args.ffn)
        runs = {}
        for name in OVERLAP_CONFIGS:
            model = copy.deepcopy(base)
            ddp = DDP(model, bucket_cap_mb=args.bucket_mb)
            overlap = name != "ft"
            Z = TorchZero if name.startswith("torch") else FtZero
            zero = Z(ddp.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=1e-4)
            if overlap:
                hook = {
                    "ft_overlap": hook_with_zero_step,
                    "ft_overlap_interleaved": hook_with_zero_step_interleaved,
                    "torch_overlap": torch_hook,
                }[name]
                ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero))
            runs[name] = (model, ddp, zero, overlap)
        times = {name: [] for name in OVERLAP_CONFIGS}
        schedule = shuffled_iterations(
            args.warmup + args.iters, OVERLAP_CONFIGS, 100 + rank, args.batch, args.d
        )
        for i, x, y, order in schedule:
            for name in order:
                model, ddp, zero, overlap = runs[name]
                dist.barrier()
                t0 = time.perf_counter()
                zero.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                if not overlap:
                    zero.step()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        t_all = torch.tensor([times[n] for n in OVERLAP_CONFIGS], dtype=torch.float64)
        dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
        ref = OVERLAP_CONFIGS.index("torch_overlap")
        ft_ov = runs["ft_overlap"][0].parameters()
        same = all(torch.equal(a, b) for a, b in zip(ft_ov, runs["torch_overlap"][0].parameters()))
        same_t = torch.tensor([int(same)])
        dist.all_reduce(same_t, op=dist.ReduceOp.MIN)
        report = {
            "world": world,
            "params": sum(p.numel() for p in base.parameters()),
            "buckets": len(runs["ft_overlap"][2].overlap.info.params_per_bucket),
            "ft_vs_torch_overlap_bitwise": bool(same_t.item()),
            "configs": {},
        }
        ref_med = statistics.median(t_all[ref].tolist())
        for k, name in enumerate(OVERLAP_CONFIGS):
            med = statistics.median(t_all[k].tolist())
            report["configs"][name] = {
                "ms": med * 1e3,
                "ratio": med / ref_med,
                "paired": statistics.median((t_all[k] / t_all[ref]).tolist()),
            }
        if rank == 0:
            print("RESULT " + json.dumps(report), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def overlap_report(rep: dict, args) -> None:
    print(
        f"ZeRO overlap bench: {rep['world']} ranks, backend ft, {rep['params'] / 1e6:.2f}M "
        f"params, {rep['buckets']} DDP buckets of {args.bucket_mb} MB, batch {args.batch}, Adam, "
        f"{args.iters} iterations after {args.warmup} warm-up (median, slowest rank)"
    )
    print(f"{'config':<26}{'iter ms':>10}{'/torch_ov':>11}{'paired':>9}")
    for name, c in rep["configs"].items():
        print(f"{name:<26}{c['ms']:>10.2f}{c['ratio']:>11.3f}{c['paired']:>9.3f}")
    print(
        f"ft_overlap and torch_overlap parameters bitwise equal: "
        f"{rep['ft_vs_torch_overlap_bitwise']}"
    )


def launch(args) -> int:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=args.timeout), wait_for_workers=False
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "bench.zero_bench",
        "--world",
        str(args.world),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        "--backend",
        args.backend,
        "--port",
        str(store.port),
        "--blocks",
        str(args.blocks),
        "--d",
        str(args.d),
        "--ffn",
        str(args.ffn),
        "--batch",
        str(args.batch),
        "--bucket-mb",
        str(args.bucket_mb),
    ]
    if args.overlap:
        cmd.append("--overlap")
    procs = [
        subprocess.Popen(
            cmd + ["--rank", str(r)],
            env=env,
            stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
            text=True,
        )
        for r in range(args.world)
    ]
    try:
        out, _ = procs[0].communicate(timeout=args.timeout)
        codes = [procs[0].returncode] + [p.wait(timeout=30) for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    if any(codes):
        print(f"ranks failed with exit codes {codes}", file=sys.stderr)
        return 1
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    rep = json.loads(line[len("RESULT ") :])
    if args.overlap:
        overlap_report(rep, args)
        return 0
    n, plain = rep["world"], rep["plain_adam_state_bytes"]
    print(
        f"ZeroRedundancyOptimizer bench: {n} ranks, backend {rep['backend']}, "
        f"{rep['params'] / 1e6:.2f}M params, Adam, {args.iters} iterations (median, slowest rank)"
    )
    print(
        f"{'config':<24}{'ft ms':>10}{'torch ms':>10}{'ft/torch':>10}{'paired':>10}  bitwise-equal"
    )
    for name, c in rep["configs"].items():
        print(
            f"{name:<24}{c['ft_ms']:>10.2f}{c['torch_ms']:>10.2f}{c['ratio']:>10.3f}"
            f"{c['paired_ratio']:>10.3f}  {c['params_bitwise_equal']}"
        )
    c = rep["configs"]["bucket_view=False"]
    worst = max(c["ft_state_bytes_per_rank"])
    print(
        f"optimizer state per rank (bytes): ft {c['ft_state_bytes_per_rank']}, "
        f"torch {c['torch_state_bytes_per_rank']}, plain Adam {plain}"
    )
    print(
        f"largest rank / plain Adam = {worst / plain:.4f} "
        f"(1/N = {1 / n:.4f}; target <= {1 / n + 0.05:.4f})"
    )
    return 0


FT_ITER_CONFIGS = ("after_backward", "overlap", "overlap_interleaved")


def ft_lighthouse(world: int):
    """An in-process lighthouse for ``world`` replica groups (fault-tolerant modes)."""
    from ft.coordination import LighthouseServer

    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=world,
        join_timeout_ms=1000,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=5000,
        http_bind="",
    )


def ft_replica(lh_addr: str, replica_id: str, model: nn.Module, config=None, bucket_mb=4.0):
    """One replica group of the fault-tolerant modes: ``(manager, ddp, optimizer)``, a Manager
    (sync quorum) and FaultTolerantZeroRedundancyOptimizer(Adam) over ``model``. ``config``
    (one of ``FT_ITER_CONFIGS``) also wraps ``model`` in the DDP it trains through:
    ``ft.DistributedDataParallel`` for ``after_backward``, ``FaultTolerantZeroDDP`` (the
    optimizer overlapped) otherwise; without one, ``ddp`` is None and the optimizer steps
    after backward."""
    import ft
    from ft.optim import FaultTolerantZeroDDP, FaultTolerantZeroRedundancyOptimizer
    from tests.manager.inproc import make_manager

    m = make_manager(
        lh_addr,
        replica_id,
        use_async_quorum=False,
        init_sync=False,
        timeout=timedelta(seconds=120),
        quorum_timeout=timedelta(seconds=120),
    )
    overlap = config not in (None, "after_backward")
    opt = FaultTolerantZeroRedundancyOptimizer(
        m, model.parameters(), torch.optim.Adam, overlap_with_ddp=overlap, lr=1e-4
    )
    if config is None:
        ddp = None
    elif overlap:
        ddp = FaultTolerantZeroDDP(
            m, model, opt, interleaved=config.endswith("interleaved"), bucket_cap_mb=bucket_mb
        )
    else:
        ddp = ft.DistributedDataParallel(m, model, bucket_cap_mb=bucket_mb)
    return m, ddp, opt


def ft_mode(world: int, iters: int) -> int:
    """Fault-tolerant mode: ``world`` replica groups (one thread each, in-process lighthouse and
    Managers, sync quorum), FaultTolerantZeroRedundancyOptimizer(Adam) on the same model.
    Reports the optimizer-state bytes each replica holds (own + buddy shard) against plain
    Adam, and the bytes each step puts on the wire: the parameter exchange (which replaces the
    plain mode's broadcast) and the buddy copy's share of it (state migrated; 0 outside
    quorum changes)."""

    torch.set_num_threads(1)
    lh = ft_lighthouse(world)
    models = [make_model() for _ in range(world)]  # seeded: built here, not in threads
    out: dict = {}

    def run(r: int) -> None:
        model = models[r]
        m, _, opt = ft_replica(lh.address(), f"b{r}", model)
        for _ in range(iters):
            opt.zero_grad()
            fill_grads(model)
            mig0 = opt.stats["migrated_bytes"]
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            out.setdefault(r, []).append((dt, opt.stats["migrated_bytes"] - mig0))
        out[f"bytes{r}"] = opt.state_bytes()
        out[f"own{r}"] = state_bytes(opt)  # opt.state is the owned shard
        out[f"param{r}"] = opt.stats["param_bytes"] // max(1, opt.stats["steps"])
        out[f"committed{r}"] = m.current_step()
        m.shutdown(wait=False)

    in_threads(run, world)
    lh.shutdown()
    plain = make_model()
    popt = torch.optim.Adam(plain.parameters(), lr=1e-4)
    fill_grads(plain)
    popt.step()
    full = state_bytes(popt)
    held = [out[f"bytes{r}"] for r in range(world)]
    own = [out[f"own{r}"] for r in range(world)]
    print(
        f"fault-tolerant mode, {world} replicas, {iters} steps "
        f"(committed {[out[f'committed{r}'] for r in range(world)]})"
    )
    print(f"plain Adam state: {full} bytes")
    print(
        f"held per replica (own + buddy): {held} -> max/plain = {max(held) / full:.4f} "
        f"(2/N = {2 / world:.4f})"
    )
    print(f"own shard per replica: {own} -> max/plain = {max(own) / full:.4f}")
    print(
        f"transient during step (+ copy of own shard): max/plain = "
        f"{max(h + o for h, o in zip(held, own)) / full:.4f}"
    )
    print(
        f"buddy copy bytes per step (state migrated) after the first step: "
        f"{[sum(b for _, b in out[r][1:]) // max(1, iters - 1) for r in range(world)]}"
    )
    print(f"first step (initial layout) migrated: {[out[r][0][1] for r in range(world)]}")
    print(
        f"parameter exchange per step (allreduce input bytes per replica): "
        f"{[out[f'param{r}'] for r in range(world)]}"
    )
    print(
        f"median step ms: {[round(statistics.median(d for d, _ in out[r]) * 1e3, 1) for r in range(world)]}"
    )
    return 0


def ft_iteration_times(world: int, iters: int, args) -> None:
    """Iteration time of the fault-tolerant optimizer, stepped after backward vs overlapped
    (module docstring, "Fault-tolerant mode")."""
    import threading

    torch.set_num_threads(1)
    lhs = {c: ft_lighthouse(world) for c in FT_ITER_CONFIGS}
    base = make_model(args.blocks, args.d, args.ffn)  # seeded: built here, not in threads
    models = {(c, r): copy.deepcopy(base) for c in FT_ITER_CONFIGS for r in range(world)}
    barrier = threading.Barrier(world, timeout=300)
    times: dict = {}
    out: dict = {}

    def run(r: int) -> None:
        runs = {
            c: ft_replica(lhs[c].address(), f"{c}-{r}", models[(c, r)], c, args.bucket_mb)
            for c in FT_ITER_CONFIGS
        }
        schedule = shuffled_iterations(
            args.warmup + iters, FT_ITER_CONFIGS, 100 + r, args.batch, args.d
        )
        for i, x, y, order in schedule:
            for c in order:
                m, ddp, opt = runs[c]
                barrier.wait()
                t0 = time.perf_counter()
                opt.zero_grad()
                nn.functional.mse_loss(ddp(x), y).backward()
                t1 = time.perf_counter()
                opt.step()
                t2 = time.perf_counter()
                if i >= args.warmup:
                    times.setdefault((c, r), []).append((t2 - t0, t2 - t1))
        for c in FT_ITER_CONFIGS:
            m, ddp, opt = runs[c]
            out[(c, r)] = m.current_step()
            if c == "overlap_interleaved":
                ov = sum(
                    b.xbuf.numel() * b.xbuf.element_size() for b in opt.overlap.buckets.values()
                )
                ov += sum(
                    t.numel() * t.element_size()
                    for bo in opt.overlap.opts.values()
                    for t in bo.sb_t
                )
                out[("extra", r)] = ov
                out[("held", r)] = opt.state_bytes()
                out[("buckets", r)] = len(opt.overlap.buckets)
            m.shutdown(wait=False)

    in_threads(run, world)
    for lh in lhs.values():
        lh.shutdown()
    n_params = sum(p.numel() for p in base.parameters())
    steps = {c: sorted({out[(c, r)] for r in range(world)}) for c in FT_ITER_CONFIGS}
    print(
        f"\niteration time, {world} replicas (threads of one process), "
        f"{n_params / 1e6:.2f}M params, {out[('buckets', 0)]} DDP buckets of {args.bucket_mb} MB, "
        f"batch {args.batch}, Adam, {iters} iterations after {args.warmup} warm-up "
        f"(median, slowest replica; committed steps {steps})"
    )
    # per iteration: the slowest replica
    it = {
        c: [max(times[(c, r)][k][0] for r in range(world)) for k in range(iters)]
        for c in FT_ITER_CONFIGS
    }
    st = {
        c: [max(times[(c, r)][k][1] for r in range(world)) for k in range(iters)]
        for c in FT_ITER_CONFIGS
    }
    ref = "after_backward"
    print(f"{'config':<22}{'iter ms':>10}{'step() ms':>11}{'/after':>9}{'paired':>9}")
    for c in FT_ITER_CONFIGS:
        med = statistics.median(it[c])
        paired = statistics.median(a / b for a, b in zip(it[c], it[ref]))
        print(
            f"{c:<22}{med * 1e3:>10.1f}{statistics.median(st[c]) * 1e3:>11.1f}"
            f"{med / statistics.median(it[ref]):>9.3f}{paired:>9.3f}"
        )

    def params(c: str, r: int) -> list:
        return [p.detach() for p in models[(c, r)].parameters()]

    replicas_same = all(
        torch.equal(a, b)
        for c in FT_ITER_CONFIGS
        for r in range(1, world)
        for a, b in zip(params(c, r), params(c, 0))
    )
    overlaps_same = all(
        torch.equal(a, b) for a, b in zip(params("overlap", 0), params("overlap_interleaved", 0))
    )
    diff = max((a - b).abs().max().item() for a, b in zip(params("overlap", 0), params(ref, 0)))
    print(
        f"bitwise-equal parameters: replicas of each config {replicas_same}; overlap and "
        f"overlap_interleaved {overlaps_same}; max |overlap - after_backward| {diff:.3g}"
    )
    print(
        f"overlap memory per replica: held state {out[('held', 0)]} bytes (2/N); staged at the "
        f"vote: the same again; persistent exchange buffers + standby scratch: "
        f"{[out[('extra', r)] for r in range(world)]} bytes"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "ft"])
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument(
        "--ft",
        action="store_true",
        help="fault-tolerant mode (Manager + buddy copy): memory and bytes per step",
    )
    ap.add_argument(
        "--ft-iters",
        type=int,
        default=0,
        help="--ft: also time N whole iterations, stepped after backward vs overlapped",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="iteration time with overlap_with_ddp: ft vs ft overlapped vs torch "
        "overlapped (backend ft)",
    )
    ap.add_argument(
        "--blocks", type=int, default=6, help="MLP blocks of the model (plain and overlap modes)"
    )
    ap.add_argument("--d", type=int, default=512, help="model width")
    ap.add_argument("--ffn", type=int, default=1536, help="hidden width of each block")
    ap.add_argument("--batch", type=int, default=32, help="overlap modes: batch size")
    ap.add_argument("--bucket-mb", type=float, default=4.0, help="overlap modes: DDP bucket_cap_mb")
    args = ap.parse_args()
    if args.ft:
        rc = ft_mode(args.world, args.iters)
        if args.ft_iters > 0:
            ft_iteration_times(args.world, args.ft_iters, args)
        return rc
    if args.overlap:
        args.backend = "ft"
        args.warmup = max(args.warmup, 3)
    if args.rank is None:
        return launch(args)
    if args.overlap:
        overlap_worker(args.rank, args.world, args.port, args)
        return 0
    worker(
        args.rank,
        args.world,
        args.port,
        args.backend,
        args.warmup,
        args.iters,
        (args.blocks, args.d, args.ffn),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
