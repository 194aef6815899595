"""A process of the striped-heal tests (tests/multihost/test_striped_heal.py), on one simulated
host. Its one argument is a JSON config.

    {"role": "donor", "addr": ..., "mib": M, "step": S, "stop_file": F, "lifetime": T}
        stages the state of ``state(M)`` as step S on an HTTPTransport at ``addr``, prints
        {"event": "ready", "url": ...}, serves until ``stop_file`` exists, then prints
        {"event": "served", "bytes": <data bytes it sent>} and exits.
    {"role": "receiver", "addr": ..., "mib": M, "step": S, "sources": [url, ...],
     "stall_s": X, "lifetime": T}
        fetches step S striped from ``sources`` (the first one the assigned source), checks it
        bitwise against ``state(M)`` and prints {"event": "healed", "equal": bool, "served":
        {url: bytes}, "seconds": ...}, or {"event": "failed", "error": ...}.

The job secret comes from the environment (FT_JOB_SECRET_FILE): every request is signed.
Every process ends by ``lifetime`` on its own, so that none outlives a broken test run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch

from ft.checkpointing import HTTPTransport
from ft.checkpointing.striped import StripeOptions

TIMEOUT = timedelta(seconds=60)


def state(mib: int) -> dict:
    """The same bytes in every process: 4 float32 tensors and the Manager's counters."""
    n = mib * (1 << 18) // 4
    model = {}
    for i in range(4):
        t = torch.arange(n, dtype=torch.int32).mul_(2654435761 & 0x7FFFFFFF).add_(i)
        model[f"w{i}"] = t.view(torch.float32)
    return {"user": {"model": model}, "torchft": {"step": 7, "batches_committed": 70}}


def say(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, **kw}), flush=True)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    watchdog = threading.Timer(cfg.get("lifetime", 60.0), lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    want = state(cfg["mib"])
    tr = HTTPTransport(
        TIMEOUT,
        cfg.get("chunks", 2),
        advertise_host=cfg["addr"],
        same_host=False,
        stripe=StripeOptions(stall_timeout_s=cfg.get("stall_s", 5.0)),
    )
    if cfg["role"] == "donor":
        tr.send_checkpoint([1], cfg["step"], want, TIMEOUT)
        say("ready", url=tr.metadata())
        while not os.path.exists(cfg["stop_file"]):
            time.sleep(0.05)
        say("served", bytes=tr.served_bytes)
    else:
        sources = [(i, url) for i, url in enumerate(cfg["sources"])]
        say("fetching")
        t0 = time.monotonic()
        try:
            got = tr.recv_checkpoint_striped(sources, cfg["step"], TIMEOUT)
        except Exception as e:  # noqa: BLE001 - reported to the test
            say("failed", error=f"{type(e).__name__}: {e}")
        else:
            equal = got["torchft"] == want["torchft"] and all(
                torch.equal(got["user"]["model"][k].view(torch.int32), t.view(torch.int32))
                for k, t in want["user"]["model"].items()
            )
            say(
                "healed",
                equal=equal,
                served=tr.last_served,
                seconds=time.monotonic() - t0,
            )
    sys.stdout.flush()
    os._exit(0)  # the transport's threads need no orderly teardown here


if __name__ == "__main__":
    main()
