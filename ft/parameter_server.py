"""A prototype parameter server on reconfigurable process groups (torchft's
``torchft.parameter_server``).

A client asks the server's HTTP endpoint for a session; the server answers with a fresh
store prefix, and both sides configure a new two-rank process group on it (server rank 0,
client rank 1). The server then runs :meth:`ParameterServer.forward` for that session on
its own thread; the client gets the configured group from :meth:`ParameterServer.new_session`
and talks to ``forward`` through it.

Contract:
* ``GET <address()>`` (``http://host:port/new_session``) answers 200 with one JSON object
  ``{"session_id": str, "store_addr": "host:port/session/<id>"}``; any other path answers 404.
* Each session gets a new group from ``new_process_group()`` (subclasses implement it),
  configured with ``replica_id="0"``, ``world_size=2``; ``forward(session_id, pg)`` runs once
  per session and the group is shut down when it returns or raises (a raise is logged; the
  client then sees its ops fail and must open a new session).
* Sessions run on the request's connection thread: at most ``max_sessions`` at once (one
  more is refused with 503).
* It serves no authentication: it refuses to listen beyond loopback unless ``insecure=True``
  (or ``FT_INSECURE=1``), like ft's other servers without a job secret (docs/security.md).
  The session store (a TCPStore server) listens on every interface, as torch's always does.

Differences from torchft: it listens on this host's advertised address (``host=``, default
``FT_ADVERTISE_HOST`` or the interface found by :mod:`ft.utils.net`) instead of every
interface, it has the exposure check above, and :meth:`ParameterServer.shutdown` stops it.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
import uuid
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Any, Optional

from torch.distributed import TCPStore

from ft.backend.process_group import ProcessGroup
from ft.utils import net
from ft.utils.auth import check_exposure
from ft.utils.http_server import BoundedHTTPServer, BoundedRequestHandler

__all__ = ["ParameterServer"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SESSIONS = 64
_NEW_SESSION_PATH = "/new_session"


def _bracket(host: str) -> str:
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


class ParameterServer(ABC):
    """A threaded parameter server: one reconfigurable process group per client session.

    Args:
        port: HTTP port (0: any free port; see :meth:`address`).
        store_port: port of the sessions' TCPStore (0: any free port).
        host: address to listen on and advertise (default: this host's advertised address).
        insecure: allow listening beyond loopback although nothing is authenticated.
        max_sessions: most sessions (connections) at once.
    """

    def __init__(
        self,
        port: int,
        store_port: int = 0,
        *,
        host: Optional[str] = None,
        insecure: Optional[bool] = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if host is None:
            advertise = net.advertise_host()
            bind = net.bind_host_for(advertise).strip("[]")
        else:
            advertise = bind = host.strip("[]")
        check_exposure(bind, None, insecure, "the parameter server")
        self._advertise = advertise
        self.store = TCPStore(
            host_name=advertise,
            port=store_port,
            is_master=True,
            wait_for_workers=False,
        )
        ps = self

        class Handler(BoundedRequestHandler):
            timeout = 30.0  # a reply the client does not read cannot hold the thread forever

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("parameter server: " + fmt, *args)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != _NEW_SESSION_PATH:
                    body = f"unknown path {self.path!r}; sessions start at {_NEW_SESSION_PATH}\n"
                    self._reply(404, "text/plain; charset=utf-8", body.encode())
                    return
                session_id = str(uuid.uuid4())
                store_addr = f"{_bracket(advertise)}:{ps.store.port}/session/{session_id}"
                body = json.dumps({"session_id": session_id, "store_addr": store_addr})
                self._reply(200, "application/json", (body + "\n").encode())
                self.close_connection = True
                # The session keeps this thread: the connection cap bounds the sessions.
                ps._handle_session(session_id, store_addr)

            def _reply(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.wfile.flush()

        self._server = BoundedHTTPServer(
            (bind, port),
            Handler,
            idle_timeout_s=10.0,
            max_connections=max_sessions,
            name="ft-parameter-server",
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            daemon=True,
            name="ft-parameter-server",
        )
        self._thread.start()
        logger.info("parameter server listening at %s", self.address())

    def address(self) -> str:
        """Where clients start a session: ``http://host:port/new_session``."""
        port = self._server.server_address[1]
        return f"http://{_bracket(self._advertise)}:{port}{_NEW_SESSION_PATH}"

    def shutdown(self) -> None:
        """Stops accepting sessions and closes open connections (sessions already inside
        ``forward`` run until it returns)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    @classmethod
    @abstractmethod
    def new_process_group(cls) -> ProcessGroup:
        """A new, not yet configured, reconfigurable process group (e.g.
        ``ft.ProcessGroupGloo(timeout=...)``)."""

    @classmethod
    def new_session(cls, address: str, timeout: timedelta = timedelta(seconds=60)) -> ProcessGroup:
        """Opens a session on the server at ``address`` and returns a group configured for it
        (this client is rank 1, the server rank 0). ``timeout`` bounds the HTTP request (ft
        addition; the group's own timeout bounds its configure)."""
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as resp:
            data = json.loads(resp.read().decode())
        session_id, store_addr = data["session_id"], data["store_addr"]
        logger.info("joining parameter-server session %s at %s", session_id, store_addr)
        pg = cls.new_process_group()
        pg.configure(store_addr, replica_id="0", rank=1, world_size=2)
        return pg

    def _handle_session(self, session_id: str, store_addr: str) -> None:
        pg = self.new_process_group()
        try:
            pg.configure(store_addr, replica_id="0", rank=0, world_size=2)
            self.forward(session_id, pg)
        except Exception:  # noqa: BLE001 - one failed session must not stop the server
            logger.exception("parameter-server session %s failed", session_id)
        finally:
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                logger.debug("shutting session %s's group down failed", session_id, exc_info=True)

    @abstractmethod
    def forward(self, session_id: str, pg: ProcessGroup) -> None:
        """Serves one session, on its own thread (loop inside for several ops). The server is
        rank 0 of ``pg``, the client rank 1."""
