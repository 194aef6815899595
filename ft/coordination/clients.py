"""Clients of the lighthouse and of a ManagerServer (retries: docs/design.md, "Network faults").

Every call takes a timeout (``datetime.timedelta`` or seconds) that bounds the whole call,
connecting included. A missed deadline raises :class:`TimeoutError`; any other failure raises
:class:`CoordinationError` (a ``RuntimeError`` carrying the gRPC ``code`` and ``details``).

Failure notifications
---------------------
The lighthouse streams a notification when a member of the current quorum misses its heartbeat
deadline (the ticker wakes at each member's deadline), and at once when a member's own
subscription drops before its deadline: a subscriber named ``"{replica_id}/{rank}"`` (as
ft.Manager subscribes) ties the stream to its replica's liveness, so a process killed with
``kill -9`` is known dead within milliseconds instead of a heartbeat timeout. Two ways to
receive them::

    client = LighthouseClient("http://lighthouse:29510", connect_timeout=timedelta(seconds=10))
    # secret=... / tls=... (default: FT_JOB_SECRET_FILE / FT_JOB_SECRET and FT_TLS_*)

    # 1. callback on a background thread, resubscribing by itself until closed
    sub = client.subscribe_failures(lambda n: pg.abort())   # n: FailureNotification
    sub.wait_subscribed(timeout=5)    # optional: True once the stream is open
    ...
    sub.close()

    # 2. a plain iterator over one stream, bounded by ``timeout``
    for n in client.failures(timeout=timedelta(minutes=5)):
        print(n.replica_id, n.quorum_id, n.error_message)

``FailureNotification`` has ``replica_id``, ``error_message``, ``quorum_id`` (the quorum the
replica belonged to), ``heartbeat_age_s`` and ``detected`` (datetime, UTC). A subscription only
sees failures detected while it is open; between two streams (every ``stream_timeout``, default
5 minutes) there is a gap of one round trip.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import logging
import secrets
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Self, Sequence, Tuple

import grpc

from . import _rpc
from ._proto import torchft_pb2 as pb
from ._rpc import CoordinationError, Timeout
from . import wire
from .quorum import FailureNotification, GroupRequest, Quorum, QuorumResult
from ..utils.auth import (
    GRPC_PURPOSE,
    LIGHTHOUSE_SERVER_NAME,
    NO_SERVER_ID,
    OTHER_SERVER,
    SERVER_ID_METHOD,
    AuthError,
    SecretLike,
    Signer,
    manager_server_name,
    resolve_secret,
)
from ..utils.deadline import Deadline
from ..utils.tls import TLSConfig, resolve_tls
from ..utils.retry import retry_until

logger = logging.getLogger("ft.coordination")

__all__ = [
    "LighthouseClient",
    "ManagerClient",
    "FailureNotification",
    "FailureSubscription",
    "CoordinationError",
]


def _transient(exc: BaseException) -> bool:
    """A failure that a later attempt may not meet: the connection, not the request."""
    return isinstance(exc, CoordinationError) and exc.code in _rpc.TRANSIENT_CODES


def _method_path(service: str, method: str) -> str:
    """The gRPC path of one method of the proto ("/torchft.Service/Method"); KeyError if the
    proto has no such method."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    return f"/{desc.full_name}/{desc.methods_by_name[method].name}"


@functools.lru_cache(maxsize=None)
def _service_methods(service: str) -> Dict[str, Tuple[str, type, bool]]:
    """method name -> (full path, response class, streams) for one service of the proto
    (request-streaming methods, which have their own clients, left out)."""
    desc = pb.DESCRIPTOR.services_by_name[service]
    return {
        m.name: (_method_path(service, m.name), getattr(pb, m.output_type.name), m.server_streaming)
        for m in desc.methods
        if not m.client_streaming
    }


def _other_server(exc: BaseException) -> bool:
    """A refusal of a signature made for another server id: the server restarted since this
    client learnt its id (or a connection was redirected)."""
    return (
        isinstance(exc, CoordinationError)
        and exc.code == grpc.StatusCode.UNAUTHENTICATED
        and OTHER_SERVER in exc.details
    )


