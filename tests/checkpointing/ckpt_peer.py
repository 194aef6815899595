"""Child process for the checkpoint transport tests: a sending replica.

Usage:
    ckpt_peer.py http --step N [--token T] [--payload F | --plain --big-mb M] [--slow S]
    ckpt_peer.py pg --port P --world W --dsts 1,2 --step N [--payload F | ...] [--slow S]

Prints JSON lines ({"event": ...}) on stdout; quits on "quit" or EOF on stdin, and on its own
after --lifetime seconds so that it can never outlive a broken test run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import timedelta


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.checkpointing import ckpt_testlib
from ft.checkpointing import HTTPTransport, PGTransport  # noqa: E402


def say(event: str, **kw: object) -> None:
    print(json.dumps({"event": event, **kw}), flush=True)


class SlowHTTPTransport(HTTPTransport):
    slow = 0.0

    def _pace(self) -> None:
        time.sleep(self.slow)


class SlowPG:
    """Delays every send (so a test can kill this process mid-transfer)."""

    def __init__(self, pg: object, slow: float) -> None:
        self.pg = pg
        self.slow = slow

    def send(self, tensors, dst, tag):  # type: ignore[no-untyped-def]
        time.sleep(self.slow)
        return self.pg.send(tensors, dst, tag)  # type: ignore[attr-defined]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["http", "pg"])
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--token", default=None)
    p.add_argument("--big-mb", type=int, default=0)
    p.add_argument("--plain", action="store_true", help="only the big tensor (fast start)")
    p.add_argument("--payload", default=None, help="build_state() saved by the test itself")
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dsts", default="1")
    p.add_argument("--lifetime", type=float, default=60.0)
    a = p.parse_args()

    watchdog = threading.Timer(a.lifetime, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()

    if a.plain:
        state = {"big": torch.randn(max(1, a.big_mb) << 18)}
    elif a.payload:  # written by the test process itself: trusted, so plain torch.load is fine
        state = torch.load(a.payload, weights_only=False)
    else:
        state = ckpt_testlib.build_state(a.big_mb)
    timeout = timedelta(seconds=20)
    if a.mode == "http":
        cls = SlowHTTPTransport if a.slow else HTTPTransport
        tr = cls(timeout, a.chunks, token=a.token, advertise_host="127.0.0.1")
        if a.slow:
            tr.slow = a.slow  # type: ignore[attr-defined]
        tr.send_checkpoint([1], a.step, state, timeout)
        say("ready", url=tr.metadata())
        for line in sys.stdin:
            if line.strip() == "quit":
                break
        tr.shutdown()
    else:
        store = dist.TCPStore("127.0.0.1", a.port, a.world, False, timeout=timeout)
        pg = ckpt_testlib.gloo_pg(store, 0, a.world, timeout)
        say("connected")
        tr = PGTransport(SlowPG(pg, a.slow) if a.slow else pg, timeout, torch.device("cpu"))
        dsts = [int(x) for x in a.dsts.split(",")]
        try:
            tr.send_checkpoint(dsts, a.step, state, timeout)
        except Exception as e:  # noqa: BLE001
            say("error", error=f"{type(e).__name__}: {e}")
        else:
            say("sent")
        for line in sys.stdin:
            if line.strip() == "quit":
                break
    say("bye")
    sys.stdout.flush()
    os._exit(0)  # skip slow interpreter/PG teardown


if __name__ == "__main__":
    main()
