"""Same-host checkpoint transfer: the receiver copies the source's tensors straight out of the
source process's memory, and both sides checksum every byte.

Why: a replica group that restarts on the host of its healing source (the common case for the
local launcher, and for hosts that run several groups) would otherwise pull its state through
loopback TCP: two kernel copies and the socket machinery, ~5x a memcpy on the development
machine. Here the kernel copies once (``process_vm_readv``, see csrc/process_memory.hpp).

How a receiver finds the path: the HTTP source also listens on an abstract Unix socket with a
random name (``ft-ckpt-<32 hex>``) and names it in its metadata, as the URL's fragment
(``http://host:port#ft-ckpt-...``). Abstract sockets exist only inside one network namespace of
one kernel, so a successful connect proves that source and receiver share a host; the socket's
peer credentials then give the source's pid as the receiver's kernel numbers it. A same-host
heal never touches TCP, and takes one request: the source answers with the metadata, where its
tensors are and the CRCs, while the receiver allocates and copies. Anything that makes the path
unusable before a byte is copied (another host, another pid namespace, the kernel refusing
``process_vm_readv``) makes the receiver use HTTP; failures after that are transfer failures.

Who may ask: the source accepts connections only from processes of its own uid (the socket's
peer credentials, checked before a byte is read; others are closed at once), and, where the job
has a secret, only requests signed with it (``auth``: ``Signer(secret, "same-host")`` over
``fetch <endpoint name>`` and the JSON ``[step, wait, chunks]``, see ft.utils.auth); the secret
itself never crosses the socket. Only such a request names its pid as this process's ptracer
(Yama ptrace_scope 1). A connection must send its request within REQUEST_TIMEOUT_S, and at most
MAX_CONNECTIONS are open at once (more are closed at once), so idle sockets cannot hoard the
endpoint. A receiver that is refused (closed without a reply), cannot connect in
CONNECT_TIMEOUT_S, or gets no reply in time uses HTTP instead.

Protocol (frames are a 4-byte big-endian length plus UTF-8 JSON of at most 1 MiB; raw frames
the same length prefix plus bytes)::

    receiver -> source  {"op": "fetch", "auth", "step", "wait", "chunks"}
    source -> receiver  {"ok": true, "lease": "...", "regions": [[address, nbytes], ...],
                         "ranges": [[a, b], ...]}
                        then a raw frame: the header and its CRC-32, exactly the body of HTTP's
                        /meta response (the lease is good for ``chunks`` HTTP data requests)
    source -> receiver  one record per range, in order: >II (range index, CRC-32C of its bytes)
    receiver -> source  b"D" when every range verified (the source may reuse its tensors),
                        b"F" when it falls back to HTTP before copying anything

    Any refusal is {"ok": false, "code": <HTTP status>, "error": "..."}.

Regions are the source's tensors in header order (their bytes concatenated form the offsets
that ranges index); ranges are consecutive byte ranges covering the whole checkpoint. The
source checksums each range once, from its own memory, usually before the receiver asks (see
same_host_source.py); the receiver checksums what it copied, range by range, on a
second thread while it copies the next. A mismatch fails the heal, nothing is returned.
"""

from __future__ import annotations

import bisect
import errno
import json
import os
import logging
import re
import select
import socket
import struct
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from ft import _C  # ft's compiled extension (torch's _C naming)
from ft.checkpointing.deadline_io import read_exact
from ft.checkpointing.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointTransferError,
)
from ft.utils.deadline import Deadline

__all__ = [
    "LocalEndpoint",
    "Session",
    "parse_ranges",
    "segments",
    "supported",
    "NAME_PATTERN",
]

logger = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"ft-ckpt-[0-9a-f]{32}")
_FRAME = struct.Struct(">I")
_CRC_RECORD = struct.Struct(">II")
_MAX_FRAME = 1 << 20
MAX_CONNECTIONS = 256  # open same-host connections per source (each holds a thread)
# A receiver sends its request right after connecting: a connection silent for longer is closed.
REQUEST_TIMEOUT_S = 2.0
# Most a receiver's connect may take. A full listen backlog (the endpoint swamped) fails it at
# once (EAGAIN), and the receiver uses HTTP; this bounds whatever else could hold it.
CONNECT_TIMEOUT_S = 1.0
# A connect needs a positive socket timeout (0 would make the socket non-blocking, and the
# connect fail at once) even when the heal's deadline has all but passed.
_MIN_CONNECT_TIMEOUT_S = 0.001
# Connections queued before the endpoint accepts them; beyond this a receiver's connect fails
# at once (EAGAIN) and it uses HTTP, which is what a swamped endpoint should make it do.
_LISTEN_BACKLOG = 64
# After a failed accept (EMFILE, ENOMEM...: transient), the endpoint waits this long before
# accepting again, so that a descriptor shortage does not spin a core.
_ACCEPT_RETRY_S = 0.05
# Refused connections are logged at most this often (a flood must not flood the log too).
_REFUSAL_LOG_INTERVAL_S = 10.0
# close() joins the endpoint's threads this long by default: they have been cut off by then.
_CLOSE_JOIN_S = 5.0
DONE = b"D"
FALLBACK = b"F"
# errnos of a kernel (or sandbox) that will not let this receiver read the source: use HTTP
_NOT_PERMITTED = {errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EINVAL}


