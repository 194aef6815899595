"""Manager benchmark: per-step overhead, recovery latency, survivors' stall.

    .venv/bin/python -m bench.manager_bench [--groups 2] [--steps 30]

All on CPU, loopback, one process per replica group (1 rank each), a ~4M-parameter MLP
(16 MiB of float32 parameters).

1. overhead: the same training loop (DDP forward/backward, SGD step) on plain torch Gloo DDP
   (``init_process_group("gloo")``) and on ft (lighthouse + Manager + ft.DistributedDataParallel
   + ft.Optimizer, async quorum). Median step time over --steps after warm-up; ratio ft/plain.
2. recovery: one group is killed and restarted; from the new process's start to its first
   committed step, split into process start (exec -> Manager ready), quorum (start_quorum ->
   quorum answer + pg configure), transfer (checkpoint fetch, 16 MiB model + 16 MiB momentum)
   and load (apply) -- from the Manager's structured log records. Also: a local memory copy of
   the same bytes. Measured twice: a cold restart (a new process: Python + import torch first)
   and a warm one (a standby that imported torch and ft ahead of time, as ft-launch restarts
   groups; "start" is then its activation).
3. stall: the survivors' longest gap between two committed steps when a group is killed
   (kill -9) and when one is stopped (SIGSTOP); heartbeat timeout --hb-ms.

Results: docs/benchmarks.md, "Manager".
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import shutil
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # children's PYTHONPATH


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model():
    import torch

    torch.manual_seed(0)
    # 1024*1024 + 1024 + 3 * (1024*1024 + 1024) ~= 4.2M parameters, 16 MiB
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


# ------------------------------------------------------------------------------ children


def child(args: argparse.Namespace) -> None:
    t_exec = float(os.environ.get("BENCH_T_EXEC", time.time()))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    events: List[Dict[str, Any]] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            ft_fields = getattr(record, "ft", None)
            if ft_fields is not None:
                events.append({"t": record.created, "msg": record.getMessage(), **ft_fields})

    logging.getLogger("ft.manager").addHandler(Grab())
    logging.getLogger("ft.manager").setLevel(logging.INFO)
    logging.getLogger("ft").propagate = False

    model = make_model()
    opt_inner = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(32, 1024, generator=torch.Generator().manual_seed(args.group))
    out: Dict[str, Any] = {"t_exec": t_exec, "steps": []}

    if args.mode == "plain":
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{args.port}",
            rank=args.group,
            world_size=args.groups,
            timeout=timedelta(seconds=60),
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt: Any = opt_inner
        step_fn = None
    else:
        import ft

        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
        manager = ft.Manager(
            pg=pg,
            min_replica_size=1,
            load_state_dict=lambda sd: (
                model.load_state_dict(sd["model"]),
                opt_inner.load_state_dict(sd["optim"]),
            ),
            state_dict=lambda: {"model": model.state_dict(), "optim": opt_inner.state_dict()},
            use_async_quorum=not args.sync,
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=args.port,
            lighthouse_addr=args.lighthouse,
            replica_id=f"g{args.group}",
            hostname="127.0.0.1",
            timeout=timedelta(seconds=args.pg_timeout),
            checkpoint_transport=ft.checkpointing.HTTPTransport(
                timeout=timedelta(seconds=30), num_chunks=4, advertise_host="127.0.0.1"
            ),
        )
        out["t_ready"] = time.time()
        ddp = ft.DistributedDataParallel(manager, model)
        opt = ft.Optimizer(manager, opt_inner)
        step_fn = manager.current_step
    stop_file = args.stop_file
    for i in range(args.steps):
        if stop_file and os.path.exists(stop_file):
            break
        t0 = time.perf_counter()
        c0 = time.process_time()  # this process's CPU time, all threads
        opt.zero_grad()
        ta = time.perf_counter()
        ddp(x).square().mean().backward()
        tb = time.perf_counter()
        opt.step()
        t1 = time.perf_counter()
        out["steps"].append(
            {
                "dt": t1 - t0,
                "wall": time.time(),
                "phases": [ta - t0, tb - ta, t1 - tb],
                "cpu": time.process_time() - c0,
                "step": step_fn() if step_fn else i,
            }
        )
        if args.progress:
            with open(args.progress, "w") as f:
                f.write(str(step_fn() if step_fn else i))
    out["events"] = events
    with open(args.out, "w") as f:
        json.dump(out, f)
    os._exit(0)


# ------------------------------------------------------------------------------ parent


def bench_lighthouse(groups: int, hb_ms: int, join_timeout_ms: int = 5000) -> Any:
    """A lighthouse in this process on loopback (no dashboard) for ``groups`` replica groups,
    quorum ticks of 100 ms, heartbeats timing out after ``hb_ms``."""
    from ft.coordination import LighthouseServer

    return LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=groups,
        http_bind="",
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=hb_ms,
    )


def child_argv(
    args: argparse.Namespace,
    tmp: str,
    group: int,
    mode: str,
    port: int,
    steps: int,
    name: str,
    lighthouse: str = "",
    extra: List[str] = (),
) -> List[str]:
    """A child's command line after the interpreter (``-m bench.manager_bench ...``)."""
    return [
        "-m",
        "bench.manager_bench",
        "--child",
        "--mode",
        mode,
        "--group",
        str(group),
        "--groups",
        str(args.groups),
        "--port",
        str(port),
        "--steps",
        str(steps),
        "--lighthouse",
        lighthouse,
        "--out",
        os.path.join(tmp, f"{name}.json"),
        "--progress",
        os.path.join(tmp, f"{name}.progress"),
        "--stop-file",
        os.path.join(tmp, "stop"),
        *extra,
    ]


