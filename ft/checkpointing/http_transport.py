"""HTTPTransport: a healthy replica serves its state dict over HTTP; recovering replicas pull it.

Wire protocol (with a job secret, every request carries ``Authorization: FT-HMAC <signature>``
of the address it dials, its path and its query, see ft.utils.auth)::

    GET /ft/v1/checkpoint/{step}/meta?chunks=N&wait=S
        -> 200, body = header JSON (serialization.encode_header) + CRC32 (4 bytes, big endian)
           response header X-FT-Lease: a lease id for the data requests that follow
           If {step} is ahead of what is staged, the server waits up to S seconds for it.
    GET /ft/v1/checkpoint/{step}/data?staging=ID&lease=L&start=A&end=B
        -> 200, body = bytes [A, B) of the concatenated tensor bytes + CRC-32C of those bytes

    403: missing, wrong or replayed signature. 404: step not staged. 409: the source failed to
    produce the step (abandon_checkpoint). 410: withdrawn. 503: shutting down.

With a job secret the source also signs what it serves, bound to the request it answers
(HMAC-SHA256 with the secret's checkpoint-content key): the metadata answer carries
``X-FT-Content-MAC: hex(MAC("meta", request signature, header))``, and each data range's
trailer is its CRC-32C followed by ``MAC("data", request signature, start, end, CRC)``. The
receiver checks the metadata MAC before it parses a byte of the header, and each range's MAC
with its CRC before anything is returned; a source that does not know the secret cannot make
either, so a replica never loads weights that a job member did not serve. Signing covers the
checksums, not the bytes again: the bytes are read once, for the CRC.

The sender keeps references to the tensors (no serialization at ``send_checkpoint``) and reads
them only while answering requests; the CRC is computed over exactly the bytes it writes, so
corruption anywhere on the way is detected by the receiver, which then raises
:class:`CheckpointCorruptError` and returns nothing. ``disallow_checkpoint`` waits (bounded by
the timeout) until transfers that already started have finished, so that after it returns the
caller may mutate the tensors again.

Same-host receivers take the path in same_host.py instead. For them, ``send_checkpoint`` also
starts a background thread that copies CPU tensors of 2 MiB or more into huge-page memory (at
most a quarter of the memory available, divided by ``LOCAL_WORLD_SIZE``; above that the tensors
are served in place) and checksums the byte ranges that path verifies, while the healer is
still finding this source.
"""

from __future__ import annotations

import hmac
import http.client
import logging
import os
import socket
import ssl
import struct
import threading
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait as futures_wait
from datetime import timedelta
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, TypeVar
from urllib.parse import parse_qs, urlsplit

import torch

from ft import _C
from ft.checkpointing import same_host as same_host_path
from ft.checkpointing import serialization as ser
from ft.utils import net
from ft.utils.tls import TLSConfig, resolve_tls
from ft.utils.http_server import BoundedHTTPServer, BoundedRequestHandler
from ft.utils.auth import (
    CHECKPOINT_CONTENT_PURPOSE,
    CHECKPOINT_REQUEST_PURPOSE,
    HTTP_SCHEME,
    SAME_HOST_PURPOSE,
    AuthError,
    JobSecret,
    SecretLike,
    Signer,
    Verifier,
    check_exposure,
    resolve_secret,
)
from ft.checkpointing.transport import (
    CheckpointAuthError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    CheckpointTransport,
)

T = TypeVar("T")

__all__ = ["HTTPTransport", "default_advertise_host", "plan_chunks"]

logger = logging.getLogger(__name__)

TOKEN_ENV = "FT_CHECKPOINT_TOKEN"
ADVERTISE_ENV = net.ADVERTISE_ENV
PORT_ENV = "FT_CHECKPOINT_PORT"
SAME_HOST_ENV = "FT_CHECKPOINT_SAME_HOST"
_PREFIX = "/ft/v1/checkpoint/"
# A signed source's MAC of its metadata answer (response header, hex) and of each range (the
# range trailer's last bytes): HMAC-SHA256.
_CONTENT_MAC_HEADER = "X-FT-Content-MAC"
_MAC_SIZE = 32


def _range_bytes(start: int, end: int) -> bytes:
    return struct.pack(">QQ", start, end)
_SLICE = 1 << 20  # bytes per read/crc/write step
_MIN_CHUNK = 1 << 20  # don't split transfers into chunks smaller than this
_MAX_CHUNKS = same_host_path.MAX_RANGES
_MAX_HEADER = ser.MAX_HEADER_BYTES  # metadata a receiver accepts, checked before reading it
_TRAILER = struct.Struct(">I")
# A connection must deliver its request line and headers this long after connecting (a
# receiver sends them at once); then the transfer is bounded by ``timeout`` only, never by this.
# Long enough for a receiver on a loaded host, short enough that idle sockets are not hoarded.
DEFAULT_IDLE_TIMEOUT_S = 30.0
# Most connections open at once. A receiver opens at most _MAX_CHUNKS (256) data connections
# at a time, after its metadata request has ended, so one receiver at the widest split fits
# (usual receivers open one to a few). It bounds the threads and descriptors that anyone who
# reaches the port can take to a quarter of the common 1024 open-file limit.
DEFAULT_MAX_CONNECTIONS = 256