def supported() -> bool:
    """Abstract Unix sockets and process_vm_readv: Linux only."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_PEERCRED")


def segments(offsets: Sequence[int], start: int, end: int) -> Iterator[Tuple[int, int, int]]:
    """Splits bytes ``[start, end)`` of tensors laid end to end (``offsets[i]`` is where tensor
    i starts, ``offsets[-1]`` the total) into ``(i, lo, hi)`` pieces, ``lo``/``hi`` within
    tensor i; empty tensors are skipped."""
    i = max(0, bisect.bisect_right(offsets, start) - 1)
    pos = start
    while pos < end:
        while offsets[i + 1] <= pos:
            i += 1
        hi = min(end, offsets[i + 1])
        yield i, pos - offsets[i], hi - offsets[i]
        pos = hi


# ----------------------------------------------------------------------------- framing


def recv_exact(sock: socket.socket, n: int, deadline: Deadline) -> bytes:
    """``n`` bytes from ``sock`` by ``deadline`` (TimeoutError, EOFError otherwise)."""
    buf = bytearray(n)
    read_exact(sock, sock.recv_into, memoryview(buf), deadline)
    return buf  # bytes-like; not copied again into a bytes object


def send_raw(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_FRAME.pack(len(data)) + data)


def recv_raw(sock: socket.socket, deadline: Deadline, max_bytes: int) -> bytes:
    (n,) = _FRAME.unpack(recv_exact(sock, _FRAME.size, deadline))
    if n > max_bytes:
        raise ValueError(f"frame of {n} bytes exceeds {max_bytes}")
    return recv_exact(sock, n, deadline)


def send_frame(sock: socket.socket, obj: Any) -> None:
    send_raw(sock, json.dumps(obj, separators=(",", ":")).encode("utf-8"))


def recv_frame(sock: socket.socket, deadline: Deadline, max_bytes: int = _MAX_FRAME) -> Any:
    body = recv_raw(sock, deadline, max_bytes)
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"frame is not JSON ({e})") from None


def poll_answer(sock: socket.socket, wait: float = 0.0) -> Optional[bytes]:
    """The receiver's one-byte answer if it has arrived within ``wait`` seconds (b"" if the
    receiver closed the connection), else None."""
    try:
        readable, _, _ = select.select([sock], [], [], wait)
        if not readable:
            return None
        return sock.recv(1)
    except (OSError, ValueError):
        return b""


def ptracer_needed() -> bool:
    """True where Yama's ptrace_scope is 1: a receiver may read this process only once this
    process names it (``_C.allow_process_to_read``)."""
    global _PTRACER_NEEDED
    if _PTRACER_NEEDED is None:
        try:
            with open("/proc/sys/kernel/yama/ptrace_scope") as f:
                _PTRACER_NEEDED = f.read().strip() == "1"
        except OSError:
            _PTRACER_NEEDED = False  # no Yama: same-user processes may read each other
    return _PTRACER_NEEDED


_PTRACER_NEEDED: Optional[bool] = None


def send_crc(sock: socket.socket, index: int, crc: int) -> None:
    sock.sendall(_CRC_RECORD.pack(index, crc))


def peer_creds(sock: socket.socket) -> Tuple[int, int, int]:
    """The connected peer's (pid, uid, gid) as the kernel recorded them at connect (pid 0 if
    it is not visible in this pid namespace)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def peer_pid(sock: socket.socket) -> int:
    """The connected peer's pid in this process's pid namespace (0 if it is not visible)."""
    return peer_creds(sock)[0]


