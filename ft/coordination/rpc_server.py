"""Serving gRPC methods whose handlers answer when they are ready, not when they return.

A handler is ``handler(request, call)``: it gets the parsed request and a :class:`Call`, and
answers by ``call.reply(response)`` (unary), ``call.write(message)`` + ``call.finish()``
(streaming), or ``call.abort(code, details)``, now or later and from any thread. A lighthouse
Quorum call, for instance, is answered by whichever request completes the quorum. No thread waits
per open call.

Two transports serve the same handlers:

* ``native``: ``ft.coordination._grpc_server``, gRPC's C++ callback API (built when the system
  has gRPC C++, e.g. Debian's libgrpc++-dev). The Python cost of a request is one function call.
* ``grpcio``: the Python grpcio server, with one worker thread blocked per open call. About
  0.5 ms more CPU per request; used when the native server is not built.

``RpcServer(..., transport="auto")`` picks native when available. Both give callers the same
statuses and messages (tests run the lighthouse against both).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, NoReturn, Optional, Tuple, Type

import grpc
from google.protobuf.message import DecodeError, Message

from . import _rpc
from ..utils import net
from ..utils.auth import SERVER_ID_METHOD, AuthError, Verifier, split_signed

if TYPE_CHECKING:
    from ..utils.tls import TLSConfig

logger = logging.getLogger("ft.rpc")

try:
    from . import _grpc_server as _native
except ImportError:  # not built (no gRPC C++ on the build machine)
    _native = None

# Messages queued for one streaming call before write() refuses (csrc/grpc_server: the same).
_MAX_QUEUED_WRITES = 1024
# grpcio's stop(grace) event fires once every call is cancelled after the grace; allow it this
# long beyond the grace (its handler threads must notice the cancellation) before moving on.
GRPCIO_STOP_SLACK_S = 5.0
# time_remaining() of a call without a deadline.
_NO_DEADLINE = float("inf")


# Native servers still serving: shut down at exit, before the interpreter finalizes under
# gRPC's threads (which hold Python thread states).
_live_native: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _shutdown_native_servers() -> None:
    for server in list(_live_native):
        server.shutdown(0)


def native_available() -> bool:
    return _native is not None


class CallAborted(Exception):
    """Raised by :meth:`Call.abort` after the call was finished; the dispatcher swallows it."""


class Call:
    """One open call, as a handler sees it. Thread-safe; nothing here blocks.

    ``on_cancel``: set it to a callable to be told (once) when the call ends without having
    been answered: the caller cancelled, went away, or its deadline passed. It runs on a gRPC
    thread, or at once in the setter if that already happened, and may run inside another Call
    method of this server, so it must not take locks the code that answers calls holds; hand
    the work to another thread.
    """

    method: str
    # True when the transport already checked the call's signature and took it off the request
    # (the native server does, in C++); the dispatcher then does not check it again (its nonce
    # is spent).
    verified: bool = False
    # time.monotonic() when the call arrived, where the transport knows it (native), else None.
    arrived: Optional[float] = None

    def time_remaining(self) -> float:
        """Seconds until the caller's deadline (inf when it set none)."""
        raise NotImplementedError

    def is_active(self) -> bool:
        """Not yet answered, and the caller is still there."""
        raise NotImplementedError

    def reply(self, response: Message) -> bool:
        """Answers a unary call (status OK). False if the call was already over."""
        raise NotImplementedError

    def write(self, message: Message) -> bool:
        """Sends one message of a streaming answer. False if the call is over (or too far behind)."""
        raise NotImplementedError

    def write_serialized(self, data: bytes) -> bool:
        """:meth:`write` for a message serialized once for many calls."""
        raise NotImplementedError

    def reply_serialized(self, data: bytes) -> bool:
        """:meth:`reply` for a message serialized once for many calls."""
        raise NotImplementedError

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> bool:
        """Ends the call (after the messages already written)."""
        raise NotImplementedError

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """Finishes the call with ``code`` and raises :class:`CallAborted` (as grpcio's does)."""
        self.finish(code, details)
        raise CallAborted(details)


