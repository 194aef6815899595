"""Run by tests/packaging/test_wheel.py with the interpreter of a venv where the ft-torch wheel
is installed, from a folder outside the source tree:

    python wheel_quorum.py LIGHTHOUSE_ADDR [LIBRARY ...]

Tries to load each LIBRARY (a soname or path the test made unloadable), notes which files
importing the native gRPC module maps, then serves a quorum: a ManagerServer (default
transport: the native server where the module loads) joins the lighthouse, and a ManagerClient
(native client likewise) asks it for a quorum. Logs at INFO to stderr; prints one JSON line.
"""

import ctypes
import json
import logging
import sys


def mapped_files():
    """The files mapped into this process (/proc/self/maps)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/"):
                out.add(fields[5].strip())
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    addr, sonames = sys.argv[1], sys.argv[2:]
    out = {"system_loads": {}}
    for soname in sonames:
        try:
            ctypes.CDLL(soname)
            out["system_loads"][soname] = "loaded"
        except OSError as e:
            out["system_loads"][soname] = str(e)

    before = mapped_files()
    from ft.coordination import _grpc_server

    out["module"] = _grpc_server.__file__
    out["mapped_by_import"] = sorted(mapped_files() - before)

    from ft.coordination import ManagerClient, ManagerServer

    server = ManagerServer(
        "wheel:0",
        addr,
        "127.0.0.1",
        "127.0.0.1:0",
        "store-wheel",
        1,
        heartbeat_interval=0.1,
        connect_timeout=30.0,
    )
    try:
        client = ManagerClient(server.address(), 30.0)
        try:
            q = client.quorum(0, 0, "", False, 60.0)
        finally:
            client.close()
    finally:
        server.shutdown(grace=0.1)
    out.update(
        quorum_id=q.quorum_id,
        replica_rank=q.replica_rank,
        replica_world_size=q.replica_world_size,
        mapped_at_end=sorted(mapped_files()),
    )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
