"""The job secret, and what it signs (stdlib only).

One secret authenticates a job: every gRPC call to the lighthouse and to ManagerServers, every
checkpoint request and every checkpoint a source serves, the same-host heal socket, and the
dashboard's actions. Nothing that knows only an address can take part (docs/security.md;
summary: docs/design.md, "Threat model").

Where the secret comes from, in order: an explicit ``secret=`` argument; the file named by
``FT_JOB_SECRET_FILE``; ``FT_JOB_SECRET``. It is kept in memory only, never logged (its
``repr`` hides it), and never sent: requests carry an HMAC over what they say, bound to a time
and a nonce, so a captured request cannot be replayed and nothing a peer receives lets it speak
for the job.

Request signature (HTTP: ``Authorization: FT-HMAC <token>``; gRPC: a leading field of the
request message, see below)::

    token = "v1.<unix ms>.<nonce: 32 hex>.<hex HMAC-SHA256(k, "v1\\n<what>\\n<ms>\\n<nonce>\\n" + body)>"

where ``k`` is a key derived from the secret for one purpose (gRPC, checkpoint requests,
checkpoint content), ``what`` names the request (the gRPC method, or the HTTP path and query),
and ``body`` is the serialized request. A verifier accepts a token once, within
``FT_AUTH_MAX_SKEW_S`` (default 120 s) of its own clock.

On gRPC the signature is also bound to the server it is meant for: every server life draws a
random *server id* (:func:`new_server_id`), a client learns it before it signs (the unsigned
``SERVER_ID_METHOD`` call, whose answer the server signs over the client's challenge and its
name), and the token carries it (``v2``)::

    token = "v2.<unix ms>.<nonce>.<server id: 32 hex>.<HMAC(k, "v2\\n<method>\\n<server id>\\n<ms>\\n<nonce>\\n" + body)>"

A server accepts only tokens made for its own id, so a request captured on its way to one
server is refused by every other one, and by the same one after it restarted (a new life, a new
id), which forgot the nonces it had seen (docs/security.md, "Bound to one server").

On gRPC the token travels inside the request message, as a length-delimited field numbered
``AUTH_FIELD_NUMBER`` placed ahead of the request's own fields (``body`` is the bytes after it).
A server that does not know the field (torchft's) skips it as unknown; ft's servers take it off
before anything parses the request. Why not gRPC metadata: a header value that changes on every
request cannot be indexed by HPACK, and carrying it cost more than signing it did
(docs/benchmarks.md, "Authentication").

Serving without a secret is allowed on loopback only; elsewhere it needs ``insecure=True`` (or
``FT_INSECURE=1``), and every start logs a warning that says what that gives up.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import logging
import os
import secrets as _secrets
import stat
import threading
import time
from collections import deque
from typing import Deque, Dict, Optional, Tuple, Union

from .net import is_loopback

logger = logging.getLogger("ft.auth")

__all__ = [
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "INSECURE_ENV",
    "AUTH_FIELD_NUMBER",
    "HTTP_SCHEME",
    "GRPC_PURPOSE",
    "SERVER_ID_METHOD",
    "OTHER_SERVER",
    "NO_SERVER_ID",
    "LIGHTHOUSE_SERVER_NAME",
    "manager_server_name",
    "new_server_id",
    "CHECKPOINT_REQUEST_PURPOSE",
    "CHECKPOINT_CONTENT_PURPOSE",
    "SAME_HOST_PURPOSE",
    "STORE_PURPOSE",
    "StoreValues",
    "SecretLike",
    "AuthError",
    "InsecureServerError",
    "JobSecret",
    "Signer",
    "Verifier",
    "resolve_secret",
    "split_signed",
    "resolve_insecure",
    "check_exposure",
]

SECRET_ENV = "FT_JOB_SECRET"
SECRET_FILE_ENV = "FT_JOB_SECRET_FILE"
INSECURE_ENV = "FT_INSECURE"
MAX_SKEW_ENV = "FT_AUTH_MAX_SKEW_S"
# The gRPC request field that carries the signature (no torchft message uses numbers this high).
AUTH_FIELD_NUMBER = 8001
HTTP_SCHEME = "FT-HMAC"

# What a key is for (JobSecret.key): a signature made for one cannot pass for another.
GRPC_PURPOSE = "grpc"  # requests to the lighthouse and ManagerServers
CHECKPOINT_REQUEST_PURPOSE = "ckpt-request"  # a healer's requests to a checkpoint source
CHECKPOINT_CONTENT_PURPOSE = "ckpt-content"  # a source's metadata and range checksums
SAME_HOST_PURPOSE = "same-host"  # requests on the same-host heal socket
STORE_PURPOSE = "store"  # what ft writes to a group's TCPStore (StoreValues)

# The one gRPC method that is not signed: it tells a client the server's id (and name), signed
# over the client's challenge (Verifier.answer_server_id, Signer.check_server_id_answer). It is
# no method of torchft's services: only ft's clients with a secret call it.
SERVER_ID_METHOD = "/ft.Auth/ServerId"
# What a server's refusal of a signature made for another server id says (clients that read it
# ask the server for its id again and resend once).
OTHER_SERVER = "signed for another server"
# The server id a client signs for when the server does not authenticate (no secret, or
# torchft's): no server that checks signatures ever has it.
NO_SERVER_ID = "0" * 32
# The names servers prove in their server-id answer; a client that knows whom it calls checks it.
LIGHTHOUSE_SERVER_NAME = "lighthouse"

# Shorter secrets are refused: 16 bytes is the least that a brute force cannot reach.
MIN_SECRET_BYTES = 16
# Clocks of the hosts of one job agree to within this (NTP keeps them far closer); a token
# older or newer than this is refused, and nonces are remembered for as long.
DEFAULT_MAX_SKEW_S = 120.0
# A verifier remembers at most this many nonces; beyond it the oldest are forgotten early and
# tokens as old as they are refused (only signed requests add nonces, so only a member of the
# job, sending 10k requests a second for minutes, could reach it).
MAX_REMEMBERED_NONCES = 1 << 21
_VERSION = "v1"  # tokens bound by ``what`` alone (HTTP: the address the client dialled)
_BOUND_VERSION = "v2"  # tokens bound to one server life (gRPC: its server id)
# Tokens are ~115 (v1) or ~150 (v2) bytes; a longer field is not a signature (refused as malformed).
_MAX_TOKEN_BYTES = 255


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# The auth field's key on the wire: field AUTH_FIELD_NUMBER, wire type 2 (length-delimited).
_AUTH_TAG = _varint((AUTH_FIELD_NUMBER << 3) | 2)
_MALFORMED = "\x01malformed"  # what split_signed reports for a broken field; never verifies


def split_signed(data: bytes) -> Tuple[bytes, str]:
    """``(request, token)``: the request bytes after a leading auth field and the token it
    carries, or ``(data, "")`` when there is none. A broken field (its length too long, or past
    the end) gives a token that no verifier accepts."""
    if not data.startswith(_AUTH_TAG):
        return data, ""
    pos, length = len(_AUTH_TAG), 0
    for shift in (0, 7):
        if pos >= len(data):
            return data, _MALFORMED
        b = data[pos]
        pos += 1
        length |= (b & 0x7F) << shift
        if not b & 0x80:
            if length > _MAX_TOKEN_BYTES or pos + length > len(data):
                return data, _MALFORMED
            try:
                token = data[pos : pos + length].decode("ascii")
            except UnicodeDecodeError:  # tokens are ASCII; anything else is not one of ours
                return data, _MALFORMED
            return data[pos + length :], token
    return data, _MALFORMED


class AuthError(PermissionError):
    """A request without a valid signature, or content whose signature does not match."""


class InsecureServerError(ValueError):
    """A server would listen beyond loopback with no secret, and insecure mode was not asked for."""


class JobSecret:
    """The job's shared secret. Its bytes never appear in a repr, a log line or a pickle."""

    __slots__ = ("_secret", "_keys", "source")

    def __init__(self, secret: Union[str, bytes], source: str = "argument") -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        raw = raw.strip()
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the job secret from {source} is {len(raw)} bytes; at least {MIN_SECRET_BYTES} "
                f"are required (make one with: python -m ft.utils.new_secret)"
            )
        self._secret = raw
        self._keys: Dict[str, bytes] = {}
        self.source = source

    @classmethod
    def generate(cls) -> "JobSecret":
        return cls(_secrets.token_hex(32), source="generated")

    def key(self, purpose: str) -> bytes:
        """A key for one purpose, so that a signature for one use is worthless for another."""
        k = self._keys.get(purpose)
        if k is None:
            k = hmac.new(self._secret, b"ft-key\n" + purpose.encode(), hashlib.sha256).digest()
            self._keys[purpose] = k
        return k

    def export(self) -> str:
        """The secret as text, to hand to a child process (environment or file), never to a log."""
        return self._secret.decode("utf-8", "surrogateescape")

    def __repr__(self) -> str:
        return f"JobSecret(<hidden>, from {self.source})"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("a JobSecret is not picklable: pass it through FT_JOB_SECRET_FILE instead")


