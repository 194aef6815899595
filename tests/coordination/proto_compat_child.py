"""Child of test_proto_compat.py (``python -m tests.coordination.proto_compat_child``): ft's own
coordination over real gRPC on loopback, run with whatever grpcio/protobuf come first on
sys.path (the test puts the oldest supported there).

Prints one JSON line: the versions it ran on and what it checked.
"""

import json
import sys

import google.protobuf
import grpc

from ft.coordination import LighthouseClient, ManagerClient
from ft.coordination.lighthouse import LighthouseServer
from ft.coordination.manager_server import ManagerServer


def main() -> None:
    want_grpc, want_protobuf = sys.argv[1], sys.argv[2]
    assert grpc.__version__ == want_grpc, grpc.__version__
    assert google.protobuf.__version__ == want_protobuf, google.protobuf.__version__
    lh = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100, http_bind="", transport="grpcio"
    )
    try:
        c = LighthouseClient(lh.address(), connect_timeout=5.0)
        c.heartbeat("solo", timeout=2.0)
        q = c.quorum("solo", 5.0, step=7, data={"k": 1})
        assert [p.replica_id for p in q.participants] == ["solo"] and q.participants[0].step == 7
        ms = ManagerServer(
            "grp:1",
            lh.address(),
            "127.0.0.1",
            "127.0.0.1:0",
            "127.0.0.1:1234",
            world_size=1,
            heartbeat_interval=0.1,
            connect_timeout=5.0,
            transport="grpcio",
        )
        try:
            mc = ManagerClient(ms.address(), connect_timeout=5.0)
            r = mc._quorum(0, 3, "meta-3", False, 10.0)
            assert r.replica_world_size == 1 and r.max_step == 3, r
            assert mc._checkpoint_metadata(0, 5.0) == "meta-3"
            assert mc.should_commit(0, 3, True, 5.0) is True
        finally:
            ms.shutdown()
    finally:
        lh.shutdown()
    print(
        json.dumps(
            {"grpcio": grpc.__version__, "protobuf": google.protobuf.__version__, "ok": True}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
