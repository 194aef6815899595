"""The group's store: rank 0 hosts it on the port it is given; when another program holds that
port, the Manager says so within its connect timeout instead of waiting on a listener that
never answers (torch's TCPStore client would wait there without end)."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.manager.inproc import lighthouse, make_manager


@pytest.fixture
def lh():
    server = lighthouse(min_replicas=1)
    yield server.address()
    server.shutdown()


def test_rank0_whose_store_port_is_held_by_a_silent_listener_fails_fast_and_names_it(lh) -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(16)  # accepts (the kernel's backlog) and never answers
    port = squatter.getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError) as info:
            make_manager(lh, "held", store_port=port, connect_timeout=timedelta(seconds=2))
        took = time.monotonic() - start
        message = str(info.value)
        assert f"127.0.0.1:{port}" in message
        assert "could not host" in message and "not a store that answers" in message
        # Bounded by the connect timeout (2 s), not torch's unbounded wait; generous slack for
        # a loaded machine.
        assert took < 20, took
    finally:
        squatter.close()
    # The process stays usable: a Manager on a free port starts and forms a quorum.
    manager = make_manager(lh, "after")
    try:
        manager.start_quorum()
        manager.wait_quorum()
        assert manager.num_participants() == 1
    finally:
        manager.shutdown()
