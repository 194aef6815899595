"""Quorum benchmark: round latency with unchanged membership, and failure detection time.

    python -m bench.quorum_bench [--groups 2 8 32] [--rounds 50] [--quick]

The lighthouse runs in its own process (``python -m ft.coordination.cli``), as in a real job.
For N simulated replica groups, each in its own process as in a real job, it measures the median
time of one quorum round with unchanged membership (from the first group asking to the last
answer), two ways:

* ``lighthouse``: every group calls ``LighthouseClient.quorum`` directly;
* ``full stack``: every group is a ``ManagerServer`` (world_size 1) asked in-process the way the
  Manager's rank 0 asks it, i.e. rank 0 -> ManagerServer -> lighthouse -> answer.

Baseline: the same N processes each doing one trivial RPC (Heartbeat) on the same lighthouse.
Each is measured with the lighthouse on the native gRPC server (C++, when built) and on grpcio.

Then, with 4 groups heartbeating every 100 ms, it stops one group's heartbeats and measures the
time from its last heartbeat to the failure notification (``subscribe_failures``) and to the
survivors' next quorum. Targets: a round under 5 ms at 8 groups; notification within
heartbeat_timeout + one tick.

Results: docs/benchmarks.md, "Quorum and lighthouse".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from datetime import timedelta

from ft.coordination import LighthouseClient
from ft.coordination.cli import LighthouseProcess, start_lighthouse_process
from tests.procs import in_threads, values


def start_lighthouse(
    min_replicas: int,
    heartbeat_timeout_ms: int,
    tick_ms: int,
    join_timeout_ms: int,
    transport: str = "auto",
) -> LighthouseProcess:
    return start_lighthouse_process(
        min_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        quorum_tick_ms=tick_ms,
        join_timeout_ms=join_timeout_ms,
        log_level="ERROR",
        transport=transport,
    )


def timed_rounds(n: int, rounds: int, ask) -> list:
    """n threads call ask(i) once per round; returns each round's duration (all asked -> last answer)."""
    starts, ends = [], [[0.0] * n for _ in range(rounds)]
    barrier = threading.Barrier(n, action=lambda: starts.append(time.perf_counter()))

    def worker(i: int) -> None:
        try:
            for r in range(rounds):
                barrier.wait(timeout=30)
                ask(i)
                ends[r][i] = time.perf_counter()
        except BaseException:
            barrier.abort()  # the others stop waiting for this one
            raise

    values(in_threads([lambda i=i: worker(i) for i in range(n)], timeout=120))
    return [max(ends[r]) - starts[r] for r in range(rounds)]


def _caller(
    i: int, n: int, addr: str, kind: str, rounds: int, barrier, results, server_pid: int
) -> None:
    """One simulated replica group, in its own process (as in a real job).

    kind "heartbeat": a trivial RPC (the floor); "lighthouse": LighthouseClient.quorum;
    "full": a ManagerServer (world_size 1) in this process, asked the way the Manager's rank 0
    asks it (in-process), which asks the lighthouse.
    """
    from ft.coordination import LighthouseClient, ManagerServer
    from ft.coordination.manager_server import LocalManagerClient

    rid = f"group{i:03d}"
    server = None
    try:
        if kind == "full":
            server = ManagerServer(
                rid,
                addr,
                "127.0.0.1",
                "127.0.0.1:0",
                f"store{i}",
                1,
                timedelta(milliseconds=100),
                timedelta(seconds=10),
            )
            client = LocalManagerClient(server)
            ask = lambda: client._quorum(0, 1, "", False, timedelta(seconds=30))  # noqa: E731
        else:
            lh = LighthouseClient(addr, timedelta(seconds=10))
            lh.heartbeat(rid, timeout=10)
            if kind == "heartbeat":
                ask = lambda: lh.heartbeat(rid, timeout=30)  # noqa: E731
            else:
                ask = lambda: lh.quorum(rid, timeout=30, step=1)  # noqa: E731
        times = []
        cpu0 = server0 = 0.0
        for r in range(rounds + 1):  # the first round forms the quorum (warm-up)
            barrier.wait(timeout=60)
            if r == 1:
                cpu0 = time.process_time()
                if i == 0:  # every group is past the warm-up round here
                    server0 = process_cpu_s(server_pid)
            t0 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            ask()
            times.append((t0, time.perf_counter()))
        client_cpu = (time.process_time() - cpu0) / rounds
        barrier.wait(timeout=60)  # every group has its last answer
        server_cpu = (process_cpu_s(server_pid) - server0) / rounds if i == 0 else 0.0
        # CPU per measured round: this process's (all its threads, incl. a ManagerServer's
        # heartbeats), and, from group 0, the lighthouse's (its whole process).
        results.put((i, (times[1:], client_cpu, server_cpu)))
    except BaseException as e:  # noqa: BLE001
        results.put((i, repr(e)))
        barrier.abort()
    finally:
        if server is not None:
            server.shutdown(0.1)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run so far: the sum of their scheduler statistics
    (nanoseconds; /proc/PID/stat counts in 10 ms ticks, too coarse for a few rounds). Threads
    that have already exited are not counted; the servers' threads live as long as they do."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended between the listing and the read
    return total / 1e9


