"""A TCP proxy in front of an HTTP checkpoint server that flips one byte of chosen responses:
corruption in transit, for the tests that claim it is detected and never loaded."""

from __future__ import annotations

import socket
import threading
from typing import Dict, List, Optional


class CorruptingProxy:
    """Listens on 127.0.0.1:``port`` and forwards to 127.0.0.1:``target_port``. In the body of
    each response to a request whose request line contains ``/{kind}`` ("meta" or "data"), it
    XORs the byte at ``body_offset`` with 0x5A; only for the first ``count`` such responses when
    ``count`` is set. ``flipped`` counts the responses it corrupted."""

    def __init__(
        self,
        target_port: int,
        kind: str = "data",
        body_offset: int = 100,
        count: Optional[int] = None,
    ) -> None:
        self.target = target_port
        self.kind = kind
        self.offset = body_offset
        self.count = count
        self.flipped = 0
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._start(self._accept)

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
            client.settimeout(10)
            request: Dict[str, bytes] = {"first": b""}
            self._start(self._pump, client, server, True, request)
            self._start(self._pump, server, client, False, request)

    def _should_corrupt(self, request: Dict[str, bytes]) -> bool:
        with self._lock:
            line = request["first"].split(b"\r\n")[0]
            if f"/{self.kind}".encode() not in line:
                return False
            if self.count is not None and self.flipped >= self.count:
                return False
            self.flipped += 1
            return True

    def _pump(
        self, src: socket.socket, dst: socket.socket, upstream: bool, request: Dict[str, bytes]
    ) -> None:
        head = b""
        body_seen: Optional[int] = None
        corrupt: Optional[bool] = None
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream:
                    request["first"] += data
                else:
                    if corrupt is None:
                        corrupt = self._should_corrupt(request)
                    if corrupt and body_seen is None:
                        head += data
                        end = head.find(b"\r\n\r\n")
                        if end < 0:
                            continue
                        dst.sendall(head[: end + 4])
                        data, body_seen = head[end + 4 :], 0
                    if corrupt and body_seen is not None:
                        k = self.offset - body_seen
                        if 0 <= k < len(data):
                            flipped = bytearray(data)
                            flipped[k] ^= 0x5A
                            data = bytes(flipped)
                        body_seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self._srv.shutdown(socket.SHUT_RDWR)  # wakes accept() (close alone does not)
        except OSError:
            pass
        self._srv.close()
        for t in list(self._threads):
            t.join(5)
