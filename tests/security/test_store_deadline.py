"""A store address that leads nowhere useful (a port that refuses, or a server that accepts and
never answers, as a hostile or wedged peer would) must not hold a replica's configure() past
its timeout. The test asserts what the victim keeps: configure() fails within its timeout, and
the process group connects to a real store right after."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import List

import pytest
import torch
import torch.distributed as dist

from ft.process_group import ProcessGroupGloo

TIMEOUT_S = 2.0


class _SilentServer:
    """Accepts TCP connections and never sends a byte; closes them all on close()."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.conns: List[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_configure_to_an_unreachable_store_honours_its_timeout() -> None:
    pg = ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S))
    silent = _SilentServer()
    store = None
    try:
        for i, port in enumerate((silent.port, _free_port())):  # silent, then refusing
            t0 = time.monotonic()
            with pytest.raises(dist.DistStoreError, match=f"127.0.0.1:{port}"):
                pg.configure(f"127.0.0.1:{port}/attempt{i}", "replica", 0, 1)
            took = time.monotonic() - t0
            assert took <= 1.1 * TIMEOUT_S, (port, took)
            if port == silent.port:
                # its connection was ended: nothing of the victim stays stuck on it
                end = time.monotonic() + 2
                while any(
                    t.name == "ft-store-connect" and t.is_alive() for t in threading.enumerate()
                ):
                    assert time.monotonic() < end, "a store connect to the silent server runs on"
                    time.sleep(0.01)
                assert silent.conns
                for c in silent.conns:
                    c.settimeout(2)
                    c.recv(65536)  # what the client sent before it gave up
                    assert c.recv(1) == b""  # then the end of the connection

        # the group is still usable: configure against a real store works at once
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
        )
        t0 = time.monotonic()
        pg.configure(f"127.0.0.1:{store.port}/real", "replica", 0, 1)
        assert time.monotonic() - t0 < TIMEOUT_S
        t = torch.arange(4, dtype=torch.float32)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.arange(4, dtype=torch.float32))
    finally:
        pg.shutdown()
        silent.close()
        del store


def test_configure_whose_peers_never_come_honours_its_timeout() -> None:
    """The store answers, but the other rank never configures: every step of configure()
    (store, each lane's Gloo connect) shares the one deadline, instead of each lane waiting
    its own timeout plus Gloo's backstop (3 s for 2 s before)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    pg = ProcessGroupGloo(timeout=timedelta(seconds=TIMEOUT_S))
    try:
        t0 = time.monotonic()
        with pytest.raises(dist.DistBackendError, match="could not connect to its peers"):
            pg.configure(f"127.0.0.1:{store.port}/alone", "replica", 0, 2)
        took = time.monotonic() - t0
        assert took <= 1.1 * TIMEOUT_S, took
        # the group is usable right after
        pg.configure(f"127.0.0.1:{store.port}/solo", "replica", 0, 1)
        t = torch.ones(3)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(3))
    finally:
        pg.shutdown()
        del store
