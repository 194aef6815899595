"""Checkpoint transport benchmark: a 16 MiB state dict over HTTPTransport (its same-host path
and its HTTP path) and PGTransport (Gloo) on loopback, against local memory copies of the same
bytes (torch.clone; copy_ into preallocated tensors; copy into fresh huge-page memory, which is
what a receiver allocates, timed alternately with the same-host transfer for the ratio).

    .venv/bin/python -m bench.transport_bench [--mb 16] [--reps 15] [--throughput-mb 128]

The sender runs in a separate process (as in a real heal); the receiver is this process. Each
transfer is timed from the receiver's recv_checkpoint call to its return: request, checksums,
reassembly and (for HTTP) the header round trip included. Medians over --reps.

Results: docs/benchmarks.md, "Checkpoint transports".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import zlib
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ft.checkpointing import HTTPTransport, PGTransport

TIMEOUT = timedelta(seconds=60)


def make_state(mb: int) -> Dict[str, Any]:
    """~mb MiB of float32 in 8 layers (like a 4M-parameter model for 16 MiB) plus scalars."""
    g = torch.Generator().manual_seed(0)
    n = mb * (1 << 18)  # float32 elements
    per = n // 8
    model = {f"layers.{i}.weight": torch.randn(per, generator=g) for i in range(8)}
    return {"user": {"model": model}, "torchft": {"step": 1, "batches_committed": 3}}


def model_tensors(state: Dict[str, Any]) -> List[torch.Tensor]:
    return list(state["user"]["model"].values())


def gloo_pg(store: object, rank: int, world: int) -> object:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = TIMEOUT
    return dist.ProcessGroupGloo(store, rank, world, opts)


def child(mode: str, mb: int, reps: int, port: int) -> None:
    state = make_state(mb)
    if mode == "tcp":  # raw loopback TCP, for scale: no HTTP, no checksums, no serialization
        import socket

        flat = torch.cat(model_tensors(state)).view(torch.uint8).numpy()
        srv = socket.create_server(("127.0.0.1", 0))
        print(json.dumps({"port": srv.getsockname()[1]}), flush=True)
        for _ in range(reps + 1):
            conn, _ = srv.accept()
            conn.sendall(memoryview(flat))
            conn.close()
    elif mode == "http":
        tr = HTTPTransport(TIMEOUT, 4, advertise_host="127.0.0.1")
        t0 = time.perf_counter()
        tr.send_checkpoint([1], 1, state, TIMEOUT)
        # A healer needs milliseconds to find its source (quorum answer, metadata RPC); by then
        # the source has usually prepared for same-host receivers (huge-page copy, checksums).
        # Wait for that, so that every timed transfer sees the same source.
        st = tr._staging
        while st is not None and not st.prepared() and time.perf_counter() - t0 < 30:
            time.sleep(0.001)
        prep_ms = (time.perf_counter() - t0) * 1e3
        print(json.dumps({"url": tr.metadata(), "prepare_ms": prep_ms}), flush=True)
        sys.stdin.readline()
        tr.shutdown()
    else:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=TIMEOUT)
        pg = gloo_pg(store, 0, 2)
        tr = PGTransport(pg, TIMEOUT, torch.device("cpu"))
        for _ in range(reps + 1):
            pg.barrier().wait()  # type: ignore[attr-defined]
            tr.send_checkpoint([1], 1, state, TIMEOUT)
    os._exit(0)


def spawn(mode: str, mb: int, reps: int, port: int = 0) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.transport_bench",
            "--child",
            mode,
            "--mb",
            str(mb),
            "--reps",
            str(reps),
            "--port",
            str(port),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def median_time(fn, reps: int) -> tuple:  # type: ignore[no-untyped-def]
    """(median, min) seconds over ``reps`` timed calls after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def fresh_copier(tensors: List[torch.Tensor]):  # type: ignore[no-untyped-def]
    """A function that copies ``tensors`` into fresh memory allocated as a receiver does."""
    from ft.checkpointing import serialization as ser

    specs = ser.flatten(tensors)[1]

    def copy_fresh() -> None:
        for sp, t in zip(specs, tensors):
            ser.allocate(sp, torch.device("cpu")).copy_(t)

    return copy_fresh


