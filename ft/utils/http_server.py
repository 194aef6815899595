"""An HTTP server that idle, slow or too many clients cannot starve (stdlib only).

:class:`BoundedHTTPServer` is ``http.server.HTTPServer`` with a daemon thread per connection
(like ``ThreadingHTTPServer``) and three bounds that anyone who can reach the port would
otherwise be able to exhaust:

* **Connections**: at most ``max_connections`` are open at once. One more is answered
  ``503`` (best effort, without blocking) and closed at once, in the accepting thread, without
  a thread of its own; the connections already open are unaffected.
* **Idle time**: a connection must deliver its request line and headers within
  ``idle_timeout_s`` of connecting (or, on a kept-alive connection, of its previous answer).
  This bounds the whole header phase, so a client that trickles one byte at a time loses its
  slot as surely as one that sends nothing. Once the headers are in, the bound no longer
  applies: a long answer (a checkpoint transfer, a long poll) is never cut by it; the
  handler's own ``timeout`` (a socket timeout on every read and write) bounds it instead.
* **Shutdown**: threads and sockets are tracked; :meth:`BoundedHTTPServer.server_close`
  shuts every open connection down, so no thread stays blocked on a client.

The idle bound is enforced by the serving thread itself (``service_actions``, run every
``poll_interval`` of ``serve_forever``): no extra thread, and a deadline resolution of one
poll interval.

Handlers derive from :class:`BoundedRequestHandler`. One that reads a request body and wants
the idle bound to cover it too sets ``hold_idle_deadline = True`` and calls
:meth:`BoundedRequestHandler.request_read` once it has the whole request.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any, Dict, Optional, Set, Tuple

from .deadline import Deadline

logger = logging.getLogger(__name__)

__all__ = ["BoundedHTTPServer", "BoundedRequestHandler"]

_ACTIVE = float("inf")  # deadline of a connection whose request is being answered
_REAPED = float("-inf")  # deadline of a connection closed for idling
_REFUSED = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: text/plain; charset=utf-8\r\n"
    b"Content-Length: 30\r\n"
    b"Retry-After: 1\r\n"
    b"Connection: close\r\n"
    b"\r\n"
    b"too many connections; retry.\r\n"
)
# Refusals are logged at most this often (a flood must not flood the log too).
_REFUSAL_LOG_INTERVAL_S = 10.0


class BoundedHTTPServer(HTTPServer):
    """HTTPServer with a thread per connection, a connection cap and an idle timeout.

    Args:
        addr: ``(host, port)`` to listen on; port 0 picks a free one.
        handler: a :class:`BoundedRequestHandler` subclass.
        idle_timeout_s: a connection that has not delivered a complete request line and
            headers this long after connecting (or after its previous answer) is closed.
        max_connections: most connections open at once; more are refused at once.
        family: ``socket.AF_INET`` or ``AF_INET6`` (default: from ``addr``'s host). An IPv6
            wildcard listens on IPv4 as well where the system allows it.
        name: names the threads and the log lines.
        ssl_context: serve HTTPS with it (the handshake happens in the connection's own
            thread, with its first read, under the idle bound: never in the accepting thread,
            which a slow client would block; the TLS socket is the one tracked, so the idle and
            shutdown bounds apply to it).
    """

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        addr: Tuple[str, int],
        handler: Any,
        *,
        idle_timeout_s: float,
        max_connections: int,
        family: Optional[int] = None,
        name: str = "ft-http",
        ssl_context: Optional[ssl.SSLContext] = None,
    ) -> None:
        if idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if family is None:
            family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.address_family = family
        self.idle_timeout_s = float(idle_timeout_s)
        self.max_connections = int(max_connections)
        self.name = name
        self.ssl_context = ssl_context
        self.track_lock = threading.Lock()
        self.threads: Set[threading.Thread] = set()
        # open connection -> monotonic deadline for its request line and headers
        self._deadlines: Dict[socket.socket, float] = {}
        self._closed = False
        self._refused = 0
        self._refusal_logged = 0.0
        super().__init__(addr, handler)

    @property
    def scheme(self) -> str:
        """``https`` with an SSL context, else ``http``."""
        return "https" if self.ssl_context is not None else "http"

    def get_request(self) -> Tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        if self.ssl_context is not None:
            conn = self.ssl_context.wrap_socket(
                conn, server_side=True, do_handshake_on_connect=False
            )
        return conn, addr

    @property
    def sockets(self) -> Set[socket.socket]:
        """The connections open now (a snapshot)."""
        with self.track_lock:
            return set(self._deadlines)

    def open_connections(self) -> int:
        with self.track_lock:
            return len(self._deadlines)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            try:
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            except OSError:
                pass
        # HTTPServer.server_bind would call getfqdn(), which can block on DNS.
        if self.allow_reuse_address:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(self.server_address)
        self.server_address = self.socket.getsockname()
        self.server_name = str(self.server_address[0])
        self.server_port = self.server_address[1]

    # ------------------------------------------------------------------ connections

    def process_request(self, request: Any, client_address: Any) -> None:
        t = threading.Thread(
            target=self._run, args=(request, client_address), daemon=True, name=self.name
        )
        with self.track_lock:
            admit = not self._closed and len(self._deadlines) < self.max_connections
            if admit:
                self._deadlines[request] = time.monotonic() + self.idle_timeout_s
                self.threads.add(t)
        if not admit:
            self._refuse(request, client_address)
            return
        try:
            t.start()
        except RuntimeError:  # no thread to be had: refuse this one, keep serving
            with self.track_lock:
                self._deadlines.pop(request, None)
                self.threads.discard(t)
            self._refuse(request, client_address)

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        try:
            request.setblocking(False)
            request.send(_REFUSED)
        except OSError:
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        with self.track_lock:
            self._refused += 1
            if now - self._refusal_logged < _REFUSAL_LOG_INTERVAL_S:
                return
            self._refusal_logged, n, self._refused = now, self._refused, 0
        logger.warning(
            "%s: refused %d connection(s) (last from %s): %d already open, the most allowed",
            self.name,
            n,
            client_address,
            self.max_connections,
        )

    def _run(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - a broken client must not kill the server
            logger.debug("%s: request from %s failed", self.name, client_address, exc_info=True)
        finally:
            self.shutdown_request(request)
            with self.track_lock:
                self._deadlines.pop(request, None)
                self.threads.discard(threading.current_thread())

    def arm(self, conn: socket.socket) -> None:
        """Starts ``conn``'s idle clock: its next request line and headers are due in
        ``idle_timeout_s``."""
        with self.track_lock:
            if self._deadlines.get(conn, _REAPED) != _REAPED:
                self._deadlines[conn] = time.monotonic() + self.idle_timeout_s

    def disarm(self, conn: socket.socket) -> bool:
        """Stops ``conn``'s idle clock (its request is in). False if it was already closed for
        idling: the request it delivered may be cut short and must not be acted on."""
        with self.track_lock:
            if self._deadlines.get(conn, _REAPED) == _REAPED:
                return False
            self._deadlines[conn] = _ACTIVE
            return True

    def service_actions(self) -> None:
        """Closes the connections that overran their idle deadline (serving thread, every
        poll interval)."""
        now = time.monotonic()
        with self.track_lock:
            for conn, deadline in self._deadlines.items():
                if deadline <= now and deadline != _REAPED:
                    self._deadlines[conn] = _REAPED
                    # Under the lock, so a handler cannot disarm it in between. shutdown(2)
                    # does not block; the handler's read then ends and its thread exits.
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    logger.debug(
                        "%s: closed a connection idle for %.1fs", self.name, self.idle_timeout_s
                    )

    def kill_connections(self) -> None:
        """Shuts every open connection down (their threads then finish)."""
        with self.track_lock:
            socks = list(self._deadlines)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def server_close(self) -> None:
        with self.track_lock:
            self._closed = True
        super().server_close()
        self.kill_connections()

    def join_threads(self, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds in all for the connection threads; True if all ended."""
        deadline = Deadline.after(timeout)
        with self.track_lock:
            threads = list(self.threads)
        for t in threads:
            t.join(deadline.remaining())
        return not any(t.is_alive() for t in threads)


class BoundedRequestHandler(BaseHTTPRequestHandler):
    """Request handler for :class:`BoundedHTTPServer`: keeps the server's idle clock.

    ``hold_idle_deadline = True``: the idle bound also covers reading the body; the handler
    calls :meth:`request_read` once it has read it (and must not act if it returns False).
    """

    server: BoundedHTTPServer
    hold_idle_deadline = False

    def handle_one_request(self) -> None:
        self.server.arm(self.connection)
        super().handle_one_request()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not self.hold_idle_deadline and not self.request_read():
            return False
        return True

    def request_read(self) -> bool:
        """The whole request is in: stops the idle clock. False if the connection was already
        closed for idling (the request may be cut short: do not act on it)."""
        if self.server.disarm(self.connection):
            return True
        self.close_connection = True
        return False