def timed_rounds_mp(
    n: int, rounds: int, addr: str, kind: str, server_pid: int, cpu: dict = None
) -> list:
    """Each round: n processes ask at once; returns each round's first-ask -> last-answer.

    ``cpu``, when given, receives CPU ms per round: ``client_ms`` (the callers', summed over
    groups) and ``server_ms`` (the lighthouse process ``server_pid``'s).
    """
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(
            target=_caller,
            args=(i, n, addr, kind, rounds, barrier, results, server_pid),
            daemon=True,
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        per_group, client_cpu, server_cpu = {}, {}, {}
        for _ in range(n):
            i, got = results.get(timeout=180)
            if isinstance(got, str):
                raise RuntimeError(f"caller {i} ({kind}) failed: {got}")
            per_group[i], client_cpu[i], server_cpu[i] = got
    finally:
        join_callers(procs)
    if cpu is not None:
        cpu["client_ms"] = sum(client_cpu.values()) * 1000
        cpu["server_ms"] = server_cpu[0] * 1000
    return [
        max(per_group[g][r][1] for g in per_group) - min(per_group[g][r][0] for g in per_group)
        for r in range(rounds)
    ]


def bench_rounds(n: int, rounds: int, transport: str) -> dict:
    """Median round times, and CPU per round: the lighthouse's (its whole process over the
    phase, divided by the rounds: includes its tick thread) and the callers' (summed)."""
    lh_cpu, full_cpu = {}, {}
    with start_lighthouse(n, 5000, 100, 60000, transport) as server:
        floor = timed_rounds_mp(n, rounds, server.address, "heartbeat", server.pid)
        lh_times = timed_rounds_mp(n, rounds, server.address, "lighthouse", server.pid, lh_cpu)
    # A fresh lighthouse: the full-stack groups have new replica ids.
    with start_lighthouse(n, 5000, 100, 60000, transport) as server:
        full_times = timed_rounds_mp(n, rounds, server.address, "full", server.pid, full_cpu)
    return {
        "lighthouse_server_cpu_ms": lh_cpu["server_ms"],
        "lighthouse_client_cpu_ms": lh_cpu["client_ms"],
        "full_server_cpu_ms": full_cpu["server_ms"],
        "full_client_cpu_ms": full_cpu["client_ms"],
        "groups": n,
        "floor_median_ms": statistics.median(floor) * 1000,
        "lighthouse_median_ms": statistics.median(lh_times) * 1000,
        "lighthouse_p90_ms": sorted(lh_times)[int(0.9 * len(lh_times))] * 1000,
        "full_median_ms": statistics.median(full_times) * 1000,
        "full_p90_ms": sorted(full_times)[int(0.9 * len(full_times))] * 1000,
    }


def bench_death(heartbeat_timeout_ms: int, tick_ms: int, trials: int, transport: str) -> dict:
    server = start_lighthouse(1, heartbeat_timeout_ms, tick_ms, 60000, transport)
    try:
        lh = LighthouseClient(server.address, timedelta(seconds=10))
        to_notify, to_quorum = [], []
        for trial in range(trials):
            ids = [f"t{trial}-g{i}" for i in range(4)]
            victim = ids[-1]
            stops = {rid: threading.Event() for rid in ids}
            last_hb = {}

            def heartbeat(rid):
                while not stops[rid].is_set():
                    lh.heartbeat(rid, timeout=2)
                    last_hb[rid] = time.perf_counter()
                    stops[rid].wait(0.1)

            hbs = [threading.Thread(target=heartbeat, args=(rid,), daemon=True) for rid in ids]
            for t in hbs:
                t.start()
            while len(last_hb) < len(ids):
                time.sleep(0.01)
            timed_rounds(len(ids), 1, lambda i: lh.quorum(ids[i], timeout=30))
            note = {}
            got = threading.Event()

            def on_failure(n):
                if n.replica_id == victim and "t" not in note:
                    note["t"] = time.perf_counter()
                    got.set()

            sub = lh.subscribe_failures(on_failure)
            sub.wait_subscribed(10)
            stops[victim].set()
            hbs[-1].join(5)
            t_dead = last_hb[victim]
            survivors = ids[:-1]
            q_end = []
            timed_rounds(
                len(survivors),
                1,
                lambda i: (lh.quorum(survivors[i], timeout=30), q_end.append(time.perf_counter())),
            )
            got.wait(30)
            sub.close()
            for rid in survivors:
                stops[rid].set()
            for t in hbs:
                t.join(5)
            to_notify.append(note["t"] - t_dead)
            to_quorum.append(max(q_end) - t_dead)
        return {
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
            "tick_ms": tick_ms,
            "notify_median_ms": statistics.median(to_notify) * 1000,
            "notify_max_ms": max(to_notify) * 1000,
            "quorum_median_ms": statistics.median(to_quorum) * 1000,
            "quorum_max_ms": max(to_quorum) * 1000,
        }
    finally:
        server.stop()


def join_callers(procs) -> None:
    """Waits for the caller processes (10 s each); kills the ones still running."""
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def add_round_options(p: argparse.ArgumentParser, rounds: int) -> None:
    """The options of a quorum round measurement (``bench_rounds``): the numbers of groups, the
    rounds of a trial (default ``rounds``) and the trials."""
    p.add_argument("--groups", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--trials", type=int, default=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_round_options(p, rounds=50)
    p.add_argument("--heartbeat_timeout_ms", type=int, default=1000)
    p.add_argument("--tick_ms", type=int, default=100)
    p.add_argument("--quick", action="store_true", help="fewer rounds and trials")
    p.add_argument(
        "--transports",
        nargs="+",
        default=None,
        choices=["native", "grpcio"],
        help="lighthouse gRPC servers to measure (default: native when built, and grpcio)",
    )
    a = p.parse_args()
    if a.quick:
        a.rounds, a.trials = 10, 1
    if a.transports is None:
        from ft.coordination.rpc_server import native_available

        a.transports = (["native"] if native_available() else []) + ["grpcio"]
    print(
        f"quorum round, unchanged membership ({a.rounds} rounds; the lighthouse and every group "
        "in its own process)"
    )
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; baseline = the same "
        "callers doing one trivial RPC (Heartbeat) each"
    )
    print(
        f"{'server':>7} {'groups':>6} {'baseline':>10} {'lighthouse':>11} {'p90':>9} {'ratio':>6}"
        f" {'full stack':>11} {'p90':>9}"
    )
    for n in a.groups:
        for transport in a.transports:
            r = bench_rounds(n, a.rounds, transport)
            print(
                f"{transport:>7} {n:>6} {r['floor_median_ms']:>7.2f} ms"
                f" {r['lighthouse_median_ms']:>8.2f} ms {r['lighthouse_p90_ms']:>6.2f} ms"
                f" {r['lighthouse_median_ms'] / r['floor_median_ms']:>5.2f}x"
                f" {r['full_median_ms']:>8.2f} ms {r['full_p90_ms']:>6.2f} ms",
                flush=True,
            )
    d = bench_death(a.heartbeat_timeout_ms, a.tick_ms, a.trials, a.transports[0])
    bound = a.heartbeat_timeout_ms + a.tick_ms
    print(
        f"\nmember death (heartbeats stop, {a.transports[0]} server), heartbeat_timeout {a.heartbeat_timeout_ms} ms, tick "
        f"{a.tick_ms} ms, {a.trials} trials, 4 groups; bound heartbeat_timeout + tick = {bound} ms"
    )
    print(
        f"  last heartbeat -> failure notification: median {d['notify_median_ms']:.0f} ms, "
        f"max {d['notify_max_ms']:.0f} ms"
    )
    print(
        f"  last heartbeat -> survivors' next quorum: median {d['quorum_median_ms']:.0f} ms, "
        f"max {d['quorum_max_ms']:.0f} ms"
    )


if __name__ == "__main__":
    main()