def same_host_throughput(mb: int, reps: int) -> tuple:
    """Same-host transfers of an ``mb`` MiB state timed alternately with copies of it into
    fresh memory: ((median, min) transfer, (median, min) copy, sorted per-pair ratios)."""
    tensors = model_tensors(make_state(mb))
    proc = spawn("http", mb, reps)
    try:
        url = json.loads(proc.stdout.readline())["url"]  # type: ignore[union-attr]
        with HTTPTransport(TIMEOUT, 1, advertise_host="127.0.0.1") as rx:  # (source prepared)
            out = paired_times(
                lambda: rx.recv_checkpoint(0, url, 1, TIMEOUT), fresh_copier(tensors), reps
            )
            assert rx.last_recv_path == "same-host", rx.last_recv_path
        return out
    finally:
        proc.stdin.write("quit\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        proc.wait(30)


def paired_times(fn, baseline, reps: int) -> tuple:  # type: ignore[no-untyped-def]
    """Times ``fn`` and ``baseline`` alternately ``reps`` times each (after a warm-up of each):
    ((median, min) of fn, (median, min) of baseline, sorted per-pair ratios fn/baseline)."""
    fn()
    baseline()
    ours, base = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        baseline()
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        base.append(t2 - t1)
    ratios = sorted(o / b for o, b in zip(ours, base))
    return (statistics.median(ours), min(ours)), (statistics.median(base), min(base)), ratios


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument(
        "--throughput-mb",
        type=int,
        default=128,
        help="also time the same-host path on a state this large (0: skip)",
    )
    p.add_argument("--child", default=None)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    if a.child:
        child(a.child, a.mb, a.reps, a.port)
        return

    state = make_state(a.mb)
    tensors = model_tensors(state)
    size = sum(t.numel() * t.element_size() for t in tensors)
    mib = size / (1 << 20)
    rows: List[tuple] = []

    torch.set_num_threads(1)  # a loaded 2-core box makes multi-threaded copies erratic
    t_copy = median_time(lambda: [t.clone() for t in tensors], a.reps)
    rows.append(("memory copy (torch.clone)", t_copy))
    dst = [torch.empty_like(t) for t in tensors]
    t_memcpy = median_time(lambda: [d.copy_(t) for d, t in zip(dst, tensors)], a.reps)
    rows.append(("copy_ into preallocated tensors", t_memcpy))
    from ft.checkpointing import serialization as ser

    copy_fresh = fresh_copier(tensors)
    t_fresh = median_time(copy_fresh, a.reps)
    rows.append(("copy into fresh huge-page memory", t_fresh))
    flat = torch.cat(tensors).view(torch.uint8).numpy()
    t_crc = median_time(lambda: zlib.crc32(flat), a.reps)
    rows.append(("zlib.crc32 of the same bytes", t_crc))
    rows.append(
        ("ft crc32c of the same bytes (used)", median_time(lambda: ser.crc32c(flat), a.reps))
    )

    proc = spawn("tcp", a.mb, a.reps)
    try:
        import socket

        tcp_port = json.loads(proc.stdout.readline())["port"]  # type: ignore[union-attr]
        buf = memoryview(bytearray(size))

        def tcp_recv() -> None:
            with socket.create_connection(("127.0.0.1", tcp_port), timeout=60) as c:
                got = 0
                while got < size:
                    n = c.recv_into(buf[got:])
                    assert n
                    got += n

        rows.append(("raw loopback TCP, 1 stream", median_time(tcp_recv, a.reps)))
    finally:
        proc.wait(30)

    proc = spawn("http", a.mb, a.reps)
    try:
        hello = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        url, prepare_ms = hello["url"], hello["prepare_ms"]
        for chunks in (0, 1, 2, 4, 8):  # 0: the same-host path
            with HTTPTransport(
                TIMEOUT, max(1, chunks), advertise_host="127.0.0.1", same_host=chunks == 0
            ) as rx:
                if chunks == 0:
                    # The ratio to a fresh-memory copy is the claim: time the two alternately,
                    # so that both see the same state of the machine (free huge pages, load).
                    t, paired_fresh, pair_ratios = paired_times(
                        lambda: rx.recv_checkpoint(0, url, 1, TIMEOUT), copy_fresh, 2 * a.reps + 1
                    )
                    rows.append(("copy into fresh memory, paired", paired_fresh))
                else:
                    t = median_time(lambda: rx.recv_checkpoint(0, url, 1, TIMEOUT), a.reps)
                got = rx.recv_checkpoint(0, url, 1, TIMEOUT)
                path = rx.last_recv_path
            assert path == ("same-host" if chunks == 0 else "http"), path
            assert all(torch.equal(x, y) for x, y in zip(tensors, got["user"]["model"].values()))
            name = (
                "HTTPTransport, same-host path"
                if chunks == 0
                else (f"HTTPTransport, HTTP, {chunks} chunk(s)")
            )
            rows.append((name, t))
    finally:
        proc.stdin.write("quit\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        proc.wait(30)

    big = same_host_throughput(a.throughput_mb, 7) if a.throughput_mb else None

    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=TIMEOUT, wait_for_workers=False)
    proc = spawn("pg", a.mb, a.reps, store.port)
    try:
        pg = gloo_pg(dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=TIMEOUT), 1, 2)
        rx = PGTransport(pg, TIMEOUT, torch.device("cpu"))

        def pg_recv() -> None:
            pg.barrier().wait()  # type: ignore[attr-defined]
            rx.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)

        rows.append(("PGTransport (Gloo)", median_time(pg_recv, a.reps)))
    finally:
        proc.wait(60)

    print(
        f"state dict: {mib:.1f} MiB in {len(tensors)} tensors; {a.reps} runs each; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    clone, memcpy = t_copy[0], t_memcpy[0]
    print(
        f"{'method':34s} {'median ms':>9s} {'min ms':>7s} {'MiB/s':>7s} "
        f"{'/clone':>7s} {'/copy_':>7s}"
    )
    for name, (med, best) in rows:
        print(
            f"{name:34s} {med * 1e3:9.1f} {best * 1e3:7.1f} {mib / med:7.0f} "
            f"{med / clone:6.1f}x {med / memcpy:6.1f}x"
        )
    http_best = min(med for name, (med, _) in rows if name.startswith("HTTPTransport, HTTP"))
    local = next(med for name, (med, _) in rows if name.endswith("same-host path"))
    pg = next(med for name, (med, _) in rows if name.startswith("PG"))
    paired = next(med for name, (med, _) in rows if name.endswith("paired"))
    print(
        f"{mib:.0f} MiB recovery transfer: same-host {local * 1e3:.1f} ms, HTTP "
        f"{http_best * 1e3:.1f} ms (best chunking), PG/Gloo {pg * 1e3:.1f} ms; target < 1 s: "
        f"{'met' if max(local, http_best, pg) < 1 else 'MISSED'}"
    )
    q = len(pair_ratios)
    print(
        f"same-host transfer vs a local copy of the same bytes: {local / paired:.2f}x a copy "
        f"into fresh (huge-page) memory timed alternately with it (per-pair ratio: median "
        f"{pair_ratios[q // 2]:.2f}x, quartiles {pair_ratios[q // 4]:.2f}x to "
        f"{pair_ratios[3 * q // 4]:.2f}x), {local / clone:.2f}x torch.clone, "
        f"{local / memcpy:.2f}x copy_ into preallocated memory (target <= 2x)"
    )
    print(
        f"the source's preparation for same-host receivers (huge-page copy of its tensors and "
        f"checksums, on a background thread from send_checkpoint): {prepare_ms:.1f} ms"
    )
    if big is not None:
        (t_big, _), (c_big, _), r_big = big
        n = a.throughput_mb
        print(
            f"same-host throughput on {n} MiB (fixed per-transfer costs amortized): "
            f"{n / t_big:.0f} MiB/s, {t_big * 1e3:.1f} ms, {t_big / c_big:.2f}x a copy into "
            f"fresh memory timed alternately with it ({c_big * 1e3:.1f} ms; per-pair median "
            f"{r_big[len(r_big) // 2]:.2f}x)"
        )


if __name__ == "__main__":
    main()
