"""The source side of HTTP checkpoint transfers: answers the metadata, data, digest and done
requests of http_protocol.py for the checkpoint a ServedCheckpoint (served.py) holds.

The tensors are referenced, not serialized, at staging and read only while answering
requests; the CRC is computed over exactly the bytes written, so corruption anywhere on the
way is detected by the receiver. ``ServedCheckpoint.withdraw`` waits (bounded by the timeout)
until transfers that already started have finished, so that after it returns the caller may
mutate the tensors again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Dict, Optional
from urllib.parse import parse_qs, urlsplit

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import serialization as ser
from ft.checkpointing.http_protocol import Refused
from ft.checkpointing.served import ServedCheckpoint
from ft.checkpointing.staging import Abort
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


def default_advertise_host(bind_host: Optional[str] = None) -> str:
    """The address peers should use to reach this host: a specific ``bind_host`` if given,
    else the process's advertised host (:func:`ft.utils.net.advertise_host`)."""
    if bind_host not in (None, "", "0.0.0.0", "::") and not os.environ.get(net.ADVERTISE_ENV):
        return bind_host  # type: ignore[return-value]
    return net.advertise_host()


class CheckpointServer:
    """Serves ``served``'s checkpoint over HTTP.

    Contract:
      - It listens on the advertised interface only (unless told otherwise) and refuses to
        listen beyond loopback without a job secret unless ``insecure`` (ft.utils.auth).
      - With a secret, a request is answered only if signed for this address and not replayed
        (else 403), and every answer is signed for the request it answers.
      - What is served, and what a request is refused with, is ``served``'s to say
        (ServedCheckpoint); every read of the tensors here is claimed and released there.
      - After :meth:`stop`, nothing is served and every connection is cut.

    The arguments are HTTPTransport's (see there), resolved: ``secret`` is the job secret or
    None; ``tls`` is resolved here (``self.tls``, which receivers of the same transport use
    too).
    """

    def __init__(
        self,
        served: ServedCheckpoint,
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
    ) -> None:
        timeout_s = to_seconds(timeout)
        if timeout_s is None:
            raise TypeError("the checkpoint server needs a timeout (a timedelta or seconds)")
        self.timeout_s = timeout_s
        self.served = served
        self._verifier = Verifier(secret, CHECKPOINT_REQUEST_PURPOSE) if secret else None
        self.content_signer = Signer(secret, CHECKPOINT_CONTENT_PURPOSE) if secret else None

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
        # A thread per connection, capped and idle-bounded, with tracked threads and sockets
        # so that shutdown is bounded; TLS when given a context (ft.utils.http_server).
        self.httpd = BoundedHTTPServer(
            (bind_host, port),
            self._handler_class(),
            family=family,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            name="ft-ckpt-http",
            ssl_context=tls_server,
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

    def url(self) -> str:
        """``http(s)://host:port`` as receivers should dial it."""
        host = self._advertise or default_advertise_host()
        return f"{self.httpd.scheme}://{wire.bracket(host)}:{self.port}"

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
                    server.serve_request(self)
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

    def serve_request(self, h: BaseHTTPRequestHandler) -> None:
        """Answers one GET (metadata, data range or digest); raises Refused to refuse it."""
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
            self.served.finish_lease(
                step, q.get("staging", ""), q.get("lease", ""), q.get("ok") == "1"
            )
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
        _, body, lease = self.served.meta(
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
        st = self.served.claim(step, q.get("staging", ""), lease_id, h.connection)
        try:
            body = wire.encode_digest(st.digest())
        except Abort:
            raise Refused(410, f"checkpoint for step {step} was withdrawn") from None
        finally:
            self.served.release(st, lease_id, h.connection, 0)
        mac = self.content_signer.mac(b"digest", signature, body) if self.content_signer else None
        self._send_small(h, body, "application/json", mac)

    def _serve_data(
        self, h: BaseHTTPRequestHandler, step: int, q: Dict[str, str], signature: bytes
    ) -> None:
        lease_id = q.get("lease", "")
        start = self._num(q, "start", int)
        end = self._num(q, "end", int)
        with self.served.cond:
            st = self.served.claim(step, q.get("staging", ""), lease_id, h.connection)
            if not 0 <= start <= end <= st.total:
                self.served.release(st, lease_id, h.connection, None)
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
            with self.served.cond:
                st.served_bytes += end - start
                self.served.served_bytes += end - start
        except Abort:
            logger.debug("checkpoint transfer cut off (withdrawn)")
        except OSError as e:
            logger.debug("checkpoint transfer to %s failed: %s", h.client_address, e)
        finally:
            self.served.release(st, lease_id, h.connection, used)

    # ------------------------------------------------------------------ shutdown

    def stop(self) -> bool:
        """Withdraws everything at once (no waiting), stops listening and cuts every open
        connection. False if it was stopped before."""
        if not self.served.close():
            return False
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
