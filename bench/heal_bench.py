"""Heal benchmark: how fast a receiver gets the live state from donor processes, by path,
against the floors of the machine, in one run.

    .venv/bin/python -m bench.heal_bench [--gib 1] [--reps 3] [--donors 3] [--chunks 8]
                                          [--device cpu|cuda]

The state is ``--gib`` GiB of float32 in 8 tensors (plus the Manager's counters), held by each
donor, a separate process (as in a real heal); the receiver is this process. A heal is timed
from the receiver's call until the state is in place (every byte checked, on ``--device``),
and compared bitwise with the donors' state. Paths, each timed ``--reps`` times, interleaved
with the floors so that drift on the machine falls on both:

  * same-host path (HTTPTransport's default between processes of one host);
  * HTTP on loopback, one donor, ``--chunks`` parallel ranges (same-host path off);
  * striped HTTP from 2..``--donors`` donors at once (recv_checkpoint_striped);
  * floors: ``copy_`` into preallocated tensors (memcpy); a copy into fresh memory allocated
    as a receiver allocates it (``serialization.allocate``: what a heal into new tensors cannot
    beat where the machine faults fresh memory in slowly); with ``--device cuda`` also a
    pinned host round trip (device -> pinned host -> device) and a device-to-device clone.

"donor blocked" is what the donor's calling thread spends in the transport: send_checkpoint
(staging) plus disallow_checkpoint (withdrawal) once the receiver is done; the serving itself
runs on the transport's threads.

Results: docs/benchmarks.md, "Heal".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch

TIMEOUT = timedelta(seconds=300)
TENSORS = 8


def make_state(gib: float, device: str) -> Dict[str, Any]:
    """``gib`` GiB of float32 in 8 tensors, the same in every process (a cheap deterministic
    fill: random generation of several GiB would dominate the start)."""
    n = int(gib * (1 << 30)) // 4 // TENSORS
    model = {}
    for i in range(TENSORS):
        t = torch.arange(n, dtype=torch.int32, device=device)
        t.mul_(2654435761 & 0x7FFFFFFF).add_(i)  # scrambled, distinct per tensor
        model[f"layers.{i}.weight"] = t.view(torch.float32)
    return {"user": {"model": model}, "torchft": {"step": 1, "batches_committed": 3}}


def nbytes(state: Dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["user"]["model"].values())


# ----------------------------------------------------------------------------- donor process


def donor(gib: float, device: str, chunks: int, same_host: bool) -> None:
    from ft.checkpointing import HTTPTransport

    state = make_state(gib, device)
    tr = HTTPTransport(TIMEOUT, chunks, advertise_host="127.0.0.1", same_host=same_host)
    print(json.dumps({"event": "ready", "url": tr.metadata()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "stage":
            t0 = time.perf_counter()
            tr.send_checkpoint([1], int(cmd[1]), state, TIMEOUT)
            out = {"event": "staged", "send_s": time.perf_counter() - t0}
        elif cmd[0] == "withdraw":
            t0 = time.perf_counter()
            tr.disallow_checkpoint()
            out = {"event": "withdrawn", "disallow_s": time.perf_counter() - t0}
        else:
            out = {"event": "error", "what": cmd[0]}
        print(json.dumps(out), flush=True)
    tr.shutdown()
    os._exit(0)


class Donor:
    def __init__(self, gib: float, device: str, chunks: int, same_host: bool) -> None:
        argv = [sys.executable, "-m", "bench.heal_bench", "--donor", "--gib", str(gib)]
        argv += ["--device", device, "--chunks", str(chunks)]
        argv += ["--same-host", "1" if same_host else "0"]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.url = self._read("ready")["url"]

    def _read(self, event: str) -> Dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"donor exited (rc {self.proc.wait()})")
            if line.startswith("{"):
                msg = json.loads(line)
                if msg["event"] == event:
                    return msg

    def ask(self, cmd: str, event: str) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        return self._read(event)

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except Exception:  # noqa: BLE001 - killed below
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ----------------------------------------------------------------------------- receiver


def check_equal(got: Dict[str, Any], want: Dict[str, Any]) -> None:
    for k, t in want["user"]["model"].items():
        g = got["user"]["model"][k]
        if g.device != t.device or not torch.equal(g.view(torch.int32), t.view(torch.int32)):
            raise AssertionError(f"{k}: received state differs from the donor's")
    if got["torchft"] != want["torchft"]:
        raise AssertionError("counters differ")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def floors(state: Dict[str, Any], device: str) -> Dict[str, float]:
    """Seconds of each floor for the whole state."""
    src = list(state["user"]["model"].values())
    out: Dict[str, float] = {}
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):
        d.copy_(s)  # touch the destination once: the floor is the copy, not page faults
    sync(device)
    t0 = time.perf_counter()
    for d, s in zip(dst, src):
        d.copy_(s)
    sync(device)
    out["memcpy (copy_ into preallocated)"] = time.perf_counter() - t0
    del dst
    if device == "cpu":
        # What a receiver does at best: its tensors are fresh memory (huge pages from 2 MiB
        # up), and faulting that in is most of the cost on a VM that backs memory lazily.
        from ft.checkpointing import serialization as ser
        from ft.checkpointing.staging import Staging

        specs = Staging(0, state).specs
        t0 = time.perf_counter()
        fresh = [ser.allocate(sp, torch.device("cpu")) for sp in specs]
        for d, s in zip(fresh, src):
            d.copy_(s)
        out["copy into fresh memory"] = time.perf_counter() - t0
        del fresh
    if device == "cuda":
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in src]
        back = [torch.empty_like(t) for t in src]
        sync(device)
        t0 = time.perf_counter()
        for h, s in zip(host, src):
            h.copy_(s, non_blocking=True)
        torch.cuda.synchronize()
        for b, h in zip(back, host):
            b.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        out["pinned host round trip"] = time.perf_counter() - t0
        del host, back
        t0 = time.perf_counter()
        clones = [s.clone() for s in src]
        sync(device)
        out["device-to-device clone"] = time.perf_counter() - t0
        del clones
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="GiB of float32 state per donor")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--donors", type=int, default=3, help="most donors of the striped runs")
    p.add_argument("--chunks", type=int, default=8, help="HTTP ranges in parallel (receiver)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--donor", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--same-host", default="1", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.donor:
        donor(a.gib, a.device, a.chunks, a.same_host == "1")
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")

    from ft.checkpointing import HTTPTransport

    want = make_state(a.gib, a.device)
    total = nbytes(want)
    print(
        f"heal of {total / (1 << 30):.2f} GiB float32 ({TENSORS} tensors) on {a.device}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}; {a.reps} reps, median",
        flush=True,
    )
    donors: List[Donor] = []
    try:
        donors.append(Donor(a.gib, a.device, a.chunks, same_host=True))
        for _ in range(max(1, a.donors) - 1):
            donors.append(Donor(a.gib, a.device, a.chunks, same_host=False))
        dev = torch.device(a.device)
        local = HTTPTransport(TIMEOUT, a.chunks, advertise_host="127.0.0.1", device=dev)
        remote = HTTPTransport(
            TIMEOUT, a.chunks, advertise_host="127.0.0.1", device=dev, same_host=False
        )
        paths: List[Tuple[str, int, Any]] = [
            (
                "ft same-host path",
                1,
                lambda step, ds: local.recv_checkpoint(0, ds[0].url, step, TIMEOUT),
            ),
            (
                f"ft HTTP, {a.chunks} chunks, 1 donor",
                1,
                lambda step, ds: remote.recv_checkpoint(0, ds[0].url.split("#")[0], step, TIMEOUT),
            ),
        ]
        for n in range(2, len(donors) + 1):
            paths.append(
                (
                    f"ft HTTP striped, {n} donors",
                    n,
                    lambda step, ds: remote.recv_checkpoint_striped(
                        [(i, d.url.split("#")[0]) for i, d in enumerate(ds)], step, TIMEOUT
                    ),
                )
            )
        times: Dict[str, List[float]] = {}
        blocked: Dict[str, List[float]] = {}
        step = 0
        for _ in range(a.reps):
            for name, s in floors(want, a.device).items():
                times.setdefault(name, []).append(s)
            for name, n, fetch in paths:
                step += 1
                ds = donors[:n]
                sends = [d.ask(f"stage {step}", "staged")["send_s"] for d in ds]
                t0 = time.perf_counter()
                got = fetch(step, ds)
                sync(a.device)
                times.setdefault(name, []).append(time.perf_counter() - t0)
                check_equal(got, want)
                del got
                outs = [d.ask("withdraw", "withdrawn")["disallow_s"] for d in ds]
                blocked.setdefault(name, []).append(max(s + o for s, o in zip(sends, outs)))
        floor_name = (
            "pinned host round trip" if a.device == "cuda" else "memcpy (copy_ into preallocated)"
        )
        floor_gbs = total / statistics.median(times[floor_name]) / 1e9
        fresh_gbs = (
            total / statistics.median(times["copy into fresh memory"]) / 1e9
            if "copy into fresh memory" in times
            else None
        )
        print(
            f"\n| path | GB/s | vs {floor_name} | vs copy into fresh memory | donor blocked (ms) |"
        )
        print("|---|---|---|---|---|")
        for name, ts in times.items():
            gbs = total / statistics.median(ts) / 1e9
            b = blocked.get(name)
            bl = f"{statistics.median(b) * 1000:.1f}" if b else "—"
            fr = f"{gbs / fresh_gbs:.2f}x" if fresh_gbs else "—"
            spread = f" ({total / max(ts) / 1e9:.2f}..{total / min(ts) / 1e9:.2f})"
            print(f"| {name} | {gbs:.2f}{spread} | {gbs / floor_gbs:.2f}x | {fr} | {bl} |")
        local.shutdown()
        remote.shutdown()
    finally:
        for d in donors:
            d.close()


if __name__ == "__main__":
    main()