def child_env() -> Dict[str, str]:
    return dict(
        os.environ, BENCH_T_EXEC=repr(time.time()), PYTHONPATH=ROOT, FT_ADVERTISE_HOST="127.0.0.1"
    )


def spawn(args: argparse.Namespace, tmp: str, *child: Any, **kw: Any) -> subprocess.Popen:
    """Starts the child of ``child_argv(args, tmp, *child, **kw)``, its output in
    ``<tmp>/<name>.log``."""
    cmd = [sys.executable] + child_argv(args, tmp, *child, **kw)
    name = inspect.signature(child_argv).bind(args, tmp, *child, **kw).arguments["name"]
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    return subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=subprocess.STDOUT)


def start_standby() -> subprocess.Popen:
    """A warm standby as ft-launch keeps one (ft/launch/standby.py); returns once it is ready."""
    from ft.launch import standby

    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "ft.launch.standby"],
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != standby.READY:
        proc.kill()
        raise RuntimeError(f"standby did not come up: {line!r}")
    return proc


def activate_standby(proc: subprocess.Popen, argv: List[str], log_path: str) -> None:
    """Hands the standby a child's command; its output is copied to ``log_path``."""
    from ft.launch import standby

    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(standby.activation(child_env(), argv))
    proc.stdin.close()
    out = proc.stdout

    def copy() -> None:
        with open(log_path, "w") as log:
            for line in out:
                log.write(line)
                log.flush()

    threading.Thread(target=copy, daemon=True).start()


def load(tmp: str, name: str) -> Dict[str, Any]:
    with open(os.path.join(tmp, f"{name}.json")) as f:
        return json.load(f)


def progress(tmp: str, name: str) -> int:
    try:
        with open(os.path.join(tmp, f"{name}.progress")) as f:
            return int(f.read() or -1)
    except (OSError, ValueError):
        return -1


