"""DiLoCo benchmarks: communication overlap and bytes on the wire.

    python -m bench.diloco_bench            # both, 2 replicas on loopback

Two replica processes train the same MLP with ft.local_sgd.DiLoCo through the
real stack: a lighthouse (in the bench's parent process), one ft.Manager per
replica (sync quorum, as DiLoCo requires) and an ft.ProcessGroupGloo with one
lane per fragment. Every run builds a fresh Manager (DiLoCo registers its
state for healing under fixed keys).

Overlap: every fragment allreduce completes only after its real Gloo op *plus*
an injected delay D (`SlowLinkManager`: a side thread sleeps before completing
the Manager's Work, i.e. a slow link). Streaming DiLoCo (2 fragments, tau=1)
sends one inner step before it needs the result; we compare its time per inner
step against the same run with no tensor communication (the quorum and commit
RPCs still run) and against tau=0 (nothing to overlap with).
hidden = 1 - (time blocked on fragment allreduces with tau=1) / (same with tau=0), from
DiLoCo.comm_wait_seconds; the same from inner-step times, 1 - (t_tau1 - t_nocomm) /
(t_tau0 - t_nocomm), is printed too but is noisy on a shared 2-core host.

Bytes: /proc/self/io `wchar` (bytes this process wrote with write()/writev(),
which is how Gloo sends) measured around the training loop, per outer step
(= sync_every inner steps), for DDP (per-step gradient allreduce), DiLoCo,
Streaming DiLoCo (2 fragments) and DiLoCo with int8 quantization.

Rejoin (`--what rejoin`, not part of "all"): replica 0 trains DiLoCo without a
break; replica 1 (re)joins it again and again, each time with a fresh Manager,
starting when replica 0 is halfway through an interval, and measures the time
from building its Manager to its first commit. Two ways, interleaved:
"heal first" (DiLoCo's join round: a quorum before the first inner step) and
"train first" (sync_every inner steps from its own initial parameters before its
first quorum: the behaviour before the join round, and torchft's).

Results: docs/benchmarks.md, "DiLoCo".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import ft
from bench.manager_bench import wait_until
from ft.local_sgd import DiLoCo
from tests.diloco.workers import wchar  # bytes this process has written (Gloo's sockets)


class _DoneWork:
    def wait(self) -> bool:
        return True


class _DelayedWork:
    """Completes after `inner` has completed and `delay` seconds have passed,
    counted on a side thread (the caller is not blocked until wait())."""

    def __init__(self, inner, delay: float) -> None:
        self._done = threading.Event()
        self._err = None

        def run() -> None:
            try:
                inner.wait()
                time.sleep(delay)
            except BaseException as e:  # noqa: BLE001
                self._err = e
            self._done.set()

        threading.Thread(target=run, daemon=True).start()

    def wait(self) -> bool:
        self._done.wait()
        if self._err is not None:
            raise self._err
        return True


class SlowLinkManager(ft.Manager):
    """ft.Manager whose allreduces finish `delay` seconds after the real op (a slow link), or,
    with `no_comm`, at once without sending anything (the baseline)."""

    delay = 0.0
    no_comm = False

    def allreduce(self, t, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        if self.no_comm:
            return _DoneWork()
        if not self.delay:
            return super().allreduce(t, should_quantize=should_quantize, reduce_op=reduce_op)
        return _DelayedWork(
            super().allreduce(t, should_quantize=should_quantize, reduce_op=reduce_op), self.delay
        )


def make_manager(
    rank: int,
    args,
    run: str,
    delay: float = 0.0,
    no_comm: bool = False,
    min_replica_size: int = 2,
) -> SlowLinkManager:
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=60), num_lanes=2)
    m = SlowLinkManager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replica_size,
        use_async_quorum=False,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=0,
        # make_model() seeds identically on both replicas: no step-0 heal needed (a no_comm
        # run has no collective that would hold the source until the receiver has fetched).
        init_sync=False,
        lighthouse_addr=args.lighthouse,
        replica_id=f"{run}-r{rank}",
        hostname="127.0.0.1",
        timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=ft.checkpointing.HTTPTransport(
            timeout=timedelta(seconds=60), num_chunks=2, advertise_host="127.0.0.1"
        ),
    )
    m.delay, m.no_comm = delay, no_comm
    return m


def make_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def fragments_of(model: nn.Sequential, n: int):
    mods = list(model)
    k = len(mods) // n
    return [nn.Sequential(*mods[i * k : (i + 1) * k if i < n - 1 else len(mods)]) for i in range(n)]


def inner_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


_runs = [0]


def _run_name(kind: str) -> str:
    _runs[0] += 1
    return f"{kind}{_runs[0]}"


def train_diloco(rank, args, *, n_frag, tau, delay=0.0, no_comm=False, quant=False, steps):
    model = make_model(args.width, args.depth)
    mgr = make_manager(rank, args, _run_name("diloco"), delay=delay, no_comm=no_comm)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    try:
        with DiLoCo(
            mgr,
            fragments_of(model, n_frag),
            inner,
            outer,
            sync_every=args.sync_every,
            fragment_sync_delay=tau,
            should_quantize=quant,
            use_bucketization=args.bucketize,
        ) as diloco:
            for _ in range(args.sync_every):  # warm up (first quorum, heal, lanes, threads)
                inner_step(model, inner, x)
            b0, t0, w0 = wchar(), time.perf_counter(), diloco.comm_wait_seconds
            for _ in range(steps):
                inner_step(model, inner, x)
            dt = time.perf_counter() - t0
            nbytes = wchar() - b0
            waited = diloco.comm_wait_seconds - w0
    finally:
        mgr.shutdown()
    return dt / steps, nbytes, waited / steps


def train_ddp(rank, args, steps):
    """ft.DistributedDataParallel + ft.Optimizer: a gradient allreduce every step."""
    model = make_model(args.width, args.depth)
    mgr = make_manager(rank, args, _run_name("ddp"))
    try:
        ddp = ft.DistributedDataParallel(mgr, model)
        opt = ft.Optimizer(mgr, torch.optim.SGD(model.parameters(), lr=1e-3))
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(args.batch, args.width, generator=g)

        def step():
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()

        step()
        step()
        b0, t0 = wchar(), time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t0) / steps, wchar() - b0
    finally:
        mgr.shutdown()


def survive(args, store) -> dict:
    """Replica 0 of the rejoin measurement: DiLoCo without a break until the joiner is done;
    publishes its syncs and how many inner steps it has taken since the last one."""
    H = args.sync_every
    model = make_model(args.width, args.depth)
    mgr = make_manager(0, args, "survivor", min_replica_size=1)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    syncs_at, steps = [], []
    try:
        with DiLoCo(mgr, [model], inner, outer, sync_every=H) as diloco:
            local = 0
            store.set("survivor/local", "0")
            store.set("survivor/syncs", str(diloco.syncs))
            while not store.check(["rejoin/done"]):
                before, t0 = diloco.syncs, time.perf_counter()
                inner_step(model, inner, x)
                if diloco.syncs != before:
                    local = 0
                    syncs_at.append(time.perf_counter())
                else:
                    local += 1
                    steps.append(time.perf_counter() - t0)
                store.set("survivor/local", str(local))
                store.set("survivor/syncs", str(diloco.syncs))
    finally:
        mgr.shutdown()
    gaps = sorted(b - a for a, b in zip(syncs_at, syncs_at[1:]))
    return dict(
        interval_ms=gaps[len(gaps) // 2] * 1e3,
        inner_step_ms=sorted(steps)[len(steps) // 2] * 1e3,
    )


def _visit(args, mode: str) -> float:
    """One visit of the joiner: seconds from building its Manager to its first commit."""
    H = args.sync_every
    t0 = time.perf_counter()
    model = make_model(args.width, args.depth)
    mgr = make_manager(1, args, _run_name("joiner"), min_replica_size=1)
    try:
        inner = torch.optim.SGD(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))
        diloco = DiLoCo(mgr, [model], inner, outer, sync_every=H)
        if mode == "train_first":
            for _ in range(H):  # no hook yet: nothing syncs before the quorum
                inner_step(model, inner, x)
        with diloco:
            model(x)  # the first forward runs the join round (tau = 0: it commits there)
            committed = time.perf_counter()
            if diloco.commits != 1:
                raise RuntimeError(f"join round did not commit ({mode})")
            for _ in range(H):  # one more sync with the survivor before leaving
                inner_step(model, inner, x)
    finally:
        mgr.shutdown()
    return committed - t0


def rejoin(args, store) -> dict:
    """Replica 1 of the rejoin measurement (see the module docstring)."""
    H = args.sync_every
    times: dict = {"heal_first": [], "train_first": []}
    # The first visit (not counted) pays for what a process does once: threads, Gloo, HTTP.
    for i, mode in enumerate(["heal_first"] + ["train_first", "heal_first"] * args.repeats):
        # As after a crash: the survivor has synced alone since the last visit (its last
        # quorum does not hold a replica that is gone), and is halfway through an interval.
        syncs = int(store.get("survivor/syncs"))
        wait_until(lambda: int(store.get("survivor/syncs")) >= syncs + 2, 60, "solo syncs", 0.001)
        wait_until(lambda: int(store.get("survivor/local")) == H // 2, 60, "mid-interval", 0.001)
        took = _visit(args, mode)
        if i:
            times[mode].append(took)
    store.set("rejoin/done", "1")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    return dict(
        restart_to_first_commit_heal_first_ms=med["heal_first"] * 1e3,
        restart_to_first_commit_train_first_ms=med["train_first"] * 1e3,
        train_first_over_heal_first=med["train_first"] / med["heal_first"],
        runs_ms={k: [round(t * 1e3, 1) for t in v] for k, v in times.items()},
    )


def worker(rank: int, args) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    if args.what == "rejoin":
        store = dist.TCPStore(
            "127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60)
        )
        out["rejoin"] = survive(args, store) if rank == 0 else rejoin(args, store)
        return out
    H = args.sync_every
    n_params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    out["params"] = n_params
    if args.what in ("all", "overlap"):
        steps = args.overlap_steps
        # Calibrate on the median of a few no-communication runs (the first is slow).
        base0 = sorted(
            train_diloco(rank, args, n_frag=2, tau=1, no_comm=True, steps=steps)[0]
            for _ in range(3)
        )[1]
        # Injected delay per fragment allreduce, on top of the real Gloo op.
        D = args.delay_factor * base0
        runs = {"nocomm": [], "tau1": [], "tau0": []}
        waits = {"tau1": [], "tau0": []}
        for _ in range(args.repeats):  # interleaved, medians: the host is shared
            runs["nocomm"].append(
                train_diloco(rank, args, n_frag=2, tau=1, no_comm=True, steps=steps)[0]
            )
            for tau in (1, 0):
                dt, _, waited = train_diloco(rank, args, n_frag=2, tau=tau, delay=D, steps=steps)
                runs[f"tau{tau}"].append(dt)
                waits[f"tau{tau}"].append(waited)
        med = {
            k: sorted(v)[len(v) // 2]
            for k, v in {**runs, **{f"wait_{k}": v for k, v in waits.items()}}.items()
        }
        base, t1, t0 = med["nocomm"], med["tau1"], med["tau0"]
        w1, w0 = med["wait_tau1"], med["wait_tau0"]
        injected_per_step = D * 2 / H  # 2 fragment syncs per sync_every inner steps
        out["overlap"] = dict(
            inner_step_nocomm_ms=base * 1e3,
            inner_step_tau1_ms=t1 * 1e3,
            inner_step_tau0_ms=t0 * 1e3,
            injected_delay_per_sync_ms=D * 1e3,
            injected_per_inner_step_ms=injected_per_step * 1e3,
            # Direct: time blocked on fragment allreduces at sync points, per inner step. With
            # tau = 0 all of the communication (real op + injected delay) is waited for.
            comm_wait_per_step_tau0_ms=w0 * 1e3,
            comm_wait_per_step_tau1_ms=w1 * 1e3,
            hidden_tau1=1 - w1 / max(w0, 1e-9),
            # Indirect (noisy on a shared host): extra inner-step time over no communication.
            hidden_tau1_from_step_times=1 - (t1 - base) / max(t0 - base, 1e-9),
        )
    if args.what in ("all", "bytes"):
        steps = H * args.outer_steps
        per = {}
        b = train_ddp(rank, args, steps)[1]
        per["DDP (grad allreduce every step)"] = b / args.outer_steps
        b = train_diloco(rank, args, n_frag=1, tau=0, steps=steps)[1]
        per["DiLoCo"] = b / args.outer_steps
        b = train_diloco(rank, args, n_frag=2, tau=1, steps=steps)[1]
        per["Streaming DiLoCo (2 fragments, tau=1)"] = b / args.outer_steps
        b = train_diloco(rank, args, n_frag=1, tau=0, quant=True, steps=steps)[1]
        per["DiLoCo, int8 quantized"] = b / args.outer_steps
        b = train_diloco(rank, args, n_frag=1, tau=0, quant=torch.float8_e4m3fn, steps=steps)[1]
        per["DiLoCo, fp8 (e4m3) quantized"] = b / args.outer_steps
        out["bytes_per_outer_step"] = per
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["all", "overlap", "bytes", "rejoin"], default="all")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sync_every", type=int, default=8)
    p.add_argument("--overlap_steps", type=int, default=32)
    p.add_argument("--outer_steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--delay_factor",
        type=float,
        default=0.5,
        help="injected delay per fragment allreduce, in inner-step times (tau=1 can "
        "hide at most one inner step of real op + delay)",
    )
    p.add_argument(
        "--bucketize",
        type=int,
        default=1,
        help="DiLoCo use_bucketization (1: one flat allreduce per fragment)",
    )
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--lighthouse", default=None)
    p.add_argument("--store_port", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rank is not None:
        res = worker(args.rank, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f)
        return

    import logging
    import tempfile

    from ft.coordination import LighthouseServer

    # Every run leaves two replicas behind whose heartbeats expire: not worth a warning here.
    logging.getLogger("ft").setLevel(logging.ERROR)
    # A short join timeout: each run's new replicas need not wait for the previous run's. The
    # rejoin measurement's survivor trains alone between its joiner's visits.
    lh = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1 if args.what == "rejoin" else 2,
        join_timeout_ms=200,
        quorum_tick_ms=20,
        heartbeat_timeout_ms=2000,
        http_bind="",
    )

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmp = tempfile.mkdtemp(prefix="diloco-bench-")
    procs = []
    for r in range(2):
        cmd = [
            sys.executable,
            "-m",
            "bench.diloco_bench",
            "--rank",
            str(r),
            "--lighthouse",
            lh.address(),
            "--json",
            os.path.join(tmp, f"{r}.json"),
            "--store_port",
            str(store.port),
        ] + sys.argv[1:]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        codes = [pr.wait(timeout=900) for pr in procs]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
        lh.shutdown()
    if any(codes):
        sys.exit(f"bench workers failed: {codes}")
    with open(os.path.join(tmp, "0.json")) as f:
        res = json.load(f)
    if args.what == "rejoin":
        with open(os.path.join(tmp, "1.json")) as f:
            joiner = json.load(f)["rejoin"]
        print(
            f"rejoin: 2 replicas on loopback, DiLoCo sync_every={args.sync_every}, model "
            f"{sum(p.numel() for p in make_model(args.width, args.depth).parameters()):,} fp32 "
            f"parameters; the joiner starts halfway through the survivor's interval"
        )
        for k, v in {**res["rejoin"], **joiner}.items():
            print(f"  {k:40s} {v}" if isinstance(v, dict) else f"  {k:40s} {v:10.2f}")
        return
    print(
        f"model: {res['params']:,} fp32 parameters; 2 replicas on loopback (lighthouse + "
        f"ft.Manager + ft.ProcessGroupGloo, 2 lanes); sync_every={args.sync_every}"
    )
    if "overlap" in res:
        o = res["overlap"]
        print("\noverlap (rank 0):")
        for k, v in o.items():
            print(f"  {k:28s} {v:8.3f}" if "hidden" in k else f"  {k:28s} {v:8.2f}")
    if "bytes_per_outer_step" in res:
        print("\nbytes sent per outer step (rank 0, measured with /proc/self/io wchar):")
        fp32 = res["params"] * 4
        for k, v in res["bytes_per_outer_step"].items():
            print(f"  {k:40s} {v / 1e6:10.2f} MB  ({v / fp32:6.2f} x model fp32)")


if __name__ == "__main__":
    main()
