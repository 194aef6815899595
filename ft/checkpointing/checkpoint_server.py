"""The source side of HTTP checkpoint transfers: stages a checkpoint, hands out leases, and
answers the metadata and data requests of http_protocol.py.

The server keeps references to the tensors (no serialization at staging) and reads them only
while answering requests; the CRC is computed over exactly the bytes it writes, so corruption
anywhere on the way is detected by the receiver. :meth:`CheckpointServer.withdraw` waits
(bounded by the timeout) until transfers that already started have finished, so that after it
returns the caller may mutate the tensors again.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import serialization as ser
from ft.checkpointing.http_protocol import Refused
from ft.checkpointing.staging import Abort, Staging, join_preparer
from ft.checkpointing.transport import CheckpointError
from ft.utils import net
from ft.utils.auth import (
    CHECKPOINT_CONTENT_PURPOSE,
    CHECKPOINT_REQUEST_PURPOSE,
    HTTP_SCHEME,
    AuthError,
    JobSecret,
    Signer,
    Verifier,
    check_exposure,
)
from ft.utils.deadline import Deadline, Timeout, to_seconds
from ft.utils.http_server import BoundedHTTPServer, BoundedRequestHandler
from ft.utils.tls import TLSConfig, resolve_tls, warn_cleartext

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_MAX_CONNECTIONS",
    "CheckpointServer",
    "default_advertise_host",
]

logger = logging.getLogger(__name__)

# A connection must deliver its request line and headers this long after connecting (a
# receiver sends them at once); then the transfer is bounded by ``timeout`` only, never by this.
# Long enough for a receiver on a loaded host, short enough that idle sockets are not hoarded.
DEFAULT_IDLE_TIMEOUT_S = 30.0
# Most connections open at once. A receiver opens at most MAX_CHUNKS (256) data connections
# at a time, after its metadata request has ended, so one receiver at the widest split fits
# (usual receivers open one to a few). It bounds the threads and descriptors that anyone who
# reaches the port can take to a quarter of the common 1024 open-file limit.
DEFAULT_MAX_CONNECTIONS = 256
# serve_forever's poll: how soon shutdown() is noticed, and the resolution of the idle bound.
_POLL_S = 0.05
# While withdrawing, how often the server looks for leases gone idle (they idle by the clock,
# see staging.LEASE_GRACE_S, not by a notification).
_WITHDRAW_POLL_S = 0.05
# Transfers cut off at withdrawal see their socket shut down and end within one write; this
# bounds the wait for them to say so on a badly loaded host.
_CUTOFF_GRACE_S = 5.0


def default_advertise_host(bind_host: Optional[str] = None) -> str:
    """The address peers should use to reach this host: a specific ``bind_host`` if given,
    else the process's advertised host (:func:`ft.utils.net.advertise_host`)."""
    if bind_host not in (None, "", "0.0.0.0", "::") and not os.environ.get(net.ADVERTISE_ENV):
        return bind_host  # type: ignore[return-value]
    return net.advertise_host()


class _HTTPServer(BoundedHTTPServer):
    """A thread per connection, capped and idle-bounded (see ft.utils.http_server), with
    tracked threads and sockets so that shutdown is bounded; TLS when given a context."""

    def __init__(
        self,
        addr: Tuple[str, int],
        handler: Any,
        family: int,
        idle_timeout_s: float,
        max_connections: int,
        ssl_context: Optional[ssl.SSLContext],
    ) -> None:
        self._ssl_context = ssl_context
        super().__init__(
            addr,
            handler,
            family=family,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            name="ft-ckpt-http",
        )

    def get_request(self) -> Tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        if self._ssl_context is not None:
            # No handshake here (it would block the accepting thread on a slow client): the
            # connection's own thread does it with its first read, under the idle bound. The
            # TLS socket is the one tracked, so idle and shutdown bounds apply to it.
            conn = self._ssl_context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        return conn, addr


