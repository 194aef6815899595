"""Slow-client attacks on an HTTP server, shared by the tests that hold servers to them:
many connections that send nothing, one that trickles its headers, one kept alive and idle.
Every socket is closed and every wait bounded, whatever the outcome."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import ExitStack
from typing import Callable, List, Tuple

from tests.procs import wait_for


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """Reads until the server closes ``s`` (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        s.settimeout(remaining)
        try:
            if not s.recv(4096):
                return True
        except socket.timeout:
            return False
        except (ConnectionResetError, BrokenPipeError):
            return True


def raw_get(port: int, path: str, timeout: float) -> Tuple[int, bytes]:
    """A real request on a fresh connection; (0, b"") if it was refused or cut."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Connection: close\r\n\r\n".encode()
            )
            data = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return 0, b""
    if not data.startswith(b"HTTP/1."):
        return 0, b""
    return int(data.split()[1]), data.partition(b"\r\n\r\n")[2]


def _closed_now(s: socket.socket) -> bool:
    """Whether the server has closed ``s`` (reads what it sent, without waiting)."""
    s.settimeout(0)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def assert_not_starved(
    port: int, path: str, idle_timeout: float, cap: int, open_now: Callable[[], int]
) -> None:
    """Holds far more connections than ``cap`` against the server at ``port``, all idle but
    one that trickles its headers, and checks that the server refuses the excess at once,
    keeps answering real requests, and closes the idle and trickling ones after
    ``idle_timeout`` (and not before)."""
    attackers = 3 * cap + 5
    with ExitStack() as stack:
        stop = threading.Event()
        stack.callback(stop.set)
        t0 = time.monotonic()
        # A slowloris that trickles its request line and headers one byte at a time, faster
        # than the idle timeout; connected first, so it gets a slot.
        trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
        stack.callback(trickler.close)

        def trickle() -> None:
            try:
                for b in b"GET / HTTP/1.1\r\nX-Padding: " + b"a" * 10_000:
                    if stop.wait(idle_timeout / 5):
                        return
                    trickler.send(bytes([b]))
            except OSError:
                return

        tt = threading.Thread(target=trickle, daemon=True)
        tt.start()
        stack.callback(tt.join, 5)
        wait_for(lambda: open_now() >= 1, 5, "the trickler to be accepted")
        idle: List[socket.socket] = []
        for _ in range(attackers):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            stack.callback(s.close)
            idle.append(s)

        # Beyond the cap, connections are refused at once, well before any idle timeout.
        excess = attackers + 1 - cap
        refused: List[socket.socket] = []
        deadline = t0 + idle_timeout / 2
        while len(refused) < excess and time.monotonic() < deadline:
            refused += [s for s in idle if s not in refused and _closed_now(s)]
            time.sleep(0.01)
        assert len(refused) == excess, (len(refused), excess)
        assert open_now() == cap

        # A real request is answered within a few seconds all the same ...
        deadline = time.monotonic() + idle_timeout + 5
        code = 0
        while code != 200:
            assert time.monotonic() < deadline, "the server was starved by idle connections"
            code, _ = raw_get(port, path, timeout=2)
            if code != 200:
                time.sleep(0.05)

        # ... and every idle connection it accepted is closed after the idle timeout.
        for s in idle:
            if s not in refused:
                assert closed_by_peer(s, idle_timeout + 3), "an idle connection was never closed"
        # The trickler too: the bound covers the whole request line and headers.
        assert closed_by_peer(trickler, idle_timeout + 3), "a trickling connection was never closed"
        assert time.monotonic() - t0 >= idle_timeout * 0.9
        wait_for(lambda: open_now() == 0, 5, "every connection to be released")

        # A connection kept alive after a request, then idle, is closed as well.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
            s.settimeout(5)
            assert s.recv(65536).startswith(b"HTTP/1.1 ")
            assert closed_by_peer(s, idle_timeout + 3)
