"""ManagerServer RPC cost for a replica group of 2 ranks: the per-step Quorum + ShouldCommit
that rank 1 (another process) sends to rank 0's ManagerServer, served by the native gRPC server
and by grpcio, side by side in one run. On the native server rank 1's native client sends them
as messages of its two call streams (``native``, the default), or as calls
(``native-calls``: FT_CLIENT_CALL_STREAMS=0); grpcio serves no call streams.

    .venv/bin/python -m bench.manager_server_bench [--rounds 300]

Rank 0 asks in-process (LocalManagerClient), as the Manager's rank 0 does; the lighthouse runs in
a third process. Reported per step: the wall time of the round as rank 1 sees it, and
the CPU time of the process hosting the ManagerServer (from os.times, all its threads), which
is what serving costs the training process of rank 0.

Results: docs/benchmarks.md, "Manager".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from datetime import timedelta

TIMEOUT = timedelta(seconds=30)
WARMUP = 10  # untimed rounds first
# The server's transport, and for the native one whether rank 1 uses call streams.
CONFIGS = ("native", "native-calls", "grpcio")


def own_cpu_s() -> float:
    """This process's CPU time so far (user + system, all its threads), seconds; at the
    clock's own resolution (os.times counts in 10 ms ticks, which a few rounds do not
    reach)."""
    return time.process_time()


def timed_steps(client, rank: int, rounds: int, barrier, clock) -> list:  # type: ignore[no-untyped-def]
    """``rounds`` steps of Quorum + ShouldCommit as ``rank``, each after ``barrier``, after
    WARMUP untimed ones; what each took by ``clock`` (seconds)."""
    costs = []
    for step in range(WARMUP + rounds):
        barrier.wait(timeout=60)
        c0 = clock()
        client._quorum(rank, step, "", False, TIMEOUT)
        client.should_commit(rank, step, True, TIMEOUT)
        costs.append(clock() - c0)
    return costs[WARMUP:]


def rank1(addr: str, rounds: int, barrier, out, streams: bool) -> None:  # type: ignore[no-untyped-def]
    from ft.coordination import _rpc
    from ft.coordination.clients import ManagerClient

    if not streams:
        os.environ[_rpc.CALL_STREAMS_ENV] = "0"
    client = ManagerClient(addr, timedelta(seconds=10))
    try:
        out.put(timed_steps(client, 1, rounds, barrier, time.perf_counter))
    except BaseException as e:  # noqa: BLE001
        out.put(repr(e))
        barrier.abort()
    finally:
        client.close()


def run(config: str, lighthouse_addr: str, rounds: int) -> tuple:
    from ft.coordination import ManagerServer
    from ft.coordination.manager_server import LocalManagerClient

    transport = config.split("-")[0]
    server = ManagerServer(
        f"bench-{config}",
        lighthouse_addr,
        "127.0.0.1",
        "127.0.0.1:0",
        "store",
        2,
        timedelta(milliseconds=100),
        timedelta(seconds=10),
        transport=transport,
    )
    local = LocalManagerClient(server)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    out = ctx.Queue()
    proc = ctx.Process(
        target=rank1,
        args=(server.address(), rounds, barrier, out, config != "native-calls"),
        daemon=True,
    )
    proc.start()
    try:
        cpu = timed_steps(local, 0, rounds, barrier, own_cpu_s)
        times = out.get(timeout=60)
        if isinstance(times, str):
            raise RuntimeError(f"rank 1 failed: {times}")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        server.shutdown(0.1)
    return statistics.median(times), statistics.mean(cpu), server_transport(server)


def server_transport(server) -> str:  # type: ignore[no-untyped-def]
    return server._server.transport


def lighthouse(addr_out, stop) -> None:  # type: ignore[no-untyped-def]
    from ft.coordination import LighthouseServer

    lh = LighthouseServer(
        "127.0.0.1:0", 1, join_timeout_ms=100, quorum_tick_ms=10, heartbeat_timeout_ms=5000
    )
    addr_out.put(lh.address())
    stop.wait(600)
    lh.shutdown(0.1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=300)
    a = p.parse_args()

    # the lighthouse in a process of its own: the CPU measured below is the ManagerServer's
    ctx = mp.get_context("spawn")
    addr_out, stop = ctx.Queue(), ctx.Event()
    lh = ctx.Process(target=lighthouse, args=(addr_out, stop), daemon=True)
    lh.start()
    rows = []
    try:
        addr = addr_out.get(timeout=60)
        for config in CONFIGS * 2:  # alternate against drift
            rows.append((config, *run(config, addr, a.rounds)))
    finally:
        stop.set()
        lh.join(10)
        if lh.is_alive():
            lh.kill()
    print(
        f"ManagerServer, group of 2 ranks, {a.rounds} steps (Quorum + ShouldCommit per step); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'server':12s} {'step round trip (rank 1)':>26s} {'server process CPU/step':>25s}")
    for config, wall, cpu, actual in rows:
        assert actual == config.split("-")[0], (actual, config)
        print(f"{config:12s} {wall * 1e3:23.2f} ms {cpu * 1e3:22.2f} ms")

    def ratio(a: str, b: str) -> str:
        mean = lambda name, i: statistics.mean(r[i] for r in rows if r[0] == name)  # noqa: E731
        over = lambda i: (  # noqa: E731
            f"{mean(a, i) / mean(b, i):.2f}x" if mean(b, i) > 0 else "n/a (nothing measured)"
        )
        return f"{a} / {b}: round trip {over(1)}, CPU {over(2)}"

    print(ratio("native", "grpcio"))
    print(ratio("native", "native-calls"))


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
