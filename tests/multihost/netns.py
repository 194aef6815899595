"""Simulated hosts for multi-host tests: Linux network namespaces on a private bridge.

``Hosts(["lh", "a", "b"])`` makes one namespace per host plus a switch namespace holding the
bridge, and gives host i the address ``10.213.77.(10+i)/24`` on that bridge. The subnet exists
only inside these namespaces: the test machine's own namespace gets no interface on it. Each
host has its own loopback. Faults are injected on the switch side of a host's link
(``partition``: the link goes down; ``restore``: up again), so the host's own processes see a
silent network, not an interface that vanished. ``close()`` (also on ``__exit__``, whatever the
test did) kills every process started here, by pid, and deletes every namespace.

Needs root and ``ip`` (iproute2); :func:`unavailable_reason` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from typing import Dict, List, Optional

from tests.procs import Proc, Procs

SUBNET = "10.213.77"


def unavailable_reason() -> Optional[str]:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"ftprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _ip(*args: str, ns: Optional[str] = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class Hosts:
    def __init__(self, names: List[str]) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.switch = f"ftsw{self.tag}"
        self.ns: Dict[str, str] = {}
        self.addr: Dict[str, str] = {}
        self._switch_port: Dict[str, str] = {}
        self.procs = Procs()
        try:
            _ip("netns", "add", self.switch)
            _ip("link", "add", "br0", "type", "bridge", ns=self.switch)
            _ip("link", "set", "br0", "up", ns=self.switch)
            for i, name in enumerate(names):
                self._add_host(i, name)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int, name: str) -> None:
        ns = f"ft{self.tag}{name}"
        _ip("netns", "add", ns)
        self.ns[name] = ns
        # Create the pair in the host namespace, then move one end into the switch.
        host_end, sw_end = f"eth{i}", f"p{i}"
        _ip("link", "add", host_end, "type", "veth", "peer", "name", sw_end, ns=ns)
        _ip("link", "set", sw_end, "netns", self.switch, ns=ns)
        _ip("link", "set", sw_end, "master", "br0", ns=self.switch)
        _ip("link", "set", sw_end, "up", ns=self.switch)
        addr = f"{SUBNET}.{10 + i}"
        _ip("addr", "add", f"{addr}/24", "dev", host_end, ns=ns)
        _ip("link", "set", host_end, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        self.addr[name] = addr
        self._switch_port[name] = sw_end

    def partition(self, name: str) -> None:
        """Cuts ``name`` off the network (its switch port goes down)."""
        _ip("link", "set", self._switch_port[name], "down", ns=self.switch)

    def restore(self, name: str) -> None:
        _ip("link", "set", self._switch_port[name], "up", ns=self.switch)

    def run(self, name: str, argv: List[str]) -> None:
        """Runs a short command (``iptables``, ``tc``) on host ``name``; raises if it fails."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[name], *argv],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} on {name}: {r.stderr.strip()}")

    def popen(
        self,
        name: str,
        argv: List[str],
        log_path: str,
        env: Optional[Dict[str, str]] = None,
        label: Optional[str] = None,
    ) -> Proc:
        """Starts ``argv`` on host ``name`` (tests.procs.Proc, output in ``log_path``); killed
        and reaped by :meth:`close`."""
        return self.procs.add(
            Proc(
                ["ip", "netns", "exec", self.ns[name], *argv],
                env={**os.environ, **(env or {})},
                log_path=log_path,
                name=label or f"{os.path.basename(argv[0])} on {name}",
            )
        )

    def close(self) -> None:
        self.procs.kill_all()
        for ns in [*self.ns.values(), self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        self.ns.clear()

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
