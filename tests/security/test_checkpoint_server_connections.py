"""Connection exhaustion against a replica's checkpoint server (HTTPTransport), each test named
for the attack and asserting what the victim keeps: it serves its checkpoint to a recovering
replica, and transfers under way are never cut by the idle bound that sheds the attackers."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from datetime import timedelta

import torch

from ft.checkpointing import HTTPTransport
from ft.checkpointing import http_transport

from tests.procs import wait_for
from tests.security._slow_clients import assert_not_starved

TO = timedelta(seconds=20)


def transport(stack: ExitStack, cls=HTTPTransport, **kw) -> HTTPTransport:
    kw.setdefault("timeout", TO)
    kw.setdefault("num_chunks", 1)
    kw.setdefault("advertise_host", "127.0.0.1")
    kw.setdefault("bind_host", "127.0.0.1")
    kw.setdefault("same_host", False)  # every byte over HTTP, where the bounds apply
    t = cls(**kw)
    stack.callback(t.shutdown)
    return t


def state(n: int = 1 << 16) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32), "step": 3}


def test_slow_clients_holding_connections_do_not_starve_the_checkpoint_server():
    idle_timeout, cap = 1.0, 8
    with ExitStack() as stack:
        src = transport(stack, idle_timeout_s=idle_timeout, max_connections=cap)
        sent = state()
        src.send_checkpoint([1], 1, sent, TO)
        port = src._server.server_address[1]
        assert_not_starved(
            port,
            "/ft/v1/checkpoint/1/meta?chunks=1&wait=0",
            idle_timeout,
            cap,
            src._server.open_connections,
        )
        # A recovering replica still gets the whole checkpoint.
        dst = transport(stack)
        got = dst.recv_checkpoint(0, src.metadata(), 1, timedelta(seconds=10))
        assert torch.equal(got["w"], sent["w"]) and got["step"] == 3


class _Slow(HTTPTransport):
    """A source that serves each 1 MiB slice slowly: one range takes several idle timeouts."""

    delay_s = 0.4

    def _pace(self) -> None:
        time.sleep(self.delay_s)


def test_idle_bound_never_cuts_a_transfer_under_way():
    idle_timeout = 0.5
    with ExitStack() as stack:
        src = transport(stack, cls=_Slow, idle_timeout_s=idle_timeout, max_connections=4)
        dst = transport(stack)
        sent = state(6 << 18)  # 6 MiB: 6 slices, ~2.4 s, about five idle timeouts
        src.send_checkpoint([1], 1, sent, TO)
        t0 = time.monotonic()
        got = dst.recv_checkpoint(0, src.metadata(), 1, TO)
        assert time.monotonic() - t0 > 4 * idle_timeout  # it did outlast the idle bound
        assert torch.equal(got["w"], sent["w"])

        # A receiver ahead of the source waits in its metadata request (a long poll) for
        # longer than the idle bound, and gets the step once it is staged.
        out: dict = {}

        def recv() -> None:
            try:
                out["got"] = dst.recv_checkpoint(0, src.metadata(), 2, TO)
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e

        t = threading.Thread(target=recv, daemon=True)
        t.start()
        stack.callback(t.join, 30)
        wait_for(lambda: src._server.open_connections() == 1, 5, "the receiver's request")
        time.sleep(3 * idle_timeout)
        src.send_checkpoint([1], 2, {"w": torch.ones(4)}, TO)
        t.join(30)
        assert not t.is_alive(), "the receiver never finished"
        assert "error" not in out, out.get("error")
        assert torch.equal(out["got"]["w"], torch.ones(4))


def test_checkpoint_server_defaults_bound_idle_connections():
    assert 0 < http_transport.DEFAULT_IDLE_TIMEOUT_S <= 60
    # A receiver at the widest split fits under the cap.
    assert http_transport.DEFAULT_MAX_CONNECTIONS >= http_transport._MAX_CHUNKS
    with ExitStack() as stack:
        src = transport(stack)
        assert src._server.idle_timeout_s == http_transport.DEFAULT_IDLE_TIMEOUT_S
        assert src._server.max_connections == http_transport.DEFAULT_MAX_CONNECTIONS