class _Client:
    """A channel to one server. With a job secret, every request carries its signature
    (ft.utils.auth): the client serializes the request once, and each attempt sends those bytes
    behind a fresh signature (the native channel signs in C++, grpcio's path in Python).

    Signatures are bound to one server life: before its first signed call the client asks the
    server for its id (``SERVER_ID_METHOD``, the one unsigned call; the answer is signed over a
    fresh challenge, and names the server, which the client checks when it knows whom it calls:
    the lighthouse, or a ManagerServer given its ``replica_id``). It asks again after a lost
    connection, and when the server refuses a signature made for another id (it restarted),
    then sends the request once more (docs/security.md, "Bound to one server").

    ``transport``: ``"auto"`` (``FT_CLIENT_TRANSPORT``, else native when built), ``"native"``
    (gRPC C++: ft.coordination._grpc_server.Channel) or ``"grpcio"``, for unary calls; the
    failure stream is grpcio's either way, and so is everything over TLS. Both raise the same
    exceptions (module docstring) for the same failures.

    The constructor is ``__new__``, as in torchft's clients (Rust classes, built by their
    ``__new__``): ``inspect.signature`` and ``help()`` show the arguments and Python checks
    them, while ``mock.patch(..., autospec=True)``, which checks calls of a class against its
    ``__init__``, accepts any call, as it does for torchft's. A test written against torchft
    (``client_mock()`` to reach the instance mock) runs unchanged.
    """

    _service = ""
    # method name -> how its serialized response is decoded (default: the proto class's
    # FromString).
    _response_parsers: Dict[str, Callable[[bytes], Any]] = {}
    # method name -> the call stream method that carries its calls on the native transport
    # (see _CallStream).
    _call_stream_methods: Dict[str, str] = {}

    def __new__(
        cls,
        addr: str,
        connect_timeout: Timeout,
        *,
        secret: SecretLike = None,
        tls: Optional[TLSConfig] = None,
        transport: str = "auto",
    ) -> Self:
        self = super().__new__(cls)
        self.addr = addr
        self._connect_timeout = _rpc.required_seconds(connect_timeout, "connect_timeout")
        secret = resolve_secret(secret)
        self._signer = Signer(secret, GRPC_PURPOSE) if secret is not None else None
        tls = resolve_tls(tls)
        self.transport = _rpc.client_transport(transport, tls is not None)
        # grpcio's channel connects on its first use: with the native transport, only a
        # failure stream uses it.
        self._channel = _rpc.make_channel(addr, tls)
        self._native = (
            _rpc.make_native_channel(addr, self._signer.key if self._signer is not None else b"")
            if self.transport == "native"
            else None
        )
        self._calls = {}
        self._methods = {}
        for name, (path, response, streams) in _service_methods(self._service).items():
            make = self._channel.unary_stream if streams else self._channel.unary_unary
            parse = self._response_parsers.get(name, response.FromString)
            self._calls[name] = (
                path,
                make(path, request_serializer=None, response_deserializer=parse),
            )
            self._methods[name] = (path, parse)
        self._call_streams = (
            {
                name: _CallStream(
                    self._native,
                    _method_path(self._service, stream),
                    _method_path(self._service, name),
                )
                for name, stream in self._call_stream_methods.items()
            }
            if self._native is not None and _rpc.call_streams_enabled()
            else {}
        )
        self._server_id_call = self._channel.unary_unary(
            SERVER_ID_METHOD, request_serializer=None, response_deserializer=None
        )
        # The id of the server life this client's signatures are bound to (None: ask first).
        self._server_id: Optional[str] = None
        self._connected = False
        self._open()
        return self

    def _open(self) -> None:
        """What a kind of client sets up beside its channels (called by ``__new__``)."""

    def _expected_server_name(self) -> Optional[str]:
        """The name the server must prove in its server-id answer (None: any)."""
        return None

    def _learn_server_id(self, timeout: float, method: str = "ServerId") -> str:
        """Asks the server for its id, checks the answer (signed over a fresh challenge, and
        naming the expected server), and binds this client's signatures to it. A server that
        does not know the call (no secret; torchft's) checks no signature: the client signs
        for ``NO_SERVER_ID``, which every server that checks refuses. Failures are raised as
        failures of ``method`` (the call that needed the id)."""
        challenge = secrets.token_hex(16)
        timeout = max(timeout, 1e-3)
        try:
            if self._native is not None:
                try:
                    answer = self._native.call(
                        SERVER_ID_METHOD, challenge.encode(), timeout, True, sign=False
                    )
                except _rpc.native.CallError as e:
                    raise _rpc.status_error(*_rpc.native_status(e), method) from None
            else:
                try:
                    answer = self._server_id_call(
                        challenge.encode(), timeout=timeout, wait_for_ready=True
                    )
                except grpc.RpcError as e:
                    raise _rpc.translate(e, method) from None
        except CoordinationError as e:
            if e.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            sid = NO_SERVER_ID
        else:
            try:
                _, sid = self._signer.check_server_id_answer(
                    answer, challenge, self._expected_server_name()
                )
            except AuthError as e:
                raise CoordinationError(
                    grpc.StatusCode.UNAUTHENTICATED, f"{self.addr}: {e}", method
                ) from None
        if self._native is not None:
            self._native.set_server_id(sid)
        self._server_id = sid
        return sid

    def _signed(self, path: str, data: bytes, timeout: float) -> bytes:
        """``data`` behind a signature for ``path``, bound to the server's id (asked for
        first when not known, within ``min(timeout, connect_timeout)``)."""
        sid = self._server_id
        if sid is None:
            sid = self._learn_server_id(
                min(timeout, self._connect_timeout), path.rsplit("/", 1)[-1]
            )
        return self._signer.sign_request(path, data, sid)

    def note_refusal(self, code: grpc.StatusCode, details: str) -> None:
        """After a stream's refusal: a signature for another server id means the server
        restarted; the next call asks for its new id."""
        if code == grpc.StatusCode.UNAUTHENTICATED and OTHER_SERVER in details:
            self._server_id = None

    def invoke(self, method: str, request, **kwargs):
        """Sends ``request`` through grpcio (signed when there is a secret); returns what the
        stub returns."""
        return self._invoke_serialized(method, request.SerializeToString(), **kwargs)

    def _invoke_serialized(self, method: str, data: bytes, **kwargs):
        path, call = self._calls[method]
        if self._signer is not None:
            data = self._signed(path, data, kwargs.get("timeout") or self._connect_timeout)
        return call(data, **kwargs)

    def _call(
        self,
        method: str,
        request,
        timeout: Timeout,
        wait_for_ready: bool = True,
        *,
        retries: Optional[int] = None,
        on_retry: Optional[Callable[[int, BaseException, float], None]] = None,
    ):
        """One RPC, retried with backoff on a transient failure (a refused, reset or dropped
        connection: UNAVAILABLE) until ``timeout`` runs out, or ``retries`` retries (0: no
        retry). A network blip or a restarting server is not fatal while time remains; the
        last failure is raised when it does run out."""
        t = _rpc.required_seconds(timeout, method)
        if t <= 0:
            raise TimeoutError(f"{method}: timeout must be > 0, got {t}")
        deadline = Deadline.after(t)
        path, parse = self._methods[method]
        data = request.SerializeToString()  # once; each attempt signs it anew (a fresh nonce)
        native = self._native
        stream = self._call_streams.get(method)

        def attempt(remaining: float):
            try:
                return send(remaining)
            except CoordinationError as e:
                if not _other_server(e):
                    raise
            # Refused unread, for a signature bound to an earlier life of the server (it
            # restarted since): ask for its id again and send once more.
            self._server_id = None
            self._learn_server_id(deadline.remaining(), method)
            return send(max(deadline.remaining(), 1e-3))

        def send(remaining: float):
            if wait_for_ready and not self._connected:
                # Bound the connection phase by connect_timeout as well as by the deadline.
                connect = min(self._connect_timeout, remaining)
                try:
                    if native is not None:
                        _rpc.wait_ready_native(native, self.addr, connect)
                    else:
                        _rpc.wait_ready(self._channel, self.addr, connect)
                except TimeoutError as e:
                    raise TimeoutError(f"{method}: {e}") from None
            if self._signer is not None and self._server_id is None:
                self._learn_server_id(deadline.remaining(), method)
            if native is not None:
                try:
                    raw = (
                        stream.call(data, remaining, wait_for_ready) if stream is not None else None
                    )
                    if raw is None:
                        raw = native.call(path, data, remaining, wait_for_ready)
                    resp = parse(raw)
                except _rpc.native.CallError as e:
                    code, details = _rpc.native_status(e)
                    if code == grpc.StatusCode.UNAVAILABLE:
                        self._connected = False
                        self._server_id = None  # the server may come back as a new life
                    raise _rpc.status_error(code, details, method) from None
            else:
                try:
                    resp = self._invoke_serialized(
                        method, data, timeout=remaining, wait_for_ready=wait_for_ready
                    )
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.UNAVAILABLE:
                        self._connected = False
                        self._server_id = None  # the server may come back as a new life
                    raise _rpc.translate(e, method) from None
            self._connected = True
            return resp

        return retry_until(
            attempt, deadline, retries=retries, retry_on=_transient, on_retry=on_retry
        )

    def close(self) -> None:
        for stream in self._call_streams.values():
            stream.close()
        if self._native is not None:
            self._native.close()
        _rpc.close_channel(self._channel)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FailureSubscription:
    """A background subscription to lighthouse failure notifications (see module docstring)."""

    def __init__(
        self,
        client: "LighthouseClient",
        callback: Callable[[FailureNotification], None],
        subscriber: str,
        stream_timeout: float,
    ) -> None:
        self._client = client
        self._callback = callback
        self._subscriber = subscriber
        self._stream_timeout = stream_timeout
        self._closed = threading.Event()
        self._subscribed = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._thread = threading.Thread(
            target=self._run, name="ft-failure-subscription", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        from ..utils.retry import backoff_delays

        delays = backoff_delays(0.05, 1.0)
        while not self._closed.is_set():
            try:
                call = self._client.invoke(
                    "SubscribeFailures",
                    pb.SubscribeFailuresRequest(subscriber=self._subscriber),
                    timeout=self._stream_timeout,
                    wait_for_ready=True,
                )
                with self._lock:
                    self._call = call
                    if self._closed.is_set():
                        call.cancel()
                for msg in call:
                    if msg.keepalive:
                        self._subscribed.set()
                        delays = backoff_delays(0.05, 1.0)
                        continue
                    try:
                        self._callback(wire.notification_from_pb(msg))
                    except Exception:
                        logger.exception("failure notification callback raised")
            except (CoordinationError, TimeoutError) as e:
                # Asking the server for its id failed (ft.utils.auth): try again after a pause.
                self._subscribed.clear()
                logger.debug("failure subscription to %s: %s", self._client.addr, e)
                self._closed.wait(next(delays))
                continue
            except grpc.RpcError as e:
                self._subscribed.clear()
                if self._closed.is_set():
                    break
                self._client.note_refusal(e.code(), e.details() or "")
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    logger.debug("failure subscription to %s: %s", self._client.addr, e.code())
                    self._closed.wait(next(delays))
                continue
            except ValueError:
                # grpcio refuses calls on a closed channel: the client was closed under this
                # subscription (LighthouseClient.close() closes it first), which ends here.
                self._subscribed.clear()
                logger.debug("failure subscription to %s: client closed", self._client.addr)
                break
            self._subscribed.clear()
            if not self._closed.is_set():
                # The server ended the stream (shutdown); resubscribe after a pause.
                self._closed.wait(next(delays))

    def wait_subscribed(self, timeout: Optional[Timeout] = None) -> bool:
        """True once a stream is open (the lighthouse sent its first keep-alive)."""
        return Deadline.after(timeout).wait_event(self._subscribed)

    @property
    def subscribed(self) -> bool:
        return self._subscribed.is_set()

    def close(self, timeout: float = 5.0) -> None:
        self._closed.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if threading.current_thread() is not self._thread:  # closed from its own callback
            self._thread.join(timeout)


class _HeartbeatStream:
    """Routine heartbeats as messages of one long-lived ``HeartbeatStream`` call (native
    transport). Why: a unary call costs the lighthouse a new HTTP/2 stream, headers, a call
    object and trailers; a message on an open stream is one DATA frame. At a thousand groups
    heartbeating ten times a second that halves the lighthouse's CPU (docs/benchmarks.md,
    "Quorum and lighthouse").

    Nothing is lost to a server that does not take the stream: the first message of every
    call counts as sent only once the lighthouse confirmed the stream (its answer's headers,
    sent after it recorded that message); a server without the method (torchft's lighthouse,
    ft's on grpcio) ends the call instead, and that heartbeat goes as a ``Heartbeat`` call.
    A server that ends the stream for another reason than the connection leaves heartbeats
    unary for ``RETRY_AFTER_S``; a broken connection opens a new stream at the next
    heartbeat. Names the lighthouse's C++ path would refuse (empty, too long) go unary, so that
    Python's answer explains them. A message the stream did not take by the deadline raises
    TimeoutError, as a unary heartbeat would.
    """

    RETRY_AFTER_S = 60.0
    # Closing waits this long for the lighthouse's answer (then cancels).
    CLOSE_TIMEOUT_S = 0.2

    def __init__(self, channel, method: str) -> None:
        self._stream = channel.open_stream(method)
        self._unary_until = 0.0
        self._closed = False
        self.sent = 0  # heartbeats the stream took

    def send(self, request: pb.LighthouseHeartbeatRequest, timeout: float) -> bool:
        """True: sent on the stream; False: send it as a Heartbeat call."""
        if self._closed or time.monotonic() < self._unary_until:
            return False
        if not 0 < len(request.replica_id.encode("utf-8", "replace")) <= _rpc.MAX_NAME_LEN:
            return False
        try:
            self._stream.send(request.SerializeToString(), timeout)
        except _rpc.native.CallError as e:
            code, details = _rpc.native_status(e)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"Heartbeat: {details}") from None
            # A signature for another server id (the lighthouse restarted): this heartbeat goes
            # as a call, which learns the new id; the next one opens a new stream.
            if code not in _rpc.TRANSIENT_CODES and OTHER_SERVER not in details:
                self._unary_until = time.monotonic() + self.RETRY_AFTER_S
                logger.debug("heartbeat stream: %s %s; unary heartbeats for a while", code, details)
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        """Ends the stream; later heartbeats go as calls (which a closed client refuses)."""
        self._closed = True
        self._stream.close(self.CLOSE_TIMEOUT_S)


