"""Fixtures for the coordination tests: real servers on loopback, reaped child processes."""

import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, List

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_child.py")
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # run from anywhere, installed or not
    sys.path.insert(0, ROOT)

from ft.coordination import LighthouseServer, ManagerServer  # noqa: E402
from ft.coordination.rpc_server import native_available  # noqa: E402

# Every lighthouse test runs on both gRPC server transports (ft.coordination.rpc_server).
TRANSPORTS = [
    pytest.param("native", marks=pytest.mark.skipif(
        not native_available(), reason="native gRPC server not built (no gRPC C++)")),
    "grpcio",
]


def wait_for(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Child:
    """A child process of this test, killed and reaped on exit. Reads one ADDRESS line."""

    def __init__(self, *args: str, env=None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, CHILD, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: List[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("ADDRESS ") or line.startswith("ft-lighthouse ready"):
                self._ready.set()
        self._ready.set()

    def ready_line(self, timeout: float = 15.0) -> str:
        if not self._ready.wait(timeout):
            raise AssertionError(f"child not ready after {timeout}s: {self.output()}")
        for line in self.lines:
            if line.startswith("ADDRESS ") or line.startswith("ft-lighthouse ready"):
                return line
        raise AssertionError(f"child exited early (rc={self.proc.poll()}): {self.output()}")

    def address(self, timeout: float = 15.0) -> str:
        return self.ready_line(timeout).split()[1]

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        self._reader.join(2)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture
def children():
    """Factory of child processes; every one is killed (by its own pid) and reaped."""
    made: List[Child] = []

    def make(*args: str, env=None) -> Child:
        c = Child(*args, env=env)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.kill()


@pytest.fixture(params=TRANSPORTS)
def lighthouse_factory(request):
    made: List[LighthouseServer] = []

    def make(bind: str = "127.0.0.1:0", min_replicas: int = 1, **kw) -> LighthouseServer:
        kw.setdefault("transport", request.param)
        kw.setdefault("join_timeout_ms", 200)
        kw.setdefault("quorum_tick_ms", 20)
        kw.setdefault("heartbeat_timeout_ms", 500)
        lh = LighthouseServer(bind, min_replicas, **kw)
        made.append(lh)
        return lh

    try:
        yield make
    finally:
        for lh in made:
            lh.shutdown(grace=0.1)


@pytest.fixture
def manager_factory(request):
    made: List[ManagerServer] = []
    # ManagerServers serve on the same transport as the test's lighthouse (both run twice)
    callspec = getattr(request.node, "callspec", None)
    transport = callspec.params.get("lighthouse_factory", "auto") if callspec else "auto"

    def make(replica_id: str, lighthouse_addr: str, world_size: int = 1, **kw) -> ManagerServer:
        kw.setdefault("transport", transport)
        kw.setdefault("heartbeat_interval", 0.05)
        kw.setdefault("connect_timeout", 5.0)
        s = ManagerServer(
            replica_id, lighthouse_addr, "127.0.0.1", "127.0.0.1:0", f"store-{replica_id}",
            world_size, **kw,
        )
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.shutdown(grace=0.1)


@contextmanager
def run_threads(fns, timeout: float = 10.0):
    """Runs callables concurrently; yields a list that holds each result or exception."""
    results: list = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: B902
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    try:
        yield results
    finally:
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "threads did not finish"


def parallel(fns, timeout: float = 10.0) -> list:
    with run_threads(fns, timeout) as results:
        pass
    return results
