"""gRPC plumbing shared by the coordination servers and clients (internal)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Optional, Tuple

import grpc

from ..utils.deadline import Deadline, Timeout, to_seconds

if TYPE_CHECKING:
    from ..utils.tls import TLSConfig

try:
    from . import _grpc_server as native
except ImportError:  # not built (no gRPC C++ on the build machine)
    native = None

# A client's transport when it is built with transport="auto": "native" or "grpcio".
CLIENT_TRANSPORT_ENV = "FT_CLIENT_TRANSPORT"
# "0" turns off the native client's call streams (Quorum calls as messages of one long-lived
# call, ft.coordination.clients._CallStream): every Quorum is then a call of its own. For a
# proxy between clients and lighthouse that does not carry long-lived streams.
CALL_STREAMS_ENV = "FT_CLIENT_CALL_STREAMS"


# Servers refuse requests larger than this (RESOURCE_EXHAUSTED); clients accept answers up to it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# String fields that name things (replica ids, addresses) must be shorter than this.
MAX_NAME_LEN = 1024
# Largest rank / world size accepted.
MAX_RANK = 1 << 20
# A deadline further away than this is treated as "no deadline" (gRPC reports ~9.2e18 s).
NO_DEADLINE_S = 1e9
# A server answers this much (at most a tenth of the time left) before the caller's deadline,
# so that its explanation (which rank is missing, ...) reaches the caller before the caller's
# own deadline turns it into a bare DEADLINE_EXCEEDED.
ANSWER_MARGIN_S = 0.05

# Client keepalive period; servers accept pings twice as often.
KEEPALIVE_TIME_MS = 5000

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect quickly after a server restart instead of gRPC's default 1 s..120 s backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_retries", 0),
    # Notice a dead peer within ~10 s even while a call waits with nothing to send (a partition
    # sends no RST): ping every 5 s, give up on the connection 5 s after an unanswered ping.
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings (the default policy answers pings more often than
    # every 5 minutes with GOAWAY "too_many_pings").
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]


# Failures of the connection rather than of the request: a refused, reset or dropped connection
# (UNAVAILABLE), or a stream torn down mid-call (CANCELLED by the transport, UNKNOWN "Stream
# removed"). Clients retry these until their deadline (docs/design.md, "Network faults").
TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


class CoordinationError(RuntimeError):
    """An RPC failed with a gRPC status other than DEADLINE_EXCEEDED."""

    def __init__(self, code: grpc.StatusCode, details: str, method: str = "") -> None:
        self.code = code
        self.details = details
        self.method = method
        super().__init__(
            f"{method}: {code.name}: {details}" if method else f"{code.name}: {details}"
        )


def required_seconds(timeout: Optional[Timeout], what: str) -> float:
    """A call's timeout in seconds; every coordination call needs one (an RPC without a
    deadline could wait forever on a peer that is gone)."""
    s = to_seconds(timeout)
    if s is None:
        raise ValueError(f"{what}: a timeout is required")
    return s


def grpc_target(addr: str) -> str:
    """'http://host:port' / 'host:port' / '[::1]:port' -> a gRPC target string."""
    for scheme in ("http://", "https://", "grpc://"):
        if addr.startswith(scheme):
            addr = addr[len(scheme) :]
            break
    return addr.rstrip("/")


def advertised_host(bind_host: str, hostname: Optional[str] = None) -> str:
    """The host peers should dial for a server bound to ``bind_host``."""
    if hostname:
        return hostname
    if bind_host in ("", "0.0.0.0", "::", "[::]", "*"):
        return socket.gethostname()
    return bind_host.strip("[]")


def make_channel(addr: str, tls: Optional["TLSConfig"] = None) -> grpc.Channel:
    if tls is not None:
        return grpc.secure_channel(
            grpc_target(addr),
            tls.grpc_channel_credentials(),
            options=CHANNEL_OPTIONS + tls.grpc_channel_options(),
        )
    return grpc.insecure_channel(grpc_target(addr), options=CHANNEL_OPTIONS)


def client_transport(transport: str, tls: bool) -> str:
    """ "native" or "grpcio": what a client built with ``transport`` uses for its unary calls.

    ``"auto"`` reads ``FT_CLIENT_TRANSPORT`` (default auto: native when built). The native
    client has no TLS: a TLS client uses grpcio, as a TLS server does.
    """
    if transport == "auto":
        transport = os.environ.get(CLIENT_TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if transport not in ("auto", "native", "grpcio"):
        raise ValueError(
            f"client transport must be 'auto', 'native' or 'grpcio', got {transport!r}"
            f" (argument or {CLIENT_TRANSPORT_ENV})"
        )
    if transport == "native":
        if native is None:
            raise RuntimeError(
                "the native gRPC client (ft.coordination._grpc_server) is not built: build ft "
                "on a machine with gRPC C++ (e.g. apt-get install libgrpc++-dev), or use "
                "transport='grpcio'"
            )
        if tls:
            raise ValueError("the native gRPC client does not do TLS; use transport='grpcio'")
    return "native" if transport != "grpcio" and native is not None and not tls else "grpcio"


def call_streams_enabled() -> bool:
    """Whether native clients carry calls on call streams (``FT_CLIENT_CALL_STREAMS``, default
    on; "0", "false", "no" or "off" turn them off)."""
    value = os.environ.get(CALL_STREAMS_ENV, "").strip().lower()
    return value not in ("0", "false", "no", "off")


def make_native_channel(addr: str, signing_key: bytes = b""):
    """A native (gRPC C++) channel with the options of :func:`make_channel`; with a
    ``signing_key`` (ft.utils.auth.Signer.key) it signs every request it sends."""
    return native.Channel(grpc_target(addr), CHANNEL_OPTIONS, signing_key)


# The native client's status codes (gRPC's integers) as grpcio's enum.
_STATUS_BY_VALUE = {s.value[0]: s for s in grpc.StatusCode}


# How torchft's Rust client words a missed deadline (its gRPC status as tonic prints it).
# ft's message says more (which call, what it waited for) and ends with this phrase, so code
# written against torchft that matches on it keeps working.
TORCHFT_TIMEOUT_PHRASE = 'status: Cancelled, message: "Timeout expired"'


def deadline_exceeded(method: str, details: str) -> TimeoutError:
    """The error of a call that missed its deadline: names the call and why, in ft's words
    and, last, in torchft's."""
    return TimeoutError(f"{method}: deadline exceeded: {details} ({TORCHFT_TIMEOUT_PHRASE})")


