"""Multi-process test harness: real processes, a fresh store per test, every
wait bounded, every child reaped.

A test names a worker function by "module:function". Each child runs
`function(rank, world_size, store_port, **kwargs)` and its return value (any
torch.save-able object) comes back through a file. Children coordinate with
the test through the TCPStore the test hosts (`store.wait([...])` with a
timeout), and the test can `kill -9`, SIGSTOP or SIGCONT them by pid.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_store(timeout_s: float = 30.0) -> dist.TCPStore:
    """A fresh TCPStore server on loopback (port chosen by the OS)."""
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def connect_store(port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", port, is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class Child:
    def __init__(self, proc: subprocess.Popen, result_path: str, log_path: str, rank: int):
        self.proc = proc
        self.result_path = result_path
        self.log_path = log_path
        self.rank = rank

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def log(self) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-6000:]
        except OSError:
            return ""


class Workers:
    """Starts children, collects results, and always reaps them.

    with Workers("tests.backend.workers:allreduce", 2, store, n=4) as w:
        results = w.join(timeout=30)
    """

    def __init__(
        self,
        target: str,
        world_size: int,
        store: Optional[dist.TCPStore] = None,
        ranks: Optional[List[int]] = None,
        env: Optional[Dict[str, str]] = None,
        **kwargs: Any,
    ) -> None:
        self.target = target
        self.world_size = world_size
        self.store = store if store is not None else make_store()
        self.kwargs = kwargs
        self.env = env or {}
        self.tmp = tempfile.mkdtemp(prefix="ft-test-")
        self.children: List[Child] = []
        self._ranks = list(range(world_size)) if ranks is None else ranks

    def __enter__(self) -> "Workers":
        for rank in self._ranks:
            self.spawn(rank)
        return self

    def spawn(self, rank: int, target: Optional[str] = None, **override: Any) -> Child:
        """Starts one more child. With `target`, it runs that function with
        only the given kwargs; otherwise the default target and kwargs."""
        kwargs = dict(override) if target else dict(self.kwargs, **override)
        target = target or self.target
        n = len(self.children)
        result_path = os.path.join(self.tmp, f"result-{rank}-{n}.pt")
        log_path = os.path.join(self.tmp, f"log-{rank}-{n}.txt")
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env.update(
            FT_TEST_TARGET=target,
            FT_TEST_RANK=str(rank),
            FT_TEST_WORLD_SIZE=str(self.world_size),
            FT_TEST_STORE_PORT=str(self.store.port),
            FT_TEST_KWARGS=json.dumps(kwargs),
            FT_TEST_RESULT=result_path,
        )
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.procs"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
            )
        child = Child(proc, result_path, log_path, rank)
        self.children.append(child)
        return child

    def by_rank(self, rank: int) -> Child:
        return [c for c in self.children if c.rank == rank][-1]

    def join(self, timeout: float, children: Optional[List[Child]] = None) -> List[Any]:
        """Waits for children (default: all) and returns their results in order.

        Raises with the child's log if one fails or overruns the timeout.
        """
        children = self.children if children is None else children
        deadline = time.monotonic() + timeout
        results = []
        for child in children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                code = child.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"rank {child.rank} (pid {child.pid}) did not finish within "
                    f"{timeout}s; log:\n{child.log()}"
                ) from None
            if code != 0:
                raise AssertionError(
                    f"rank {child.rank} exited with {code}; log:\n{child.log()}"
                )
            results.append(torch.load(child.result_path, weights_only=False))
        return results

    def __exit__(self, *exc: Any) -> None:
        for child in self.children:
            if child.proc.poll() is None:
                try:
                    os.kill(child.pid, signal.SIGCONT)
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for child in self.children:
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def wait_progress(store: Any, keys: List[str], at_least: int, timeout: float,
                  w: Workers) -> int:
    """Waits until every key in the test store holds a step >= at_least; returns the max.

    Fails at once (with the child's log) if a child exits with an error; a child killed by
    the test (SIGKILL) is expected. Bounded by ``timeout``, with every child's log tail.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vals = [int(store.get(k)) if store.check([k]) else -1 for k in keys]
        if min(vals) >= at_least:
            return max(vals)
        for c in w.children:
            code = c.proc.poll()
            if code not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"child {c.rank} exited with {code}:\n{c.log()}")
        time.sleep(0.02)
    logs = "\n".join(f"--- child {c.rank}\n{c.log()[-3000:]}" for c in w.children)
    raise AssertionError(f"no progress to {at_least} on {keys} within {timeout}s\n{logs}")


def max_step(store: Any, keys: List[str]) -> int:
    """The largest step any of ``keys`` holds in the test store (0 if none is set)."""
    return max(int(store.get(k)) if store.check([k]) else 0 for k in keys)


def child_main() -> None:
    import importlib

    module_name, func_name = os.environ["FT_TEST_TARGET"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(
        int(os.environ["FT_TEST_RANK"]),
        int(os.environ["FT_TEST_WORLD_SIZE"]),
        int(os.environ["FT_TEST_STORE_PORT"]),
        **json.loads(os.environ["FT_TEST_KWARGS"]),
    )
    torch.save(result, os.environ["FT_TEST_RESULT"])


if __name__ == "__main__":
    child_main()
