"""What authentication costs: every measurement with the job secret off and on, in one run.

    .venv/bin/python -m bench.auth_bench [--groups 2 8 32] [--rounds 30] [--trials 3]
        [--only quorum|paired|step|cost|heal]

Baseline: the same code with no secret, measured alternately with it (off, on, on, off, ...),
so that drift on the machine falls on both sides. Reported: medians of the per-trial medians
and their ratio (on / off). Target: at most 1.03 for each.

1. quorum: the round of bench/quorum_bench.py (lighthouse in its own process, one process per
   group), ``LighthouseClient.quorum`` direct and through a ManagerServer (full stack): the
   median round time, and CPU per round of the lighthouse ("cpu srv") and of all the groups
   together ("cpu cli"). On a machine with fewer cores than processes the CPU figures are the
   steadier measure of what the signatures cost.
   paired: the direct round again, with the two sides measured in the same moments: two
   lighthouses (one with the secret, one without) run side by side and every group asks both
   in each round, in an order that flips every round. Machine drift, which the trials above
   can only average out, falls on both sides of every pair; reported is the median of the
   per-round ratios with its interquartile range.
2. step: the ft loop of bench/manager_bench.py (Manager + ft DDP + async quorum, 2 groups,
   16 MiB MLP): median step time.
3. cost: what a signature costs per request, measured alone (deterministic, unlike the
   rounds on a shared 2-core machine): the native client's C++ sign, the native server's C++
   check, and grpcio's Python sign and check, beside the CPU one Heartbeat RPC costs client
   and server without a secret (one client, back to back, on the native lighthouse).
4. heal: HTTPTransport, source and receiver in this process on loopback, HTTP path (the
   same-host path is off), a --heal-mb MiB state: median transfer time. With the secret the
   source signs the metadata and each range's checksum; the bytes are read once either way.

Results: docs/benchmarks.md, "Authentication".
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List

SECRET = "auth-bench-secret-0123456789abcdef0123"


def set_auth(on: bool) -> None:
    """Every process started after this (and every server made here) sees the secret or not."""
    os.environ.pop("FT_JOB_SECRET_FILE", None)
    if on:
        os.environ["FT_JOB_SECRET"] = SECRET
    else:
        os.environ.pop("FT_JOB_SECRET", None)


def alternate(
    measure: Callable[[], Dict[str, float]], trials: int
) -> Dict[str, Dict[str, List[float]]]:
    """Runs ``measure`` with the secret off and on, alternately, ``trials`` times each."""
    out: Dict[str, Dict[str, List[float]]] = {"off": {}, "on": {}}
    for trial in range(trials):
        # The order flips every trial, so that whatever the previous run leaves behind (exiting
        # processes, a warm cache) falls on both sides.
        for mode in ("off", "on") if trial % 2 == 0 else ("on", "off"):
            set_auth(mode == "on")
            for k, v in measure().items():
                out[mode].setdefault(k, []).append(v)
    set_auth(False)
    return out


def report(title: str, res: Dict[str, Dict[str, List[float]]], unit: str = "ms") -> None:
    for key in res["off"]:
        off, on = statistics.median(res["off"][key]), statistics.median(res["on"][key])
        print(
            f"  {title:<28} {key:<12} off {off:9.3f} {unit}   on {on:9.3f} {unit}   "
            f"ratio {on / off:6.3f}   (trials off: "
            f"{', '.join(f'{v:.2f}' for v in res['off'][key])}; on: "
            f"{', '.join(f'{v:.2f}' for v in res['on'][key])})",
            flush=True,
        )


def bench_quorum(groups: List[int], rounds: int, trials: int, transport: str) -> None:
    from bench import quorum_bench

    print(f"quorum round ({rounds} rounds per trial, {trials} trials, {transport} lighthouse)")
    for n in groups:

        def measure() -> Dict[str, float]:
            r = quorum_bench.bench_rounds(n, rounds, transport)
            return {
                "lighthouse": r["lighthouse_median_ms"],
                "full stack": r["full_median_ms"],
                # CPU per round: the lighthouse process, and all the groups' processes
                "lh cpu srv": r["lighthouse_server_cpu_ms"],
                "lh cpu cli": r["lighthouse_client_cpu_ms"],
                "full cpu srv": r["full_server_cpu_ms"],
                "full cpu cli": r["full_client_cpu_ms"],
            }

        report(f"{n} groups", alternate(measure, trials))


def bench_step(trials: int, steps: int) -> None:
    import argparse as _argparse

    from bench import manager_bench

    args = _argparse.Namespace(groups=2, steps=steps, warmup=5, trials=1, hb_ms=1000)
    tmp = tempfile.mkdtemp(prefix="ft-auth-bench-")
    counter = [0]

    def measure() -> Dict[str, float]:
        counter[0] += 1
        lh = manager_bench.bench_lighthouse(args.groups, args.hb_ms)
        names = [f"ft{counter[0]}-{g}" for g in range(args.groups)]
        procs = [
            manager_bench.spawn(
                args, tmp, g, "ft", manager_bench.free_port(), args.steps, names[g], lh.address()
            )
            for g in range(args.groups)
        ]
        try:
            manager_bench.wait_all(procs, 300)
        finally:
            manager_bench.reap(procs)
            lh.shutdown()
        return {"step": manager_bench.median_step(tmp, names, args.warmup) * 1000}

    print(
        f"training step (2 groups x 1 rank, 16 MiB MLP, {steps} steps per trial, {trials} trials)"
    )
    report("ft Manager + ft DDP", alternate(measure, trials))


def bench_cost(requests: int) -> None:
    from bench import quorum_bench
    from ft.coordination import LighthouseClient
    from ft.coordination.rpc_server import native_available
    from ft.utils.auth import GRPC_PURPOSE, JobSecret, Signer, Verifier, new_server_id

    secret = JobSecret(SECRET)
    sid = new_server_id()  # tokens are bound to one server life (docs/security.md)
    path = "/torchft.LighthouseService/Heartbeat"
    body = b"\n\x0fgroup-000:abcdef"  # a heartbeat's bytes
    signer = Signer(secret, GRPC_PURPOSE)
    verifier = Verifier(secret, GRPC_PURPOSE, server_id=sid)
    n = 50000
    t0 = time.perf_counter()
    tokens = [signer.sign(path, body, sid) for _ in range(n)]
    sign_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for t in tokens:
        verifier.verify(path, body, t)
    python_verify_us = (time.perf_counter() - t0) / n * 1e6
    native_verify_us = native_sign_us = float("nan")
    if native_available():
        from ft.coordination import _grpc_server

        native_signer = _grpc_server.RequestSigner(signer.key)
        native_signer.set_server_id(sid)
        t0 = time.perf_counter()
        for _ in range(n):
            native_signer.token(path, body)
        native_sign_us = (time.perf_counter() - t0) / n * 1e6  # includes the Python call
        native = _grpc_server.RequestVerifier(*verifier.native_config())
        tokens = [signer.sign(path, body, sid) for _ in range(n)]
        t0 = time.perf_counter()
        for t in tokens:
            native.verify(path, body, t)
        native_verify_us = (time.perf_counter() - t0) / n * 1e6  # includes the Python call
    set_auth(False)
    lighthouse = quorum_bench.start_lighthouse(1, 5000, 100, 60000, "native")
    try:
        c = LighthouseClient(lighthouse.address, timedelta(seconds=10))
        for _ in range(300):
            c.heartbeat("cost", timeout=5)
        s0, c0 = quorum_bench.process_cpu_s(lighthouse.pid), time.process_time()
        for _ in range(requests):
            c.heartbeat("cost", timeout=5)
        client_us = (time.process_time() - c0) / requests * 1e6
        server_us = (quorum_bench.process_cpu_s(lighthouse.pid) - s0) / requests * 1e6
    finally:
        lighthouse.stop()
    print(f"cost of a signature per request ({n} signatures; RPC CPU over {requests} heartbeats)")
    print(
        f"  client: native C++ sign {native_sign_us:.1f} us (grpcio's Python sign "
        f"{sign_us:.1f} us), against {client_us:.0f} us of CPU per RPC without a secret: "
        f"{native_sign_us / client_us * 100:.1f} %"
    )
    print(
        f"  server: native C++ check {native_verify_us:.1f} us (grpcio's Python check "
        f"{python_verify_us:.1f} us), against {server_us:.0f} us of CPU per RPC: "
        f"{native_verify_us / server_us * 100:.1f} %"
    )


def bench_heal(mb: int, reps: int, trials: int) -> None:
    import torch

    from ft.checkpointing import HTTPTransport

    n = mb * (1 << 20) // 4 // 8
    state = {f"p{i}": torch.randn(n) for i in range(8)}
    to = timedelta(seconds=60)

    def measure() -> Dict[str, float]:
        kw = dict(advertise_host="127.0.0.1", bind_host="127.0.0.1", same_host=False)
        with HTTPTransport(to, 4, **kw) as src, HTTPTransport(to, 4, **kw) as rx:
            src.send_checkpoint([1], 1, state, to)
            rx.recv_checkpoint(0, src.metadata(), 1, to)  # warm-up
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                rx.recv_checkpoint(0, src.metadata(), 1, to)
                times.append(time.perf_counter() - t0)
            src.disallow_checkpoint()
        return {"transfer": statistics.median(times) * 1000}

    print(
        f"heal transfer (HTTP path, 4 connections, {mb} MiB, {reps} reps per trial, {trials} trials)"
    )
    res = alternate(measure, trials)
    report("HTTPTransport", res)
    off, on = (statistics.median(res[m]["transfer"]) / 1000 for m in ("off", "on"))
    print(f"  {'':<28} {'throughput':<12} off {mb / off:7.0f} MiB/s   on {mb / on:7.0f} MiB/s")


# --------------------------------------------------------------------------- paired rounds


def _paired_caller(i: int, n: int, addrs: Dict[str, str], rounds: int, barrier, results) -> None:
    """One simulated replica group (its own process) with two LighthouseClients: one signing
    with the secret (to the lighthouse that has it) and one not (to the one that has none).
    Every round asks both, in an order that flips every round."""
    from ft.coordination import LighthouseClient

    rid = f"group{i:03d}"
    try:
        clients = {
            "off": LighthouseClient(addrs["off"], timedelta(seconds=10), secret=None),
            "on": LighthouseClient(addrs["on"], timedelta(seconds=10), secret=SECRET),
        }
        for c in clients.values():
            c.heartbeat(rid, timeout=10)
        times: Dict[str, list] = {"off": [], "on": []}
        for r in range(rounds + 1):  # round 0 forms both quorums (warm-up)
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                barrier.wait(timeout=60)
                t0 = time.perf_counter()
                clients[mode].quorum(rid, timeout=30, step=1)
                times[mode].append((t0, time.perf_counter()))
        results.put((i, {m: v[1:] for m, v in times.items()}))
    except BaseException as e:  # noqa: BLE001
        results.put((i, repr(e)))
        barrier.abort()


def bench_paired(groups: List[int], rounds: int, transport: str) -> None:
    """The direct round with the secret off and on, paired: two lighthouses (one with the
    secret, one without) run side by side, and every group asks both in each round, so the
    two sides of every pair see the same machine at the same moment. Reported: the median
    round of each side and the median and spread of the per-round ratio on / off."""
    import multiprocessing as mp

    from bench import quorum_bench

    print(f"paired direct rounds ({rounds} pairs, {transport} lighthouses)")
    for n in groups:
        procs: Dict[str, Any] = {}
        try:
            for mode in ("off", "on"):
                set_auth(mode == "on")  # the lighthouse process inherits it
                procs[mode] = quorum_bench.start_lighthouse(n, 5000, 100, 60000, transport)
            set_auth(False)
            addrs = {m: p.address for m, p in procs.items()}
            ctx = mp.get_context("spawn")
            barrier, results = ctx.Barrier(n), ctx.Queue()
            callers = [
                ctx.Process(
                    target=_paired_caller, args=(i, n, addrs, rounds, barrier, results), daemon=True
                )
                for i in range(n)
            ]
            for p in callers:
                p.start()
            try:
                per_group = {}
                for _ in range(n):
                    i, got = results.get(timeout=300)
                    if isinstance(got, str):
                        raise RuntimeError(f"caller {i} failed: {got}")
                    per_group[i] = got
            finally:
                quorum_bench.join_callers(callers)
        finally:
            set_auth(False)
            for lighthouse in procs.values():
                lighthouse.stop()

        def round_times(mode: str) -> List[float]:
            return [
                max(per_group[g][mode][r][1] for g in per_group)
                - min(per_group[g][mode][r][0] for g in per_group)
                for r in range(rounds)
            ]

        off, on = round_times("off"), round_times("on")
        ratios = sorted(b / a for a, b in zip(off, on))
        q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
        print(
            f"  {n} groups: off {statistics.median(off) * 1000:.3f} ms   on "
            f"{statistics.median(on) * 1000:.3f} ms   ratio of medians "
            f"{statistics.median(on) / statistics.median(off):.3f}   per-round ratio: median "
            f"{statistics.median(ratios):.3f} (25-75 %: {q(0.25):.3f}-{q(0.75):.3f})",
            flush=True,
        )


def main() -> None:
    from bench import quorum_bench

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    quorum_bench.add_round_options(p, rounds=30)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--heal-mb", type=int, default=128)
    p.add_argument("--heal-reps", type=int, default=5)
    p.add_argument("--transport", default=None, choices=["native", "grpcio"])
    p.add_argument("--only", choices=["quorum", "paired", "step", "cost", "heal"], default=None)
    p.add_argument("--pairs", type=int, default=400, help="rounds per side for --only paired")
    p.add_argument("--cost-requests", type=int, default=5000)
    a = p.parse_args()
    if a.transport is None:
        from ft.coordination.rpc_server import native_available

        a.transport = "native" if native_available() else "grpcio"
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; secret off vs on, "
        "alternating"
    )
    if a.only in (None, "quorum"):
        bench_quorum(a.groups, a.rounds, a.trials, a.transport)
    if a.only in (None, "paired"):
        bench_paired(a.groups, a.pairs, a.transport)
    if a.only in (None, "step"):
        bench_step(a.trials, a.steps)
    if a.only in (None, "cost"):
        bench_cost(a.cost_requests)
    if a.only in (None, "heal"):
        bench_heal(a.heal_mb, a.heal_reps, a.trials)


if __name__ == "__main__":
    main()