def status_error(code: grpc.StatusCode, details: str, method: str) -> BaseException:
    """A call's failure -> TimeoutError (missed deadline) or CoordinationError."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return deadline_exceeded(method, details)
    return CoordinationError(code, details, method)


def translate(err: grpc.RpcError, method: str) -> BaseException:
    """A client-side RpcError -> TimeoutError (missed deadline) or CoordinationError."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    return status_error(code, details, method)


def native_status(err: BaseException) -> Tuple[grpc.StatusCode, str]:
    """(code, details) of the native client's CallError."""
    code, details = err.args
    return _STATUS_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN), details


def wait_ready(channel: grpc.Channel, addr: str, timeout: float) -> None:
    """Blocks until the channel is connected, or raises TimeoutError."""
    ready = grpc.channel_ready_future(channel)
    try:
        ready.result(timeout=max(timeout, 0.0))
    except grpc.FutureTimeoutError:
        # Stop its polling thread now: it would otherwise outlive a channel closed meanwhile.
        ready.cancel()
        raise TimeoutError(f"could not connect to {addr} within {timeout:.3f}s") from None


# close_channel() waits at most this long for grpcio's connectivity poller to stop: with nothing
# subscribed it stops after its current 0.2 s watch.
POLLER_STOP_TIMEOUT_S = 0.5


def close_channel(channel: grpc.Channel) -> None:
    """Closes a grpcio channel once grpcio's connectivity poller is done with it.

    Why: ``channel_ready_future`` (:func:`wait_ready`) starts a grpcio thread that polls the
    channel's state, 0.2 s at a time, and keeps polling briefly after the future is done. A
    channel closed under it makes that thread raise ``ValueError: Cannot invoke RPC: Channel
    closed!`` (a traceback in the process's log, from grpcio's thread). So the poller is told
    to stop (grpcio's own ``_unsubscribe_all``, which ``close()`` calls anyway) and given up to
    ``POLLER_STOP_TIMEOUT_S`` to exit first. These are grpcio internals: where they are
    missing (another grpcio version) the channel is closed at once, as before.
    """
    state = getattr(channel, "_connectivity_state", None)
    unsubscribe_all = getattr(channel, "_unsubscribe_all", None)
    if state is not None and callable(unsubscribe_all) and getattr(state, "polling", False):
        unsubscribe_all()
        deadline = Deadline.after(POLLER_STOP_TIMEOUT_S)
        while getattr(state, "polling", False) and not deadline.expired:
            deadline.sleep(0.01)
    channel.close()


def wait_ready_native(channel, addr: str, timeout: float) -> None:
    """:func:`wait_ready` for a native channel."""
    if not channel.wait_connected(max(timeout, 0.0)):
        raise TimeoutError(f"could not connect to {addr} within {timeout:.3f}s")


def server_deadline(context: grpc.ServicerContext, method: str) -> Deadline:
    """The deadline by which a handler must answer. Aborts INVALID_ARGUMENT without one.

    The server answers a little before the caller's deadline, so that its explanation (which
    rank is missing, ...) reaches the caller instead of a bare client-side deadline error.
    """
    remaining = context.time_remaining()
    if remaining is None or remaining > NO_DEADLINE_S:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: a deadline is required (set a timeout on the call)",
        )
    margin = min(ANSWER_MARGIN_S, remaining * 0.1)
    return Deadline.after(remaining - margin)


def bad(context: grpc.ServicerContext, msg: str) -> None:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)


def check_name(
    context: grpc.ServicerContext, what: str, value: str, allow_empty: bool = False
) -> None:
    if not value and not allow_empty:
        bad(context, f"{what} must not be empty")
    if len(value) > MAX_NAME_LEN:
        bad(context, f"{what} is too long ({len(value)} > {MAX_NAME_LEN} characters)")


def check_rank(
    context: grpc.ServicerContext, what: str, value: int, world_size: Optional[int] = None
) -> None:
    if value < 0:
        bad(context, f"{what} must be >= 0, got {value}")
    if world_size is not None and value >= world_size:
        bad(context, f"{what} {value} is out of range for world_size {world_size}")
    if value > MAX_RANK:
        bad(context, f"{what} {value} is too large")
