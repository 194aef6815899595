"""Helpers of the coordination tests (and tests/security), imported as
``from tests.coordination._helpers import ...``; the fixtures are in conftest.py beside it.

Imports neither torch nor the C++ extension (``ft.coordination`` does not either).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Dict, Optional

import pytest

from ft.coordination.rpc_server import native_available
from tests.procs import Proc, free_port, python_argv, wait_for  # noqa: F401  (re-exported)

# Every lighthouse test runs on both gRPC server transports (ft.coordination.rpc_server).
TRANSPORTS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not native_available(), reason="native gRPC server not built (no gRPC C++)"
        ),
    ),
    "grpcio",
]

# The line a server child prints once it serves (tests/coordination/_child.py, ft-lighthouse).
READY = r"^(ADDRESS |ft-lighthouse ready)"


class CoordinationChild(Proc):
    """A server or client of tests/coordination/_child.py in its own process
    (``python -m tests.coordination._child MODE ARGS...``)."""

    def __init__(self, *args: str, env: Optional[Dict[str, str]] = None) -> None:
        super().__init__(
            python_argv("tests.coordination._child", *args),
            env=env,
            name=f"_child {' '.join(args[:2])}",
        )

    def ready_line(self, timeout: float = 15.0) -> str:
        """Its ``ADDRESS ...`` or ``ft-lighthouse ready ...`` line, once printed."""
        return self.wait_for_line(READY, timeout)

    def address(self, timeout: float = 15.0) -> str:
        return self.ready_line(timeout).split()[1]


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
