"""Helpers for the GPU tests: an in-process store and configured process groups."""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_prefixes = itertools.count()


class Store:
    """A TCPStore server in this process; `addr()` gives a fresh prefix each call."""

    def __init__(self) -> None:
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
        )
        self.port = self.store.port

    def addr(self) -> str:
        return f"127.0.0.1:{self.port}/gpu-test-{next(_prefixes)}"


def nccl_pg(store: Store, timeout_s: float = 30.0, num_lanes: int = 2, configure: bool = True):
    import ft

    pg = ft.ProcessGroupNCCL(timeout=timedelta(seconds=timeout_s), num_lanes=num_lanes)
    if configure:
        pg.configure(store.addr(), "gpu-test", 0, 1)
    return pg


def cpu_peer(addr: str, rank: int, world_size: int, timeout_s: float = 60.0):
    """A CPU-only rank (ProcessGroupGloo: never creates an NCCL communicator) that
    configures on a thread and then idles. Returns (thread, holder dict)."""
    import ft

    holder: dict = {}

    def run() -> None:
        pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        holder["pg"] = pg
        try:
            pg.configure(addr, "cpu-peer", rank, world_size)
            holder["configured"] = True
        except Exception as e:  # the other side may abort first
            holder["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, holder


def wait_until(pred, timeout_s: float, interval_s: float = 0.05) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval_s)
    return pred()


def sleep_cycles(seconds: float) -> int:
    """GPU clock cycles for torch.cuda._sleep to run about `seconds`."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    rate_khz = getattr(props, "clock_rate", 0) or 1_500_000
    return int(seconds * rate_khz * 1000)