class _CallStream:
    """Calls of one method as messages of one long-lived call (native transport): a call
    stream, ``ClientCallStream`` in csrc/grpc_server/grpc_client.cpp, one request at a time.
    Why: a call costs the lighthouse, and this client, a new HTTP/2 stream, headers, a call
    object and trailers; a message on an open stream is one DATA frame each way
    (docs/benchmarks.md, "Quorum and lighthouse").

    Nothing is lost to a server without the stream method (torchft's lighthouse, ft's on
    grpcio): it ends the stream UNIMPLEMENTED before reading the request, and that request,
    and the next ones for ``RETRY_AFTER_S``, go as calls. A request that a second thread
    sends while the stream is busy goes as a call too. A stream that ended while idle (the
    lighthouse restarted, the connection broke) is replaced at the next request without
    failing it. Any other failure is raised as the call's would be (and retried the same way
    by ``_Client._call``); the next request opens a new stream.
    """

    RETRY_AFTER_S = 60.0

    def __init__(self, channel, stream_method: str, method: str) -> None:
        self._stream = channel.open_call_stream(stream_method, method)
        self._unary_until = 0.0
        self._closed = False
        self.answered = 0  # requests answered on the stream

    def call(self, data: bytes, timeout: float, wait_for_ready: bool) -> Optional[bytes]:
        """The serialized response, or None: make a call instead. Raises the native
        ``CallError`` as ``Channel.call`` does."""
        if self._closed or time.monotonic() < self._unary_until:
            return None
        try:
            response = self._stream.call(data, timeout, wait_for_ready)
        except _rpc.native.CallError as e:
            code, details = _rpc.native_status(e)
            if code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._unary_until = time.monotonic() + self.RETRY_AFTER_S
            logger.debug("call stream: %s; calls for a while", details)
            return None
        if response is not None:
            self.answered += 1
        return response

    def close(self) -> None:
        self._closed = True
        self._stream.close()


