"""Fixtures for the coordination tests: real servers on loopback, reaped child processes."""

from typing import List

import pytest

from ft.coordination import LighthouseServer, ManagerServer
from tests.coordination._helpers import TRANSPORTS, CoordinationChild


@pytest.fixture
def children(procs):
    """``children(MODE, *args, env=None)``: a tests/coordination/_child.py process
    (``CoordinationChild``); every one is killed (by its own pid) and reaped after the test."""

    def make(*args: str, env=None) -> CoordinationChild:
        return procs.add(CoordinationChild(*args, env=env))

    return make


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
            replica_id,
            lighthouse_addr,
            "127.0.0.1",
            "127.0.0.1:0",
            f"store-{replica_id}",
            world_size,
            **kw,
        )
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.shutdown(grace=0.1)