def same_user(sock: socket.socket) -> bool:
    """True if the peer runs as this process's effective uid (False if that cannot be told)."""
    try:
        return peer_creds(sock)[1] == os.geteuid()
    except OSError:
        return False


def request_body(step: Any, wait: Any, chunks: Any) -> bytes:
    """What a fetch request's signature covers besides the endpoint's name."""
    return json.dumps([step, wait, chunks], separators=(",", ":")).encode("utf-8")


def request_what(name: str) -> str:
    """The signed name of a fetch from endpoint ``name`` (a signature for one source is
    worthless at another)."""
    return f"fetch {name}"


# ----------------------------------------------------------------------------- source side


class LocalEndpoint:
    """An abstract Unix socket that hands each connection to ``handle`` on its own thread.

    Contract: only connections from this process's uid reach ``handle``, at most
    MAX_CONNECTIONS at once (others are closed at once, unread). ``handle(conn)`` owns the
    connection until it returns (the endpoint closes it afterwards); it bounds its own reads
    (see REQUEST_TIMEOUT_S). ``close()`` may be called from any thread, more than once; it
    stops accepting, shuts down open connections and joins the threads within
    ``join_timeout`` seconds.
    """

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.name = f"ft-ckpt-{uuid.uuid4().hex}"
        self._handle = handle
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(_LISTEN_BACKLOG)
        self._lock = threading.Lock()
        self._conns: Set[socket.socket] = set()
        self._threads: Set[threading.Thread] = set()
        self._closed = False
        self._last_warning = -1e9
        self._refused = 0
        self._acceptor = threading.Thread(
            target=self._accept_loop, daemon=True, name="ft-ckpt-local-accept"
        )
        self._acceptor.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                # EMFILE, ENOMEM...: transient; the name stays bound, so keep serving
                logger.warning("same-host checkpoint endpoint: accept failed (%s)", e)
                time.sleep(_ACCEPT_RETRY_S)
                continue
            if not same_user(conn):
                # Another user's process: closed before a byte is read. It could not read this
                # process's memory anyway, and must not learn where the tensors are.
                self._warn("refused a connection from another user")
                conn.close()
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                if len(self._conns) >= MAX_CONNECTIONS:
                    # each connection holds a thread until it is done or times out: bound them
                    # (the receiver refused here uses HTTP)
                    self._warn(f"{len(self._conns)} connections open; refused another")
                    conn.close()
                    continue
                t = threading.Thread(
                    target=self._run, args=(conn,), daemon=True, name="ft-ckpt-local"
                )
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    def _warn(self, what: str) -> None:
        """Logs a refusal, at most once per _REFUSAL_LOG_INTERVAL_S."""
        now = time.monotonic()
        self._refused += 1
        if now - self._last_warning >= _REFUSAL_LOG_INTERVAL_S:
            logger.warning(
                "same-host checkpoint endpoint: %s (%d refusal(s) since the last "
                "warning; receivers use HTTP meanwhile)",
                what,
                self._refused,
            )
            self._last_warning = now
            self._refused = 0

    def _run(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        except Exception:  # noqa: BLE001 - a broken receiver must not kill the endpoint
            logger.debug("same-host checkpoint request failed", exc_info=True)
        finally:
            conn.close()
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())

    def close(self, join_timeout: float = _CLOSE_JOIN_S) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = Deadline.after(join_timeout)
        self._acceptor.join(deadline.remaining())
        for t in threads:
            t.join(deadline.remaining())


# ----------------------------------------------------------------------------- receiver side


class _Fallback(Exception):
    """The same-host path cannot be used; nothing was copied."""


def _copy_plan(
    reply: Dict[str, Any], offsets: Sequence[int], views: Sequence[memoryview]
) -> Tuple[List[Tuple[int, int]], List[Any]]:
    """What a same-host copy does, from the source's reply: the byte ranges it checksums (in
    the layout ``offsets`` gives, tensor after tensor) and, for each, the pieces that fill it:
    (address in the source's memory, view into ``views``)."""
    regions = _parse_regions(reply.get("regions"), offsets)
    ranges = parse_ranges(reply.get("ranges"), offsets[-1])
    plan = [
        [(regions[i][0] + lo, views[i][lo:hi]) for i, lo, hi in segments(offsets, a, b)]
        for a, b in ranges
    ]
    return ranges, plan


