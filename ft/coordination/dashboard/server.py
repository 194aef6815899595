"""The lighthouse dashboard's HTTP(S) server: endpoints, who may use them, and sign-in.

``DashboardServer(addr, status=..., metrics=..., kill=..., sessions=..., tls=...)`` serves:

* ``GET /``            the page (index.html);
* ``GET /healthz``, ``GET /metrics``  open to anyone (ids and numbers, never an address);
* ``GET /api/status``  the status document (managers' and stores' addresses: see below);
* ``POST /api/login``  JSON ``{"credential": <login ticket or operator token>}``: sets the
  session cookie (ft.utils.dashboard_login);
* ``POST /api/kill``   JSON ``{"replica_id": ..., "msg": ...}``: the lighthouse forwards Kill.

Credentials: the job secret itself is never one (it signs the whole job, and would cross the
network as sent). With a secret, the dashboard takes a session cookie that ``/api/login`` gives
for a login ticket made from the secret (``python -m ft.utils.dashboard_login``). An operator
token (``auth_token`` / ``FT_AUTH_TOKEN``), where configured, is taken at ``/api/login`` and as
``Authorization: Bearer <token>``. With TLS configured (``FT_TLS_*``, ft.utils.tls) the
dashboard serves HTTPS only, and the cookie is ``Secure``.
"""

from __future__ import annotations

import json
import logging
import ssl
from typing import Callable, Dict, Optional, Tuple
from urllib.parse import urlparse, urlsplit

from ...utils.auth import AuthError
from ...utils.dashboard_login import SESSION_COOKIE, SESSION_TTL_S, DashboardSessions
from ...utils.http_server import BoundedHTTPServer, BoundedRequestHandler
from ...utils.net import is_loopback

logger = logging.getLogger("ft.lighthouse")

__all__ = [
    "DashboardServer",
    "DASHBOARD_MAX_CONNECTIONS",
    "DASHBOARD_IDLE_TIMEOUT_S",
    "CSRF_HEADER",
]

# Most dashboard connections open at once. A browser holds at most 6 connections to one host
# and the page polls once a second, so 64 serve about ten open pages plus a metrics scraper;
# more are refused at once. It bounds the threads and descriptors that anyone who reaches the
# port can take (the lighthouse's gRPC side needs its descriptors).
DASHBOARD_MAX_CONNECTIONS = 64
# A dashboard connection must deliver its whole request this long after connecting (or after
# its previous answer), or it is closed. The page polls every second, so its own connection
# never idles this long, and browsers reopen a closed idle connection on their own.
DASHBOARD_IDLE_TIMEOUT_S = 10.0
# Socket timeout of each read and write once a request is in (a client that stops reading).
_DASHBOARD_IO_TIMEOUT_S = 30.0
_MAX_BODY = 64 * 1024
# Header the dashboard's page sends with every action. A page of another origin cannot send a
# custom header without a CORS preflight, which this server never approves (no OPTIONS).
CSRF_HEADER = "X-FT-Request"

StatusFn = Callable[[], dict]
KillFn = Callable[[str, str], Tuple[int, dict]]


def _hostname(hostport: str) -> str:
    """The host of a ``Host`` header value (brackets and port removed, lower case)."""
    try:
        return urlsplit("//" + hostport.strip()).hostname or ""
    except ValueError:
        return ""


def _hide_addresses(st: dict) -> None:
    """Removes every manager and store address from a status document, in place."""
    q = st.get("quorum")
    for m in q["members"] if q else ():
        m["address"] = ""
        m["store_address"] = ""
    for r in st["replicas"]:
        r["address"] = ""


def _cookie(header: str, name: str) -> Optional[str]:
    """The value of cookie ``name`` in a ``Cookie`` header (the last one named so), or None."""
    found = None
    for part in header.split(";"):
        k, sep, v = part.strip().partition("=")
        if sep and k == name:
            found = v.strip().strip('"')
    return found


