"""ft's lighthouse and client beside torchft 0.2.0's (Rust), on one harness, in one run.

    .venv/bin/python -m bench.quorum_vs_torchft [--groups 2 8 32 256] [--rounds 30] [--repeats 3]
        [--heartbeats 3000] [--secret] [--clients ft-native ft-grpcio torchft]

torchft is installed with ``pip install --no-deps torchft==0.2.0`` into a throwaway venv
(``$FT_BENCH_TORCHFT_VENV``, default /tmp/ft-bench-torchft) that sees this venv's packages; the
bench then re-runs itself there, where both libraries import. Where torchft cannot be
installed (no package index), it says so and measures ft alone.

Harness, the same for both libraries: the lighthouse runs in its own process (ft: ``python -m
ft.coordination.cli``, native gRPC server; torchft: its ``torchft_lighthouse`` binary). Every
simulated replica group is a client thread in this process; a round is every group calling
``quorum`` at once with unchanged membership, timed from the first call to the last answer.
Every pairing is measured (client x server), so that the client's and the server's shares stay
visible. ft's client runs on both of its transports (``LighthouseClient(transport=...)``):
``ft-native`` (gRPC C++, ft.coordination._grpc_server.Channel; its Quorum requests are
messages of one ``QuorumStream`` call per client where the server has it, ft's lighthouse, and
calls otherwise) and ``ft-grpcio``.

1. Steady round, median over ``--rounds``, at each ``--groups``, the lighthouse's CPU per
   round (its threads' scheduler time; /proc/PID/task/*/schedstat), and the clients' CPU per
   quorum call (this process's CPU time over the rounds, divided by the calls). Every pairing
   is measured ``--repeats`` times, the pairings taking turns (so that a slow minute of the
   machine does not fall on one library), and the median of the repeats is reported with
   their range: on 2 shared cores one measurement of a sub-millisecond round varies 2x.
2. Heartbeats: one client sends ``--heartbeats`` heartbeats back to back; reported: the
   lighthouse's CPU per heartbeat, the latency, the client's CPU per heartbeat, and what the
   lighthouse's CPU makes for 1024 groups heartbeating at 10 Hz (10,240 heartbeats/s), in cores.
3. Steady round with C++ clients: the same rounds, every group a connection of
   ``LoadGenerator.run_rounds`` (C++, all calls of a round started at once from one thread),
   on each server: the lighthouse's round without Python clients sharing its cores. Needs the
   native module; not run with ``--secret``.
4. Heartbeat load: 1024 groups x 10 Hz for real, from ``ft.coordination._grpc_server.
   LoadGenerator`` (C++, open loop: heartbeats go out on schedule whether or not earlier ones
   were answered) over ``--load-connections`` connections (default 1024: one per group, as in
   a job), 1024 replica ids, for ``--load-seconds``; reported: the rate achieved, the
   heartbeats that failed, and the lighthouse's CPU in cores while it ran. Both lighthouses
   get Heartbeat calls (what torchft's client sends); ft's also gets the same load as messages
   on one HeartbeatStream call per group (what ft's native client sends). Needs the native
   module; not run with ``--secret`` (the generator does not sign).

With ``--secret`` ft's side runs with a job secret (signed requests, verified in C++); torchft
has no authentication, so that compares a secured ft with an open torchft.

Results: docs/benchmarks.md, "Quorum and lighthouse".
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import types
from datetime import timedelta
from typing import Callable, List, Optional, Tuple

from bench.quorum_bench import process_cpu_s, timed_rounds  # one harness for both

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VENV = os.environ.get("FT_BENCH_TORCHFT_VENV", "/tmp/ft-bench-torchft")
TORCHFT = "torchft==0.2.0"
SECRET = "quorum-vs-torchft-bench-secret-0123456789"


# --- the torchft venv ----------------------------------------------------------------------
def torchft_python() -> Optional[str]:
    """The throwaway venv's python with torchft installed, or None (and why, printed)."""
    py = os.path.join(VENV, "bin", "python")
    marker = os.path.join(VENV, ".torchft-installed")
    if os.path.exists(marker):
        return py
    try:
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True, timeout=120)
        site = subprocess.run(
            [py, "-c", "import site; print(site.getsitepackages()[0])"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        ours = subprocess.run(
            [sys.executable, "-c", "import site; print(site.getsitepackages()[0])"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
        with open(os.path.join(site, "ft-bench-base.pth"), "w") as f:
            f.write(ours + "\n")  # torch, grpcio, protobuf: this venv's
        subprocess.run(
            [py, "-m", "pip", "install", "-q", "--no-deps", TORCHFT], check=True, timeout=600
        )
    except (OSError, subprocess.SubprocessError) as e:
        print(f"torchft baseline skipped: could not install {TORCHFT} into {VENV}: {e}")
        return None
    open(marker, "w").close()
    return py


def import_torchft_native():
    """torchft's Rust module, without running torchft/__init__.py (which needs opentelemetry and
    loads torch: neither is part of what is measured)."""
    import importlib.util

    if "torchft._torchft" in sys.modules:
        return sys.modules["torchft._torchft"]
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        return None
    pkg = types.ModuleType("torchft")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("torchft", pkg)
    from torchft import _torchft

    return _torchft


# --- servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lighthouse:
    def __init__(self, kind: str, groups: int, secret: bool) -> None:
        self.kind = kind
        port = free_port()
        flags = [
            "--min_replicas",
            str(groups),
            "--join_timeout_ms",
            "60000",
            "--quorum_tick_ms",
            "100",
            "--heartbeat_timeout_ms",
            "5000",
        ]
        env = dict(os.environ)
        env.pop("FT_JOB_SECRET", None)
        if kind == "ft":
            if secret:
                env["FT_JOB_SECRET"] = SECRET
            cmd = [
                sys.executable,
                "-m",
                "ft.coordination.cli",
                "--bind",
                f"127.0.0.1:{port}",
                "--http_bind",
                "",
                "--log_level",
                "ERROR",
                "--transport",
                "native",
                *flags,
            ]
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
            line = self.proc.stdout.readline()
            if not line.startswith("ft-lighthouse ready"):
                self.stop()
                raise RuntimeError(f"ft lighthouse did not start: {line!r}")
        else:
            # torchft's own entry point (torchft._torchft.lighthouse_main), started the way its
            # ``torchft_lighthouse`` script does, minus torchft/__init__.py (see above). It
            # parses the process's argv after argv[0], taking the script's name as its own. It
            # imports this module (``bench``) through PYTHONPATH=ROOT.
            script = os.path.join(VENV, "serve_torchft_lighthouse.py")
            with open(script, "w") as f:
                f.write(
                    "from bench.quorum_vs_torchft import import_torchft_native\n"
                    "import_torchft_native().lighthouse_main()\n"
                )
            env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
            cmd = [sys.executable, script, "--bind", f"127.0.0.1:{port}", *flags]
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 30
            while True:  # ready once it accepts connections
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise RuntimeError("torchft lighthouse did not start") from None
                    time.sleep(0.05)
        self.address = f"http://127.0.0.1:{port}"

    def cpu_s(self) -> float:
        return process_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# --- clients ---------------------------------------------------------------------------------
CLIENTS = ("ft-native", "ft-grpcio", "torchft")


def make_client(kind: str, address: str, secret: bool):
    """(quorum(replica_id), heartbeat(replica_id)) bound to one new client of ``kind``: one of
    CLIENTS, or "ft" (ft's default transport)."""
    if kind.startswith("ft"):
        from ft.coordination import LighthouseClient

        c = LighthouseClient(
            address,
            timedelta(seconds=10),
            secret=SECRET if secret else None,
            transport=kind[3:] or "auto",
        )
        return (
            lambda rid: c.quorum(rid, timeout=timedelta(seconds=60), step=1),
            lambda rid: c.heartbeat(rid, timeout=timedelta(seconds=5)),
        )
    tf = import_torchft_native()
    c = tf.LighthouseClient(address, timedelta(seconds=10))
    return (
        lambda rid: c.quorum(rid, timedelta(seconds=60), step=1),
        lambda rid: c.heartbeat(rid, timedelta(seconds=5)),
    )


def rounds(n: int, count: int, ask: List[Callable[[], object]]) -> List[float]:
    """``count`` rounds of n threads asking at once, after one round that forms the quorum;
    each round's first ask -> last answer (quorum_bench's thread harness)."""
    return timed_rounds(n, count + 1, lambda i: ask[i]())[1:]


def measure_round(
    client: str, server: str, n: int, count: int, secret: bool
) -> Tuple[float, float, float]:
    """(median round ms, lighthouse CPU ms per round, this process's CPU us per quorum call:
    the clients' share)."""
    lh = Lighthouse(server, n, secret and server == "ft")
    try:
        ft_client = client.startswith("ft")
        use_secret = secret and server == "ft" and ft_client
        if secret and server == "ft" and not ft_client:
            return float("nan"), float("nan"), float("nan")  # torchft's client cannot sign
        asks = []
        for i in range(n):
            quorum, _ = make_client(client, lh.address, use_secret)
            asks.append(lambda q=quorum, rid=f"g{i:04d}": q(rid))
        rounds(n, 1, asks)  # warm-up: connections, first quorum
        c0, p0 = lh.cpu_s(), time.process_time()
        times = rounds(n, count, asks)
        cpu = (lh.cpu_s() - c0) / count
        client_cpu = (time.process_time() - p0) / (count * n)
        return statistics.median(times) * 1000, cpu * 1000, client_cpu * 1e6
    finally:
        lh.stop()


def measure_heartbeat(
    client: str, server: str, count: int, secret: bool
) -> Tuple[float, float, float]:
    """(lighthouse CPU us, latency us, this process's CPU us: the client's) per heartbeat."""
    lh = Lighthouse(server, 1, secret and server == "ft")
    try:
        if secret and server == "ft" and not client.startswith("ft"):
            return float("nan"), float("nan"), float("nan")
        _, hb = make_client(client, lh.address, secret and server == "ft")
        for _ in range(100):
            hb("hb")
        c0, w0, p0 = lh.cpu_s(), time.perf_counter(), time.process_time()
        for _ in range(count):
            hb("hb")
        wall = time.perf_counter() - w0
        client_cpu = time.process_time() - p0
        return (lh.cpu_s() - c0) / count * 1e6, wall / count * 1e6, client_cpu / count * 1e6
    finally:
        lh.stop()


def measure_load(
    server: str, rate: float, seconds: float, connections: int, streamed: bool = False
) -> Tuple[float, int, int, float, str]:
    """(rate achieved, heartbeats ok, failed, lighthouse cores, first error) of an open-loop
    heartbeat load of ``rate`` per second from 1024 replica ids (section 4 of the docstring):
    Heartbeat calls, or with ``streamed`` messages on one HeartbeatStream call per connection
    (what ft's native client sends; ft's lighthouse only)."""
    from ft.coordination import _rpc
    from ft.coordination._proto import torchft_pb2 as pb

    bodies = [
        pb.LighthouseHeartbeatRequest(replica_id=f"g{i:04d}").SerializeToString()
        for i in range(1024)
    ]
    lh = Lighthouse(server, 1, False)
    try:
        gen = _rpc.native.LoadGenerator(
            _rpc.grpc_target(lh.address), _rpc.CHANNEL_OPTIONS, connections, 60.0
        )
        time.sleep(0.5)  # the connections' setup is not part of the load
        c0, w0 = lh.cpu_s(), time.monotonic()
        if streamed:
            r = gen.run_streams(
                "/torchft.LighthouseService/HeartbeatStream", bodies, rate, seconds, 5.0
            )
            r["failed"] += r["streams_failed"]
        else:
            r = gen.run("/torchft.LighthouseService/Heartbeat", bodies, rate, seconds, 5.0)
        cores = (lh.cpu_s() - c0) / (time.monotonic() - w0)
        del gen
        return r["sent"] / r["send_s"], r["ok"], r["failed"], cores, r["first_error"]
    finally:
        lh.stop()


def measure_native_rounds(server: str, n: int, count: int) -> Tuple[float, float, int, str]:
    """(median round ms, lighthouse CPU ms per round, failed calls, first error) of ``count``
    steady rounds of n groups whose clients are C++ (``LoadGenerator.run_rounds``: one
    connection per group, every Quorum call of a round started at once from one thread), so
    that the clients' CPU does not compete with the lighthouse's as Python clients on the
    same 2 cores do (section 3 of the docstring)."""
    from ft.coordination import _rpc
    from ft.coordination._proto import torchft_pb2 as pb

    bodies = [
        pb.LighthouseQuorumRequest(
            requester=pb.QuorumMember(replica_id=f"g{i:04d}", step=1)
        ).SerializeToString()
        for i in range(n)
    ]
    lh = Lighthouse(server, n, False)
    try:
        gen = _rpc.native.LoadGenerator(_rpc.grpc_target(lh.address), _rpc.CHANNEL_OPTIONS, n, 60.0)
        path = "/torchft.LighthouseService/Quorum"
        gen.run_rounds(path, bodies, 2, 60.0)  # the first quorum, and one steady round
        c0 = lh.cpu_s()
        r = gen.run_rounds(path, bodies, count, 60.0)
        cpu = (lh.cpu_s() - c0) / count
        del gen
        return statistics.median(r["round_s"]) * 1000, cpu * 1000, r["failed"], r["first_error"]
    finally:
        lh.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, nargs="+", default=[2, 8, 32, 256])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="measurements per pairing (medians)")
    p.add_argument("--heartbeats", type=int, default=3000)
    p.add_argument("--secret", action="store_true", help="ft's side with a job secret")
    p.add_argument(
        "--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS), help="clients measured"
    )
    p.add_argument("--load-seconds", type=float, default=3.0, help="0: no load section")
    p.add_argument("--load-connections", type=int, default=1024)
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if not a.inner:
        py = torchft_python()
        if py is not None:
            # RUST_LOG: torchft's client logs every connection at INFO otherwise.
            env = dict(os.environ, PYTHONPATH=ROOT, RUST_LOG="error")
            os.execve(py, [py, "-m", "bench.quorum_vs_torchft", "--inner", *sys.argv[1:]], env)
    have_torchft = import_torchft_native() is not None
    from ft.coordination import _rpc

    servers = ["ft", "torchft"] if have_torchft else ["ft"]
    clients = [
        c
        for c in a.clients
        if (c != "torchft" or have_torchft) and (c != "ft-native" or _rpc.native is not None)
    ]
    pairs = [(c, s) for s in servers for c in clients]
    print(
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; ft secret "
        f"{'on' if a.secret else 'off'}; torchft {'0.2.0' if have_torchft else 'not installed'}"
    )
    print(
        f"steady quorum round, median of {a.rounds} rounds, median of {a.repeats} repeats "
        "(range); in brackets the lighthouse's CPU per round, in braces the clients' CPU per "
        "quorum call"
    )
    print(f"{'groups':>6}  " + "  ".join(f"{c + ' client/' + s + ' server':>58}" for c, s in pairs))
    for n in a.groups:
        got = {pair: [] for pair in pairs}
        for _ in range(a.repeats):
            for c, s in pairs:
                got[(c, s)].append(measure_round(c, s, n, a.rounds, a.secret))
        cells = []
        for pair in pairs:
            ms = [g[0] for g in got[pair]]
            cpu = statistics.median(g[1] for g in got[pair])
            client_us = statistics.median(g[2] for g in got[pair])
            cells.append(
                f"{statistics.median(ms):8.2f} ms ({min(ms):.2f}-{max(ms):.2f}) "
                f"[{cpu:6.2f} ms] {{{client_us:4.0f} us}}".rjust(58)
            )
        print(f"{n:>6}  " + "  ".join(cells), flush=True)
    print(
        f"\nheartbeats, {a.heartbeats} back to back from one client: lighthouse CPU per "
        "heartbeat, latency, the client's CPU, and the lighthouse's cores for 1024 groups at 10 Hz"
    )
    for c, s in pairs:
        cpu_us, lat_us, client_us = measure_heartbeat(c, s, a.heartbeats, a.secret)
        print(
            f"  {c:>9} client / {s:<7} server: {cpu_us:7.1f} us CPU, {lat_us:7.1f} us latency,"
            f" client {client_us:6.1f} us CPU -> {cpu_us * 10240 / 1e6:5.2f} cores at 10,240"
            " heartbeats/s",
            flush=True,
        )
    if _rpc.native is not None and not a.secret:
        print(
            f"\nsteady quorum round with C++ clients (one connection per group), median of "
            f"{a.rounds} rounds, median of {a.repeats} repeats (range); in brackets the "
            "lighthouse's CPU per round"
        )
        print(f"{'groups':>6}  " + "  ".join(f"{s + ' server':>40}" for s in servers))
        for n in a.groups:
            got = {s: [] for s in servers}
            for _ in range(a.repeats):
                for s in servers:
                    got[s].append(measure_native_rounds(s, n, a.rounds))
            cells = []
            for s in servers:
                ms = [g[0] for g in got[s]]
                cpu = statistics.median(g[1] for g in got[s])
                failed = sum(g[2] for g in got[s])
                err = next((g[3] for g in got[s] if g[3]), "")
                cell = (
                    f"{statistics.median(ms):8.2f} ms ({min(ms):.2f}-{max(ms):.2f}) "
                    f"[{cpu:6.2f} ms]" + (f" {failed} failed: {err}" if failed else "")
                )
                cells.append(cell.rjust(40))
            print(f"{n:>6}  " + "  ".join(cells), flush=True)
    if a.load_seconds <= 0:
        return
    if _rpc.native is None or a.secret:
        print("\nheartbeat load skipped: " + ("--secret" if a.secret else "no native module"))
        return
    print(
        f"\nheartbeat load: 1024 groups x 10 Hz for {a.load_seconds:g} s, open loop, "
        f"{a.load_connections} connections: rate achieved, failed calls, lighthouse cores"
    )
    loads = [("ft", True)] + [(s, False) for s in servers]
    for s, streamed in loads:
        rate, ok, failed, cores, err = measure_load(
            s, 10240, a.load_seconds, a.load_connections, streamed
        )
        how = "one HeartbeatStream per group" if streamed else "Heartbeat calls"
        print(
            f"  {s:>7} server, {how:>29}: {rate:7.0f} heartbeats/s, {failed} of {ok + failed}"
            f" failed, {cores:5.2f} cores" + (f" (first failure: {err})" if err else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
