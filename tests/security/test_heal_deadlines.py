"""Attacks on the deadlines of a heal (HTTPTransport): a peer that asks for metadata and never
for data, and a hostile source that answers with endless or oversized metadata. Each test is
named for the attack and asserts what the victim keeps: the source withdraws its checkpoint at
once (and the transfer under way still completes), the receiver fails clearly within its
deadline, and both stay usable."""

from __future__ import annotations

import http.server
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from datetime import timedelta
from typing import Any, List

import pytest
import torch

from ft.checkpointing import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    HTTPTransport,
)
from ft.checkpointing import serialization as ser
from tests.checkpointing.ckpt_testlib import run_in_thread

TO = timedelta(seconds=10)


def transport(stack: ExitStack, cls: type = HTTPTransport, **kw: Any) -> HTTPTransport:
    kw.setdefault("timeout", TO)
    kw.setdefault("num_chunks", 2)
    kw.setdefault("advertise_host", "127.0.0.1")
    kw.setdefault("bind_host", "127.0.0.1")
    kw.setdefault("same_host", False)
    t = cls(**kw)
    stack.callback(t.shutdown)
    return t


class _Paced(HTTPTransport):
    """Serves each 1 MiB slice in 0.1 s: a transfer a test can catch in flight."""

    def _pace(self) -> None:
        time.sleep(0.1)


def test_dangling_meta_does_not_delay_disallow_checkpoint() -> None:
    """A peer that asks for the metadata of the staged step and never for its data held the
    source's disallow_checkpoint() for the whole timeout (5 s). It must not wait for such a
    lease at all; a receiver whose transfer is under way is still served to the end."""
    sent = {"w": torch.randn(1 << 20)}  # 4 MiB: 2 ranges of 2 paced slices each
    with ExitStack() as stack:
        src = transport(stack, timeout=timedelta(seconds=5))
        src.send_checkpoint([1], 3, sent, TO)
        meta_url = f"{src.metadata()}/ft/v1/checkpoint/3/meta?chunks=4"
        with urllib.request.urlopen(meta_url, timeout=5) as resp:  # the dangling request
            resp.read()
            lease = resp.headers["X-FT-Lease"]
        st = src._staging
        assert st is not None and lease in st.leases

        t0 = time.monotonic()
        src.disallow_checkpoint()
        assert time.monotonic() - t0 < 0.2
        # the lease is gone with the checkpoint: its data requests are refused cleanly (410)
        data_url = (
            f"{src.metadata()}/ft/v1/checkpoint/3/data?staging={st.id}&lease={lease}&start=0&end=16"
        )
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(data_url, timeout=5)
        assert e.value.code == 410
        e.value.close()

        # A transfer under way beside a dangling lease: disallow waits for the transfer only.
        paced = transport(stack, cls=_Paced, timeout=timedelta(seconds=5))
        dst = transport(stack)
        paced.send_checkpoint([1], 4, sent, TO)
        with urllib.request.urlopen(
            f"{paced.metadata()}/ft/v1/checkpoint/4/meta?chunks=4", timeout=5
        ) as resp:
            resp.read()
        run = run_in_thread(lambda: dst.recv_checkpoint(0, paced.metadata(), 4, TO))
        st = paced._staging
        assert st is not None
        end = time.monotonic() + 5
        while st.active == 0 and time.monotonic() < end:
            time.sleep(0.005)
        assert st.active > 0
        t0 = time.monotonic()
        paced.disallow_checkpoint()
        waited = time.monotonic() - t0
        run["thread"].join(10)
        assert not run["thread"].is_alive()
        assert "error" not in run, run.get("error")
        assert torch.equal(run["value"]["w"], sent["w"])
        assert waited < 2.0, waited  # the transfer's ~0.4 s, not the dangling lease's 5 s
        with pytest.raises(CheckpointNotAvailableError):
            dst.recv_checkpoint(0, paced.metadata(), 4, timedelta(seconds=2))