class CheckpointServer:
    """Serves at most one staged checkpoint over HTTP, and keeps its leases.

    Contract:
      - It listens on the advertised interface only (unless told otherwise) and refuses to
        listen beyond loopback without a job secret unless ``insecure`` (ft.utils.auth).
      - With a secret, a request is answered only if signed for this address and not replayed
        (else 403), and every answer is signed for the request it answers.
      - A step is served only under the step it was staged for; requests get 404/409/410/503
        as http_protocol.py says. A metadata request waits (bounded by ``timeout``) for a step
        ahead of what is staged.
      - After :meth:`withdraw` returns, no thread of this server reads the tensors.

    ``cond`` guards the staging and its bookkeeping; :meth:`claim` and :meth:`release` bracket
    every read of the tensors, by this server or by the same-host source.

    The arguments are HTTPTransport's (see there), resolved: ``secret`` is the job secret or
    None; ``tls`` is resolved here (``self.tls``, which receivers of the same transport use
    too); ``pace`` is called once per 1 MiB slice served, on either path.
    """

    def __init__(
        self,
        timeout: Timeout,
        *,
        secret: Optional[JobSecret],
        insecure: Optional[bool],
        tls: Optional[TLSConfig],
        advertise_host: Optional[str],
        bind_host: Optional[str],
        port: int,
        idle_timeout_s: float,
        max_connections: int,
        pace: Callable[[], None],
    ) -> None:
        timeout_s = to_seconds(timeout)
        if timeout_s is None:
            raise TypeError("the checkpoint server needs a timeout (a timedelta or seconds)")
        self.timeout_s = timeout_s
        self._pace = pace
        self._verifier = Verifier(secret, CHECKPOINT_REQUEST_PURPOSE) if secret else None
        self.content_signer = Signer(secret, CHECKPOINT_CONTENT_PURPOSE) if secret else None
        self.cond = threading.Condition()
        self._staging: Optional[Staging] = None
        self._last_step: Optional[int] = None
        # (step, reason) of the last step this source failed to stage (abandon_checkpoint).
        self._abandoned: Optional[Tuple[int, str]] = None
        # A step the source announced it will stage (expect): requests for it wait for it.
        self._expected: Optional[int] = None
        # The step wait_delivered released last, until another staging (see _servable).
        self._released: Optional[int] = None
        self._closed = False
        # data bytes this server sent over HTTP, every staging together (ranges that completed)
        self.served_bytes = 0

        if bind_host is None:
            # The advertised interface only: nothing on the machine's other networks can reach
            # the model's bytes.
            bind_host = net.bind_host_for(advertise_host or net.advertise_host()).strip("[]")
        if bind_host in ("", "::", "0.0.0.0"):
            bind_host = "::" if socket.has_dualstack_ipv6() else "0.0.0.0"
        check_exposure(bind_host, secret, insecure, "the checkpoint server")
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self.tls = resolve_tls(tls)
        warn_cleartext(secret, self.tls, "the checkpoint server")
        tls_server = self.tls.server_context() if self.tls and self.tls.can_serve else None
        self._scheme = "https" if tls_server else "http"
        self.httpd = _HTTPServer(
            (bind_host, port),
            self._handler_class(),
            family,
            idle_timeout_s,
            max_connections,
            tls_server,
        )
        self.port = self.httpd.server_address[1]
        # None: resolved at every url() call, so the host the Manager picks at its start (the
        # interface that routes to the lighthouse) applies to a server built before it.
        self._advertise = advertise_host or (
            bind_host if bind_host not in ("", "0.0.0.0", "::") else None
        )
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": _POLL_S},
            daemon=True,
            name="ft-ckpt-http-server",
        )
        self._thread.start()

    @property
    def staging(self) -> Optional[Staging]:
        """The checkpoint staged now (None if none)."""
        return self._staging

    def url(self) -> str:
        """``http(s)://host:port`` as receivers should dial it."""
        host = self._advertise or default_advertise_host()
        return f"{self._scheme}://{wire.bracket(host)}:{self.port}"

    # ------------------------------------------------------------------ staging

    def stage(self, step: int, state_dict: Any) -> Staging:
        """Withdraws the staged checkpoint, then serves ``state_dict`` as ``step``. Raises
        TypeError (naming the key path) for values that cannot be sent safely, before anything
        is withdrawn."""
        staging = Staging(step, state_dict, self._pace)
        self.withdraw(restaging=True)
        with self.cond:
            if self._closed:
                raise CheckpointError("HTTPTransport is shut down")
            self._staging = staging
            self._last_step = step
            self._released = None
            self._abandoned = None
            self._expected = None
            self.cond.notify_all()
        return staging

    def expect(self, step: int) -> None:
        """The source will stage ``step`` (again): requests for it wait for it instead of being
        told it was withdrawn or abandoned, until it is staged or abandoned."""
        with self.cond:
            self._expected = step
            if self._abandoned is not None and self._abandoned[0] == step:
                self._abandoned = None

    def wait_delivered(self, step: int, receivers: int, deadline: Deadline) -> bool:
        """Waits until ``receivers`` receivers have read all of the staged checkpoint of
        ``step``; False at the deadline, or once it is no longer staged."""
        with self.cond:

            def settled() -> bool:
                st = self._staging
                return (
                    st is None
                    or st.step != step
                    or st.closing
                    or (st.delivered >= receivers and not st.striped_readers())
                )

            deadline.wait(self.cond, settled)
            st = self._staging
            if st is None or st.step != step or st.delivered < receivers or st.striped_readers():
                return False
            # The caller changes the tensors from now on: nobody new may start reading them.
            st.released = True
            self._released = step
            return True

    def wait_asked(self, step: int, receivers: int, deadline: Deadline) -> bool:
        """Waits until ``receivers`` receivers have been given the metadata of the staged
        checkpoint of ``step`` (each may still be reading it), or until nobody new can be (it
        is no longer staged, or released): True; False at the deadline."""
        with self.cond:

            def settled() -> bool:
                st = self._staging
                return (
                    st is None
                    or st.step != step
                    or st.closing
                    or st.released
                    or st.asked >= receivers
                )

            return deadline.wait(self.cond, settled)

    def check_staged(self, step: int) -> None:
        """Returns if ``step`` is being served; raises CheckpointError otherwise."""
        with self.cond:
            st = self._staging
            if st is not None and not st.closing and st.step == step:
                return
            staged = None if st is None or st.closing else st.step
        raise CheckpointError(
            f"allow_checkpoint({step}): no checkpoint of step {step} is staged "
            f"(staged: {staged}); send_checkpoint(dst_ranks, {step}, state_dict, timeout) "
            f"stages and serves one"
        )

    def abandon(self, step: int, reason: str) -> None:
        """Receivers waiting for ``step`` get 409 naming ``reason`` at once."""
        self.withdraw()
        with self.cond:
            self._abandoned = (step, reason)
            if self._expected == step:
                self._expected = None
            self.cond.notify_all()

    def withdraw(self, restaging: bool = False) -> None:
        """Withdraws the staged checkpoint: new requests get 410 at once, and so do receivers
        that got the metadata but have not started reading data (their leases are dropped, not
        waited for). Transfers that already started, and the other ranges of their receivers
        (asked for at the same moment), get up to ``timeout`` to finish; then they are cut off.
        ``restaging`` (``stage`` withdraws the previous one): receivers waiting for a released
        step to be staged again keep waiting.
        """
        with self.cond:
            if not restaging:
                self._released = None
            st = self._staging
            if st is None:
                return
            st.closing = True
            deadline = Deadline.after(self.timeout_s)
            while True:
                st.prune()
                st.drop_idle_leases(time.monotonic())
                if (not st.leases and st.active == 0) or deadline.expired:
                    break
                self.cond.wait(min(deadline.remaining(), _WITHDRAW_POLL_S))
            st.withdrawn = True
            conns = set(st.conns)
            if st.active:
                logger.warning("cutting off %d checkpoint transfer(s) still running", st.active)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        with self.cond:
            Deadline.after(_CUTOFF_GRACE_S).wait(self.cond, lambda: st.active == 0)
            if self._staging is st:
                self._staging = None
            self.cond.notify_all()
        join_preparer(st)

    # ------------------------------------------------------------------ leases

    def meta(
        self, step: int, wait_s: float, chunks: int, stripe: Optional[bool] = None
    ) -> Tuple[Staging, bytes, str]:
        """Waits up to ``wait_s`` for ``step`` to be staged; returns the staging, its metadata
        body (header + CRC-32) and a lease for ``chunks`` data ranges. Raises Refused
        otherwise. ``stripe`` (a striped receiver): the lease lasts until its ``done``
        request, and counts as a delivery only if ``stripe`` is True (this is the receiver's
        assigned source, not a helper)."""
        chunks = min(max(1, chunks), wire.MAX_CHUNKS)
        wait_s = min(max(0.0, wait_s), self.timeout_s)
        deadline = Deadline.after(wait_s)

        def servable() -> Optional[Staging]:
            st = self._servable(step)
            if st is None and stripe is False and self._released == step:
                # a striped helper is told at once that it is no source
                raise Refused(410, f"checkpoint for step {step} is no longer served")
            return st

        with self.cond:
            deadline.wait(self.cond, lambda: servable() is not None)
            st = servable()
            if st is None:
                last = self._last_step
                raise Refused(
                    404,
                    f"step {step} is not available "
                    + (
                        "(nothing staged)"
                        if last is None
                        else f"(step {step} was delivered and released, and not staged again)"
                        if self._released == step
                        else f"(last staged step {last})"
                    ),
                )
            lease = uuid.uuid4().hex
            n = len(wire.plan_chunks(st.total, chunks))
            if stripe is not None:
                st.lease(lease, n, self.timeout_s, explicit=True, counted=stripe)
            elif n:
                st.lease(lease, n, self.timeout_s)
            else:
                st.delivered += 1  # no data: the metadata is all of it
            st.asked += 1
            self.cond.notify_all()
            return st, st.header + wire.TRAILER.pack(ser.crc32(st.header)), lease

    def _servable(self, step: int) -> Optional[Staging]:
        """The staging that serves ``step``, None if it may still come; raises Refused if it
        will not. Caller holds ``cond``."""
        if self._closed:
            raise Refused(503, "checkpoint server is shutting down")
        st = self._staging
        if st is not None and st.step == step and not st.closing and not st.released:
            return st
        if self._expected == step:
            return None  # announced: it comes
        if self._abandoned is not None and self._abandoned[0] == step:
            raise Refused(409, f"the source failed to produce step {step}: {self._abandoned[1]}")
        if self._released == step:
            # Its receivers have it and the source changes its tensors from now on: nobody
            # new reads them. One asking for the same step again (a second heal at an
            # unchanged step) waits for the source to stage it afresh.
            return None
        last = self._last_step
        if last is not None and step <= last:
            if step == last:
                raise Refused(410, f"checkpoint for step {step} was withdrawn")
            raise Refused(404, f"step {step} is not available (last staged step is {last})")
        return None

    def claim(self, step: int, staging_id: str, lease_id: str, conn: socket.socket) -> Staging:
        """Registers a transfer of the staged checkpoint (``withdraw`` waits for it, then cuts
        ``conn``). Raises Refused if it is not served."""
        with self.cond:
            st = self._staging
            if self._closed:
                raise Refused(503, "checkpoint server is shutting down")
            if st is None or st.step != step or st.id != staging_id or st.withdrawn:
                raise Refused(410, f"checkpoint for step {step} is no longer served")
            lease = st.leases.get(lease_id)
            if (st.closing or st.released) and lease is None:
                raise Refused(410, f"checkpoint for step {step} was withdrawn")
            if lease is not None:
                lease.active += 1
                lease.touched = time.monotonic()
            st.active += 1
            st.conns.add(conn)
            return st

    def release(self, st: Staging, lease_id: str, conn: socket.socket, used: Optional[int]) -> None:
        """Ends a transfer registered by ``claim``. ``used``: how many of the lease's ranges
        it delivered (None: it failed, and the lease is dropped so nothing waits for it)."""
        with self.cond:
            st.active -= 1
            st.conns.discard(conn)
            lease = st.leases.get(lease_id)
            if lease is not None and lease.explicit:
                # a striped receiver's lease ends with its done request only
                lease.active = max(0, lease.active - 1)
                lease.touched = time.monotonic()
            elif lease is not None:
                lease.active = max(0, lease.active - 1)
                lease.touched = time.monotonic()
                lease.remaining -= used or 0
                if lease.remaining <= 0 or used is None:
                    del st.leases[lease_id]
                    if used is not None:
                        st.delivered += 1
            self.cond.notify_all()

    def finish_lease(self, step: int, staging_id: str, lease_id: str, ok: bool) -> None:
        """A striped receiver is done with this source: its lease ends, and counts as a
        delivery if ``ok`` and this was its assigned source."""
        with self.cond:
            st = self._staging
            if st is None or st.step != step or st.id != staging_id:
                return
            lease = st.leases.get(lease_id)
            if lease is None or not lease.explicit:
                return
            del st.leases[lease_id]
            if ok and lease.counted:
                st.delivered += 1
            self.cond.notify_all()

    def drop_lease(self, lease_id: str) -> None:
        """A lease whose receiver will not use it: nothing waits for it."""
        with self.cond:
            st = self._staging
            if st is not None:
                st.leases.pop(lease_id, None)
            self.cond.notify_all()

    # ------------------------------------------------------------------ HTTP

    def _handler_class(self) -> type:
        server = self

        class Handler(BoundedRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = self.timeout_s  # socket timeout for every read/write
            server_version = "ft-checkpoint/1"

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("%s " + fmt, self.address_string(), *args)

            def do_GET(self) -> None:  # noqa: N802
                self.close_connection = True
                try:
                    server._serve(self)
                except Refused as e:
                    body = (e.msg + "\n").encode("utf-8", "replace")
                    self.send_response(e.code)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)

        return Handler

    def _dialled_address(self) -> str:
        """``host:port`` as receivers dial it (from :meth:`url`), as they sign it."""
        url = urlsplit(self.url())
        return f"{wire.bracket(url.hostname or '')}:{url.port}"

    def _verify_request(self, h: BaseHTTPRequestHandler) -> bytes:
        """Refuses (403) a request not signed with the job secret, or signed before (a replay);
        returns its signature, which what this source answers is bound to."""
        if self._verifier is None:
            return b""
        auth = h.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        try:
            self._verifier.verify(
                f"GET {self._dialled_address()}{h.path}",
                b"",
                token.strip() if scheme == HTTP_SCHEME else None,
            )
        except AuthError as e:
            raise Refused(403, f"refused: {e}; this source requires the job secret") from None
        return token.strip().encode()

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        signature = self._verify_request(h)
        url = urlsplit(h.path)
        if not url.path.startswith(wire.PREFIX):
            raise Refused(404, f"unknown path {url.path[:100]!r}")
        parts = url.path[len(wire.PREFIX) :].split("/")
        if len(parts) != 2:
            raise Refused(404, f"unknown path {url.path[:100]!r}")
        try:
            step = int(parts[0])
        except ValueError:
            raise Refused(400, f"bad step {parts[0][:40]!r}") from None
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if parts[1] == "meta":
            self._serve_meta(h, step, q, signature)
        elif parts[1] == "data":
            self._serve_data(h, step, q, signature)
        elif parts[1] == "digest":
            self._serve_digest(h, step, q, signature)
        elif parts[1] == "done":
            self.finish_lease(step, q.get("staging", ""), q.get("lease", ""), q.get("ok") == "1")
            self._send_small(h, b"ok\n", "text/plain; charset=utf-8")
        else:
            raise Refused(404, f"unknown path {url.path[:100]!r}")

    @staticmethod
    def _num(q: Dict[str, str], key: str, kind: type, default: Any = None) -> Any:
        if key not in q:
            if default is None:
                raise Refused(400, f"missing parameter {key!r}")
            return default
        try:
            return kind(q[key])
        except ValueError:
            raise Refused(400, f"bad parameter {key}={q[key][:40]!r}") from None

    def _serve_meta(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        stripe = {"primary": True, "helper": False}.get(q.get("stripe", ""))
        if "stripe" in q and stripe is None:
            raise Refused(400, f"bad parameter stripe={q['stripe'][:40]!r}")
        _, body, lease = self.meta(
            step, self._num(q, "wait", float, 0.0), self._num(q, "chunks", int, 1), stripe
        )
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.send_header(wire.LEASE_HEADER, lease)
        if self.content_signer is not None:
            h.send_header(
                wire.CONTENT_MAC_HEADER, self.content_signer.mac(b"meta", signature, body).hex()
            )
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _send_small(
        h: BaseHTTPRequestHandler, body: bytes, kind: str, mac: Optional[bytes] = None
    ) -> None:
        h.send_response(200)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body)))
        if mac is not None:
            h.send_header(wire.CONTENT_MAC_HEADER, mac.hex())
        h.send_header("Connection", "close")
        h.end_headers()
        h.wfile.write(body)

    def _serve_digest(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        """The CRC-32C of each of the staging's ``local_ranges`` (wire.encode_digest): a
        striped receiver checks that all its sources hold the same bytes. Claimed like a data
        transfer, so that a withdrawal waits for it or cuts it off."""
        lease_id = q.get("lease", "")
        st = self.claim(step, q.get("staging", ""), lease_id, h.connection)
        try:
            body = wire.encode_digest(st.digest())
        except Abort:
            raise Refused(410, f"checkpoint for step {step} was withdrawn") from None
        finally:
            self.release(st, lease_id, h.connection, 0)
        mac = self.content_signer.mac(b"digest", signature, body) if self.content_signer else None
        self._send_small(h, body, "application/json", mac)

    def _serve_data(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        lease_id = q.get("lease", "")
        start = self._num(q, "start", int)
        end = self._num(q, "end", int)
        with self.cond:
            st = self.claim(step, q.get("staging", ""), lease_id, h.connection)
            if not 0 <= start <= end <= st.total:
                self.release(st, lease_id, h.connection, None)
                raise Refused(400, f"bad range [{start}, {end}) of {st.total} bytes")
        used: Optional[int] = None
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            signer = self.content_signer
            h.send_header(
                "Content-Length",
                str(end - start + wire.TRAILER.size + (wire.MAC_SIZE if signer else 0)),
            )
            h.send_header("Connection", "close")
            h.end_headers()
            crc = 0
            for piece in st.slices(start, end):
                crc = ser.crc32c(piece, crc)
                h.wfile.write(piece)
            trailer = wire.TRAILER.pack(crc)
            if signer is not None:
                trailer += signer.mac(b"data", signature, wire.range_bytes(start, end), trailer)
            h.wfile.write(trailer)
            used = 1
            with self.cond:
                st.served_bytes += end - start
                self.served_bytes += end - start
        except Abort:
            logger.debug("checkpoint transfer cut off (withdrawn)")
        except OSError as e:
            logger.debug("checkpoint transfer to %s failed: %s", h.client_address, e)
        finally:
            self.release(st, lease_id, h.connection, used)

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> bool:
        """Withdraws everything at once (no waiting), stops listening and cuts every open
        connection. False if it was stopped before."""
        with self.cond:
            if self._closed:
                return False
            self._closed = True
            st = self._staging
            if st is not None:
                st.closing = True
                st.withdrawn = True
            self.cond.notify_all()
        self.httpd.shutdown()  # serve_forever polls every _POLL_S
        self.httpd.server_close()
        self.httpd.kill_connections()
        return True

    def join(self, deadline: Deadline) -> None:
        """Waits (until ``deadline``) for the serving threads of a stopped server to end."""
        self._thread.join(deadline.remaining())
        with self.httpd.track_lock:
            threads = list(self.httpd.threads)
        for t in threads:
            t.join(deadline.remaining())

    def forget(self) -> None:
        """Drops a stopped server's staging once its background preparation has ended."""
        with self.cond:
            st, self._staging = self._staging, None
        if st is not None:
            join_preparer(st)