class LighthouseClient(_Client):
    """Client of ``LighthouseService``.

    Args:
        addr: ``"http://host:port"`` or ``"host:port"`` of the lighthouse.
        connect_timeout: how long to wait for the connection.
        secret, tls, transport: as for every ft client (docs/security.md).
    """

    _service = "LighthouseService"
    # close() waits this long for each open failure subscription's thread to end (it only has
    # to notice its cancelled call).
    SUBSCRIPTION_CLOSE_TIMEOUT_S = 1.0
    # A quorum goes straight from the wire into ft's types (natively where built).
    _response_parsers = {"Quorum": wire.quorum_from_response}
    _call_stream_methods = {"Quorum": "QuorumStream"}

    def _expected_server_name(self) -> Optional[str]:
        return LIGHTHOUSE_SERVER_NAME

    def _open(self) -> None:
        self._heartbeats = (
            _HeartbeatStream(self._native, _method_path(self._service, "HeartbeatStream"))
            if self._native is not None
            else None
        )
        # Closed with the client: their threads call through its channel.
        self._subscriptions: "weakref.WeakSet[FailureSubscription]" = weakref.WeakSet()

    def quorum(
        self,
        replica_id: str,
        timeout: Timeout,
        address: str = "",
        store_address: str = "",
        step: int = 0,
        world_size: int = 0,
        shrink_only: bool = False,
        data: Optional[dict] = None,
        commit_failures: int = 0,
        reconfigure_handles: Sequence[str] = (),
        *,
        wait_for_ready: bool = True,
        retries: Optional[int] = None,
        on_retry: Optional[Callable[[int, BaseException, float], None]] = None,
    ) -> Quorum:
        """Joins the next quorum and blocks until it is issued (or ``timeout``). A lost
        connection is retried until ``timeout`` (or ``retries`` times)."""
        member = pb.QuorumMember(
            replica_id=replica_id,
            address=address,
            store_address=store_address,
            step=step,
            world_size=world_size,
            shrink_only=shrink_only,
            data=json.dumps(data) if data is not None else "",
            commit_failures=commit_failures,
            reconfigure_handles=reconfigure_handles,
        )
        return self._call(
            "Quorum",
            pb.LighthouseQuorumRequest(requester=member),
            timeout,
            wait_for_ready,
            retries=retries,
            on_retry=on_retry,
        )

    def heartbeat(
        self,
        replica_id: str,
        timeout: Timeout = _dt.timedelta(seconds=5),
        *,
        wait_for_ready: bool = True,
        leaving: bool = False,
    ) -> None:
        """One heartbeat. ``leaving=True`` says the replica shuts down cleanly (an ft
        extension; a torchft lighthouse ignores it and times the replica out instead).

        On the native transport a routine heartbeat is a message on one long-lived stream
        (``HeartbeatStream``, see :class:`_HeartbeatStream`); otherwise, and whenever the
        stream cannot take it, a ``Heartbeat`` call."""
        request = pb.LighthouseHeartbeatRequest(replica_id=replica_id, leaving=leaving)
        deadline = Deadline.after(_rpc.required_seconds(timeout, "Heartbeat"))
        stream = self._heartbeats if not leaving else None
        if stream is not None and self._signer is not None and self._server_id is None:
            # The stream signs for the server's id: learn it first (a failure leaves this
            # heartbeat to the call below, which retries).
            try:
                self._learn_server_id(min(deadline.remaining(), self._connect_timeout), "Heartbeat")
            except (CoordinationError, TimeoutError):
                stream = None
        if stream is not None and stream.send(request, deadline.remaining()):
            return
        self._call("Heartbeat", request, max(deadline.remaining(), 1e-3), wait_for_ready)

    def close(self) -> None:
        for subscription in list(self._subscriptions):
            subscription.close(timeout=self.SUBSCRIPTION_CLOSE_TIMEOUT_S)
        if self._heartbeats is not None:
            self._heartbeats.close()
        super().close()

    def subscribe_failures(
        self,
        callback: Callable[[FailureNotification], None],
        subscriber: str = "",
        stream_timeout: Timeout = _dt.timedelta(minutes=5),
    ) -> FailureSubscription:
        """Calls ``callback(notification)`` on a background thread for every failure, until
        the subscription or this client is closed."""
        subscription = FailureSubscription(
            self, callback, subscriber, _rpc.required_seconds(stream_timeout, "stream_timeout")
        )
        self._subscriptions.add(subscription)
        return subscription

    def failures(self, timeout: Timeout, subscriber: str = "") -> Iterator[FailureNotification]:
        """Yields failure notifications from one stream until ``timeout`` (then returns)."""
        call = self.invoke(
            "SubscribeFailures",
            pb.SubscribeFailuresRequest(subscriber=subscriber),
            timeout=_rpc.required_seconds(timeout, "failures"),
            wait_for_ready=True,
        )
        try:
            for msg in call:
                if not msg.keepalive:
                    yield wire.notification_from_pb(msg)
        except grpc.RpcError as e:
            self.note_refusal(e.code(), e.details() or "")
            if e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
                raise _rpc.translate(e, "SubscribeFailures") from None
        finally:
            call.cancel()


