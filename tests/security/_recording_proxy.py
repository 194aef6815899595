"""A TCP proxy on loopback that records what clients send through it, and a reader that takes
the gRPC messages back out of the recorded HTTP/2 bytes: an eavesdropper on the path, for the
tests that replay what it captured (tests/security/test_replay.py).

Only DATA frames are read (HEADERS are HPACK-compressed and not needed: a test finds the
message it wants by its content). Each gRPC message is a 5-byte prefix (compressed flag,
big-endian length) and the message, split across DATA frames as HTTP/2 pleases.
"""

from __future__ import annotations

import socket
import struct
from typing import Callable, Dict, List, Tuple

from tests.corrupting_proxy import Forward, LoopbackProxy

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA = 0x0
_PADDED = 0x8


class RecordingProxy(LoopbackProxy):
    """Listens on 127.0.0.1 (``port``) and forwards each connection to 127.0.0.1:``target``,
    keeping every byte a client sent and every byte the server answered (per connection, in
    order). ``close()`` ends it all."""

    def __init__(self, target_port: int) -> None:
        self._sent: List[bytearray] = []
        self._received: List[bytearray] = []  # what the server answered, per connection
        super().__init__(target_port)

    def _connected(self, client: socket.socket, server: socket.socket) -> Tuple[Forward, Forward]:
        server.settimeout(None)
        record, reply = bytearray(), bytearray()
        with self._lock:
            self._sent.append(record)
            self._received.append(reply)
            self._socks += [client, server]
        return self._keeper(record), self._keeper(reply)

    def _keeper(self, into: bytearray) -> Forward:
        def keep(data: bytes) -> bytes:
            with self._lock:
                into.extend(data)
            return data

        return keep

    def transcript(self) -> bytes:
        """Every byte that crossed the proxy, both ways, connection by connection."""
        with self._lock:
            return b"".join(bytes(a) + bytes(b) for a, b in zip(self._sent, self._received))

    def messages(self) -> List[bytes]:
        """Every gRPC message clients sent so far, in order (connection by connection)."""
        with self._lock:
            sent = [bytes(r) for r in self._sent]
        out: List[bytes] = []
        for data in sent:
            out += grpc_messages(data)
        return out


def grpc_messages(data: bytes) -> List[bytes]:
    """The gRPC messages in the client side of one HTTP/2 connection (``data`` from its
    preface on), stream by stream in the order their first bytes came."""
    if not data.startswith(_PREFACE):
        return []
    pos = len(_PREFACE)
    streams: Dict[int, bytearray] = {}
    while pos + 9 <= len(data):
        length = int.from_bytes(data[pos : pos + 3], "big")
        kind, flags = data[pos + 3], data[pos + 4]
        stream = struct.unpack(">I", data[pos + 5 : pos + 9])[0] & 0x7FFFFFFF
        payload = data[pos + 9 : pos + 9 + length]
        pos += 9 + length
        if len(payload) < length:
            break  # a frame still on its way
        if kind != _DATA:
            continue
        if flags & _PADDED:
            pad = payload[0]
            payload = payload[1 : len(payload) - pad]
        streams.setdefault(stream, bytearray()).extend(payload)
    out: List[bytes] = []
    for body in streams.values():
        out += _split_messages(bytes(body))
    return out


def _split_messages(body: bytes) -> List[bytes]:
    out: List[bytes] = []
    pos = 0
    while pos + 5 <= len(body):
        compressed, n = body[pos], int.from_bytes(body[pos + 1 : pos + 5], "big")
        if compressed or pos + 5 + n > len(body):
            break  # ft sends no compressed messages; an incomplete one is not ours yet
        out.append(body[pos + 5 : pos + 5 + n])
        pos += 5 + n
    return out


def find_signed(messages: List[bytes], match: Callable[[bytes], bool]) -> Tuple[bytes, str]:
    """The first captured signed request whose request bytes (the signature taken off) satisfy
    ``match`` -- sent as a call or on a heartbeat stream ("call"), or carried by a call stream
    ("stream": CallStreamRequest.request) -- and how it travelled. AssertionError if none."""
    from ft.coordination._proto import torchft_pb2 as pb
    from ft.utils.auth import split_signed

    for m in messages:
        request, token = split_signed(m)
        if token and _matches(match, request):
            return m, "call"
        try:
            carried = pb.CallStreamRequest.FromString(m).request
        except Exception:  # noqa: BLE001 (not a CallStreamRequest)
            continue
        request, token = split_signed(carried)
        if token and _matches(match, request):
            return carried, "stream"
    raise AssertionError(f"no such signed request among {len(messages)} captured messages")


def _matches(match: Callable[[bytes], bool], request: bytes) -> bool:
    try:
        return bool(match(request))
    except Exception:  # noqa: BLE001 (a message of another type)
        return False
