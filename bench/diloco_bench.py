"""DiLoCo benchmarks: communication overlap and bytes on the wire.

    python bench/diloco_bench.py            # both, 2 replicas on loopback

Two replica processes train the same MLP with ft.local_sgd.DiLoCo over an
ft.ProcessGroupGloo. The manager used here is `DirectManager`: a thin stand-in
for ft.Manager that sends every allreduce straight to the process group and
always commits (no quorum or commit RPCs), so the numbers isolate what the
algorithm itself puts on the wire and how much of it the schedule hides.

Overlap: every allreduce completes only after its real Gloo op *plus* an
injected delay D (a side thread sleeps before completing the Work, i.e. a slow
link). Streaming DiLoCo (2 fragments, tau=1) sends one inner step before it
needs the result; we compare its time per inner step against the same run
with no communication at all, and against tau=0 (nothing to overlap with).
hidden = 1 - (t_tau1 - t_nocomm) / (comm time per inner step).

Bytes: /proc/self/io `wchar` (bytes this process wrote with write()/writev(),
which is how Gloo sends) measured around the training loop, per outer step
(= sync_every inner steps), for DDP (per-step gradient allreduce), DiLoCo,
Streaming DiLoCo (2 fragments) and DiLoCo with int8 quantization.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import ft  # noqa: E402
from ft.collectives import allreduce_quantized  # noqa: E402
from ft.local_sgd import DiLoCo  # noqa: E402


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar")


class _DoneWork:
    def wait(self) -> bool:
        return True


class _DelayedWork:
    """Completes after `inner` has completed and `delay` seconds have passed,
    counted on a side thread (the caller is not blocked until wait())."""

    def __init__(self, inner, delay: float, after=None) -> None:
        self._done = threading.Event()
        self._err = None

        def run() -> None:
            try:
                inner.wait()
                if after is not None:
                    after()
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


class DirectManager:
    """The parts of ft.Manager's API that DiLoCo uses, straight over a pg."""

    _use_async_quorum = False

    def __init__(self, pg, delay: float = 0.0, no_comm: bool = False) -> None:
        self._pg = pg
        self.delay = delay
        self.no_comm = no_comm
        self.step = 0
        self.comm_seconds = 0.0

    def register_state_dict_fn(self, *a) -> None:
        pass

    def start_quorum(self, *a, **k) -> None:
        pass

    def current_step(self) -> int:
        return self.step

    def report_error(self, e) -> None:
        raise e

    def should_commit(self, timeout=None) -> bool:
        self.step += 1
        return True

    def allreduce(self, t, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        if self.no_comm:
            return _DoneWork()
        n = self._pg.size()
        if should_quantize:
            work = allreduce_quantized([t], dist.ReduceOp.SUM, self._pg)
        else:
            work = self._pg.allreduce([t])
        return _DelayedWork(work, self.delay, after=lambda: t.div_(n))


def make_model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def fragments_of(model: nn.Sequential, n: int):
    mods = list(model)
    k = len(mods) // n
    return [nn.Sequential(*mods[i * k:(i + 1) * k if i < n - 1 else len(mods)]) for i in range(n)]


def inner_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def train_diloco(pg, rank, args, *, n_frag, tau, delay=0.0, no_comm=False, quant=False, steps):
    model = make_model(args.width, args.depth)
    mgr = DirectManager(pg, delay=delay, no_comm=no_comm)
    inner = torch.optim.SGD(model.parameters(), lr=1e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    with DiLoCo(mgr, fragments_of(model, n_frag), inner, outer, sync_every=args.sync_every,
                fragment_sync_delay=tau, should_quantize=quant):
        for _ in range(args.sync_every):  # warm up (first syncs, lanes, threads)
            inner_step(model, inner, x)
        pg.barrier().wait()
        b0, t0 = wchar(), time.perf_counter()
        for _ in range(steps):
            inner_step(model, inner, x)
        dt = time.perf_counter() - t0
        nbytes = wchar() - b0
    return dt / steps, nbytes


def train_ddp(pg, rank, args, steps):
    model = make_model(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    params = list(model.parameters())

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        flat = torch.cat([p.grad.view(-1) for p in params])  # one bucket, like DDP's
        pg.allreduce([flat]).wait()
        flat /= pg.size()
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()

    step()
    pg.barrier().wait()
    b0, t0 = wchar(), time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps, wchar() - b0


def worker(rank: int, port: int, args) -> dict:
    torch.set_num_threads(1)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=60), num_lanes=2)
    pg.configure(f"127.0.0.1:{port}/bench", "bench", rank, 2)
    out: dict = {}
    H = args.sync_every
    n_params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    out["params"] = n_params
    if args.what in ("all", "overlap"):
        steps = args.overlap_steps
        base0, _ = train_diloco(pg, rank, args, n_frag=2, tau=1, no_comm=True, steps=steps)
        # Injected delay per fragment allreduce, on top of the real Gloo op.
        D = args.delay_factor * base0
        runs = {"nocomm": [], "tau1": [], "tau0": []}
        for _ in range(args.repeats):  # interleaved, medians: the host is shared
            runs["nocomm"].append(train_diloco(pg, rank, args, n_frag=2, tau=1, no_comm=True,
                                               steps=steps)[0])
            runs["tau1"].append(train_diloco(pg, rank, args, n_frag=2, tau=1, delay=D, steps=steps)[0])
            runs["tau0"].append(train_diloco(pg, rank, args, n_frag=2, tau=0, delay=D, steps=steps)[0])
        med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
        base, t1, t0 = med["nocomm"], med["tau1"], med["tau0"]
        # tau=0 exposes all of the communication (real op + D), so its extra
        # time per inner step is the communication time per inner step.
        comm_per_step = max(t0 - base, 1e-9)
        injected_per_step = D * 2 / H  # 2 fragment syncs per sync_every inner steps
        out["overlap"] = dict(
            inner_step_nocomm_ms=base * 1e3, inner_step_tau1_ms=t1 * 1e3,
            inner_step_tau0_ms=t0 * 1e3, injected_delay_per_sync_ms=D * 1e3,
            comm_per_inner_step_ms=comm_per_step * 1e3,
            injected_per_inner_step_ms=injected_per_step * 1e3,
            hidden_tau1=1 - (t1 - base) / comm_per_step,
            hidden_tau1_vs_injected=1 - (t1 - base) / injected_per_step,
        )
    if args.what in ("all", "bytes"):
        steps = H * args.outer_steps
        per = {}
        _, b = train_ddp(pg, rank, args, steps)
        per["DDP (grad allreduce every step)"] = b / args.outer_steps
        _, b = train_diloco(pg, rank, args, n_frag=1, tau=0, steps=steps)
        per["DiLoCo"] = b / args.outer_steps
        _, b = train_diloco(pg, rank, args, n_frag=2, tau=1, steps=steps)
        per["Streaming DiLoCo (2 fragments, tau=1)"] = b / args.outer_steps
        _, b = train_diloco(pg, rank, args, n_frag=1, tau=0, quant=True, steps=steps)
        per["DiLoCo, int8 quantized"] = b / args.outer_steps
        out["bytes_per_outer_step"] = per
    pg.barrier().wait()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--what", choices=["all", "overlap", "bytes"], default="all")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--sync_every", type=int, default=8)
    p.add_argument("--overlap_steps", type=int, default=32)
    p.add_argument("--outer_steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delay_factor", type=float, default=0.8,
                   help="injected delay per fragment allreduce, in inner-step times")
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.rank is not None:
        res = worker(args.rank, args.port, args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f)
        return

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    import tempfile

    tmp = tempfile.mkdtemp(prefix="diloco-bench-")
    procs = []
    for r in range(2):
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(r), "--port", str(store.port),
               "--json", os.path.join(tmp, f"{r}.json")] + sys.argv[1:]
        procs.append(subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    try:
        codes = [pr.wait(timeout=900) for pr in procs]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    if any(codes):
        sys.exit(f"bench workers failed: {codes}")
    with open(os.path.join(tmp, "0.json")) as f:
        res = json.load(f)
    print(f"model: {res['params']:,} fp32 parameters; 2 replicas on loopback; "
          f"sync_every={args.sync_every}")
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
