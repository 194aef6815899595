"""File-descriptor exhaustion of the lighthouse: an attacker who can reach its gRPC port opens idle
connections until the process has no descriptor left, so that accept() fails with EMFILE. Once
those connections are gone, the lighthouse must serve new clients again at once.

(gRPC 1.51's own listener never accepts again after such an error; the native server accepts
its connections itself for that reason: csrc/grpc_server/grpc_server.cpp, Listener.)

A real lighthouse process (``ft-lighthouse``) under a 256-descriptor limit, on loopback with
ephemeral ports. Its sockets are closed and the process killed by its own id and reaped even
when the test fails; every wait has a deadline.
"""

from __future__ import annotations

import datetime
import os
import re
import resource
import socket
import sys
import time
from contextlib import ExitStack

import grpc
import pytest

from ft.coordination import LighthouseClient
from tests.coordination._helpers import TRANSPORTS
from tests.procs import Proc, lighthouse_argv, wait_for

if not sys.platform.startswith("linux"):
    pytest.skip("counts the lighthouse's descriptors in /proc (Linux)", allow_module_level=True)

FD_LIMIT = 256
# Idle connections opened: more than the lighthouse can hold; the rest wait in its listen queue.
ATTACK_SOCKETS = FD_LIMIT + 40
RECOVERY_S = 1.0  # the requirement: a new client is served within this long

# Runs the CLI with RLIMIT_NOFILE lowered (what `prlimit --nofile=256` does), in this process
# (exec), so that the pid the test watches is the lighthouse's.
_LIMITED = (
    "import os, resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n}))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'ft.coordination.cli'] + sys.argv[1:])\n"
)


def _open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:  # gone
        return -1


def _start_lighthouse(transport: str, tmp_path, stack: ExitStack) -> Proc:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "FT_JOB_SECRET",
            "FT_JOB_SECRET_FILE",
            "FT_AUTH_TOKEN",
            "FT_INSECURE",
            "FT_LIGHTHOUSE_TRANSPORT",
        )
    }
    return stack.enter_context(
        Proc(  # killed by its own id and reaped on the stack's exit
            lighthouse_argv(
                sys.executable,
                "-c",
                _LIMITED.format(n=FD_LIMIT),
                transport=transport,
                log_level="WARNING",
            ),
            env=env,
            log_path=tmp_path / "lighthouse.log",
            name=f"ft-lighthouse ({transport})",
        )
    )


def _grpc_port(proc: Proc) -> int:
    ready = r"ft-lighthouse ready grpc=http://127\.0\.0\.1:(\d+)"
    return int(re.search(ready, proc.wait_for_line(ready, 60)).group(1))


def _heartbeat(port: int, timeout_s: float) -> None:
    with LighthouseClient(
        f"http://127.0.0.1:{port}",
        secret=None,
        connect_timeout=datetime.timedelta(seconds=timeout_s),
    ) as client:
        client.heartbeat("fresh-replica", timeout=datetime.timedelta(seconds=timeout_s))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_fd_exhaustion_does_not_stop_the_lighthouse_accepting(transport, tmp_path, monkeypatch):
    for k in ("FT_JOB_SECRET", "FT_JOB_SECRET_FILE", "FT_INSECURE"):
        monkeypatch.delenv(k, raising=False)
    with ExitStack() as stack:
        # This process holds the attack's sockets: make room for them.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = ATTACK_SOCKETS + 256
        if soft != resource.RLIM_INFINITY and soft < want:
            if hard != resource.RLIM_INFINITY and hard < want:
                pytest.skip(f"this process may open only {hard} descriptors")
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            stack.callback(resource.setrlimit, resource.RLIMIT_NOFILE, (soft, hard))

        proc = _start_lighthouse(transport, tmp_path, stack)
        port = _grpc_port(proc)
        _heartbeat(port, 10)  # serving before the attack

        # The attack: idle connections until the lighthouse has no descriptor left.
        attack = []

        def close_attack() -> None:
            for s in attack:
                s.close()
            attack.clear()

        stack.callback(close_attack)
        for _ in range(ATTACK_SOCKETS):
            attack.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(
            lambda: _open_fds(proc.pid) >= FD_LIMIT,
            10,
            f"the lighthouse to run out of descriptors ({_open_fds(proc.pid)} open)",
        )

        # A client now cannot get in: its connection waits in the listen queue (EMFILE).
        with pytest.raises((TimeoutError, grpc.RpcError, OSError)):
            _heartbeat(port, 0.5)

        close_attack()
        closed = time.monotonic()
        try:
            _heartbeat(port, 5)
        except Exception as e:  # noqa: BLE001 (report how long it failed for)
            pytest.fail(
                f"{transport}: a new client's heartbeat failed {time.monotonic() - closed:.1f}s "
                f"after the attack's sockets closed: {type(e).__name__}: {e}"
            )
        took = time.monotonic() - closed
        assert took <= RECOVERY_S, (
            f"{transport}: a new client was served {took:.2f}s after the attack ended "
            f"(want <= {RECOVERY_S}s)"
        )
        assert proc.poll() is None, "the lighthouse died"
