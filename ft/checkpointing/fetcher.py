"""The receiving side of a heal: fetches a checkpoint from a source's address, over the
same-host path where the source shares this host (same_host.Session), else as parallel HTTP
byte ranges (http_protocol.py), and checks every byte before returning anything.
"""

from __future__ import annotations

import http.client
import logging
import socket
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait as futures_wait
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

import torch

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import same_host
from ft.checkpointing import serialization as ser
from ft.checkpointing.deadline_io import read_exact
from ft.checkpointing import errors
from ft.utils.auth import (
    CHECKPOINT_CONTENT_PURPOSE,
    CHECKPOINT_REQUEST_PURPOSE,
    HTTP_SCHEME,
    SAME_HOST_PURPOSE,
    JobSecret,
    Signer,
)
from ft.utils.deadline import Deadline, Timeout
from ft.utils.tls import TLSConfig

if TYPE_CHECKING:
    from ft.checkpointing.striped import StripeOptions

__all__ = ["CheckpointFetcher"]

logger = logging.getLogger(__name__)

# Range fetchers end by the deadline on their own (every read is bounded by it) and then say
# what went wrong; they are waited for this much longer so that the caller gets their error
# (a checksum mismatch, a refusal) rather than a bare timeout.
_RANGE_ERROR_GRACE_S = 1.0
# When several ranges fail, the error raised is the most telling: corruption, then refusal of
# the secret, then availability, then anything else.
_ERROR_ORDER = (
    errors.CheckpointCorruptError,
    errors.CheckpointAuthError,
    errors.CheckpointNotAvailableError,
)
# A refusal's text is read up to this much: more than any message a source sends, and a bound
# on what a hostile one can make the receiver read.
_REFUSAL_TEXT_BYTES = 4096


def _severity(e: BaseException) -> int:
    return next((i for i, c in enumerate(_ERROR_ORDER) if isinstance(e, c)), len(_ERROR_ORDER))


class _Cutoff:
    """Shuts a client connection's socket down at ``deadline`` unless cancelled first: a
    peer that answers each read just within the socket timeout cannot stretch a request past
    its deadline."""

    def __init__(self, conn: http.client.HTTPConnection, deadline: Deadline) -> None:
        self._conn = conn
        self._timer = threading.Timer(deadline.remaining(), self._cut)
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


class _TLSConnection(http.client.HTTPSConnection):
    """HTTPS to a checkpoint source, verified against the job's CA (and ``server_name``)."""

    def __init__(self, host: str, port: int, tls: TLSConfig, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout, context=tls.client_context())
        self._expected_name = tls.server_name or host

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._expected_name)