class Session:
    """One receiver's connection to a same-host source. Not thread-safe: one caller.

    ``open`` returns None where the source is not on this host. ``meta`` and ``copy`` raise
    the CheckpointErrors of a failed transfer (``raise_for_status`` maps refusals).
    """

    def __init__(
        self,
        sock: socket.socket,
        pid: int,
        where: str,
        raise_for_status: Callable[[int, str], None],
    ) -> None:
        self._sock = sock
        self._pid = pid
        self._where = where
        self._raise_for_status = raise_for_status

    @classmethod
    def open(
        cls,
        name: str,
        deadline: Deadline,
        where: str,
        raise_for_status: Callable[[int, str], None],
    ) -> Optional["Session"]:
        if not supported() or not NAME_PATTERN.fullmatch(name):
            return None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:
            return None
        try:
            # a full backlog (the endpoint swamped) fails at once: use HTTP, do not wait
            sock.settimeout(
                max(_MIN_CONNECT_TIMEOUT_S, deadline.sooner(CONNECT_TIMEOUT_S).remaining())
            )
            sock.connect("\0" + name)
            pid, uid, _ = peer_creds(sock)
        except OSError as e:
            sock.close()
            logger.info("%s: no same-host path (%s); using HTTP", where, e)
            return None
        if pid <= 0:
            sock.close()
            logger.debug("%s: source is in another pid namespace; using HTTP", where)
            return None
        if uid != os.geteuid():
            # not this user's process: it could not be read, and is not trusted to say where
            sock.close()
            logger.info(
                "%s: the same-host source runs as uid %d, not %d; using HTTP",
                where,
                uid,
                os.geteuid(),
            )
            return None
        return cls(sock, pid, where, raise_for_status)

    def close(self) -> None:
        self._sock.close()

    def _check(self, reply: Any) -> Dict[str, Any]:
        if type(reply) is not dict:
            raise ValueError("reply is not an object")
        if reply.get("ok") is not True:
            code, msg = reply.get("code"), reply.get("error")
            self._raise_for_status(
                code if type(code) is int else 500, f"{self._where}: {str(msg)[:500]}"
            )
            raise ValueError(f"refused without a status: {msg!r:.200}")
        return reply

    def _translate(self, e: BaseException) -> BaseException:
        where = self._where
        if isinstance(e, CheckpointError):
            return e  # a refusal already mapped (some CheckpointErrors are OSErrors too)
        if isinstance(e, (socket.timeout, TimeoutError)):
            return CheckpointTransferError(f"{where}: timed out (same-host path)")
        if isinstance(e, (OSError, EOFError)):
            return CheckpointTransferError(
                f"{where}: source vanished during a same-host transfer ({type(e).__name__}: {e})"
            )
        if isinstance(e, ValueError):
            return CheckpointFormatError(f"{where}: bad same-host reply: {e}")
        if isinstance(e, RuntimeError):  # the native copy could not run (e.g. out of memory)
            return CheckpointTransferError(f"{where}: same-host copy failed: {e}")
        return e

    def fetch(
        self,
        request: Dict[str, Any],
        deadline: Deadline,
        max_bytes: int,
        reply_deadline: Optional[Deadline] = None,
    ) -> Optional[Tuple[bytes, str, Dict[str, Any]]]:
        """Asks for the checkpoint: returns the metadata body (header + CRC-32 trailer), the
        source's lease and the reply that ``copy`` needs. None (use HTTP) if the source
        predates this request, closed the connection unanswered (it refuses other users, and
        connections beyond MAX_CONNECTIONS), or sent no reply by ``reply_deadline`` (default
        ``deadline``): nothing was copied yet, and HTTP does not depend on this socket."""
        try:
            send_frame(self._sock, dict(request, op="fetch"))
        except OSError as e:
            logger.info(
                "%s: the same-host source refused the connection (%s); using HTTP", self._where, e
            )
            return None
        try:
            # the reply lists every tensor's region: it may be as large as the header
            reply = recv_frame(
                self._sock,
                deadline
                if reply_deadline is None or deadline.at <= reply_deadline.at
                else reply_deadline,
                max_bytes,
            )
        except (EOFError, ConnectionError) as e:
            logger.info(
                "%s: the same-host source closed the connection unanswered (%s: busy, "
                "or refusing this user); using HTTP",
                self._where,
                type(e).__name__,
            )
            return None
        except TimeoutError:  # socket.timeout too
            logger.info("%s: no same-host reply in time; using HTTP", self._where)
            return None
        except (OSError, ValueError) as e:
            raise self._translate(e) from None
        try:
            if (
                type(reply) is dict
                and reply.get("ok") is not True
                and reply.get("code") == 400
                and "unknown op" in str(reply.get("error"))
            ):
                logger.info(
                    "%s: the source does not know the one-request protocol; using HTTP", self._where
                )
                return None
            reply = self._check(reply)
            body = recv_raw(self._sock, deadline, max_bytes)
        except (OSError, EOFError, ValueError) as e:  # socket.timeout is an OSError
            raise self._translate(e) from None
        lease = reply.get("lease")
        return body, lease if type(lease) is str else "", reply

    def copy(
        self,
        reply: Dict[str, Any],
        offsets: Sequence[int],
        views: Sequence[memoryview],
        deadline: Deadline,
    ) -> bool:
        """Copies every byte into ``views`` (tensor i's bytes; ``offsets`` lays them end to
        end, as the header the source sent), verifying each range. False: the kernel refused
        before anything was copied (the source was told; fetch over HTTP with the lease)."""
        try:
            ranges, plan = _copy_plan(reply, offsets, views)
            return self._copy(ranges, plan, deadline)
        except _Fallback as e:
            logger.info("%s: same-host path unusable (%s); using HTTP", self._where, e)
            try:
                self._sock.sendall(FALLBACK)
            except OSError:
                pass
            return False
        except CheckpointError:
            raise  # already says what failed (checksum mismatch, refusal...)
        except (OSError, EOFError, ValueError, RuntimeError) as e:
            raise self._translate(e) from None

    def _copy(self, ranges: List[Tuple[int, int]], plan: List[Any], deadline: Deadline) -> bool:
        # One native call copies and checksums everything with the GIL released; the source's
        # CRCs (usually computed before the fetch arrived) are waiting in the socket by then.
        crcs, err = _copy_ranges(self._pid, plan)
        if err:
            if not crcs and err in _NOT_PERMITTED:
                raise _Fallback(f"process_vm_readv: {os.strerror(err)}")
            raise CheckpointTransferError(
                f"{self._where}: reading the source's memory failed on the same-host path "
                f"({os.strerror(err)})"
            )
        records = recv_exact(self._sock, _CRC_RECORD.size * len(ranges), deadline)
        for expected, (index, crc) in enumerate(_CRC_RECORD.iter_unpack(records)):
            if index != expected:
                raise ValueError(f"checksum record {index}, expected {expected}")
            if crcs[index] != crc:
                a, b = ranges[index]
                raise CheckpointCorruptError(
                    f"{self._where}: checksum mismatch in bytes [{a}, {b}) (same-host path); "
                    "data discarded"
                )
        self._sock.sendall(DONE)
        return True


