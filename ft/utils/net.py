"""Where this replica lives on the network: the one address it advertises (stdlib only).

A replica advertises one host to its peers: for its ManagerServer, its checkpoint server, the
store its group hosts, and the interface Gloo binds. It is, in order:

1. ``FT_ADVERTISE_HOST``, if set;
2. the host the Manager resolved at start (:func:`set_process_advertise_host`): the address of
   the interface that routes to the lighthouse, so a job whose lighthouse is on another
   machine advertises the interface that reaches it, whatever ``gethostname()`` resolves to;
3. otherwise a non-loopback address of this host (its name, then the default route), or the
   host name itself.

See docs/multihost.md, "Addresses".
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from typing import Optional, Tuple

logger = logging.getLogger(__name__)

__all__ = [
    "ADVERTISE_ENV",
    "advertise_host",
    "chosen_advertise_host",
    "set_process_advertise_host",
    "route_source",
    "is_loopback",
    "check_reachable_advertisement",
    "bind_host_for",
]

ADVERTISE_ENV = "FT_ADVERTISE_HOST"

_lock = threading.Lock()
_process_host: Optional[str] = None


def is_loopback(host: str) -> bool:
    """True for loopback addresses and names that mean this host only ("localhost")."""
    host = host.strip("[]")
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _resolves_to_loopback_only(host: str) -> bool:
    if is_loopback(host):
        return True
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(addrs) and all(is_loopback(a) for a in addrs)


def route_source(host: str, port: int = 9) -> Optional[str]:
    """The local address the kernel would use to reach ``host`` (None if there is no route).

    A UDP ``connect`` sends nothing; it only asks the routing table.
    """
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, _, _, _, addr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(addr)
                src = s.getsockname()[0]
        except OSError:
            continue
        if not ipaddress.ip_address(src.split("%")[0]).is_unspecified:
            return src
    return None


def set_process_advertise_host(host: str) -> None:
    """Sets the host this process advertises when ``FT_ADVERTISE_HOST`` is unset (the Manager
    calls it once it knows the lighthouse's address)."""
    global _process_host
    with _lock:
        _process_host = host


def _fallback_host() -> str:
    name = socket.gethostname()
    try:
        addrs = [info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
    except OSError:
        addrs = []
    good = sorted((a for a in addrs if not is_loopback(a)), key=lambda a: ":" in a)
    if good:
        return good[0]
    for probe in ("192.0.2.1", "2001:db8::1"):  # documentation ranges: never contacted
        src = route_source(probe)
        if src is not None and not is_loopback(src):
            return src
    return name


def chosen_advertise_host() -> Optional[str]:
    """``FT_ADVERTISE_HOST``, else the host the Manager chose, else None (nothing chosen)."""
    env = os.environ.get(ADVERTISE_ENV)
    if env:
        return env
    with _lock:
        return _process_host


def advertise_host(toward: Optional[str] = None) -> str:
    """The host peers should dial to reach this process (see the module doc).

    ``toward``: a peer's host; when neither the environment nor the Manager has chosen, the
    interface that routes to it is used.
    """
    chosen = chosen_advertise_host()
    if chosen is not None:
        return chosen
    if toward is not None:
        src = route_source(toward)
        if src is not None and (not is_loopback(src) or is_loopback(toward)):
            return src
    return _fallback_host()


def check_reachable_advertisement(host: str, peer: str, what: str) -> None:
    """Refuses to advertise a loopback ``host`` to a ``peer`` on another machine.

    Raises:
        ValueError: naming the setting to change. Such a replica would join quorums that no
            peer can reach, and no step would ever commit.
    """
    if _resolves_to_loopback_only(host) and not _resolves_to_loopback_only(peer):
        raise ValueError(
            f"{what} would advertise {host!r}, a loopback address, to {peer!r} on another "
            f"host: peers could not reach it. Set {ADVERTISE_ENV} to an address of this host "
            f"that {peer} can reach (or pass hostname= to the Manager)."
        )


def bind_host_for(host: str) -> str:
    """Where a server that advertises ``host`` listens: that address (a name is resolved to its
    first address), so nothing on the machine's other interfaces can reach it; every interface
    only when the name does not resolve."""
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return "[::]"
        addrs = [info[4][0] for info in infos]
        chosen = next((a for a in addrs if not is_loopback(a)), addrs[0] if addrs else None)
        if chosen is None:
            return "[::]"
        ip = ipaddress.ip_address(chosen.split("%")[0])
    return f"[{ip}]" if ip.version == 6 else str(ip)


def split_hostport(addr: str) -> Tuple[str, int]:
    """'[::1]:80' -> ('::1', 80); 'host:80' -> ('host', 80); a leading 'http://',
    'https://' or 'grpc://' and a trailing '/' are ignored. Raises ValueError without a port."""
    for scheme in ("http://", "https://", "grpc://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme) :]
            break
    addr = addr.rstrip("/")
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        port = rest.lstrip(":")
    else:
        host, _, port = addr.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"address {addr!r} has no port")
    return host, int(port)


def join_hostport(host: str, port: int) -> str:
    """('::1', 80) -> '[::1]:80'; ('host', 80) -> 'host:80'."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