def _make_handler(
    status: StatusFn,
    metrics: Callable[[], str],
    kill: KillFn,
    sessions: DashboardSessions,
    https: bool,
):
    page_cache: Dict[str, bytes] = {}

    class Handler(BoundedRequestHandler):
        """The dashboard's endpoints, and who may use them.

        Open to anyone who reaches the port: ``/`` (the page), ``/healthz``, and ``/metrics``
        (counts, ages and replica ids, never an address).

        ``GET /api/status`` lists every manager's and store's address, so:

        * with a credential configured (the job secret, or an operator ``auth_token`` /
          ``FT_AUTH_TOKEN``) it needs a session cookie from ``/api/login`` (or the operator
          token as ``Authorization: Bearer``), and answers 401, with no status, without it.
          The job secret itself is refused as a credential: it never travels;
        * with none, it is open when the dashboard listens on loopback only (whoever reaches
          it is on this host already); listening elsewhere, it answers with every address
          removed (``config.addresses_hidden``), as anyone on the network could read it.

        Actions (every POST: ``/api/login`` and ``/api/kill``) are refused with 403 and the
        reason unless the request carries ``X-FT-Request: 1`` (a page of another origin
        cannot send a custom header without a CORS preflight, which this server never
        approves) and, if it has an ``Origin``, that origin is this dashboard's own (``http``
        or ``https`` on the request's ``Host``; a reverse proxy must pass ``Host`` through).
        Their parameters come from a JSON object sent as ``Content-Type: application/json``
        only. With a credential configured, ``/api/kill`` needs it too (401).

        With no credential and a loopback listener, ``/api/`` requests must also name a
        loopback ``Host`` (an IP literal or ``localhost``), or get 403: a site whose name an
        attacker points at 127.0.0.1 (DNS rebinding) is same-origin to the browser, but its
        requests name that site.

        Every connection is bounded (ft.utils.http_server): idle ones are closed after the
        idle timeout, which also covers reading a POST's body, and beyond the connection
        cap new ones are refused at once.
        """

        server_version = "ft-lighthouse"
        protocol_version = "HTTP/1.1"
        timeout = _DASHBOARD_IO_TIMEOUT_S
        hold_idle_deadline = True  # released by do_GET at once, by do_POST after the body

        def log_message(self, fmt, *args):  # quiet
            logger.debug("http: " + fmt, *args)

        def _send(
            self, code: int, body: bytes, ctype: str, headers: Tuple[Tuple[str, str], ...] = ()
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            # Never inside another site's frame (a click there must not land on "kill").
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("Content-Security-Policy", "frame-ancestors 'none'")
            # The page's address never travels on as a referrer (a login link's ticket is
            # in its fragment, which browsers never send, but no need to find out).
            self.send_header("Referrer-Policy", "no-referrer")
            for k, v in headers:
                self.send_header(k, v)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, code: int, obj, headers: Tuple[Tuple[str, str], ...] = ()) -> None:
            self._send(code, json.dumps(obj).encode(), "application/json", headers)

        # --- who is asking ---------------------------------------------------------------

        def _credential(self) -> Optional[bool]:
            """None when no credential is configured; else whether the request presents one
            (a valid session cookie, or the operator token as a bearer credential)."""
            if not sessions.required:
                return None
            session = _cookie(self.headers.get("Cookie", ""), SESSION_COOKIE)
            if session is not None and sessions.check_session(session):
                return True
            scheme, _, got = self.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer":
                got = self.headers.get("X-FT-Token", "")
            try:
                presented = got.strip().encode("latin-1")  # the header's bytes as sent
            except UnicodeEncodeError:
                return False
            return sessions.check_token(presented)

        def _loopback_only(self) -> bool:
            return is_loopback(str(self.server.server_address[0]))

        def _rebinding(self) -> bool:
            """True for an /api/ request that a DNS-rebinding page could have made (see above)."""
            if sessions.required or not self._loopback_only():
                return False
            return not is_loopback(_hostname(self.headers.get("Host", "")))

        def _csrf_refusal(self) -> Optional[str]:
            """Why a state-changing request may come from another site's page (None: it cannot)."""
            if self.headers.get(CSRF_HEADER, "").strip() != "1":
                return (
                    f"refused: the request lacks the header {CSRF_HEADER}: 1 that the "
                    f"dashboard's page sends (a page of another site cannot send it)"
                )
            origin = self.headers.get("Origin")
            if origin is not None:
                host = self.headers.get("Host", "").strip().lower()
                if not host or origin.strip().lower() not in (f"http://{host}", f"https://{host}"):
                    return (
                        f"refused: the request comes from a page of another origin "
                        f"({origin[:200]!r}), not from this dashboard's"
                    )
            return None

        def _unauthorized(self) -> None:
            self._json(
                401,
                {
                    "error": "not signed in: open a login link (python -m "
                    "ft.utils.dashboard_login <dashboard URL>, on a host that holds the job "
                    "secret), or send the operator token as Authorization: Bearer <token>",
                    "auth_required": True,
                },
            )

        # --- GET -------------------------------------------------------------------------

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            if not self.request_read():
                return
            path = urlparse(self.path).path
            if path in ("/", "/index.html"):
                if "page" not in page_cache:
                    from . import page_html

                    page_cache["page"] = page_html().encode()
                self._send(200, page_cache["page"], "text/html; charset=utf-8")
            elif path == "/api/status":
                self._status()
            elif path == "/metrics":  # ids and numbers only: render_metrics lists no address
                self._send(200, metrics().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain")
            else:
                self._json(404, {"error": f"no such page: {path[:200]}"})

        def _status(self) -> None:
            if self._rebinding():
                self._json(
                    403,
                    {
                        "error": "refused: the Host header does not name this host "
                        "(only a loopback Host is served here)"
                    },
                )
                return
            cred = self._credential()
            if cred is False:
                self._unauthorized()
                return
            st = status()
            hidden = cred is None and not self._loopback_only()
            if hidden:
                _hide_addresses(st)
            st["config"]["auth_required"] = cred is not None
            st["config"]["addresses_hidden"] = hidden
            self._json(200, st)

        # --- POST ------------------------------------------------------------------------

        def do_POST(self):
            self.close_connection = True  # one action per connection: no leftovers to parse
            path = urlparse(self.path).path
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > _MAX_BODY or "Transfer-Encoding" in self.headers:
                self._json(
                    413,
                    {"error": f"the body must have a Content-Length of at most {_MAX_BODY} bytes"},
                )
                return
            body = self.rfile.read(length) if length else b""
            if len(body) != length or not self.request_read():
                return  # the client left, or took longer than the idle timeout to send it
            why = self._csrf_refusal()
            if why is None and self._rebinding():
                why = (
                    "refused: the Host header does not name this host (only a loopback Host "
                    "is served here)"
                )
            if why is not None:
                logger.warning(
                    "dashboard: %s %s from %s %s",
                    self.command,
                    path[:200],
                    self.client_address[0],
                    why,
                )
                self._json(403, {"error": why})
                return
            if path not in ("/api/kill", "/api/login"):
                self._json(404, {"error": f"no such endpoint: {path[:200]}"})
                return
            if self.headers.get_content_type() != "application/json":
                self._json(
                    415,
                    {
                        "error": "parameters must be a JSON object sent as "
                        "Content-Type: application/json"
                    },
                )
                return
            try:
                args = json.loads(body)
                if not isinstance(args, dict):
                    raise ValueError("the body must be a JSON object")
            except ValueError as e:
                self._json(400, {"error": f"bad JSON: {e}"})
                return
            if path == "/api/login":
                self._login(args)
                return
            cred = self._credential()
            if cred is False:
                self._unauthorized()
                return
            rid = args.get("replica_id")
            msg = args.get("msg") or "killed from the lighthouse dashboard"
            if not isinstance(rid, str) or not rid:
                self._json(400, {"error": "replica_id (a non-empty string) is required"})
                return
            if not isinstance(msg, str):
                self._json(400, {"error": "msg must be a string"})
                return
            code, result = kill(rid, msg)
            if code >= 500 and cred is None and not self._loopback_only():
                # The failure's text can name the manager's address, hidden here (see above).
                result = {"error": f"kill of {rid} failed; the lighthouse's log has the details"}
            self._json(code, result)

        def _login(self, args: dict) -> None:
            credential = args.get("credential")
            if not isinstance(credential, str) or not credential or len(credential) > 4096:
                self._json(400, {"error": "credential (a login ticket or token) is required"})
                return
            if not sessions.required:
                self._json(
                    409, {"error": "this dashboard needs no sign-in (no credential is configured)"}
                )
                return
            try:
                session = sessions.login(credential)
            except AuthError as e:
                logger.warning("dashboard: sign-in from %s refused: %s", self.client_address[0], e)
                self._json(401, {"error": f"sign-in refused: {e}", "auth_required": True})
                return
            cookie = (
                f"{SESSION_COOKIE}={session}; Path=/; Max-Age={SESSION_TTL_S}; HttpOnly; "
                f"SameSite=Strict" + ("; Secure" if https else "")
            )
            logger.info("dashboard: signed in from %s", self.client_address[0])
            self._json(
                200, {"signed_in": True, "expires_in_s": SESSION_TTL_S}, (("Set-Cookie", cookie),)
            )

    return Handler


class DashboardServer(BoundedHTTPServer):
    """The dashboard's server: a thread per connection, capped and idle-bounded, HTTPS when
    given an SSL context (ft.utils.http_server)."""

    def __init__(
        self,
        addr: Tuple[str, int],
        *,
        status: StatusFn,
        metrics: Callable[[], str],
        kill: KillFn,
        sessions: DashboardSessions,
        ssl_context: Optional[ssl.SSLContext] = None,
        family: Optional[int] = None,
        idle_timeout_s: float = DASHBOARD_IDLE_TIMEOUT_S,
        max_connections: int = DASHBOARD_MAX_CONNECTIONS,
    ) -> None:
        super().__init__(
            addr,
            _make_handler(status, metrics, kill, sessions, https=ssl_context is not None),
            family=family,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
            name="ft-lighthouse-http",
            ssl_context=ssl_context,
        )