class _HostileSource(http.server.BaseHTTPRequestHandler):
    """Answers /meta the way the test names in ``server.mode``; ends its own answer when the
    test's stop event is set (every loop here is bounded by it and by 20 s)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _drip(self, data: bytes, gap: float) -> None:
        end = time.monotonic() + 20
        for i in range(len(data)):
            if self.server.stop.is_set() or time.monotonic() > end:  # type: ignore[attr-defined]
                return
            self.wfile.write(data[i : i + 1])
            self.wfile.flush()
            time.sleep(gap)

    def do_GET(self) -> None:  # noqa: N802
        mode = self.server.mode  # type: ignore[attr-defined]
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        try:
            if mode == "headers":  # the status line and headers, a byte every 0.2 s
                self._drip(b"HTTP/1.1 200 OK\r\n" + b"X-Filler: " + b"a" * 10000 + b"\r\n", 0.2)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if mode == "declared":  # a 1 GiB header, then as much of it as the receiver takes
                self.send_header("Content-Length", str(1 << 30))
            elif mode == "streamed":  # no length at all: chunked, endless
                self.send_header("Transfer-Encoding", "chunked")
            elif mode == "trickle":  # a length within the bound, delivered a byte at a time
                self.send_header("Content-Length", str(1 << 20))
            self.end_headers()
            end = time.monotonic() + 20
            if mode == "trickle":
                self._drip(b"{" * (1 << 20), 0.2)
                return
            chunk = b"[" * (1 << 20)
            while not self.server.stop.is_set() and time.monotonic() < end:  # type: ignore
                if mode == "streamed":
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                else:
                    self.wfile.write(chunk)
        except OSError:
            pass  # the receiver hung up: what it should do


@pytest.mark.parametrize("mode", ["declared", "streamed", "trickle", "headers"])
def test_oversized_metadata_from_a_hostile_source_is_refused_in_time(mode: str) -> None:
    """A source that declares or streams a huge metadata header (it once took 7.5 s to read
    and parse 100 MB against a 5 s deadline), or delivers one slowly: the receiver refuses
    a length over the bound before reading it, and reads nothing past its deadline."""
    deadline_s = 2.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileSource)
    server.daemon_threads = True
    server.mode = mode  # type: ignore[attr-defined]
    server.stop = threading.Event()  # type: ignore[attr-defined]
    server.requests: List[str] = []  # type: ignore[misc]
    serving = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    serving.start()
    try:
        with ExitStack() as stack:
            victim = transport(stack)
            url = f"http://127.0.0.1:{server.server_address[1]}"
            t0 = time.monotonic()
            with pytest.raises(CheckpointError) as e:
                victim.recv_checkpoint(0, url, 5, timedelta(seconds=deadline_s))
            took = time.monotonic() - t0
            assert server.requests and "/meta" in server.requests[0]
            if mode in ("declared", "streamed"):
                assert isinstance(e.value, CheckpointFormatError), e.value
                assert took < 0.5, took  # refused before reading the body
                if mode == "declared":
                    assert str(1 << 30) in str(e.value)
                    assert str(ser.MAX_HEADER_BYTES) in str(e.value)
            else:
                assert isinstance(e.value, CheckpointTransferError), e.value
                assert "timed out" in str(e.value)
                assert took <= deadline_s + 0.5, took

            # the receiver is intact: a real source heals it
            src = transport(stack)
            sent = {"w": torch.randn(1000), "step": 5}
            src.send_checkpoint([1], 5, sent, TO)
            got = victim.recv_checkpoint(0, src.metadata(), 5, TO)
            assert torch.equal(got["w"], sent["w"]) and got["step"] == 5
    finally:
        server.stop.set()  # type: ignore[attr-defined]
        server.shutdown()
        server.server_close()
        serving.join(5)


def test_source_refuses_to_stage_metadata_over_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound receivers apply is the sources' too: a checkpoint whose header would exceed it
    is refused at send_checkpoint, naming the size, and the previous one stays served."""
    monkeypatch.setattr(ser, "MAX_HEADER_BYTES", 4096)
    with ExitStack() as stack:
        src = transport(stack)
        src.send_checkpoint([1], 1, {"w": torch.ones(2)}, TO)
        with pytest.raises(ValueError, match="receivers accept at most 4096"):
            src.send_checkpoint([1], 2, {f"t{i}": torch.ones(1) for i in range(100)}, TO)
        got = transport(stack).recv_checkpoint(0, src.metadata(), 1, TO)
        assert torch.equal(got["w"], torch.ones(2))
