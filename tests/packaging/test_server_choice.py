"""Which gRPC server an install serves on is visible: the lighthouse and each ManagerServer log
it once when they start (native or grpcio), and a build that cannot find gRPC C++ says what is
missing and what it costs (setup.py, checked without compiling)."""

from __future__ import annotations

import json
import logging
import sys
import textwrap

import pytest

from ft.coordination import LighthouseServer, ManagerClient, ManagerServer, rpc_server
from tests.packaging import _util


def _server_lines(caplog, logger_name):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger_name and r.levelno == logging.INFO and " server" in r.getMessage()
        if "(native server" in r.getMessage() or "(grpcio server" in r.getMessage()
    ]


@pytest.mark.parametrize("transport", ["auto", "grpcio"])
def test_lighthouse_and_manager_server_log_their_server_once(caplog, transport):
    expected = "native" if transport == "auto" and rpc_server.native_available() else "grpcio"
    caplog.set_level(logging.INFO, logger="ft")
    lh = LighthouseServer("127.0.0.1:0", 1, transport=transport, join_timeout_ms=100)
    try:
        ms = ManagerServer(
            "solo:0",
            lh.address(),
            "127.0.0.1",
            "127.0.0.1:0",
            "store-solo",
            1,
            heartbeat_interval=0.05,
            connect_timeout=5.0,
            transport=transport,
        )
        try:
            # A round through both servers over gRPC; each still logged its server once.
            client = ManagerClient(ms.address(), 5.0, transport=transport)
            try:
                q = client.quorum(0, 0, "", False, 10.0)
            finally:
                client.close()
            assert q.replica_world_size == 1 and q.replica_rank == 0
        finally:
            ms.shutdown(grace=0.1)
    finally:
        lh.shutdown(grace=0.1)
    (lh_line,) = _server_lines(caplog, "ft.lighthouse")
    (ms_line,) = _server_lines(caplog, "ft.manager_server")
    assert f"({expected} server)" in lh_line and lh_line.startswith("lighthouse serving"), lh_line
    assert f"({expected} server," in ms_line and "solo:0" in ms_line, ms_line


PROBE = textwrap.dedent("""
    import json, sys
    src = open("setup.py").read()
    sys.argv = ["setup.py", "build_ext"]
    ns = {"__name__": "setup_probe", "__file__": "setup.py"}
    exec(compile(src[: src.rindex("setup(")], "setup.py", "exec"), ns)
    print(json.dumps([sorted(e.name for e in ns["ext_modules"]), ns["BUILD_WARNINGS"]]))
""")


def test_a_build_without_grpc_cpp_warns_what_is_missing_and_what_it_costs(tmp_path):
    """pkg-config pointed at an empty folder finds no grpc++.pc: the build of a machine without
    libgrpc++-dev. (That a real build prints the WARNING last: test_pip_install.py.)"""
    empty = tmp_path / "no-pc-files"
    empty.mkdir()
    env = _util.clean_env(PKG_CONFIG_LIBDIR=str(empty), PKG_CONFIG_PATH="")
    env.pop("FT_NATIVE_GRPC", None)
    exts, warnings = probe(env)
    assert exts == ["ft._C"]
    (warning,) = warnings
    assert warning.startswith("WARNING: ft is built without its native gRPC server"), warning
    assert "gRPC C++ (pkg-config grpc++)" in warning
    assert "apt-get install libgrpc++-dev" in warning
    assert "grpcio" in warning and "slower" in warning

    # Asked to leave it out: no warning.
    assert probe({**env, "FT_NATIVE_GRPC": "0"}) == [["ft._C"], []]


def probe(env):
    r = _util.run([sys.executable, "-c", PROBE], cwd=_util.ROOT, env=env, timeout=180)
    return json.loads(r.stdout.strip().splitlines()[-1])