SecretLike = Union[None, str, bytes, JobSecret]


def _read_secret_file(path: str) -> JobSecret:
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(
            f"{SECRET_FILE_ENV}={path!r}: cannot read the job secret: {e.strerror}"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning(
            "the job secret file %s can be read by other users (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(st.st_mode),
        )
    return JobSecret(data, source=f"{SECRET_FILE_ENV}={path}")


def resolve_secret(secret: SecretLike = None) -> Optional[JobSecret]:
    """``secret`` if given, else the one the environment names, else None (no authentication)."""
    if isinstance(secret, JobSecret):
        return secret
    if secret:
        return JobSecret(secret)
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return _read_secret_file(path)
    env = os.environ.get(SECRET_ENV)
    if env:
        return JobSecret(env, source=SECRET_ENV)
    return None


def resolve_insecure(insecure: Optional[bool] = None) -> bool:
    if insecure is not None:
        return bool(insecure)
    return os.environ.get(INSECURE_ENV, "").strip().lower() in ("1", "true", "yes")


def check_exposure(
    host: str, secret: Optional[JobSecret], insecure: Optional[bool], what: str
) -> None:
    """Refuses to serve ``what`` beyond loopback without a secret, unless insecure mode is on.

    ``host`` is the address the server binds ("" / "::" / "0.0.0.0" mean every interface).
    Insecure mode logs a warning at every start, naming what it gives up.
    """
    if secret is not None or is_loopback(host):
        return
    where = host or "every interface"
    if resolve_insecure(insecure):
        logger.warning(
            "%s serves on %s WITHOUT AUTHENTICATION (insecure mode): anyone who can reach it can "
            "join or stop the job, stop its groups, and read or replace its weights. Set %s or %s "
            "to authenticate (docs/security.md).",
            what,
            where,
            SECRET_FILE_ENV,
            SECRET_ENV,
        )
        return
    raise InsecureServerError(
        f"{what}: refusing to serve on {where} without a job secret: anyone who can reach it could "
        f"join or stop the job and read or replace its weights. Set {SECRET_FILE_ENV} (a file "
        f"holding the secret) or {SECRET_ENV}, or bind a loopback address, or pass insecure=True "
        f"(--insecure, {INSECURE_ENV}=1) to accept that (docs/security.md)."
    )


def _max_skew_s() -> float:
    try:
        return float(os.environ.get(MAX_SKEW_ENV, DEFAULT_MAX_SKEW_S))
    except ValueError:
        return DEFAULT_MAX_SKEW_S


def manager_server_name(replica_id: str) -> str:
    """The name a replica group's ManagerServer proves in its server-id answer."""
    return f"manager:{replica_id}"


def new_server_id() -> str:
    """A server life's id: 128 random bits as 32 hex characters (never ``NO_SERVER_ID``)."""
    while True:
        sid = _secrets.token_hex(16)
        if sid != NO_SERVER_ID:
            return sid


def _is_server_id(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)


def _mac(
    key: bytes, what: str, ms: str, nonce: str, body: bytes, server_id: Optional[str] = None
) -> str:
    # hmac.new, not the one-shot hmac.digest: the one-shot call releases the GIL around the
    # hash, and taking it back can wait on another thread (a gRPC poller) for far longer than
    # hashing a request takes.
    head = (
        f"{_VERSION}\n{what}\n{ms}\n{nonce}\n"
        if server_id is None
        else f"{_BOUND_VERSION}\n{what}\n{server_id}\n{ms}\n{nonce}\n"
    )
    h = hmac.new(key, head.encode(), hashlib.sha256)
    if body:
        h.update(body)
    return h.hexdigest()


class _Nonces:
    """Nonces unique across processes without a system call each: a random 64-bit prefix per
    process (drawn again in a forked child, which would otherwise repeat its parent's) and a
    counter. They need not be unpredictable: the signature covers them, and a verifier only
    refuses one it has seen."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._prefix = _secrets.token_hex(8)
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter) & 0xFFFFFFFFFFFFFFFF:016x}"


_nonces = _Nonces()


class Signer:
    """Makes request tokens for one purpose. Thread-safe."""

    __slots__ = ("_key",)

    def __init__(self, secret: JobSecret, purpose: str) -> None:
        self._key = secret.key(purpose)

    def sign(self, what: str, body: bytes = b"", server_id: Optional[str] = None) -> str:
        """A token for ``what`` and ``body``; with ``server_id``, bound to that server life
        (``v2``, what gRPC servers require)."""
        ms = str(int(time.time() * 1000))
        nonce = _nonces.next()
        if server_id is None:
            return f"{_VERSION}.{ms}.{nonce}.{_mac(self._key, what, ms, nonce, body)}"
        mac = _mac(self._key, what, ms, nonce, body, server_id)
        return f"{_BOUND_VERSION}.{ms}.{nonce}.{server_id}.{mac}"

    def sign_request(self, what: str, body: bytes, server_id: str) -> bytes:
        """``body`` (a serialized gRPC request for method ``what``, to the server whose id is
        ``server_id``) with its signature in a leading auth field (:func:`split_signed` takes
        it apart)."""
        token = self.sign(what, body, server_id).encode("ascii")
        return _AUTH_TAG + _varint(len(token)) + token + body

    def check_server_id_answer(
        self, answer: bytes, challenge: str, expected_name: Optional[str] = None
    ) -> Tuple[str, str]:
        """``(name, server id)`` from a server's answer to ``SERVER_ID_METHOD`` (see
        :meth:`Verifier.answer_server_id`). Raises :class:`AuthError` when the answer is not
        signed with this job's secret over ``challenge``, or names another server than
        ``expected_name`` (when given)."""
        try:
            fields = json.loads(answer.decode("utf-8"))
            name, sid, mac = fields["name"], fields["id"], fields["mac"]
            ok = isinstance(name, str) and isinstance(sid, str) and isinstance(mac, str)
        except (ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok or not _is_server_id(sid):
            raise AuthError("malformed server-id answer (not an ft server?)")
        if not hmac.compare_digest(_server_id_mac(self._key, name, sid, challenge), mac):
            raise AuthError(
                "the server's id is not signed with this client's job secret (a different job "
                "secret: another job's server, or a wrong secret here)"
            )
        if expected_name is not None and name != expected_name:
            raise AuthError(f"the server is {name!r}, not {expected_name!r}")
        return name, sid

    @property
    def key(self) -> bytes:
        """The purpose's key, for the native client that signs in C++ (it stays in process)."""
        return self._key

    def mac(self, *parts: bytes) -> bytes:
        """A plain HMAC over ``parts`` (for signed content; the other end calls :meth:`check`)."""
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.digest()

    def check(self, mac: bytes, *parts: bytes) -> bool:
        """True when ``mac`` is :meth:`mac` of ``parts`` (compared in constant time)."""
        return hmac.compare_digest(self.mac(*parts), mac)