def wait_all(procs: List[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise RuntimeError("a bench child overran") from None


def wait_until(pred, timeout: float, what: str, poll: float = 0.02) -> None:
    """Returns once ``pred()`` holds (checked every ``poll`` seconds); RuntimeError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(poll)


def reap(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.wait(10)


def median_step(tmp: str, names: List[str], warmup: int) -> float:
    dts = []
    for n in names:
        dts += [s["dt"] for s in load(tmp, n)["steps"][warmup:]]
    return statistics.median(dts)


def median_cpu(tmp: str, names: List[str], warmup: int) -> float:
    """Median CPU time per step of a training process (every thread of it)."""
    return statistics.median(s["cpu"] for n in names for s in load(tmp, n)["steps"][warmup:])


def median_phases(tmp: str, names: List[str], warmup: int) -> List[float]:
    """Median of (zero_grad, forward+backward, optimizer step) over every group's steps."""
    rows = [s["phases"] for n in names for s in load(tmp, n)["steps"][warmup:]]
    return [statistics.median(r[k] for r in rows) for k in range(3)]


def bench_overhead(args: argparse.Namespace, tmp: str) -> None:

    res = {}
    phases: Dict[str, List[float]] = {}
    cpu: Dict[str, List[float]] = {}
    for trial in range(args.trials):
        port = free_port()
        procs = [
            spawn(args, tmp, g, "plain", port, args.steps, f"plain{trial}-{g}")
            for g in range(args.groups)
        ]
        try:
            wait_all(procs, 300)
        finally:
            reap(procs)
        lh = bench_lighthouse(args.groups, args.hb_ms)
        procs = [
            spawn(args, tmp, g, "ft", free_port(), args.steps, f"ft{trial}-{g}", lh.address())
            for g in range(args.groups)
        ]
        try:
            wait_all(procs, 300)
        finally:
            reap(procs)
            lh.shutdown()
        for mode in ("plain", "ft"):
            names = [f"{mode}{trial}-{g}" for g in range(args.groups)]
            res.setdefault(mode, []).append(median_step(tmp, names, args.warmup))
            phases[mode] = median_phases(tmp, names, args.warmup)
            cpu.setdefault(mode, []).append(median_cpu(tmp, names, args.warmup))
    plain, ftm = statistics.median(res["plain"]), statistics.median(res["ft"])
    print(
        f"per-step time, {args.groups} groups x 1 rank, 4.2M-param MLP (16 MiB), "
        f"{args.steps} steps ({args.warmup} warm-up), {args.trials} trial(s), alternating"
    )
    print(
        f"  plain torch Gloo DDP : {plain * 1000:8.2f} ms   (trials: "
        f"{', '.join(f'{v * 1000:.1f}' for v in res['plain'])})"
    )
    print(
        f"  ft Manager + ft DDP  : {ftm * 1000:8.2f} ms   (trials: "
        f"{', '.join(f'{v * 1000:.1f}' for v in res['ft'])})"
    )
    print(f"  ratio ft / plain     : {ftm / plain:8.3f}x")
    pc, fc = statistics.median(cpu["plain"]), statistics.median(cpu["ft"])
    print(
        f"  CPU per step, per training process: plain {pc * 1000:.2f} ms, ft {fc * 1000:.2f} ms"
        f" ({fc / pc:.3f}x; the lighthouse's CPU is not included)"
    )
    for mode in ("plain", "ft"):
        z, fb, st = (v * 1000 for v in phases[mode])
        print(
            f"  {mode:>5} phases (last trial, medians): zero_grad {z:.2f} ms, "
            f"forward+backward {fb:.2f} ms, step {st:.2f} ms"
        )


def bench_failures(args: argparse.Namespace, tmp: str) -> None:
    import torch

    lh = bench_lighthouse(1, args.hb_ms, join_timeout_ms=1000)

    def long_child(group: int, name: str) -> List[Any]:
        """child_argv's arguments after (args, tmp) for an ft group that trains until killed."""
        return [group, "ft", free_port(), 100000, name, lh.address(), ["--pg-timeout", "60"]]

    names = [f"f-{g}" for g in range(args.groups)]
    procs = [spawn(args, tmp, *long_child(g, names[g])) for g in range(args.groups)]
    try:
        wait_until(lambda: min(progress(tmp, n) for n in names) >= 5, 300, "warm-up")
        # --- kill -9, then restart (recovery latency)
        victim = args.groups - 1
        t_kill = time.time()
        procs[victim].kill()
        procs[victim].wait(10)
        s = progress(tmp, names[0])
        wait_until(lambda: progress(tmp, names[0]) >= s + 5, 120, "survivors after kill")
        restarted = "f-restart"
        procs.append(spawn(args, tmp, *long_child(victim, restarted)))
        wait_until(lambda: progress(tmp, restarted) >= 3, 300, "restarted group")
        # --- the same kill and restart, the new group being a warm standby (as ft-launch does)
        standby_proc = start_standby()
        procs.append(standby_proc)
        s = progress(tmp, names[0])
        wait_until(lambda: progress(tmp, names[0]) >= s + 5, 120, "survivors with a standby")
        t_kill2 = time.time()
        procs[-2].kill()
        procs[-2].wait(10)
        s = progress(tmp, names[0])
        wait_until(lambda: progress(tmp, names[0]) >= s + 5, 120, "survivors after kill")
        warm = "f-warm-restart"
        activate_standby(
            standby_proc,
            child_argv(args, tmp, *long_child(victim, warm)),
            os.path.join(tmp, f"{warm}.log"),
        )
        wait_until(lambda: progress(tmp, warm) >= 3, 300, "group restarted from a standby")
        # --- SIGSTOP
        s = progress(tmp, names[0])
        t_stop = time.time()
        os.kill(procs[-1].pid, signal.SIGSTOP)
        wait_until(lambda: progress(tmp, names[0]) >= s + 5, 120, "survivors after stop")
        open(os.path.join(tmp, "stop"), "w").close()
        wait_all(procs[:victim], 120)
    finally:
        reap(procs)
        lh.shutdown()

    survivors = [load(tmp, n) for n in names[:victim]]

    def longest_gap(after: float, before: float) -> float:
        gaps = []
        for sv in survivors:
            walls = [st["wall"] for st in sv["steps"]]
            prev = max([w for w in walls if w <= after], default=None)
            nxt = [w for w in walls if after < w <= before]
            if prev is None or not nxt:
                continue
            seq = [prev] + nxt
            gaps.append(max(b - a for a, b in zip(seq, seq[1:])))
        return max(gaps)

    normal = statistics.median(s["dt"] for s in survivors[0]["steps"][args.warmup :])
    stall_kill = longest_gap(t_kill, t_kill2)  # the kill, the cold restart and its heal
    stall_kill2 = longest_gap(t_kill2, t_stop)  # the kill, the warm restart and its heal
    stall_stop = longest_gap(t_stop, float("inf"))

    # recovery breakdown from the restarted process's Manager log records (its stdout is gone,
    # so re-run a short restart measurement from the events captured before SIGSTOP is not
    # possible; the restarted child's json is written only at exit) -> use the log file.
    recs = [
        ("cold restart: a new process", parse_recovery(os.path.join(tmp, f"{restarted}.log"))),
        (
            "warm restart: a standby that had imported torch and ft (ft-launch's default)",
            parse_recovery(os.path.join(tmp, f"{warm}.log")),
        ),
    ]

    n = 2 * 4200000 * 4
    src = torch.empty(n // 4)
    t0 = time.perf_counter()
    for _ in range(5):
        src.clone()
    copy = (time.perf_counter() - t0) / 5

    print(
        f"failures, {args.groups} groups, heartbeat_timeout {args.hb_ms} ms, pg timeout 60 s; "
        f"normal step {normal * 1000:.1f} ms"
    )
    print(
        f"  survivors' longest stall, kill -9 : {stall_kill * 1000:8.1f} ms (cold restart), "
        f"{stall_kill2 * 1000:.1f} ms (warm restart)"
    )
    print(
        f"  survivors' longest stall, SIGSTOP : {stall_stop * 1000:8.1f} ms   "
        f"(bound: heartbeat timeout + one step = {args.hb_ms + normal * 1000:.0f} ms)"
    )
    for title, rec in recs:
        if not rec:
            print(f"  {title}: no recovery records found")
            continue
        total = rec["commit"] - rec["exec"]
        print(
            f"  recovery of the restarted group (state: 16 MiB params + 16 MiB momentum), {title}:"
        )
        print(
            f"    process start (exec or activation -> Manager ready) : {(rec['ready'] - rec['exec']) * 1000:8.1f} ms"
        )
        print(
            f"    quorum (start_quorum -> configured)   : {(rec['configured'] - rec['ready']) * 1000:8.1f} ms"
        )
        print(f"    transfer (fetch checkpoint)           : {rec['transfer_ms']:8.1f} ms")
        if "metadata_ms" in rec:
            print(f"      of which the source's metadata RPC  : {rec['metadata_ms']:8.1f} ms")
        print(
            f"    load (apply state)                    : {(rec['applied'] - rec['received']) * 1000:8.1f} ms"
        )
        print(f"    start -> first committed step         : {total * 1000:8.1f} ms")
        print(f"    local memory copy of the same 32 MiB  : {copy * 1000:8.1f} ms")


def parse_recovery(path: str) -> Dict[str, float]:
    """Reads the restarted child's Manager log lines (JSON-ish fields, see --child logging)."""
    out: Dict[str, float] = {}
    try:
        lines = open(path).read().splitlines()
    except OSError:
        return out
    for line in lines:
        if not line.startswith("BENCHEV "):
            continue
        ev = json.loads(line[len("BENCHEV ") :])
        e, t = ev["event"], ev["t"]
        if e == "exec":
            out["exec"] = t
        elif e == "start":
            out["ready"] = t
        elif e == "configure" and "configured" not in out:
            out["configured"] = t
        elif e == "heal_recv" and "metadata in " in ev["msg"]:
            out["metadata_ms"] = float(ev["msg"].split("metadata in ")[1].split(" ms")[0])
        elif e == "heal_recv" and "received the checkpoint" in ev["msg"]:
            out["received"] = t
            out["transfer_ms"] = float(ev["msg"].split(" in ")[1].split(" ms")[0])
        elif e == "heal_applied":
            out["applied"] = t
        elif e == "commit" and "commit" not in out and "not committed" not in ev["msg"]:
            out["commit"] = t
    return out if len(out) >= 7 else {}  # (metadata_ms is optional)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true")
    p.add_argument("--mode", default="ft")
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--lighthouse", default="")
    p.add_argument("--out", default="")
    p.add_argument("--progress", default="")
    p.add_argument("--stop-file", default="")
    p.add_argument("--sync", action="store_true")
    p.add_argument("--pg-timeout", type=float, default=60.0)
    p.add_argument("--hb-ms", type=int, default=1000)
    p.add_argument("--only", choices=["overhead", "failures"], default=None)
    args = p.parse_args()
    if args.child:
        print(
            "BENCHEV "
            + json.dumps({"event": "exec", "t": float(os.environ["BENCH_T_EXEC"]), "msg": ""}),
            flush=True,
        )

        class Echo(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                f = getattr(record, "ft", None)
                if f is not None:
                    print(
                        "BENCHEV "
                        + json.dumps(
                            {"event": f["event"], "t": record.created, "msg": record.getMessage()}
                        ),
                        flush=True,
                    )

        logging.getLogger("ft.manager").addHandler(Echo())
        child(args)
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="ft-manager-bench-") as tmp:
        if args.only in (None, "overhead"):
            bench_overhead(args, tmp)
        if args.only in (None, "failures"):
            bench_failures(args, tmp)
        keep = os.environ.get("FT_BENCH_KEEP_LOGS")  # a folder to copy the children's logs to
        if keep:
            shutil.copytree(tmp, keep, dirs_exist_ok=True)


if __name__ == "__main__":
    main()