class _NativeCall(Call):
    __slots__ = ("_c", "method", "verified")

    def __init__(self, c) -> None:
        self._c = c
        self.method = c.method
        self.verified = c.verified

    @property
    def arrived(self) -> float:
        return self._c.arrived

    @property
    def on_cancel(self):
        return getattr(self._c, "on_cancel", None)

    @on_cancel.setter
    def on_cancel(self, fn) -> None:
        self._c.on_cancel = fn

    def time_remaining(self) -> float:
        r = self._c.time_remaining()
        return _NO_DEADLINE if r > _rpc.NO_DEADLINE_S else r

    def is_active(self) -> bool:
        return self._c.is_active()

    def reply(self, response: Message) -> bool:
        return self._c.reply(response.SerializeToString())

    def reply_serialized(self, data: bytes) -> bool:
        return self._c.reply(data)

    def write(self, message: Message) -> bool:
        return self._c.write(message.SerializeToString())

    def write_serialized(self, data: bytes) -> bool:
        return self._c.write(data)

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> bool:
        return self._c.finish(code.value[0], details)


@dataclass(frozen=True)
class _End:
    code: grpc.StatusCode
    details: str


class _GrpcioCall(Call):
    """A grpcio call: a worker thread relays what the handler sends (see ``_GrpcioHandler``)."""

    def __init__(self, method: str, context: grpc.ServicerContext) -> None:
        self.method = method
        self._on_cancel: Optional[Callable[[], None]] = None
        self._cancelled = False
        self._ctx = context
        self._out: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._finished = False
        if not context.add_callback(self._on_terminated):
            # The RPC already ended (the caller left before the handler ran).
            self._finished = self._cancelled = True
            self._out.put(_End(grpc.StatusCode.CANCELLED, "cancelled"))

    def time_remaining(self) -> float:
        r = self._ctx.time_remaining()
        return _NO_DEADLINE if r is None or r > _rpc.NO_DEADLINE_S else r

    def is_active(self) -> bool:
        return not self._finished and self._ctx.is_active()

    def _put(self, item, end: Optional[_End] = None) -> bool:
        with self._lock:
            if self._finished:
                return False
            if end is None and self._out.qsize() >= _MAX_QUEUED_WRITES:
                return False  # the reader is too far behind (as the native server)
            if item is not None:
                self._out.put(item)
            if end is not None:
                self._finished = True
                self._on_cancel = None  # answered: it will not be cancelled unanswered
                self._out.put(end)
            return True

    def reply(self, response: Message) -> bool:
        return self._put(response.SerializeToString(), _End(grpc.StatusCode.OK, ""))

    def reply_serialized(self, data: bytes) -> bool:
        return self._put(data, _End(grpc.StatusCode.OK, ""))

    def write(self, message: Message) -> bool:
        return self._put(message.SerializeToString())

    def write_serialized(self, data: bytes) -> bool:
        return self._put(data)

    def finish(self, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> bool:
        return self._put(None, _End(code, details))

    @property
    def on_cancel(self):
        return self._on_cancel

    @on_cancel.setter
    def on_cancel(self, fn) -> None:
        with self._lock:
            cancelled = self._cancelled
            if not cancelled and not self._finished:
                self._on_cancel = fn
        if cancelled and fn is not None:
            fn()  # too late to store: the notice already went out

    def _on_terminated(self) -> None:
        with self._lock:
            answered = self._finished
            self._finished = True
            self._cancelled = not answered
            fn, self._on_cancel = self._on_cancel, None
            self._out.put(_End(grpc.StatusCode.CANCELLED, "cancelled"))
        if not answered and fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001
                logger.exception("on_cancel of %s failed", self.method)

    def next_item(self):
        """The next message (bytes) or _End; waits while the caller is still there."""
        while True:
            try:
                return self._out.get(timeout=1.0)
            except queue.Empty:
                if not self._ctx.is_active():
                    with self._lock:
                        self._finished = True  # refuse further writes: nobody reads them
                    return _End(grpc.StatusCode.CANCELLED, "cancelled")


class _Raw:
    """The request type of a method that takes its request's bytes as they are."""

    @staticmethod
    def FromString(data: bytes) -> bytes:  # noqa: N802 (protobuf's name)
        return data


@dataclass(frozen=True)
class Method:
    """One RPC: its request type, its handler, and whether it answers with a stream."""

    request_type: Type[Message]
    handler: Callable[[Message, Call], None]
    streaming: bool = False


class RpcServer:
    """Serves ``methods`` (full names, e.g. ``"/torchft.LighthouseService/Quorum"``) on ``bind``.

    Contract: handlers run on the server's threads, one call per request, and must not block
    for long (answer later instead). A request that does not parse gets INVALID_ARGUMENT, an
    unknown method UNIMPLEMENTED, an exception in a handler INTERNAL; the server goes on.
    Requests over ``_rpc.MAX_MESSAGE_BYTES`` get RESOURCE_EXHAUSTED from gRPC itself. With a
    ``verifier``, a request whose signature does not verify (ft.utils.auth) gets UNAUTHENTICATED
    before it is parsed, and no handler sees it.

    Args:
        bind: ``host:port``; port 0 picks a free one (see :attr:`port`).
        methods: what to serve.
        keepalive_ms: ping idle connections this often, so that calls of a peer that stopped
            answering end (0: gRPC's default).
        transport: ``"auto"`` (native when built), ``"native"`` or ``"grpcio"``.
        max_workers: grpcio only: most calls open at once.
        verifier: checks every request's signature (None: no authentication); it must be
            bound to a server id (``Verifier(..., server_id=new_server_id())``), one per server
            life, which the server tells clients (``SERVER_ID_METHOD``, the one call that is
            not signed) signed over their challenge and ``name``. The native server runs the
            same check in C++, before the GIL (one replay cache per server).
        name: what this server is, as its server-id answer proves it (ft.utils.auth:
            ``LIGHTHOUSE_SERVER_NAME``, ``manager_server_name(replica_id)``).
        tls: serve TLS with these credentials (grpcio only; see ft.utils.tls).
        fast_heartbeat: native only: the full name of a ``LighthouseHeartbeatRequest`` method
            whose well-formed calls the C++ server answers itself, without Python; collect
            them with :meth:`take_heartbeats`. Other calls of that method (leaving, malformed)
            still reach its handler. Ignored on grpcio, where the handler sees every call.
        fast_heartbeat_stream: native only, with ``fast_heartbeat``: the full name of the
            client-streaming form (one ``LighthouseHeartbeatRequest`` per message), answered
            entirely in C++; a message it cannot take ends the stream, and the client sends
            that heartbeat unary. Not served on grpcio (UNIMPLEMENTED: clients fall back to
            unary heartbeats).
        steady_quorum: native only: the full name of the lighthouse's ``Quorum`` method,
            whose steady rounds the C++ server answers itself once armed (see
            :meth:`steady_arm`; csrc/grpc_server/steady_quorum.hpp). Every other call of it
            reaches its handler. Ignored on grpcio.
        call_streams: native only: ``{stream method: unary method}``, full names. Each stream
            method is served as a call stream (``CallStreamRequest`` in, ``CallStreamResponse``
            out, one request at a time; csrc/grpc_server/grpc_server.cpp, CallStreamReactor):
            every message is a call of its unary method, which that method's handler (and the
            steady round) sees as a call of its own. Not served on grpcio (UNIMPLEMENTED:
            clients make unary calls).
    """

    def __init__(
        self,
        bind: str,
        methods: Dict[str, Method],
        *,
        keepalive_ms: int = 0,
        transport: str = "auto",
        max_workers: int = 1024,
        verifier: Optional[Verifier] = None,
        tls: Optional["TLSConfig"] = None,
        fast_heartbeat: Optional[str] = None,
        fast_heartbeat_stream: Optional[str] = None,
        steady_quorum: Optional[str] = None,
        call_streams: Optional[Dict[str, str]] = None,
        name: str = "",
    ) -> None:
        if verifier is not None and verifier.server_id is None:
            raise ValueError("a gRPC server's verifier must be bound to a server id")
        if transport not in ("auto", "native", "grpcio"):
            raise ValueError(f"transport must be 'auto', 'native' or 'grpcio', got {transport!r}")
        if transport == "native" and _native is None:
            raise RuntimeError(
                "the native gRPC server (ft.coordination._grpc_server) is not built: build ft "
                "on a machine with gRPC C++ (e.g. apt-get install libgrpc++-dev), or use "
                "transport='grpcio'"
            )
        if tls is not None and transport == "native":
            raise ValueError("the native gRPC server does not serve TLS; use transport='grpcio'")
        self._methods = dict(methods)
        self._verifier = verifier
        self.name = name
        if verifier is not None:
            self._methods[SERVER_ID_METHOD] = Method(_Raw, self._answer_server_id)
        # TLS is served by grpcio only: "auto" falls back to it.
        self.transport = (
            "native" if transport != "grpcio" and _native is not None and tls is None else "grpcio"
        )
        target = _rpc.grpc_target(bind)
        if self.transport == "native":
            try:
                self._server = _native.Server(
                    target,
                    self._dispatch_native,
                    _rpc.MAX_MESSAGE_BYTES,
                    keepalive_ms,
                    verifier=verifier.native_config() if verifier is not None else None,
                    heartbeat=(
                        (
                            fast_heartbeat,
                            fast_heartbeat_stream or "",
                            _rpc.MAX_NAME_LEN,
                            _rpc.NO_DEADLINE_S,
                        )
                        if fast_heartbeat
                        else None
                    ),
                    steady_quorum=((steady_quorum, _rpc.NO_DEADLINE_S) if steady_quorum else None),
                    call_streams=dict(call_streams or {}),
                )
            except RuntimeError as e:
                raise OSError(str(e)) from None
            self.port = self._server.port
            _live_native.add(self)
        else:
            options = list(_rpc.SERVER_OPTIONS)
            if keepalive_ms > 0:
                options += [
                    ("grpc.keepalive_time_ms", keepalive_ms),
                    ("grpc.keepalive_timeout_ms", keepalive_ms),
                ]
            self._executor = futures.ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="ft-rpc"
            )
            self._server = grpc.server(
                self._executor,
                options=options,
                maximum_concurrent_rpcs=max_workers,
            )
            self._server.add_generic_rpc_handlers((_GrpcioHandler(self),))
            if tls is not None:
                self.port = self._server.add_secure_port(target, tls.grpc_server_credentials())
            else:
                self.port = self._server.add_insecure_port(target)
            if self.port == 0:
                raise OSError(f"gRPC server could not bind {bind!r}")
            self._server.start()

    # --- dispatch (both transports) ---------------------------------------------------
    def method(self, name: str) -> Optional[Method]:
        """The method served under the full gRPC method name ``name``, or None."""
        return self._methods.get(name)

    def dispatch(self, call: Call, data: bytes) -> None:
        method = self.method(call.method)
        if method is None:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {call.method}")
            return
        if not call.verified and call.method != SERVER_ID_METHOD:
            # (else the native server checked it and took it off)
            # The signature rides in the request's leading field (ft.utils.auth); off it comes,
            # checked or not, so the request parses as its client serialized it.
            data, token = split_signed(data)
            if self._verifier is not None:
                try:
                    self._verifier.verify(call.method, data, token)
                except AuthError as e:
                    call.finish(
                        grpc.StatusCode.UNAUTHENTICATED,
                        f"{call.method}: refused: {e}; this server requires the job secret "
                        f"(FT_JOB_SECRET_FILE / FT_JOB_SECRET)",
                    )
                    return
        try:
            request = method.request_type.FromString(data)
        except (DecodeError, ValueError) as e:
            call.finish(grpc.StatusCode.INVALID_ARGUMENT, f"{call.method}: malformed request: {e}")
            return
        try:
            method.handler(request, call)
        except CallAborted:
            pass
        except Exception as e:  # noqa: BLE001 (the server must survive any handler bug)
            logger.exception("%s failed", call.method)
            call.finish(grpc.StatusCode.INTERNAL, f"{call.method}: {type(e).__name__}: {e}")

    @property
    def server_id(self) -> Optional[str]:
        """This server life's id (signatures must be bound to it), or None without a verifier."""
        return self._verifier.server_id if self._verifier is not None else None

    def _answer_server_id(self, challenge: bytes, call: Call) -> None:
        """``SERVER_ID_METHOD``: this server's name and id, signed over the client's challenge
        (32 hex characters; ft.utils.auth.Verifier.answer_server_id)."""
        if len(challenge) != 32 or not all(c in b"0123456789abcdef" for c in challenge):
            call.finish(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{SERVER_ID_METHOD}: the request must be a challenge of 32 hex characters",
            )
            return
        call.reply_serialized(self._verifier.answer_server_id(self.name, challenge.decode()))

    def _dispatch_native(self, native_call, data: bytes) -> None:
        self.dispatch(_NativeCall(native_call), data)

    def take_heartbeats(self) -> List[Tuple[str, float]]:
        """``(replica_id, time.monotonic() of arrival)`` of the heartbeats the native server
        answered itself since the last call (the latest per replica; see ``fast_heartbeat``)."""
        return self._server.take_heartbeats() if self.transport == "native" else []

    # --- the steady quorum round (native only; see ``steady_quorum``) -----------------
    def steady_arm(self, quorum_id: int, identities: Dict[str, bytes]) -> bool:
        """Answer the next rounds of quorum ``quorum_id`` in C++: requests whose member,
        serialized with ``step`` cleared, equals its entry in ``identities`` (replica id ->
        bytes). False when not armed (grpcio, or a Quorum request is on its way to its
        handler)."""
        if self.transport != "native":
            return False
        return self._server.steady_arm(quorum_id, identities)

    def steady_take(self) -> List[Tuple[Call, bytes, float]]:
        """Disarms the steady round; the requests it held, as ``(call, request bytes,
        time.monotonic() of arrival)``, for the caller to register before it arms again."""
        if self.transport != "native":
            return []
        return [(_NativeCall(c), data, t) for c, data, t in self._server.steady_take()]

    def steady_held_age(self) -> float:
        """Seconds the oldest request held by the steady round has waited (0: none)."""
        return self._server.steady_held_age() if self.transport == "native" else 0.0

    def steady_rounds(self) -> Tuple[int, int, List[float], List[bytes], int]:
        """Rounds answered in C++ since the last call: (the quorum id the last of them
        repeated, count, latencies in seconds, the last round's members as serialized
        ``QuorumMember``, its ``created`` in Unix ns)."""
        if self.transport != "native":
            return 0, 0, [], [], 0
        return self._server.steady_rounds()

    def close_heartbeat_fast_path(self) -> None:
        """From now on every heartbeat reaches its handler (which may then refuse it)."""
        if self.transport == "native":
            self._server.close_heartbeat_fast_path()

    def shutdown(self, grace: float) -> None:
        """Stops accepting calls; calls still open after ``grace`` seconds are cancelled."""
        if self.transport == "native":
            self._server.shutdown(grace)
            _live_native.discard(self)
        else:
            self._server.stop(grace).wait(timeout=grace + GRPCIO_STOP_SLACK_S)
            self._executor.shutdown(wait=False)  # its idle workers would outlive the server