def _server_id_mac(key: bytes, name: str, server_id: str, challenge: str) -> str:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in (
        b"ft-server-id",
        name.encode("utf-8", "surrogateescape"),
        server_id.encode(),
        challenge.encode("utf-8", "surrogateescape"),
    ):
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


class Verifier:
    """Checks request tokens for one purpose: signature, age, and that no nonce is used twice.

    With a ``server_id`` (a gRPC server's life, :func:`new_server_id`) it accepts only tokens
    bound to that id (``v2``); without, only ``v1`` tokens, bound by ``what`` alone.

    Contract: :meth:`verify` raises :class:`AuthError` with a reason that names the problem
    (missing, malformed, expired, replayed, bad signature, signed for another server) and
    never the secret; it accepts a given token at most once. Thread-safe; O(1) amortized.
    """

    def __init__(
        self,
        secret: JobSecret,
        purpose: str,
        max_skew_s: Optional[float] = None,
        server_id: Optional[str] = None,
    ) -> None:
        if server_id is not None and (not _is_server_id(server_id) or server_id == NO_SERVER_ID):
            raise ValueError("server_id must be 32 lowercase hex characters (new_server_id())")
        self.server_id = server_id
        self._key = secret.key(purpose)
        self._skew_ms = int((max_skew_s if max_skew_s is not None else _max_skew_s()) * 1000)
        self._lock = threading.Lock()
        self._seen: Dict[str, int] = {}
        self._order: Deque[Tuple[int, str]] = deque()
        self._forgotten_before_ms = 0

    def verify(self, what: str, body: bytes, token: Optional[str]) -> None:
        if not token:
            raise AuthError("no signature (the caller has no job secret)")
        if not token.isascii():  # hmac.compare_digest refuses non-ASCII text
            raise AuthError("malformed signature")
        parts = token.split(".")
        bound = self.server_id is not None
        if bound and len(parts) == 4 and parts[0] == _VERSION:
            raise AuthError(
                "signature not bound to a server (the caller runs an older ft; every process "
                "of the job must run the same version)"
            )
        if (
            len(parts) != (5 if bound else 4)
            or parts[0] != (_BOUND_VERSION if bound else _VERSION)
            or not parts[1].isdigit()
            or len(parts[1]) > 18
            or len(parts[2]) != 32
            or (bound and not _is_server_id(parts[3]))
        ):
            raise AuthError("malformed signature")
        ms, nonce, mac = parts[1], parts[2], parts[-1]
        sid = parts[3] if bound else None
        expected = _mac(self._key, what, ms, nonce, body, sid)
        if not hmac.compare_digest(expected, mac):
            raise AuthError("bad signature (a different job secret, or an altered request)")
        if bound and sid != self.server_id:
            raise AuthError(
                f"{OTHER_SERVER} (server id {sid[:8]}...), not this one ({self.server_id[:8]}...):"
                f" a request captured on its way elsewhere, or sent before this server restarted"
            )
        t = int(ms)
        now = int(time.time() * 1000)
        if abs(now - t) > self._skew_ms:
            raise AuthError(
                f"signature is {abs(now - t) / 1000:.1f}s off this host's clock "
                f"(more than {self._skew_ms / 1000:.0f}s: expired, or clocks disagree)"
            )
        with self._lock:
            self._prune(now)
            if nonce in self._seen or t < self._forgotten_before_ms:
                raise AuthError("replayed request (this signature was already used)")
            self._seen[nonce] = t
            self._order.append((t, nonce))

    def native_config(self) -> Tuple[bytes, int, int, str]:
        """(key, skew window in ms, most nonces remembered, server id): what the native gRPC
        server needs to run this same check in C++ (ft/coordination/_grpc_server). The key
        stays in this process."""
        if self.server_id is None:
            raise ValueError("the native gRPC server needs a verifier with a server_id")
        return self._key, self._skew_ms, MAX_REMEMBERED_NONCES, self.server_id

    def answer_server_id(self, name: str, challenge: str) -> bytes:
        """This server's answer to ``SERVER_ID_METHOD``: its ``name`` and id, signed over the
        client's ``challenge`` (:meth:`Signer.check_server_id_answer` checks it)."""
        if self.server_id is None:
            raise ValueError("this verifier is bound to no server")
        mac = _server_id_mac(self._key, name, self.server_id, challenge)
        return json.dumps({"name": name, "id": self.server_id, "mac": mac}).encode("utf-8")

    def _prune(self, now: int) -> None:
        cutoff = now - self._skew_ms
        order, seen = self._order, self._seen
        while order and (order[0][0] < cutoff or len(order) > MAX_REMEMBERED_NONCES):
            t, nonce = order.popleft()
            seen.pop(nonce, None)
            if t >= cutoff:  # forgotten early: refuse anything as old from now on
                self._forgotten_before_ms = max(self._forgotten_before_ms, t + 1)