def plan_chunks(total: int, num_chunks: int) -> List[Tuple[int, int]]:
    """Splits ``[0, total)`` into at most ``num_chunks`` contiguous byte ranges (>= 1 MiB)."""
    if total <= 0:
        return []
    n = max(1, min(num_chunks, _MAX_CHUNKS, -(-total // _MIN_CHUNK)))
    bounds = [total * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


# The same-host path checks a transfer in this many byte ranges (>= 1 MiB each): the source
# checksums them one by one while the receiver copies (and checksums the one before).
_LOCAL_RANGES = 16
# The background host copy checks between pieces of this size whether to stop.
_HOST_COPY_PIECE = 16 << 20


def _host_copy_budget() -> int:
    """Most bytes of CPU tensors a source copies into huge pages for same-host receivers: a
    quarter of the memory available now, shared by the ranks this host runs per group
    (``LOCAL_WORLD_SIZE``; they may all send at once). 0 where that cannot be read."""
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // (4 * local_ranks)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _join_preparer(st: "_Staging") -> None:
    """Waits for a withdrawn checkpoint's background preparation, which stops within one
    1 MiB checksum slice or one host-copy piece: after this nothing reads the tensors."""
    t = st.preparer
    if t is not None and t is not threading.current_thread():
        t.join(5.0)
        if t.is_alive():
            logger.warning("checkpoint step %d: preparation still running after withdrawal", st.step)


def _raise_for_status(status: int, text: str) -> None:
    """Raises the CheckpointError a refusal with this (HTTP) status means."""
    if status in (401, 403):
        raise CheckpointAuthError(text)
    if status in (404, 409, 410):
        raise CheckpointNotAvailableError(text, code=status)
    raise CheckpointTransferError(text)


def default_advertise_host(bind_host: Optional[str] = None) -> str:
    """The address peers should use to reach this host: a specific ``bind_host`` if given,
    else the process's advertised host (:func:`ft.utils.net.advertise_host`)."""
    if bind_host not in (None, "", "0.0.0.0", "::") and not os.environ.get(ADVERTISE_ENV):
        return bind_host  # type: ignore[return-value]
    return net.advertise_host()


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# A receiver asks for all its ranges at once, right after the metadata: once a checkpoint is
# withdrawn, a lease that has been used but has no range in flight for this long is not waited
# for (its receiver stalled or went away).
_LEASE_GRACE_S = 1.0


class _Lease:
    """The data ranges one metadata answer entitles its receiver to.

    ``touched`` is None until a data transfer claims the lease (only a /meta answer holds
    it), then the time of its last claim or release; ``active`` counts its transfers in flight.
    """

    __slots__ = ("remaining", "deadline", "active", "touched")

    def __init__(self, remaining: int, deadline: float) -> None:
        self.remaining = remaining
        self.deadline = deadline
        self.active = 0
        self.touched: Optional[float] = None

    def idle(self, now: float) -> bool:
        """Nothing reads for it now: never started, or no range in flight for a grace period."""
        return self.active == 0 and (self.touched is None or now - self.touched >= _LEASE_GRACE_S)


class _Staging:
    """One staged checkpoint: references to its tensors plus bookkeeping.

    Readers take tensor i's bytes from ``cpu(i)``: a host copy when one exists, else the
    caller's tensor (same bytes: the caller leaves them alone until disallow_checkpoint).
    """

    def __init__(self, step: int, state_dict: Any) -> None:
        self.id = uuid.uuid4().hex
        self.step = step
        tree, self.specs, self.tensors = ser.flatten(state_dict)
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)
        self.total = self.offsets[-1]
        self.header = ser.encode_header(
            tree, self.specs, step=step, staging=self.id, total_bytes=self.total
        )
        ser.check_header_size(self.header, len(self.specs))
        self.closing = False  # no new transfers; started ones may finish
        self.regions_sent = False  # a same-host receiver has the tensors' addresses
        self.withdrawn = False  # nothing may read the tensors any more
        self.active = 0  # data responses currently reading tensors
        self.conns: Set[socket.socket] = set()  # their connections, to cut them off
        self.leases: Dict[str, _Lease] = {}
        self._cpu: Dict[int, torch.Tensor] = {}
        self._cpu_lock = threading.Lock()
        # the byte ranges a same-host receiver gets checksums of, and those checksums
        self.local_ranges = plan_chunks(self.total, _LOCAL_RANGES)
        self._range_crcs: List[Optional[int]] = [None] * len(self.local_ranges)
        self._range_busy = [False] * len(self.local_ranges)
        self._range_cond = threading.Condition()
        self.preparer: Optional[threading.Thread] = None  # see HTTPTransport._prepare_same_host

    def prepared(self) -> bool:
        """True once every same-host range has its checksum (the preparation is done)."""
        with self._range_cond:
            return None not in self._range_crcs

    def range_crc(self, k: int, checksum: Callable[[int, int], int]) -> int:
        """CRC-32C of ``local_ranges[k]``, computed once (``checksum(start, end)``) by whichever
        thread asks first; a thread asking meanwhile waits for that result."""
        with self._range_cond:
            while self._range_crcs[k] is None and self._range_busy[k]:
                if self.withdrawn:
                    raise _Abort()
                self._range_cond.wait(0.05)
            crc = self._range_crcs[k]
            if crc is not None:
                return crc
            self._range_busy[k] = True
        try:
            crc = checksum(*self.local_ranges[k])
        except BaseException:
            with self._range_cond:
                self._range_busy[k] = False  # a waiting thread computes it instead
                self._range_cond.notify_all()
            raise
        with self._range_cond:
            self._range_crcs[k] = crc
            self._range_busy[k] = False
            self._range_cond.notify_all()
        return crc

    def cpu(self, i: int) -> torch.Tensor:
        """Tensor i in host memory (accelerator tensors are copied once, on first use)."""
        with self._cpu_lock:
            copy = self._cpu.get(i)
        if copy is not None:
            return copy
        t = self.tensors[i]
        if t.device.type == "cpu":
            return t
        copy = self._copy_to_host(i)
        assert copy is not None
        return copy

    def _copy_to_host(self, i: int, until_closing: bool = False) -> Optional[torch.Tensor]:
        """Copies tensor i into fresh host memory (huge pages from 2 MiB up). With
        ``until_closing`` (the background preparation) the copy goes in pieces and is abandoned
        (None) once the checkpoint is closing, so that disallow_checkpoint need not wait."""
        copy = ser.allocate(self.specs[i], torch.device("cpu"))
        src, dst = self.tensors[i].reshape(-1), copy.reshape(-1)
        step = max(1, _HOST_COPY_PIECE // max(1, src.element_size()))
        for lo in range(0, src.numel(), step):
            if until_closing and self.closing:
                return None
            dst[lo : lo + step].copy_(src[lo : lo + step])
        with self._cpu_lock:
            return self._cpu.setdefault(i, copy)  # a concurrent copy may have won

    def cpu_bytes(self) -> int:
        return sum(s.nbytes for s, t in zip(self.specs, self.tensors) if t.device.type == "cpu")

    def copy_cpu_tensors_to_huge_pages(self) -> None:
        """Gives every CPU tensor of at least 2 MiB a host copy in huge pages. Why: the
        same-host path's kernel copy pins the source's pages one by one, ~3x a memcpy over
        4 KiB pages and ~1.5x over huge ones, and the caller's tensors rarely sit on whole huge
        pages. Stops once the checkpoint is withdrawn or a receiver got the addresses (it
        copies from wherever each tensor was then; later copies would only compete with it)."""
        for i, (spec, t) in enumerate(zip(self.specs, self.tensors)):
            if self.closing or self.regions_sent:
                return  # a receiver already copies from where the tensors are: stop competing
            if t.device.type == "cpu" and spec.nbytes >= ser.HUGE_PAGE_BYTES:
                self._copy_to_host(i, until_closing=True)

    def view(self, i: int) -> memoryview:
        return ser.memview(self.cpu(i))

    def prune(self, now: float) -> None:
        for k in [k for k, lease in self.leases.items() if lease.deadline <= now]:
            del self.leases[k]

    def drop_idle_leases(self, now: float) -> None:
        """Forgets the leases nothing reads for (see _Lease.idle): once closing, their
        receivers get 410 and nobody waits for them."""
        for k in [k for k, lease in self.leases.items() if lease.idle(now)]:
            del self.leases[k]


class _Cutoff:
    """Shuts a client connection's socket down at ``deadline`` unless cancelled first: a
    peer that answers each read just within the socket timeout cannot stretch a request past
    its deadline."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: float) -> None:
        self._conn = conn
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        sock = self._conn.sock
        if sock is not None:
            try:
                # the plain socket's shutdown (for TLS too): the reader sees the connection end
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        self._timer.cancel()


class _HTTPError(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


class _Abort(Exception):
    pass


class _Server(BoundedHTTPServer):
    """The checkpoint server: a thread per connection, capped and idle-bounded (see
    ft.utils.http_server), with tracked threads and sockets so that shutdown is bounded."""

    def __init__(
        self, addr: Tuple[str, int], handler: Any, family: int,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        self._ssl_context = ssl_context
        super().__init__(addr, handler, family=family, idle_timeout_s=idle_timeout_s,
                         max_connections=max_connections, name="ft-ckpt-http")

    def get_request(self) -> Tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        if self._ssl_context is not None:
            # No handshake here (it would block the accepting thread on a slow client): the
            # connection's own thread does it with its first read, under the idle bound. The
            # TLS socket is the one tracked, so idle and shutdown bounds apply to it.
            conn = self._ssl_context.wrap_socket(conn, server_side=True,
                                                 do_handshake_on_connect=False)
        return conn, addr


class _TLSConnection(http.client.HTTPSConnection):
    """HTTPS to a checkpoint source, verified against the job's CA (and ``server_name``)."""

    def __init__(self, host: str, port: int, tls: TLSConfig, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=tls.client_context())
        self._expected_name = tls.server_name or host

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._expected_name)


class HTTPTransport(CheckpointTransport[T]):
    """Checkpoint transport over HTTP, with parallel chunks, checksums and an optional token.

    Args:
        timeout: default bound for transfers and for waits inside the server.
        num_chunks: parallel connections (byte ranges) a receiver uses; 0 or 1: one.
        token: the job secret under its older name (default: env ``FT_CHECKPOINT_TOKEN``);
            prefer ``secret``.
        secret: the job secret (ft.utils.auth; default: ``FT_JOB_SECRET_FILE`` /
            ``FT_JOB_SECRET``): requests are signed with it and refused without it, and what
            the source serves is signed and checked with it. None anywhere: no authentication.
        insecure: allow serving beyond loopback without a secret (default: ``FT_INSECURE``).
        tls: serve over TLS and verify TLS sources (ft.utils.tls; default: ``FT_TLS_*``).
            :meth:`metadata` then says ``https://``.
        advertise_host: host put in ``metadata()`` (default: env ``FT_ADVERTISE_HOST`` or
            :func:`default_advertise_host`).
        bind_host: interface to listen on (default: the advertised host's address; ``"::"``:
            every interface).
        port: port to listen on (default: env ``FT_CHECKPOINT_PORT``, else any free port; pin
            it where a firewall must open it).
        device: where received tensors are placed (default CPU).
        same_host: serve and use the same-host path (see ``same_host.py``): a receiver on the
            source's host copies the tensors straight from the source process instead of
            through loopback TCP, falling back to HTTP where the kernel does not allow it.
            Default: on, unless env ``FT_CHECKPOINT_SAME_HOST=0``.
        idle_timeout_s: a connection must deliver its request line and headers this long after
            connecting, or it is closed (default :data:`DEFAULT_IDLE_TIMEOUT_S`). Transfers
            under way are bounded by ``timeout`` only, never by this.
        max_connections: most connections the server holds open at once; more are answered
            503 and closed at once (default :data:`DEFAULT_MAX_CONNECTIONS`).
    """

    def __init__(
        self,
        timeout: timedelta,
        num_chunks: int,
        token: Optional[str] = None,
        advertise_host: Optional[str] = None,
        bind_host: Optional[str] = None,
        port: Optional[int] = None,
        device: Optional[torch.device] = None,
        same_host: Optional[bool] = None,
        *,
        secret: SecretLike = None,
        insecure: Optional[bool] = None,
        tls: Optional[TLSConfig] = None,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if port is None:
            port = int(os.environ.get(PORT_ENV) or 0)
        self._timeout = timeout
        self._num_chunks = max(1, int(num_chunks))
        # explicit secret, explicit token, the job secret's settings, then the older
        # FT_CHECKPOINT_TOKEN (so a leftover token never shadows the job secret)
        if secret is None:
            secret = token
        self._secret: Optional[JobSecret] = resolve_secret(secret)
        if self._secret is None and os.environ.get(TOKEN_ENV):
            self._secret = JobSecret(os.environ[TOKEN_ENV], source=TOKEN_ENV)
        if self._secret is not None:
            self._request_signer: Optional[Signer] = Signer(self._secret, CHECKPOINT_REQUEST_PURPOSE)
            self._request_verifier: Optional[Verifier] = Verifier(
                self._secret, CHECKPOINT_REQUEST_PURPOSE)
            self._content_signer: Optional[Signer] = Signer(self._secret, CHECKPOINT_CONTENT_PURPOSE)
        else:
            self._request_signer = self._request_verifier = self._content_signer = None
        self._device = torch.device("cpu") if device is None else torch.device(device)
        self._cond = threading.Condition()
        self._staging: Optional[_Staging] = None
        self._last_step: Optional[int] = None
        # (step, reason) of the last step this source failed to stage (abandon_checkpoint).
        self._abandoned: Optional[Tuple[int, str]] = None
        self._closed = False

        if bind_host is None:
            # The advertised interface only: nothing on the machine's other networks can reach
            # the model's bytes.
            bind_host = net.bind_host_for(advertise_host or net.advertise_host()).strip("[]")
        if bind_host in ("", "::", "0.0.0.0"):
            bind_host = "::" if socket.has_dualstack_ipv6() else "0.0.0.0"
        check_exposure(bind_host, self._secret, insecure, "the checkpoint server")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._tls = resolve_tls(tls)
        self._tls_server = self._tls.server_context() if self._tls and self._tls.can_serve else None
        self._server = _Server((bind_host, port), self._handler_class(), family,
                               idle_timeout_s=idle_timeout_s, max_connections=max_connections,
                               ssl_context=self._tls_server)
        self._port = self._server.server_address[1]
        # None: resolved at every metadata() call, so the host the Manager picks at its start
        # (the interface that routes to the lighthouse) applies to a transport built before it.
        self._advertise = advertise_host or (
            bind_host if bind_host not in ("", "0.0.0.0", "::") else None)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="ft-ckpt-http-server",
        )
        self._thread.start()

        if same_host is None:
            same_host = os.environ.get(SAME_HOST_ENV, "1") != "0"
        self._same_host = bool(same_host) and same_host_path.supported()
        self._local: Optional[same_host_path.LocalEndpoint] = None
        self._ptracer_lock = threading.Lock()
        # same-host requests are signed (never the secret itself): see same_host.py
        self._local_signer = Signer(self._secret, SAME_HOST_PURPOSE) if self._secret else None
        self._local_verifier = (
            Verifier(self._secret, SAME_HOST_PURPOSE) if self._secret else None)
        if self._same_host:
            try:
                self._local = same_host_path.LocalEndpoint(self._serve_local)
            except OSError as e:
                logger.warning("same-host checkpoint endpoint unavailable (%s); HTTP only", e)
        # which path the last successful recv_checkpoint took: "same-host" or "http"
        self.last_recv_path: Optional[str] = None

    # ------------------------------------------------------------------ public interface

    def metadata(self) -> str:
        """``http://host:port``, plus ``#<name>`` of the same-host endpoint when it serves one
        (a URL fragment: HTTP clients never send it)."""
        host = self._advertise or default_advertise_host()
        url = f"{'https' if self._tls_server else 'http'}://{_bracket(host)}:{self._port}"
        return f"{url}#{self._local.name}" if self._local is not None else url

    def address(self) -> str:
        return self.metadata()

    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Stages ``state_dict`` for ``step`` (keeps references; serializes on request).

        Raises TypeError (naming the key path) for values that cannot be sent safely. A
        previously staged checkpoint is withdrawn first.
        """
        staging = _Staging(step, state_dict)  # validates before anything is withdrawn
        self.disallow_checkpoint()
        with self._cond:
            if self._closed:
                raise CheckpointError("HTTPTransport is shut down")
            self._staging = staging
            self._last_step = step
            self._abandoned = None
            self._cond.notify_all()
        if self._local is not None:
            staging.preparer = threading.Thread(
                target=self._prepare_same_host,
                args=(staging,),
                daemon=True,
                name="ft-ckpt-prepare",
            )
            staging.preparer.start()
        logger.debug(
            "staged checkpoint step=%d bytes=%d tensors=%d for %s",
            step,
            staging.total,
            len(staging.tensors),
            dst_ranks,
        )

    def allow_checkpoint(self, step: int) -> None:
        """torchft's counterpart of :meth:`disallow_checkpoint`, kept for its callers.

        Here :meth:`send_checkpoint` serves what it stages at once, and
        :meth:`disallow_checkpoint` drops it, so there is nothing to re-allow: this returns
        when the checkpoint of ``step`` is being served, and raises CheckpointError otherwise
        (torchft would serve the previous state dict under the new step; ft never serves a
        state dict under a step it was not staged for).
        """
        with self._cond:
            st = self._staging
            if st is not None and not st.closing and st.step == step:
                return
            staged = None if st is None or st.closing else st.step
        raise CheckpointError(
            f"allow_checkpoint({step}): no checkpoint of step {step} is staged "
            f"(staged: {staged}); send_checkpoint(dst_ranks, {step}, state_dict, timeout) "
            f"stages and serves one")

    def abandon_checkpoint(self, step: int, reason: str) -> None:
        """Receivers waiting for ``step`` get HTTP 409 naming ``reason`` at once."""
        self.disallow_checkpoint()
        with self._cond:
            self._abandoned = (step, reason)
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Withdraws the staged checkpoint.

        New requests get 410 at once, and so do receivers that got the metadata but have not
        started reading data (their leases are dropped, not waited for). Transfers that already
        started, and the other ranges of their receivers (asked for at the same moment), get
        up to ``timeout`` to finish; then they are cut off. When this returns, no server thread
        reads the tensors.
        """
        with self._cond:
            st = self._staging
            if st is None:
                return
            st.closing = True
            deadline = time.monotonic() + self._timeout.total_seconds()
            while True:
                now = time.monotonic()
                st.prune(now)
                st.drop_idle_leases(now)
                if (not st.leases and st.active == 0) or now >= deadline:
                    break
                self._cond.wait(min(deadline - now, 0.05))
            st.withdrawn = True
            conns = set(st.conns)
            if st.active:
                logger.warning("cutting off %d checkpoint transfer(s) still running", st.active)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        with self._cond:
            self._cond.wait_for(lambda: st.active == 0, timeout=5.0)
            if self._staging is st:
                self._staging = None
            self._cond.notify_all()
        _join_preparer(st)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the checkpoint for ``step`` from the server at ``metadata`` (its URL).

        Raises:
            CheckpointCorruptError: a checksum did not match (nothing is returned).
            CheckpointAuthError: the server refused the token.
            CheckpointNotAvailableError: the server does not serve ``step``.
            CheckpointTransferError: connection failure, vanished peer, or timeout.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        url = urlsplit(metadata)
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise CheckpointError(f"bad checkpoint address {metadata!r} (want http://host:port)")
        host, port = url.hostname, url.port
        secure = url.scheme == "https"
        if secure and (self._tls is None or not self._tls.ca_file):
            raise CheckpointError(
                f"{metadata}: the source serves TLS, and this replica has no CA to verify it "
                f"with (set FT_TLS_CA_FILE, or pass tls=TLSConfig(ca_file=...))")
        where = f"checkpoint step {step} from rank {src_rank} at {metadata}"

        remaining = deadline - time.monotonic()
        wait_s = max(0.0, remaining - min(1.0, remaining / 4))
        session = (
            same_host_path.Session.open(url.fragment, deadline, where, _raise_for_status)
            if self._same_host and url.fragment
            else None
        )
        try:
            fetched = None
            if session is not None:
                fetch = {"step": step, "wait": wait_s, "chunks": self._num_chunks}
                if self._local_signer is not None:
                    fetch["auth"] = self._local_signer.sign(
                        same_host_path.request_what(url.fragment),
                        same_host_path.request_body(step, wait_s, self._num_chunks))
                # The source answers once the step is staged (within wait_s); no answer by half
                # the time kept back after that means it is stuck: HTTP gets the rest.
                reply_deadline = deadline - (deadline - time.monotonic() - wait_s) / 2
                fetched = session.fetch(fetch, deadline, _MAX_HEADER + _TRAILER.size,
                                        reply_deadline)
                if fetched is None:
                    session.close()
                    session = None
                    remaining = deadline - time.monotonic()
                    wait_s = max(0.0, remaining - min(1.0, remaining / 4))
            if fetched is not None:
                body, lease, reply = fetched
            else:
                path = f"{_PREFIX}{step}/meta?chunks={self._num_chunks}&wait={wait_s:.3f}"
                body, lease = self._get_small(host, port, path, deadline, where, secure=secure)
            if time.monotonic() >= deadline:
                raise CheckpointTransferError(f"{where}: timed out before parsing the metadata")
            tree, specs, staging, lease = self._parse_meta(body, lease, step, where)
            if time.monotonic() >= deadline:
                raise CheckpointTransferError(f"{where}: timed out parsing the metadata")
            tensors = [ser.allocate(s, torch.device("cpu")) for s in specs]
            offsets = [0]
            views = []
            for t, s in zip(tensors, specs):
                views.append(ser.memview(t))
                offsets.append(offsets[-1] + s.nbytes)
            if session is not None and session.copy(reply, offsets, views, deadline):
                self.last_recv_path = "same-host"
                return self._finish(tree, tensors, specs)
        finally:
            if session is not None:
                session.close()

        total = offsets[-1]
        ranges = plan_chunks(total, self._num_chunks)
        stop = threading.Event()
        if ranges:
            pool = ThreadPoolExecutor(len(ranges), thread_name_prefix="ft-ckpt-fetch")
            try:
                futs = [
                    pool.submit(
                        self._fetch_range,
                        host,
                        port,
                        f"{_PREFIX}{step}/data?staging={staging}&lease={lease}&start={a}&end={b}",
                        a,
                        b,
                        offsets,
                        views,
                        deadline,
                        stop,
                        where,
                        secure=secure,
                    )
                    for a, b in ranges
                ]
                done, pending = futures_wait(
                    futs, timeout=max(0.0, deadline - time.monotonic()) + 1.0,
                    return_when=FIRST_EXCEPTION,
                )
                errors = [f.exception() for f in done if f.exception() is not None]
                if errors or pending:
                    stop.set()
                    # prefer the most telling error: corruption > auth > availability > other
                    order = (
                        CheckpointCorruptError,
                        CheckpointAuthError,
                        CheckpointNotAvailableError,
                    )
                    errors.sort(
                        key=lambda e: next(
                            (i for i, c in enumerate(order) if isinstance(e, c)), len(order)
                        )
                    )
                    if errors:
                        raise errors[0]
                    raise CheckpointTransferError(f"{where}: timed out after {timeout}")
            finally:
                stop.set()
                pool.shutdown(wait=False, cancel_futures=True)

        self.last_recv_path = "http"
        return self._finish(tree, tensors, specs)

    @staticmethod
    def _parse_meta(
        body: bytes, lease: str, step: int, where: str
    ) -> Tuple[Any, List[ser.TensorSpec], str, str]:
        """Checks a metadata body (header + CRC-32); returns (tree, specs, staging, lease)."""
        if len(body) < _TRAILER.size:
            raise CheckpointTransferError(f"{where}: truncated metadata")
        header, (crc,) = body[: -_TRAILER.size], _TRAILER.unpack(body[-_TRAILER.size :])
        if ser.crc32(header) != crc:
            raise CheckpointCorruptError(f"{where}: metadata checksum mismatch")
        doc, tree, specs = ser.decode_header(header)
        total = sum(s.nbytes for s in specs)
        if doc.get("step") != step or doc.get("total_bytes") != total:
            raise CheckpointFormatError(
                f"{where}: server answered step {doc.get('step')!r} with "
                f"{doc.get('total_bytes')!r} bytes (expected step {step}, {total} bytes)"
            )
        staging = doc.get("staging")
        if type(staging) is not str or not staging.isalnum() or not staging.isascii():
            raise CheckpointFormatError(f"{where}: bad staging id")
        if not (lease.isalnum() and lease.isascii()):
            lease = ""  # an unknown lease still works while the checkpoint is staged
        return tree, specs, staging, lease

    def _finish(self, tree: Any, tensors: List[torch.Tensor], specs: List[ser.TensorSpec]) -> T:
        out = []
        for t, s in zip(tensors, specs):
            if self._device.type != "cpu":
                t = t.to(self._device)
            out.append(ser.finalize(t, s))
        return ser.unflatten(tree, out)

    def shutdown(self, wait: bool = True) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            st = self._staging
            if st is not None:
                st.closing = True
                st.withdrawn = True
            self._cond.notify_all()
        self._server.shutdown()  # serve_forever polls every 50 ms
        self._server.server_close()
        self._server.kill_connections()
        if self._local is not None:
            self._local.close(join_timeout=min(5.0, self._timeout.total_seconds()) if wait else 0.0)
        if wait:
            end = time.monotonic() + min(5.0, self._timeout.total_seconds())
            self._thread.join(max(0.0, end - time.monotonic()))
            with self._server.track_lock:
                threads = list(self._server.threads)
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))
        with self._cond:
            self._staging = None
        if st is not None:
            _join_preparer(st)

    def __enter__(self) -> "HTTPTransport[T]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ client side

    def _open(
        self, host: str, port: int, path: str, deadline: float, where: str, secure: bool = False
    ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse, socket.socket, bytes]:
        """Sends a (signed) GET; returns the connection, the response, its socket, and the
        request's signature (b"" without a secret), which the source's MACs are bound to."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CheckpointTransferError(f"{where}: timed out")
        headers = {"Connection": "close"}
        signature = b""
        if self._request_signer is not None:
            # Bound to the address dialled: a non-member that received it could not use it at
            # any real source.
            token = self._request_signer.sign(f"GET {_bracket(host)}:{port}{path}")
            headers["Authorization"] = f"{HTTP_SCHEME} {token}"
            signature = token.encode()
        conn = (_TLSConnection(host, port, self._tls, remaining) if secure
                else http.client.HTTPConnection(host, port, timeout=remaining))
        # the socket timeout bounds each read; this bounds them all (a source that trickles
        # its status line and headers a byte at a time cannot stretch them past the deadline)
        cutoff = _Cutoff(conn, deadline)
        try:
            try:
                conn.request("GET", path, headers=headers)
                sock = conn.sock  # HTTPConnection drops it once a 'close' response arrives
                resp = conn.getresponse()
            except (socket.timeout, TimeoutError):
                conn.close()
                raise CheckpointTransferError(f"{where}: timed out") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if time.monotonic() >= deadline:
                    raise CheckpointTransferError(f"{where}: timed out") from None
                raise CheckpointTransferError(
                    f"{where}: request failed ({type(e).__name__}: {e})"
                ) from None
            if resp.status != 200:
                try:
                    msg = resp.read(4096).decode("utf-8", "replace").strip()
                except (OSError, http.client.HTTPException):
                    msg = ""
                conn.close()
                _raise_for_status(resp.status, f"{where}: HTTP {resp.status} {resp.reason}: {msg}")
        finally:
            cutoff.cancel()
        return conn, resp, sock, signature

    def _get_small(
        self, host: str, port: int, path: str, deadline: float, where: str, secure: bool = False
    ) -> Tuple[bytes, str]:
        conn, resp, sock, signature = self._open(host, port, path, deadline, where, secure)
        try:
            declared = resp.getheader("Content-Length")
            if declared is None:
                raise CheckpointFormatError(
                    f"{where}: the source sent metadata without a Content-Length; refused")
            length = int(declared)
            if not 0 <= length <= _MAX_HEADER:
                # refused before a byte of it is read
                raise CheckpointFormatError(
                    f"{where}: the source declares {length} bytes of metadata; at most "
                    f"{_MAX_HEADER} are accepted (ft.checkpointing.serialization.MAX_HEADER_BYTES)")
            body = self._read_body(sock, resp, length, deadline)
            self._check_content_mac(resp.getheader(_CONTENT_MAC_HEADER, ""), signature, body, where)
            return body, resp.getheader("X-FT-Lease", "")
        except CheckpointError:
            raise  # already says what failed (some are OSErrors too: keep them as they are)
        except (socket.timeout, TimeoutError):
            raise CheckpointTransferError(f"{where}: timed out reading metadata") from None
        except ValueError:
            raise CheckpointFormatError(f"{where}: bad metadata length") from None
        except (OSError, http.client.HTTPException, EOFError) as e:
            if time.monotonic() >= deadline:
                raise CheckpointTransferError(f"{where}: timed out reading metadata") from None
            raise CheckpointTransferError(
                f"{where}: peer vanished while sending metadata ({type(e).__name__}: {e})"
            ) from None
        finally:
            resp.close()
            conn.close()

    def _fetch_range(
        self,
        host: str,
        port: int,
        path: str,
        start: int,
        end: int,
        offsets: List[int],
        views: List[memoryview],
        deadline: float,
        stop: threading.Event,
        where: str,
        secure: bool = False,
    ) -> None:
        conn, resp, sock, signature = self._open(host, port, path, deadline, where, secure)
        got = 0
        mac_size = _MAC_SIZE if self._content_signer is not None else 0
        try:
            length = resp.getheader("Content-Length")
            if length is None or int(length) != end - start + _TRAILER.size + mac_size:
                raise CheckpointTransferError(f"{where}: bad Content-Length {length!r}")
            crc = 0
            for i, lo, hi in same_host_path.segments(offsets, start, end):
                for a in range(lo, hi, _SLICE):
                    if stop.is_set():
                        raise _Abort()
                    dst = views[i][a : min(hi, a + _SLICE)]
                    self._read_exact(sock, resp, dst, deadline)
                    crc = ser.crc32c(dst, crc)
                    got += len(dst)
            trailer = bytearray(_TRAILER.size + mac_size)
            self._read_exact(sock, resp, memoryview(trailer), deadline)
            if mac_size and not self._content_signer.check(
                    bytes(trailer[_TRAILER.size:]), b"data", signature, _range_bytes(start, end),
                    bytes(trailer[:_TRAILER.size])):
                raise CheckpointAuthError(
                    f"{where}: bytes [{start}, {end}) are not signed with the job secret: the "
                    f"source is not a member of this job; data discarded")
            if _TRAILER.unpack(trailer[:_TRAILER.size])[0] != crc:
                raise CheckpointCorruptError(
                    f"{where}: checksum mismatch in bytes [{start}, {end}); data discarded"
                )
        except _Abort:
            raise CheckpointTransferError(f"{where}: cancelled") from None
        except CheckpointError:
            raise  # already says what failed (some are OSErrors too: keep them as they are)
        except (socket.timeout, TimeoutError):
            raise CheckpointTransferError(
                f"{where}: timed out after {got} of {end - start} bytes of range [{start}, {end})"
            ) from None
        except (OSError, http.client.HTTPException, EOFError) as e:
            raise CheckpointTransferError(
                f"{where}: peer vanished after {got} of {end - start} bytes of range "
                f"[{start}, {end}) ({type(e).__name__}: {e})"
            ) from None
        finally:
            resp.close()
            conn.close()

    def _check_content_mac(self, mac_hex: str, signature: bytes, body: bytes, where: str) -> None:
        """Refuses a metadata answer that a job member did not sign for this very request."""
        if self._content_signer is None:
            return
        try:
            mac = bytes.fromhex(mac_hex)
        except ValueError:
            mac = b""
        if not self._content_signer.check(mac, b"meta", signature, body):
            raise CheckpointAuthError(
                f"{where}: the metadata is not signed with the job secret "
                f"({'no signature' if not mac_hex else 'wrong signature'}): the source is not a "
                f"member of this job; nothing was loaded")

    @staticmethod
    def _read_body(
        sock: socket.socket, resp: http.client.HTTPResponse, length: int, deadline: float
    ) -> bytes:
        """Reads a ``length``-byte body, one socket read at a time, each bounded by the time
        left: a source that sends slowly cannot hold the receiver past its deadline."""
        body = bytearray()
        while len(body) < length:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError()
            sock.settimeout(remaining)
            piece = resp.read1(min(_SLICE, length - len(body)))
            if not piece:
                raise EOFError("connection closed by peer")
            body += piece
        return bytes(body)

    @staticmethod
    def _read_exact(
        sock: socket.socket,
        resp: http.client.HTTPResponse,
        dst: memoryview,
        deadline: float,
    ) -> None:
        filled = 0
        while filled < len(dst):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError()
            sock.settimeout(remaining)
            n = resp.readinto(dst[filled:])
            if not n:
                raise EOFError("connection closed by peer")
            filled += n

    # ------------------------------------------------------------------ server side

    def _handler_class(self) -> type:
        transport = self

        class Handler(BoundedRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = self._timeout.total_seconds()  # socket timeout for every read/write
            server_version = "ft-checkpoint/1"

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("%s " + fmt, self.address_string(), *args)

            def do_GET(self) -> None:  # noqa: N802
                self.close_connection = True
                try:
                    transport._serve(self)
                except _HTTPError as e:
                    body = (e.msg + "\n").encode("utf-8", "replace")
                    self.send_response(e.code)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)

        return Handler

    def _dialled_address(self) -> str:
        """``host:port`` as receivers dial it (from :meth:`metadata`), as they sign it."""
        url = urlsplit(self.metadata())
        return f"{_bracket(url.hostname or '')}:{url.port}"

    def _verify_request(self, h: BaseHTTPRequestHandler) -> bytes:
        """Refuses (403) a request not signed with the job secret, or signed before (a replay);
        returns its signature, which what this source answers is bound to."""
        if self._request_verifier is None:
            return b""
        auth = h.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        try:
            self._request_verifier.verify(
                f"GET {self._dialled_address()}{h.path}", b"",
                token.strip() if scheme == HTTP_SCHEME else None)
        except AuthError as e:
            raise _HTTPError(403, f"refused: {e}; this source requires the job secret") from None
        return token.strip().encode()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        signature = self._verify_request(h)
        url = urlsplit(h.path)
        if not url.path.startswith(_PREFIX):
            raise _HTTPError(404, f"unknown path {url.path[:100]!r}")
        parts = url.path[len(_PREFIX) :].split("/")
        if len(parts) != 2:
            raise _HTTPError(404, f"unknown path {url.path[:100]!r}")
        try:
            step = int(parts[0])
        except ValueError:
            raise _HTTPError(400, f"bad step {parts[0][:40]!r}") from None
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if parts[1] == "meta":
            self._serve_meta(h, step, q, signature)
        elif parts[1] == "data":
            self._serve_data(h, step, q, signature)
        else:
            raise _HTTPError(404, f"unknown path {url.path[:100]!r}")

    @staticmethod
    def _num(q: Dict[str, str], key: str, kind: type, default: Any = None) -> Any:
        if key not in q:
            if default is None:
                raise _HTTPError(400, f"missing parameter {key!r}")
            return default
        try:
            return kind(q[key])
        except ValueError:
            raise _HTTPError(400, f"bad parameter {key}={q[key][:40]!r}") from None

    def _serve_meta(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        _, body, lease = self._meta(
            step, self._num(q, "wait", float, 0.0), self._num(q, "chunks", int, 1)
        )
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("X-FT-Lease", lease)
        if self._content_signer is not None:
            h.send_header(_CONTENT_MAC_HEADER, self._content_signer.mac(b"meta", signature, body).hex())
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)

    def _meta(self, step: int, wait_s: float, chunks: int) -> Tuple[_Staging, bytes, str]:
        """Waits up to ``wait_s`` for ``step`` to be staged; returns the staging, its metadata
        body (header + CRC-32) and a lease for ``chunks`` data ranges. Raises _HTTPError
        otherwise."""
        chunks = min(max(1, chunks), _MAX_CHUNKS)
        wait_s = min(max(0.0, wait_s), self._timeout.total_seconds())
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                if self._closed:
                    raise _HTTPError(503, "checkpoint server is shutting down")
                st = self._staging
                if st is not None and st.step == step and not st.closing:
                    break
                if self._abandoned is not None and self._abandoned[0] == step:
                    raise _HTTPError(
                        409, f"the source failed to produce step {step}: {self._abandoned[1]}"
                    )
                last = self._last_step
                if last is not None and step <= last:
                    if step == last:
                        raise _HTTPError(410, f"checkpoint for step {step} was withdrawn")
                    raise _HTTPError(
                        404, f"step {step} is not available (last staged step is {last})"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _HTTPError(
                        404,
                        f"step {step} is not available "
                        + ("(nothing staged)" if last is None else f"(last staged step {last})"),
                    )
                self._cond.wait(remaining)
            lease = uuid.uuid4().hex
            n = len(plan_chunks(st.total, chunks))
            if n:
                st.leases[lease] = _Lease(n, time.monotonic() + self._timeout.total_seconds())
            return st, st.header + _TRAILER.pack(ser.crc32(st.header)), lease

    def _claim(self, step: int, staging_id: str, lease_id: str, conn: socket.socket) -> _Staging:
        """Registers a transfer of the staged checkpoint (``disallow_checkpoint`` waits for it,
        then cuts ``conn``). Caller holds ``self._cond``; raises _HTTPError if not served."""
        st = self._staging
        if self._closed:
            raise _HTTPError(503, "checkpoint server is shutting down")
        if st is None or st.step != step or st.id != staging_id or st.withdrawn:
            raise _HTTPError(410, f"checkpoint for step {step} is no longer served")
        lease = st.leases.get(lease_id)
        if st.closing and lease is None:
            raise _HTTPError(410, f"checkpoint for step {step} was withdrawn")
        if lease is not None:
            lease.active += 1
            lease.touched = time.monotonic()
        st.active += 1
        st.conns.add(conn)
        return st

    def _release(
        self, st: _Staging, lease_id: str, conn: socket.socket, used: Optional[int]
    ) -> None:
        """Ends a transfer registered by ``_claim``. ``used``: how many of the lease's ranges
        it delivered (None: it failed, and the lease is dropped so nothing waits for it)."""
        with self._cond:
            st.active -= 1
            st.conns.discard(conn)
            lease = st.leases.get(lease_id)
            if lease is not None:
                lease.active = max(0, lease.active - 1)
                lease.touched = time.monotonic()
                lease.remaining -= used or 0
                if lease.remaining <= 0 or used is None:
                    del st.leases[lease_id]
            self._cond.notify_all()

    def _serve_data(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        lease_id = q.get("lease", "")
        start = self._num(q, "start", int)
        end = self._num(q, "end", int)
        with self._cond:
            st = self._claim(step, q.get("staging", ""), lease_id, h.connection)
            if not 0 <= start <= end <= st.total:
                self._release(st, lease_id, h.connection, None)
                raise _HTTPError(400, f"bad range [{start}, {end}) of {st.total} bytes")
        used: Optional[int] = None
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            signer = self._content_signer
            h.send_header("Content-Length",
                          str(end - start + _TRAILER.size + (_MAC_SIZE if signer else 0)))
            h.send_header("Connection", "close")
            h.end_headers()
            crc = 0
            for piece in self._source_slices(st, start, end):
                crc = ser.crc32c(piece, crc)
                h.wfile.write(piece)
            trailer = _TRAILER.pack(crc)
            if signer is not None:
                trailer += signer.mac(b"data", signature, _range_bytes(start, end), trailer)
            h.wfile.write(trailer)
            used = 1
        except _Abort:
            logger.debug("checkpoint transfer cut off (withdrawn)")
        except OSError as e:
            logger.debug("checkpoint transfer to %s failed: %s", h.client_address, e)
        finally:
            self._release(st, lease_id, h.connection, used)

    def _serve_local(self, conn: socket.socket) -> None:
        """One same-host fetch (protocol in same_host.py), validated like its HTTP twins: sends
        the metadata and the tensors' addresses, then each range's CRC-32C, and holds the
        checkpoint until the receiver says it verified everything (or falls back to HTTP)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        lease = ""
        try:
            try:
                # a receiver sends its request as it connects: an idle socket is not kept
                req = same_host_path.recv_frame(
                    conn, min(deadline, time.monotonic() + same_host_path.REQUEST_TIMEOUT_S))
            except (EOFError, OSError):  # TimeoutError too
                return  # connected and left, or idled: nothing asked
            if type(req) is not dict:
                raise _HTTPError(400, "request is not an object")
            self._check_local_auth(req)
            op = req.get("op")
            if op != "fetch":
                raise _HTTPError(400, f"unknown op {op!r:.40}")
            step, wait_s, chunks = req.get("step"), req.get("wait"), req.get("chunks")
            if type(step) is not int or type(wait_s) not in (int, float) or type(chunks) is not int:
                raise _HTTPError(400, "bad step, wait or chunks")
            st, body, lease = self._meta(step, wait_s, chunks)
            with self._cond:
                self._claim(step, st.id, lease, conn)
        except (_HTTPError, ValueError) as e:
            code, msg = (e.code, e.msg) if isinstance(e, _HTTPError) else (400, str(e))
            if lease:
                self._drop_lease(lease)
            same_host_path.send_frame(conn, {"ok": False, "code": code, "error": msg})
            return
        self._serve_local_data(conn, st, lease, body, deadline)

    def _drop_lease(self, lease_id: str) -> None:
        """A lease whose receiver will not use it: nothing waits for it."""
        with self._cond:
            st = self._staging
            if st is not None:
                st.leases.pop(lease_id, None)
            self._cond.notify_all()

    def _check_local_auth(self, req: Dict[str, Any]) -> None:
        """Refuses (403) a same-host request not signed with the job secret for this endpoint,
        or signed before (a replay). Nothing is granted before this passes."""
        if self._local_verifier is None:
            return
        token = req.get("auth")
        try:
            self._local_verifier.verify(
                same_host_path.request_what(self._local.name if self._local else ""),
                same_host_path.request_body(req.get("step"), req.get("wait"), req.get("chunks")),
                token if type(token) is str else None)
        except AuthError as e:
            raise _HTTPError(
                403, f"refused: {e}; this source requires a signature made with the job secret"
            ) from None

    def _serve_local_data(
        self, conn: socket.socket, st: _Staging, lease_id: str, body: bytes, deadline: float
    ) -> None:
        used: Optional[int] = None
        granted = False
        try:
            granted = self._grant_read_access(conn, deadline)
            st.regions_sent = True
            regions = [[st.cpu(i).data_ptr(), spec.nbytes] for i, spec in enumerate(st.specs)]
            ranges = st.local_ranges
            same_host_path.send_frame(
                conn,
                {"ok": True, "lease": lease_id, "regions": regions,
                 "ranges": [list(r) for r in ranges]},
            )
            same_host_path.send_raw(conn, body)
            answer: Optional[bytes] = None
            for k in range(len(ranges)):
                # a receiver that falls back (or gives up) says so early: stop checksumming
                answer = same_host_path.poll_answer(conn)
                if answer is not None:
                    break
                crc = st.range_crc(k, lambda a, b: self._checksum(st, a, b))
                try:
                    same_host_path.send_crc(conn, k, crc)
                except OSError:
                    answer = same_host_path.poll_answer(conn, wait=0.1)  # b"F" may be queued
                    if answer is None:
                        raise
                    break
            if answer is None:
                # the receiver may still be copying: the tensors stay untouched until it answers
                answer = same_host_path.recv_exact(conn, 1, deadline)
            if answer == same_host_path.DONE:
                used = len(ranges) + _MAX_CHUNKS  # the whole lease
            elif answer == same_host_path.FALLBACK:
                used = 0  # it will fetch the ranges over HTTP with the same lease
        except _Abort:
            logger.debug("same-host checkpoint transfer cut off (withdrawn)")
        except (OSError, EOFError, TimeoutError) as e:
            logger.debug("same-host checkpoint transfer failed: %s", e)
        finally:
            if granted:
                _C.allow_process_to_read(0)
                self._ptracer_lock.release()
            self._release(st, lease_id, conn, used)

    def _prepare_same_host(self, st: _Staging) -> None:
        """Runs on a background thread from send_checkpoint, while a healer is still finding
        this source (milliseconds): moves large CPU tensors onto huge pages (within the memory
        budget) and, for a checkpoint of CPU tensors only, checksums the same-host ranges, so
        that a same-host receiver's copy is the fast one and its checksums are ready. Reads
        only CPU tensors, in pieces, and stops at the next piece once the checkpoint closes."""
        try:
            cpu_bytes = st.cpu_bytes()
            if cpu_bytes <= _host_copy_budget():
                st.copy_cpu_tensors_to_huge_pages()
            if cpu_bytes != st.total:
                # Accelerator tensors are copied to the host when a receiver asks, on its
                # serving thread: a background device copy would compete with training and
                # could not stop mid-tensor at disallow_checkpoint.
                return
            for k in range(len(st.local_ranges)):
                if st.closing:
                    return
                st.range_crc(k, lambda a, b: self._checksum(st, a, b))
        except _Abort:
            pass
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: serving works without it
            logger.warning("preparing checkpoint step %d for same-host receivers stopped: %s",
                           st.step, e)

    def _checksum(self, st: _Staging, start: int, end: int) -> int:
        crc = 0
        for piece in self._source_slices(st, start, end):
            crc = ser.crc32c(piece, crc)
        return crc

    def _grant_read_access(self, conn: socket.socket, deadline: float) -> bool:
        """Under Yama ptrace_scope 1, names the receiver as this process's ptracer for the
        transfer (one receiver at a time: the setting holds one pid). True if granted (the
        caller revokes it and releases the lock). Without the grant the receiver's first read
        fails and it falls back to HTTP, so a busy lock or an invisible pid only costs speed.
        Reached only by a request of this uid that passed ``_check_local_auth``."""
        if not same_host_path.ptracer_needed():
            return False
        pid, uid, _ = same_host_path.peer_creds(conn)
        if pid <= 0 or uid != os.geteuid() or not self._ptracer_lock.acquire(
            timeout=max(0.0, min(2.0, deadline - time.monotonic()))
        ):
            return False
        err = _C.allow_process_to_read(pid)
        if err:
            self._ptracer_lock.release()
            logger.debug("prctl(PR_SET_PTRACER, %d) failed: %s", pid, os.strerror(err))
            return False
        return True

    def _source_slices(self, st: _Staging, start: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` of the staged tensors in slices of at most 1 MiB; raises
        _Abort as soon as the checkpoint is withdrawn (both serving paths read through it)."""
        for i, lo, hi in same_host_path.segments(st.offsets, start, end):
            if st.withdrawn:
                raise _Abort()
            view = st.view(i)
            for a in range(lo, hi, _SLICE):
                if st.withdrawn:
                    raise _Abort()
                self._pace()
                yield view[a : min(hi, a + _SLICE)]

    def _pace(self) -> None:
        """Called once per 1 MiB slice the source serves, on either path (a seam for tests
        that slow the source down)."""