class ManagerCalls:
    """The ManagerService's calls, with torchft's names and signatures, for its two clients.

    :class:`ManagerClient` carries them over gRPC and ``LocalManagerClient`` (the process that
    hosts the ManagerServer) calls the server directly; each provides the three ``_send_*``
    hooks, and these methods are written once for both (the shape that
    ``ft.protocols.GroupServerClient`` names).
    """

    def quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: Timeout,
        init_sync: bool = True,
        commit_failures: int = 0,
        reconfigure_handle: str = "",
    ) -> QuorumResult:
        request = GroupRequest(
            group_rank=group_rank,
            step=step,
            checkpoint_metadata=checkpoint_metadata,
            shrink_only=shrink_only,
            init_sync=init_sync,
            commit_failures=commit_failures,
            reconfigure_handle=reconfigure_handle,
        )
        return self._send_quorum(request, timeout)

    def checkpoint_metadata(self, rank: int, timeout: Timeout) -> str:
        return self._send_checkpoint_metadata(rank, timeout)

    # torchft's names for the two calls above.
    _quorum = quorum
    _checkpoint_metadata = checkpoint_metadata

    def should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: Timeout
    ) -> bool:
        return self._send_should_commit(group_rank, step, should_commit, timeout)

    def _send_quorum(self, request: GroupRequest, timeout: Timeout) -> QuorumResult:
        raise NotImplementedError

    def _send_checkpoint_metadata(self, rank: int, timeout: Timeout) -> str:
        raise NotImplementedError

    def _send_should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: Timeout
    ) -> bool:
        raise NotImplementedError