_STORE_MAGIC = b"ft-signed-v1\n"


class StoreValues:
    """Signs what ft writes to a replica group's store (torch's TCPStore, which has no
    authentication) and checks it on read, so that a peer without the secret cannot make the
    group's ranks dial an address of its choosing.

    A sealed value is ``"ft-signed-v1\\n<scope>\\n<hex HMAC>\\n<value>"``, the HMAC (the
    ``STORE_PURPOSE`` key) over the scope, the key and the value. ``scope`` names the store and
    the attempt the value was written for (``"<store host:port>/<attempt>"``): every rank of a
    group computes the same one, and a value copied from another group's store or an earlier
    attempt names another. :meth:`open` raises :class:`AuthError` for a value that is unsigned,
    altered, signed with another secret, or signed for another scope. Without a secret, values
    go as they are (the wire of torchft's keys).
    """

    def __init__(self, secret: Optional[JobSecret], scope: str) -> None:
        if "\n" in scope:
            raise ValueError("a store scope is one line")
        self._key = secret.key(STORE_PURPOSE) if secret is not None else None
        self.scope = scope

    def _mac(self, scope: bytes, key: str, value: bytes) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        for p in (scope, key.encode("utf-8", "surrogateescape"), value):
            h.update(len(p).to_bytes(8, "little"))
            h.update(p)
        return h.hexdigest().encode("ascii")

    def seal(self, key: str, value: Union[str, bytes]) -> bytes:
        """``value`` as it goes into the store under ``key``."""
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        if self._key is None:
            return data
        scope = self.scope.encode("utf-8", "surrogateescape")
        return _STORE_MAGIC + scope + b"\n" + self._mac(scope, key, data) + b"\n" + data

    def open(self, key: str, data: bytes) -> bytes:
        """The value read from the store under ``key``, once its signature checks."""
        if self._key is None:
            return data
        where = f"store key {key!r} (store {self.scope})"
        if not data.startswith(_STORE_MAGIC):
            raise AuthError(
                f"{where}: the value is not signed with the job secret: written by a peer "
                f"without it (forged), or by a rank of this group that has no {SECRET_FILE_ENV}"
            )
        parts = data[len(_STORE_MAGIC) :].split(b"\n", 2)
        if len(parts) != 3:
            raise AuthError(f"{where}: malformed signed value")
        scope, mac, value = parts
        if not hmac.compare_digest(self._mac(scope, key, value), mac):
            raise AuthError(f"{where}: bad signature (a different job secret, or an altered value)")
        if scope.decode("utf-8", "surrogateescape") != self.scope:
            raise AuthError(
                f"{where}: the value was signed for store {scope.decode('utf-8', 'replace')!r}: "
                f"copied from another group's store or an earlier attempt (or this group's "
                f"ranks disagree on MASTER_ADDR / MASTER_PORT)"
            )
        return value
