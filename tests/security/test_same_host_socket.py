"""Attacks on the same-host heal socket (ft/checkpointing/same_host.py): an abstract Unix socket
that anyone on the host can connect to. Each test is named for the attack and asserts what the
victim keeps: a real heal still completes, bit for bit (over HTTP while the socket is swamped),
no other user's process is named as ptracer, and the source keeps serving."""

from __future__ import annotations

import json
import os
import pwd
import select
import signal
import socket
import time
from contextlib import ExitStack
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch

from ft import _C
from ft.checkpointing import HTTPTransport, same_host
from ft.utils.auth import SAME_HOST_PURPOSE, JobSecret, Signer
from tests.procs import wait_for

pytestmark = pytest.mark.skipif(not same_host.supported(), reason="Linux only")

TO = timedelta(seconds=10)
SECRET = "same-host-attack-tests-secret-0123456789"


def transport(stack: ExitStack, **kw: Any) -> HTTPTransport:
    kw.setdefault("advertise_host", "127.0.0.1")
    kw.setdefault("bind_host", "127.0.0.1")
    kw.setdefault("secret", SECRET)
    t = HTTPTransport(TO, 2, **kw)
    stack.callback(t.shutdown)
    return t


def state() -> Dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(1 << 18, generator=g), "b": torch.arange(10), "step": 4}


def assert_bitwise(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
            assert torch.equal(
                a[k].view(torch.uint8) if a[k].dim() else a[k],
                b[k].view(torch.uint8) if b[k].dim() else b[k],
            ), k
        else:
            assert a[k] == b[k], k


def wait_until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= end:
            return bool(predicate())
        time.sleep(0.01)
    return True


def _connect_many(name: str, n: int, into: List[socket.socket], within: float) -> None:
    """Opens ``n`` idle connections to the abstract socket ``name`` (appended to ``into``, which
    the caller closes), waiting out moments when the listen backlog is full."""
    end = time.monotonic() + within
    target = len(into) + n
    while len(into) < target and time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        if s.connect_ex("\0" + name) == 0:
            into.append(s)
        else:  # the backlog is full for a moment (EAGAIN): let the acceptor drain it
            s.close()
            time.sleep(0.001)


def test_flooded_same_host_socket_falls_back_to_http(monkeypatch: pytest.MonkeyPatch) -> None:
    """More idle connections than the endpoint holds: the heal that arrives meanwhile is
    refused by the endpoint and takes HTTP at once (no CheckpointTransferError, no waiting
    out the flood). The source sheds idle connections by itself, and heals take the same-host
    path again once the flood is gone."""
    # so long that the flood surely holds every slot during the heal below
    monkeypatch.setattr(same_host, "REQUEST_TIMEOUT_S", 30.0)
    sent = state()
    with ExitStack() as stack:
        src, dst = transport(stack), transport(stack)
        src.send_checkpoint([1], 4, sent, TO)
        assert src._local is not None
        name, local = src._local.name, src._local
        flood: List[socket.socket] = []
        stack.callback(lambda: [s.close() for s in flood])
        _connect_many(name, same_host.MAX_CONNECTIONS + 44, flood, within=10.0)
        assert wait_until(lambda: len(local._conns) >= same_host.MAX_CONNECTIONS, 5.0)

        t0 = time.monotonic()
        got = dst.recv_checkpoint(0, src.metadata(), 4, TO)
        took = time.monotonic() - t0
        assert dst.last_recv_path == "http"
        assert_bitwise(sent, got)
        assert took < 3.0, took  # refused at once, not after the flood's idle bound
        assert len(local._conns) >= same_host.MAX_CONNECTIONS - 1  # the flood still held it

        for s in flood:  # the flood goes away; its slots are free at once
            s.close()
        assert wait_until(lambda: not local._conns, 5.0)

        # idle connections are shed by the source itself, the victim needing to do nothing
        monkeypatch.setattr(same_host, "REQUEST_TIMEOUT_S", 0.5)
        idle: List[socket.socket] = []
        stack.callback(lambda: [s.close() for s in idle])
        _connect_many(name, 10, idle, within=5.0)
        assert len(idle) == 10
        assert wait_until(lambda: not local._conns, 0.5 + 2.0)
        for s in idle:
            s.settimeout(2)
            assert s.recv(1) == b""  # closed by the source, unanswered

        got = dst.recv_checkpoint(0, src.metadata(), 4, TO)
        assert dst.last_recv_path == "same-host"
        assert_bitwise(sent, got)


def _run_as(uid: int, gid: int, name: str, request: bytes, timeout: float) -> str:
    """Connects to the abstract socket ``name`` from a child process running as ``uid`` and
    sends ``request``; returns what came back ("closed", or the reply's first bytes). The child
    is always reaped; every wait is bounded."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only system calls, then _exit
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect("\0" + name)
            try:
                s.sendall(request)
                data = s.recv(4096)
                out = b"closed" if not data else b"reply:" + data[:200]
            except (ConnectionResetError, BrokenPipeError):
                out = b"closed"
            except socket.timeout:
                out = b"no answer"
            os.write(w, out)
        except BaseException as e:  # noqa: BLE001
            os.write(w, f"child error: {e!r}".encode()[:500])
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout + 5)
        result = os.read(r, 4096).decode(errors="replace") if ready else "child hung"
    finally:
        os.close(r)
        end = time.monotonic() + 5
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= end:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
    return result


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_same_host_socket_refuses_another_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's process connects with a correctly signed request (the uid check does not
    rely on the secret): it is closed before anything is read, nothing names it as ptracer, and
    the source keeps serving this user's receivers."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user")
    grants: List[int] = []
    # Act as under Yama ptrace_scope 1 (where the source names its receiver as ptracer), and
    # record the grants instead of making them.
    monkeypatch.setattr(same_host, "ptracer_needed", lambda: True)
    monkeypatch.setattr(_C, "allow_process_to_read", lambda pid: grants.append(pid) or 0)
    sent = state()
    with ExitStack() as stack:
        src, dst = transport(stack), transport(stack)
        src.send_checkpoint([1], 4, sent, TO)
        assert src._local is not None
        name = src._local.name
        fields = {"op": "fetch", "step": 4, "wait": 0.0, "chunks": 2}
        fields["auth"] = Signer(JobSecret(SECRET), SAME_HOST_PURPOSE).sign(
            same_host.request_what(name), same_host.request_body(4, 0.0, 2)
        )
        body = json.dumps(fields).encode()
        request = len(body).to_bytes(4, "big") + body
        result = _run_as(nobody.pw_uid, nobody.pw_gid, name, request, timeout=5.0)
        assert result == "closed", result  # no reply, no regions, no metadata
        assert grants == []
        st = src._staging
        assert st is not None and not st.leases and st.active == 0

        # the source is intact: this user's receiver heals from it, on the same-host path
        got = dst.recv_checkpoint(0, src.metadata(), 4, TO)
        assert dst.last_recv_path == "same-host"
        assert_bitwise(sent, got)
        # The source revokes on its serving thread once the receiver's DONE arrives, which
        # may be just after recv_checkpoint returns: wait for it (bounded).
        wait_for(lambda: len(grants) >= 2, timeout=5.0, what="the source revoking the grant")
        assert grants == [os.getpid(), 0]  # granted to the real receiver, then revoked