def _copy_ranges(pid: int, plan: List[List[Tuple[int, memoryview]]]) -> Tuple[List[int], int]:
    """(CRC-32C of each range copied, errno of the first failure or 0); a seam for tests."""
    crcs, err = _C.copy_from_process(pid, plan)
    return list(crcs), int(err)


MAX_RANGES = 256


def parse_ranges(raw: Any, total: int) -> List[Tuple[int, int]]:
    """Checks a source's ranges: at most MAX_RANGES, consecutive, non-empty, covering
    ``[0, total)``. Raises ValueError naming the first problem."""
    if type(raw) is not list or len(raw) > MAX_RANGES or (total > 0 and not raw):
        raise ValueError(f"ranges must be a list of at most {MAX_RANGES} byte ranges")
    out: List[Tuple[int, int]] = []
    pos = 0
    for r in raw:
        if type(r) is not list or len(r) != 2 or not all(type(x) is int for x in r):
            raise ValueError(f"bad range {r!r:.60}")
        a, b = r
        if a != pos or b <= a:
            raise ValueError(f"range [{a}, {b}) does not continue at byte {pos}")
        out.append((a, b))
        pos = b
    if pos != total:
        raise ValueError(f"ranges cover {pos} of {total} bytes")
    return out


def _parse_regions(raw: Any, offsets: Sequence[int]) -> List[Tuple[int, int]]:
    n = len(offsets) - 1
    if type(raw) is not list or len(raw) != n:
        raise ValueError(f"expected {n} regions")
    out = []
    for i, r in enumerate(raw):
        if (
            type(r) is not list
            or len(r) != 2
            or not all(type(x) is int and x >= 0 for x in r)
            or r[1] != offsets[i + 1] - offsets[i]
            or r[0] + r[1] >= 1 << 64
        ):
            raise ValueError(
                f"region {i} is {r!r:.80}, expected {offsets[i + 1] - offsets[i]} bytes"
            )
        out.append((r[0], r[1]))
    return out