class _GrpcioHandler(grpc.GenericRpcHandler):
    """grpcio face of an RpcServer: a worker thread per open call relays the handler's answer."""

    def __init__(self, server: RpcServer) -> None:
        self._server = server

    def service(self, handler_call_details):
        name = handler_call_details.method
        method = self._server.method(name)
        if method is None:
            return None  # grpcio answers UNIMPLEMENTED
        if method.streaming:
            return grpc.unary_stream_rpc_method_handler(
                lambda req, ctx: self._stream(name, req, ctx)
            )
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self._unary(name, req, ctx))

    def _start(self, name: str, data: bytes, context) -> _GrpcioCall:
        call = _GrpcioCall(name, context)
        self._server.dispatch(call, data)
        return call

    def _unary(self, name: str, data: bytes, context):
        call = self._start(name, data, context)
        response = None
        while True:
            item = call.next_item()
            if isinstance(item, _End):
                if item.code != grpc.StatusCode.OK:
                    context.abort(item.code, item.details)
                return response
            response = item

    def _stream(self, name: str, data: bytes, context):
        call = self._start(name, data, context)
        while True:
            item = call.next_item()
            if isinstance(item, _End):
                if item.code != grpc.StatusCode.OK:
                    context.abort(item.code, item.details)
                return
            yield item


class ServesRpc:
    """What a server that answers through an :class:`RpcServer` tells about itself (the
    lighthouse, a ManagerServer). The subclass sets ``_server`` (its RpcServer), ``_host`` (the
    host it advertises) and ``_port``."""

    _server: RpcServer
    _host: str
    _port: int

    @property
    def server_id(self) -> Optional[str]:
        """This server life's id, which every signature it accepts is bound to (None without
        a secret; ft.utils.auth)."""
        return self._server.server_id

    def address(self) -> str:
        """``http://host:port`` of the gRPC service: what clients dial."""
        return f"http://{net.join_hostport(self._host, self._port)}"
