"""Signing in to the lighthouse dashboard without sending the job secret (stdlib only).

The job secret signs the whole job (gRPC calls, checkpoints, store values), so it never goes to
the dashboard. An operator on a host that holds the secret runs::

    python -m ft.utils.dashboard_login http://lighthouse:29511

which prints a *login link*, ``http://lighthouse:29511/#login=<ticket>``. The ticket is::

    v1.<unix ms>.<nonce: 32 hex>.<HMAC(k_login, "v1\\nft-dashboard-login\\n<ms>\\n<nonce>\\n")>

with ``k_login = JobSecret.key("dashboard-login")``: made from the secret, it reveals nothing of
it, and the dashboard accepts it once, within :data:`LOGIN_TICKET_TTL_S` of when it was made.
The page (ft/coordination/dashboard/index.html) reads the ticket from the link's fragment (which
the browser does not send), removes it from the address bar, and exchanges it (``POST
/api/login``) for a session cookie::

    ft_session = s1.<expiry unix s>.<session id: 32 hex>.<HMAC(k_session, "s1", expiry, id)>

``k_session = JobSecret.key("dashboard-session")``, or a random key per lighthouse life when
the lighthouse has no secret (only an operator ``auth_token``). The cookie is ``HttpOnly``,
``SameSite=Strict``, expires after :data:`SESSION_TTL_S` (``Secure`` when the dashboard serves
HTTPS). Both keys are keys of their own purpose: neither the ticket nor the cookie can sign a
gRPC call, a checkpoint request or a store value (tests/security/test_dashboard_login.py).

Scripts do the same exchange (``curl -c jar`` on ``/api/login``, then ``curl -b jar``), or send
the operator token, ``Authorization: Bearer <auth_token>``, where one is configured.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import secrets as _secrets
import sys
import threading
import time
from typing import Optional

from .auth import AuthError, JobSecret, Signer, Verifier, resolve_secret, SECRET_FILE_ENV

__all__ = [
    "DASHBOARD_LOGIN_PURPOSE",
    "DASHBOARD_SESSION_PURPOSE",
    "LOGIN_TICKET_TTL_S",
    "SESSION_TTL_S",
    "SESSION_COOKIE",
    "login_ticket",
    "login_url",
    "DashboardSessions",
    "main",
]

DASHBOARD_LOGIN_PURPOSE = "dashboard-login"  # the key login tickets are signed with
DASHBOARD_SESSION_PURPOSE = "dashboard-session"  # the key session cookies are signed with
# A login ticket is accepted once, at most this long after it was made (time to paste a link).
LOGIN_TICKET_TTL_S = 300.0
# A session lasts this long; then the page asks for a new login link.
SESSION_TTL_S = 8 * 3600
SESSION_COOKIE = "ft_session"
_TICKET_WHAT = "ft-dashboard-login"
_SESSION_VERSION = "s1"


def login_ticket(secret: JobSecret) -> str:
    """A fresh login ticket (see the module docstring): one sign-in, within 5 minutes."""
    return Signer(secret, DASHBOARD_LOGIN_PURPOSE).sign(_TICKET_WHAT)


def login_url(dashboard: str, secret: JobSecret) -> str:
    """``dashboard``'s page with a fresh ticket in its fragment (never sent by a browser)."""
    return f"{dashboard.rstrip('/')}/#login={login_ticket(secret)}"


class DashboardSessions:
    """The dashboard's side: turns a login ticket (or the operator token) into a session
    cookie, and checks session cookies. Thread-safe."""

    def __init__(self, secret: Optional[JobSecret], auth_token: Optional[str] = None) -> None:
        self._tickets = (
            Verifier(secret, DASHBOARD_LOGIN_PURPOSE, max_skew_s=LOGIN_TICKET_TTL_S)
            if secret is not None
            else None
        )
        self._key = (
            secret.key(DASHBOARD_SESSION_PURPOSE)
            if secret is not None
            else _secrets.token_bytes(32)
        )
        self._token = auth_token.encode("utf-8", "surrogateescape") if auth_token else None
        self._lock = threading.Lock()

    @property
    def required(self) -> bool:
        """Whether the dashboard has a credential configured at all."""
        return self._tickets is not None or self._token is not None

    def check_token(self, presented: bytes) -> bool:
        """Whether ``presented`` is the operator token (compared in constant time)."""
        if self._token is None or not presented:
            return False
        return hmac.compare_digest(presented, self._token)

    def login(self, credential: str) -> str:
        """A new session cookie's value for a valid login ticket or operator token; raises
        :class:`AuthError` saying why not."""
        credential = credential.strip()
        if credential.startswith("v1.") and self._tickets is not None:
            self._tickets.verify(_TICKET_WHAT, b"", credential)
        elif not self.check_token(credential.encode("utf-8", "surrogatepass")):
            if self._tickets is None:
                raise AuthError("not the dashboard's operator token")
            raise AuthError(
                "not a login ticket: make a login link with python -m ft.utils.dashboard_login "
                "on a host that holds the job secret"
            )
        return self.new_session()

    def new_session(self, ttl_s: float = SESSION_TTL_S) -> str:
        expires = int(time.time() + ttl_s)
        sid = _secrets.token_hex(16)
        return f"{_SESSION_VERSION}.{expires}.{sid}.{self._mac(expires, sid)}"

    def _mac(self, expires: int, sid: str) -> str:
        msg = f"{_SESSION_VERSION}\n{expires}\n{sid}".encode()
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest()

    def check_session(self, value: str) -> bool:
        """Whether ``value`` is a session cookie this dashboard made that has not expired."""
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != _SESSION_VERSION or not parts[1].isdigit():
            return False
        if len(parts[1]) > 12 or len(parts[2]) != 32 or not value.isascii():
            return False
        if not hmac.compare_digest(self._mac(int(parts[1]), parts[2]), parts[3]):
            return False
        return int(parts[1]) > time.time()


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ft.utils.dashboard_login",
        description="Print a login link for the lighthouse dashboard: valid once, for "
        f"{LOGIN_TICKET_TTL_S / 60:.0f} minutes. The job secret stays on this host.",
    )
    p.add_argument(
        "dashboard",
        nargs="?",
        help="the dashboard's URL (e.g. http://lighthouse:29511); without it, print the "
        "ticket alone (paste it into the page's sign-in prompt)",
    )
    p.add_argument("--secret_file", help=f"the job secret's file (default: env {SECRET_FILE_ENV})")
    args = p.parse_args(argv)
    try:
        secret = resolve_secret(None) if not args.secret_file else None
        if args.secret_file:
            from .auth import _read_secret_file

            secret = _read_secret_file(args.secret_file)
    except ValueError as e:
        print(f"dashboard_login: {e}", file=sys.stderr)
        return 2
    if secret is None:
        print(
            f"dashboard_login: no job secret: set {SECRET_FILE_ENV} or pass --secret_file",
            file=sys.stderr,
        )
        return 2
    print(login_url(args.dashboard, secret) if args.dashboard else login_ticket(secret))
    return 0


if __name__ == "__main__":
    sys.exit(main())
