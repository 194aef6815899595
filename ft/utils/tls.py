"""Optional TLS for ft's gRPC and HTTP traffic (stdlib + grpcio).

The job secret (ft.utils.auth) authenticates every request and every checkpoint, so a peer
without it can neither take part nor feed a replica weights. It does not hide what is said:
without TLS anyone on the path can read the quorum traffic and the model's bytes. TLS adds
that privacy, and integrity of the bulk bytes against an on-path attacker (docs/security.md).

One configuration serves both ends, since every replica is a server and a client:

* ``cert_file`` / ``key_file``: this host's certificate chain and key (PEM). Servers need them.
* ``ca_file``: the CA that signed the job's certificates; clients verify servers against it.
* ``server_name``: the name clients expect in server certificates, when it differs from the
  address they dial (e.g. one certificate for the whole job).

Settings: ``tls=TLSConfig(...)`` where a component takes it, or the environment:
``FT_TLS_CERT_FILE``, ``FT_TLS_KEY_FILE``, ``FT_TLS_CA_FILE``, ``FT_TLS_SERVER_NAME``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

__all__ = [
    "TLSConfig",
    "resolve_tls",
    "warn_cleartext",
    "CERT_ENV",
    "KEY_ENV",
    "CA_ENV",
    "SERVER_NAME_ENV",
]

logger = logging.getLogger("ft.tls")

CERT_ENV = "FT_TLS_CERT_FILE"
KEY_ENV = "FT_TLS_KEY_FILE"
CA_ENV = "FT_TLS_CA_FILE"
SERVER_NAME_ENV = "FT_TLS_SERVER_NAME"


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"TLS {what} {path!r}: {e.strerror}") from None


@dataclass(frozen=True)
class TLSConfig:
    """TLS settings of one process (see the module docstring)."""

    cert_file: Optional[str] = None
    """PEM certificate chain this host serves with (required to serve)."""
    key_file: Optional[str] = None
    """PEM private key of ``cert_file``."""
    ca_file: Optional[str] = None
    """PEM CA bundle clients verify servers with (required to connect)."""
    server_name: Optional[str] = None
    """Name expected in server certificates, when not the dialled host."""
    _pem: Tuple[Optional[bytes], Optional[bytes], Optional[bytes]] = field(
        default=(None, None, None), repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError(
                "TLS needs both a certificate and its key (FT_TLS_CERT_FILE, FT_TLS_KEY_FILE)"
            )
        if not self.cert_file and not self.ca_file:
            raise ValueError("TLS needs a certificate and key to serve, or a CA file to connect")
        object.__setattr__(
            self,
            "_pem",
            (
                _read(self.cert_file, "certificate"),
                _read(self.key_file, "key"),
                _read(self.ca_file, "CA file"),
            ),
        )

    @property
    def can_serve(self) -> bool:
        return self.cert_file is not None

    def _need_serve(self) -> None:
        if not self.can_serve:
            raise ValueError(f"serving TLS needs a certificate and key ({CERT_ENV}, {KEY_ENV})")

    def _need_ca(self) -> None:
        if not self.ca_file:
            raise ValueError(f"connecting over TLS needs a CA file ({CA_ENV})")

    # --- gRPC ---------------------------------------------------------------------------
    def grpc_server_credentials(self):
        import grpc

        self._need_serve()
        cert, key, _ = self._pem
        return grpc.ssl_server_credentials([(key, cert)])

    def grpc_channel_credentials(self):
        import grpc

        self._need_ca()
        cert, key, ca = self._pem
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def grpc_channel_options(self) -> List[Tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    # --- HTTP ---------------------------------------------------------------------------
    def server_context(self) -> ssl.SSLContext:
        self._need_serve()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert_file, self.key_file)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        self._need_ca()
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def resolve_tls(tls: Optional[TLSConfig] = None) -> Optional[TLSConfig]:
    """``tls`` if given, else the configuration the environment names, else None (plain TCP)."""
    if tls is not None:
        return tls
    cert, key, ca = (os.environ.get(n) or None for n in (CERT_ENV, KEY_ENV, CA_ENV))
    if not (cert or key or ca):
        return None
    return TLSConfig(
        cert_file=cert,
        key_file=key,
        ca_file=ca,
        server_name=os.environ.get(SERVER_NAME_ENV) or None,
    )


_cleartext_lock = threading.Lock()
_cleartext_warned = False


def warn_cleartext(secret: Any, tls: Optional[TLSConfig], what: str) -> None:
    """Logs, once per process, a warning that a server of a job with a secret (``secret`` not
    None) serves without TLS: the secret authenticates, but hides nothing. Servers call it at
    start (the lighthouse, ManagerServers, checkpoint servers)."""
    global _cleartext_warned
    if secret is None or (tls is not None and tls.can_serve):
        return
    with _cleartext_lock:
        if _cleartext_warned:
            return
        _cleartext_warned = True
    logger.warning(
        "%s serves without TLS: the job secret authenticates every request, but the model's "
        "weights and the job's requests travel in clear, readable by anyone on the network "
        "path. Set %s and %s (and %s on clients) to encrypt them (docs/security.md, \"TLS\").",
        what,
        CERT_ENV,
        KEY_ENV,
        CA_ENV,
    )