class ManagerClient(ManagerCalls, _Client):
    """Client of a replica group's ``ManagerService`` (torchft-compatible names).

    Args:
        addr: ``"http://host:port"`` or ``"host:port"`` of the ManagerServer.
        connect_timeout: how long to wait for the connection.
        secret, tls, transport: as for every ft client (docs/security.md).
        replica_id: the replica whose ManagerServer this is, when known: with a secret, the
            client signs only for a server that proves it serves that replica (a connection
            redirected to another group's server fails with UNAUTHENTICATED, "the server is
            ..."). None: any of the job's ManagerServers.
    """

    _service = "ManagerService"

    def __new__(
        cls,
        addr: str,
        connect_timeout: Timeout,
        *,
        replica_id: Optional[str] = None,
        **options: Any,
    ) -> Self:
        """``options``: ``secret``, ``tls`` and ``transport``, as for every ft client."""
        self = super().__new__(cls, addr, connect_timeout, **options)
        self._replica_id = replica_id
        return self

    def _expected_server_name(self) -> Optional[str]:
        replica_id = getattr(self, "_replica_id", None)
        return manager_server_name(replica_id) if replica_id is not None else None

    _call_stream_methods = {"Quorum": "QuorumStream", "ShouldCommit": "ShouldCommitStream"}

    def _send_quorum(self, request: GroupRequest, timeout: Timeout) -> QuorumResult:
        return wire.result_from_pb(self._call("Quorum", wire.group_request_to_pb(request), timeout))

    def _send_checkpoint_metadata(self, rank: int, timeout: Timeout) -> str:
        resp = self._call("CheckpointMetadata", pb.CheckpointMetadataRequest(rank=rank), timeout)
        return resp.checkpoint_metadata

    def _send_should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: Timeout
    ) -> bool:
        req = pb.ShouldCommitRequest(should_commit=should_commit, group_rank=group_rank, step=step)
        return self._call("ShouldCommit", req, timeout).should_commit

    def kill(self, msg: str, timeout: Timeout = _dt.timedelta(seconds=5)) -> None:
        """Asks the ManagerServer's process to exit with a non-zero status (never retried: a
        kill that may have landed is not sent twice)."""
        self._call("Kill", pb.KillRequest(msg=msg), timeout, retries=0)
