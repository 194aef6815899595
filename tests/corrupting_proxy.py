"""TCP proxies on loopback for the tests: ``LoopbackProxy`` forwards each connection to a
server and lets a subclass see (and change) the bytes each way; ``CorruptingProxy`` flips one
byte of chosen HTTP responses (corruption in transit, for the tests that claim it is detected
and never loaded). tests/security/_recording_proxy.py records what passes instead."""

from __future__ import annotations

import socket
import threading
from typing import Callable, List, Optional, Tuple

# What a proxy does with the bytes one way: takes what arrived, returns what to send on now
# (b"" holds it back).
Forward = Callable[[bytes], bytes]


def _shut(s: socket.socket) -> None:
    """Shuts both directions of ``s`` down (its readers wake up), whatever state it is in."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class LoopbackProxy:
    """Listens on 127.0.0.1 (``port``, ``address``) and forwards each connection to
    127.0.0.1:``target_port``. A subclass says in ``_connected`` what each direction does with
    its bytes; the sockets it adds to ``_socks`` are shut by ``close()`` too."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._socks: List[socket.socket] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._start(self._accept)

    def _connected(self, client: socket.socket, server: socket.socket) -> Tuple[Forward, Forward]:
        """What to do with the bytes client to server, and server to client."""
        raise NotImplementedError

    def _start(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            except OSError:
                client.close()
                continue
            upstream, downstream = self._connected(client, server)
            self._start(self._pump, client, server, upstream)
            self._start(self._pump, server, client, downstream)

    def _pump(self, src: socket.socket, dst: socket.socket, forward: Forward) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                data = forward(data)
                if data:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                _shut(s)

    def close(self) -> None:
        _shut(self._srv)  # wakes accept() (close alone does not)
        self._srv.close()
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            _shut(s)
            s.close()
        for t in list(self._threads):
            t.join(5)


class CorruptingProxy(LoopbackProxy):
    """Forwards to 127.0.0.1:``target_port``. In the body of each response to a request whose
    request line contains ``/{kind}`` ("meta" or "data"), it XORs the byte at ``body_offset``
    with 0x5A; only for the first ``count`` such responses when ``count`` is set. ``flipped``
    counts the responses it corrupted."""

    def __init__(
        self,
        target_port: int,
        kind: str = "data",
        body_offset: int = 100,
        count: Optional[int] = None,
    ) -> None:
        self.kind = kind
        self.offset = body_offset
        self.count = count
        self.flipped = 0
        super().__init__(target_port)

    def _connected(self, client: socket.socket, server: socket.socket) -> Tuple[Forward, Forward]:
        client.settimeout(10)
        request = bytearray()

        def upstream(data: bytes) -> bytes:
            request.extend(data)
            return data

        return upstream, _ResponseCorrupter(self, request)

    def _should_corrupt(self, request: bytes) -> bool:
        with self._lock:
            line = request.split(b"\r\n")[0]
            if f"/{self.kind}".encode() not in line:
                return False
            if self.count is not None and self.flipped >= self.count:
                return False
            self.flipped += 1
            return True


class _ResponseCorrupter:
    """One response's bytes on their way back: decides at the first bytes whether to corrupt
    (by the request sent so far), then holds the head back until it is whole and flips the
    body's byte at the proxy's offset."""

    def __init__(self, proxy: CorruptingProxy, request: bytearray) -> None:
        self._proxy = proxy
        self._request = request
        self._corrupt: Optional[bool] = None
        self._head = b""
        self._body_seen: Optional[int] = None

    def __call__(self, data: bytes) -> bytes:
        if self._corrupt is None:
            self._corrupt = self._proxy._should_corrupt(bytes(self._request))
        if not self._corrupt:
            return data
        head = b""
        if self._body_seen is None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return b""
            head, data, self._body_seen = self._head[: end + 4], self._head[end + 4 :], 0
        k = self._proxy.offset - self._body_seen
        if 0 <= k < len(data):
            flipped = bytearray(data)
            flipped[k] ^= 0x5A
            data = bytes(flipped)
        self._body_seen += len(data)
        return head + data
