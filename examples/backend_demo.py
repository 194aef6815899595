"""The ft backend in one minute: allreduce, a peer killed with kill -9, an
in-place reconfigure of the survivors, and a newcomer joining.

    python -m examples.backend_demo     # from a source checkout's root (ft built in place)
    python examples/backend_demo.py     # anywhere, with ft installed

Three processes on loopback. Prints what each step does and how long it took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

# The members start the way this process was started: as a module (found from the working
# directory, as `python -m` finds it) or as a script.
SELF = ["-m", __spec__.name] if __spec__ is not None else [os.path.abspath(__file__)]


def member(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    import ft

    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=10))
    if rank < 3:
        pg.configure(f"127.0.0.1:{port}/gen1", "demo", rank, 3)
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        print(f"[rank {rank}] generation 1 (world 3): allreduce -> {t[0].item():.0f}", flush=True)
        store.set(f"gen1/{rank}", "1")
        if rank == 2:
            time.sleep(60)  # the demo kills us here
        store.wait(["killed"])
        start = time.monotonic()
        try:
            dist.all_reduce(t, group=pg)
        except Exception as e:
            print(
                f"[rank {rank}] allreduce with a dead peer failed after "
                f"{(time.monotonic() - start) * 1e3:.0f} ms: {str(e).splitlines()[0][:90]}...",
                flush=True,
            )
        print(f"[rank {rank}] errored() = {pg.errored()!r:.80}", flush=True)
        start = time.monotonic()
        pg.configure(f"127.0.0.1:{port}/gen2", "demo", rank, 2)
        print(
            f"[rank {rank}] reconfigured to world 2 in {(time.monotonic() - start) * 1e3:.1f} ms",
            flush=True,
        )
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=pg)
        print(f"[rank {rank}] generation 2 (world 2): allreduce -> {t[0].item():.0f}", flush=True)
        store.set(f"gen2/{rank}", "1")
        store.wait(["newcomer"])
        new_rank = rank
    else:
        new_rank = 2
        store.set("newcomer", "1")
    pg.configure(f"127.0.0.1:{port}/gen3", "demo", new_rank, 3)
    t = torch.full((4,), float(new_rank + 1))
    dist.all_reduce(t, group=pg)
    print(
        f"[rank {new_rank}] generation 3 (world 3, with a new process): allreduce -> {t[0].item():.0f}",
        flush=True,
    )


def main() -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    procs = {}

    def wait_keys(keys, timeout_s: float = 60.0) -> None:
        # Fail fast (not after a store timeout) if a member died on its own.
        end = time.monotonic() + timeout_s
        while not store.check(keys):
            dead = [s for s, p in procs.items() if p.poll() not in (None, -signal.SIGKILL)]
            if dead or time.monotonic() > end:
                raise SystemExit(f"[demo] FAILED: waiting for {keys}; exited early: {dead}")
            time.sleep(0.05)

    def start(rank: int, slot: str) -> None:
        procs[slot] = subprocess.Popen([sys.executable, *SELF, str(rank), str(store.port)])

    try:
        for r in range(3):
            start(r, f"rank{r}")
        wait_keys(["gen1/0", "gen1/1", "gen1/2"])
        print(f"[demo] kill -9 rank 2 (pid {procs['rank2'].pid})", flush=True)
        procs["rank2"].send_signal(signal.SIGKILL)
        procs["rank2"].wait(timeout=10)
        store.set("killed", "1")
        wait_keys(["gen2/0", "gen2/1"])
        print("[demo] starting a brand-new process to take rank 2", flush=True)
        start(3, "newcomer")
        for slot in ("rank0", "rank1", "newcomer"):
            procs[slot].wait(timeout=60)
        ok = all(procs[s].returncode == 0 for s in ("rank0", "rank1", "newcomer"))
        print(
            "[demo] done: survivors kept their processes, reconfigured in place, and regrew to 3"
            if ok
            else "[demo] FAILED",
            flush=True,
        )
        sys.exit(0 if ok else 1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        member(int(sys.argv[1]), int(sys.argv[2]))
    else:
        main()