class CheckpointFetcher:
    """Fetches checkpoints; one instance serves any number of fetches, one after the other or
    at once.

    Contract: :meth:`fetch` returns a state dict only when every byte of it was checked: the
    header against its CRC-32 and, with a job secret, the source's MAC for this very request
    (before a byte of it is parsed); the tensor bytes range by range against the CRC-32C the
    source computed from its own memory and, with a secret, its MAC. Otherwise it raises a
    CheckpointError and returns nothing. It ends by ``timeout``, however slowly a source
    answers. A source that serves TLS is used only when verified against the job's CA.

    Args:
        num_chunks: parallel connections (byte ranges) to use (at least 1).
        secret: the job secret: requests are signed with it, answers checked with it.
        tls: the job's TLS settings (needed to fetch from an ``https://`` source).
        device: where received tensors are placed.
        same_host: try the same-host path where the source names one.
    """

    def __init__(
        self,
        *,
        num_chunks: int,
        secret: Optional[JobSecret],
        tls: Optional[TLSConfig],
        device: torch.device,
        same_host: bool,
    ) -> None:
        self._num_chunks = num_chunks
        self._request_signer = Signer(secret, CHECKPOINT_REQUEST_PURPOSE) if secret else None
        self.content_signer = Signer(secret, CHECKPOINT_CONTENT_PURPOSE) if secret else None
        # same-host requests are signed (never the secret itself): see same_host.py
        self._local_signer = Signer(secret, SAME_HOST_PURPOSE) if secret else None
        self._tls = tls
        self._device = device
        self._same_host = same_host
        # which path the last successful fetch took: "same-host", "http" or "http-striped"
        self.last_path: Optional[str] = None
        # bytes the last striped fetch received from each source, by its metadata
        self.last_served: Dict[str, int] = {}

    def fetch(self, src_rank: int, metadata: str, step: int, timeout: Timeout) -> Any:
        """Fetches the checkpoint for ``step`` from the source at ``metadata`` (its URL).

        Raises:
            CheckpointCorruptError: a checksum did not match (nothing is returned).
            CheckpointAuthError: the source refused the secret, or did not sign what it sent.
            CheckpointNotAvailableError: the source does not serve ``step``.
            CheckpointTransferError: connection failure, vanished peer, or timeout.
        """
        deadline = Deadline.after(timeout)
        url = urlsplit(metadata)
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise errors.CheckpointError(f"bad source address {metadata!r} (want http://host:port)")
        host, port = url.hostname, url.port
        secure = url.scheme == "https"
        if secure and (self._tls is None or not self._tls.ca_file):
            raise errors.CheckpointError(
                f"{metadata}: the source serves TLS, and this replica has no CA to verify it "
                f"with (set FT_TLS_CA_FILE, or pass tls=TLSConfig(ca_file=...))"
            )
        where = f"checkpoint step {step} from rank {src_rank} at {metadata}"

        wait_s = wire.server_wait(deadline)
        session = (
            same_host.Session.open(url.fragment, deadline, where, wire.raise_for_status)
            if self._same_host and url.fragment
            else None
        )
        try:
            fetched = None
            if session is not None:
                fetched = self._ask_same_host(session, url.fragment, step, wait_s, deadline)
                if fetched is None:
                    session.close()
                    session = None
                    wait_s = wire.server_wait(deadline)
            if fetched is not None:
                body, lease, reply = fetched
            else:
                path = f"{wire.PREFIX}{step}/meta?chunks={self._num_chunks}&wait={wait_s:.3f}"
                body, lease = self.get_metadata(host, port, path, deadline, where, secure=secure)
            if deadline.expired:
                raise errors.CheckpointTransferError(f"{where}: timed out once the metadata came")
            tree, specs, staging, lease = self.parse_metadata(body, lease, step, where)
            if deadline.expired:
                raise errors.CheckpointTransferError(f"{where}: timed out parsing the metadata")
            tensors = [ser.allocate(s, torch.device("cpu")) for s in specs]
            offsets = [0]
            views = []
            for t, s in zip(tensors, specs):
                views.append(ser.memview(t))
                offsets.append(offsets[-1] + s.nbytes)
            if session is not None and session.copy(reply, offsets, views, deadline):
                self.last_path = "same-host"
                return self._finish(tree, tensors, specs)
        finally:
            if session is not None:
                session.close()

        data = f"{wire.PREFIX}{step}/data?staging={staging}&lease={lease}"
        self._fetch_ranges(host, port, data, offsets, views, deadline, where, secure, timeout)
        self.last_path = "http"
        return self._finish(tree, tensors, specs)

    def fetch_striped(
        self,
        sources: Sequence[Tuple[int, str]],
        step: int,
        timeout: Timeout,
        options: Optional["StripeOptions"] = None,
    ) -> Any:
        """Fetches the checkpoint for ``step`` from every source in ``sources`` ((rank,
        metadata) pairs, the assigned source first) at once, each taking disjoint ranges
        (striped.py). With one source, or where the assigned source shares this host (the
        same-host path beats any network), this is :meth:`fetch` from the assigned source.

        Raises what :meth:`fetch` raises; CheckpointCorruptError also when the sources do not
        hold the same checkpoint; CheckpointTransferError when every source failed.
        """
        from ft.checkpointing.striped import StripedFetch, StripeOptions

        if not sources:
            raise errors.CheckpointError("a striped fetch needs at least one source")
        rank, metadata = sources[0]
        fragment = urlsplit(metadata).fragment
        if len(sources) == 1 or (self._same_host and fragment and self._shares_host(fragment)):
            return self.fetch(rank, metadata, step, timeout)
        run = StripedFetch(
            self, sources, step, timeout, options or StripeOptions(), self._num_chunks
        )
        tree, tensors, specs = run.run()
        self.last_path = "http-striped"
        self.last_served = run.served()
        return self._finish(tree, tensors, specs)

    @staticmethod
    def _shares_host(name: str) -> bool:
        """Whether the same-host endpoint ``name`` answers here (a connect, nothing sent)."""
        session = same_host.Session.open(
            name, Deadline.after(same_host.CONNECT_TIMEOUT_S), name, wire.raise_for_status
        )
        if session is None:
            return False
        session.close()
        return True

    def _ask_same_host(
        self, session: same_host.Session, name: str, step: int, wait_s: float, deadline: Deadline
    ) -> Optional[Tuple[bytes, str, Dict[str, Any]]]:
        """The same-host source's metadata, lease and reply (see Session.fetch); None: use
        HTTP."""
        request: Dict[str, Any] = {"step": step, "wait": wait_s, "chunks": self._num_chunks}
        if self._local_signer is not None:
            request["auth"] = self._local_signer.sign(
                same_host.request_what(name), same_host.request_body(step, wait_s, self._num_chunks)
            )
        # The source answers once the step is staged (within wait_s); no answer by half the
        # time kept back after that means it is stuck: HTTP gets the rest.
        reply_deadline = deadline.sooner(wait_s + (deadline.remaining() - wait_s) / 2)
        return session.fetch(request, deadline, wire.MAX_HEADER + wire.TRAILER.size, reply_deadline)

    def _fetch_ranges(
        self,
        host: str,
        port: int,
        data_path: str,
        offsets: List[int],
        views: List[memoryview],
        deadline: Deadline,
        where: str,
        secure: bool,
        timeout: Timeout,
    ) -> None:
        """Fetches every byte range into ``views``, one connection each, at once."""
        ranges = wire.plan_chunks(offsets[-1], self._num_chunks)
        if not ranges:
            return
        stop = threading.Event()
        pool = ThreadPoolExecutor(len(ranges), thread_name_prefix="ft-ckpt-fetch")
        try:
            futs = [
                pool.submit(
                    self.fetch_range,
                    host,
                    port,
                    f"{data_path}&start={a}&end={b}",
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
                futs,
                timeout=deadline.remaining() + _RANGE_ERROR_GRACE_S,
                return_when=FIRST_EXCEPTION,
            )
            failures = [f.exception() for f in done if f.exception() is not None]
            if failures or pending:
                stop.set()
                failures.sort(key=_severity)
                if failures:
                    raise failures[0]
                raise errors.CheckpointTransferError(f"{where}: timed out after {timeout}")
        finally:
            stop.set()
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def parse_metadata(
        body: bytes, lease: str, step: int, where: str
    ) -> Tuple[Any, List[ser.TensorSpec], str, str]:
        """Checks a metadata body (header + CRC-32); returns (tree, specs, staging, lease)."""
        if len(body) < wire.TRAILER.size:
            raise errors.CheckpointTransferError(f"{where}: truncated metadata")
        header, (crc,) = body[: -wire.TRAILER.size], wire.TRAILER.unpack(body[-wire.TRAILER.size :])
        if ser.crc32(header) != crc:
            raise errors.CheckpointCorruptError(f"{where}: metadata checksum mismatch")
        doc, tree, specs = ser.decode_header(header)
        total = sum(s.nbytes for s in specs)
        if doc.get("step") != step or doc.get("total_bytes") != total:
            raise errors.CheckpointFormatError(
                f"{where}: server answered step {doc.get('step')!r} with "
                f"{doc.get('total_bytes')!r} bytes (expected step {step}, {total} bytes)"
            )
        staging = doc.get("staging")
        if type(staging) is not str or not staging.isalnum() or not staging.isascii():
            raise errors.CheckpointFormatError(f"{where}: bad staging id")
        if not (lease.isalnum() and lease.isascii()):
            lease = ""  # an unknown lease still works while the checkpoint is staged
        return tree, specs, staging, lease

    def _finish(self, tree: Any, tensors: List[torch.Tensor], specs: List[ser.TensorSpec]) -> Any:
        out = []
        for t, s in zip(tensors, specs):
            if self._device.type != "cpu":
                t = t.to(self._device)
            out.append(ser.finalize(t, s))
        return ser.unflatten(tree, out)

    # ------------------------------------------------------------------ HTTP requests

    def open(
        self,
        host: str,
        port: int,
        path: str,
        deadline: Deadline,
        where: str,
        secure: bool = False,
        stall_s: Optional[float] = None,
    ) -> Tuple[http.client.HTTPConnection, http.client.HTTPResponse, socket.socket, bytes]:
        """Sends a (signed) GET; returns the connection, the response, its socket, and the
        request's signature (b"" without a secret), which the source's MACs are bound to.
        ``stall_s`` bounds the connect and each wait for the answer (a source whose link
        went down answers nothing)."""
        remaining = deadline.remaining()
        if remaining <= 0:
            raise errors.CheckpointTransferError(f"{where}: timed out")
        if stall_s is not None:
            remaining = min(remaining, stall_s)
        headers = {"Connection": "close"}
        signature = b""
        if self._request_signer is not None:
            # Bound to the address dialled: a non-member that received it could not use it at
            # any real source.
            token = self._request_signer.sign(f"GET {wire.bracket(host)}:{port}{path}")
            headers["Authorization"] = f"{HTTP_SCHEME} {token}"
            signature = token.encode()
        conn = (
            _TLSConnection(host, port, self._tls, remaining)
            if secure
            else http.client.HTTPConnection(host, port, timeout=remaining)
        )
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
                raise errors.CheckpointTransferError(f"{where}: timed out") from None
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                if deadline.expired:
                    raise errors.CheckpointTransferError(f"{where}: timed out") from None
                raise errors.CheckpointTransferError(
                    f"{where}: request failed ({type(e).__name__}: {e})"
                ) from None
            if resp.status != 200:
                try:
                    msg = resp.read(_REFUSAL_TEXT_BYTES).decode("utf-8", "replace").strip()
                except (OSError, http.client.HTTPException):
                    msg = ""
                conn.close()
                wire.raise_for_status(
                    resp.status, f"{where}: HTTP {resp.status} {resp.reason}: {msg}"
                )
        finally:
            cutoff.cancel()
        return conn, resp, sock, signature

    def get_metadata(
        self,
        host: str,
        port: int,
        path: str,
        deadline: Deadline,
        where: str,
        secure: bool = False,
    ) -> Tuple[bytes, str]:
        """The metadata answer: its body (checked against the source's MAC) and lease."""
        conn, resp, sock, signature = self.open(host, port, path, deadline, where, secure)
        try:
            declared = resp.getheader("Content-Length")
            if declared is None:
                raise errors.CheckpointFormatError(
                    f"{where}: the source sent metadata without a Content-Length; refused"
                )
            length = int(declared)
            if not 0 <= length <= wire.MAX_HEADER:
                # refused before a byte of it is read
                raise errors.CheckpointFormatError(
                    f"{where}: the source declares {length} bytes of metadata; at most "
                    f"{wire.MAX_HEADER} are accepted "
                    "(ft.checkpointing.serialization.MAX_HEADER_BYTES)"
                )
            buf = bytearray(length)
            # one socket read at a time (read1), each bounded by the time left: a source that
            # sends slowly cannot hold the receiver past its deadline
            read_exact(sock, lambda v: resp.readinto1(v[: wire.SLICE]), memoryview(buf), deadline)
            body = bytes(buf)
            self._check_content_mac(
                resp.getheader(wire.CONTENT_MAC_HEADER, ""), signature, body, where
            )
            return body, resp.getheader(wire.LEASE_HEADER, "")
        except errors.CheckpointError:
            raise  # already says what failed (some are OSErrors too: keep them as they are)
        except (socket.timeout, TimeoutError):
            raise errors.CheckpointTransferError(f"{where}: timed out reading metadata") from None
        except ValueError:
            raise errors.CheckpointFormatError(f"{where}: bad metadata length") from None
        except (OSError, http.client.HTTPException, EOFError) as e:
            if deadline.expired:
                raise errors.CheckpointTransferError(
                    f"{where}: timed out reading metadata"
                ) from None
            raise errors.CheckpointTransferError(
                f"{where}: peer vanished while sending metadata ({type(e).__name__}: {e})"
            ) from None
        finally:
            resp.close()
            conn.close()

    def fetch_range(
        self,
        host: str,
        port: int,
        path: str,
        start: int,
        end: int,
        offsets: List[int],
        views: List[memoryview],
        deadline: Deadline,
        stop: threading.Event,
        where: str,
        secure: bool = False,
        stall_s: Optional[float] = None,
    ) -> int:
        """Reads bytes ``[start, end)`` into ``views`` and checks their CRC (and MAC); returns
        the CRC-32C. ``stall_s``: see :meth:`open` and deadline_io.read_exact."""
        if stall_s is None:
            conn, resp, sock, signature = self.open(host, port, path, deadline, where, secure)
        else:
            conn, resp, sock, signature = self.open(
                host, port, path, deadline, where, secure, stall_s=stall_s
            )
        got = 0
        mac_size = wire.MAC_SIZE if self.content_signer is not None else 0
        try:
            length = resp.getheader("Content-Length")
            if length is None or int(length) != end - start + wire.TRAILER.size + mac_size:
                raise errors.CheckpointTransferError(f"{where}: bad Content-Length {length!r}")
            crc = 0
            for i, lo, hi in same_host.segments(offsets, start, end):
                for a in range(lo, hi, wire.SLICE):
                    if stop.is_set():
                        raise errors.CheckpointTransferError(f"{where}: cancelled")
                    dst = views[i][a : min(hi, a + wire.SLICE)]
                    read_exact(sock, resp.readinto, dst, deadline, stall_s)
                    crc = ser.crc32c(dst, crc)
                    got += len(dst)
            trailer = bytearray(wire.TRAILER.size + mac_size)
            read_exact(sock, resp.readinto, memoryview(trailer), deadline, stall_s)
            if mac_size and not self.content_signer.check(
                bytes(trailer[wire.TRAILER.size :]),
                b"data",
                signature,
                wire.range_bytes(start, end),
                bytes(trailer[: wire.TRAILER.size]),
            ):
                raise errors.CheckpointAuthError(
                    f"{where}: bytes [{start}, {end}) are not signed with the job secret: the "
                    f"source is not a member of this job; data discarded"
                )
            if wire.TRAILER.unpack(trailer[: wire.TRAILER.size])[0] != crc:
                raise errors.CheckpointCorruptError(
                    f"{where}: checksum mismatch in bytes [{start}, {end}); data discarded"
                )
            return crc
        except errors.CheckpointError:
            raise  # already says what failed (some are OSErrors too: keep them as they are)
        except (socket.timeout, TimeoutError):
            raise errors.CheckpointTransferError(
                f"{where}: timed out after {got} of {end - start} bytes of range [{start}, {end})"
            ) from None
        except (OSError, http.client.HTTPException, EOFError) as e:
            raise errors.CheckpointTransferError(
                f"{where}: peer vanished after {got} of {end - start} bytes of range "
                f"[{start}, {end}) ({type(e).__name__}: {e})"
            ) from None
        finally:
            resp.close()
            conn.close()

    def _check_content_mac(self, mac_hex: str, signature: bytes, body: bytes, where: str) -> None:
        """Refuses a metadata answer that a job member did not sign for this very request."""
        if self.content_signer is None:
            return
        try:
            mac = bytes.fromhex(mac_hex)
        except ValueError:
            mac = b""
        if not self.content_signer.check(mac, b"meta", signature, body):
            raise errors.CheckpointAuthError(
                f"{where}: the metadata is not signed with the job secret "
                f"({'no signature' if not mac_hex else 'wrong signature'}): the source is not a "
                f"member of this job; nothing was loaded"
            )
