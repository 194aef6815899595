"""The lighthouse: one per job. Decides, every round, which replica groups train together
(docs/design.md, "The quorum rule" and "Failure notifications").

``LighthouseServer(bind, min_replicas, join_timeout_ms=None, quorum_tick_ms=None,
heartbeat_timeout_ms=None)`` serves ``torchft.LighthouseService`` over gRPC (Quorum long-poll,
Heartbeat, and the ft extension ``SubscribeFailures``) and, on a second port, an HTTP dashboard:

* ``GET /``            self-contained, self-refreshing HTML page;
* ``GET /api/status``  the same information as JSON (with the managers' addresses, so it
  needs a signed-in session when a job secret or an operator token is configured);
* ``GET /metrics``     Prometheus text format (no addresses);
* ``POST /api/login``  exchanges a login ticket (``python -m ft.utils.dashboard_login``, made
  from the job secret, which itself never travels) for a session cookie;
* ``POST /api/kill``   JSON ``{"replica_id": ..., "msg": ...}``: forwards Kill to that group's
  ManagerServer. Needs the header ``X-FT-Request: 1`` and, when configured, the credential.

With TLS configured (``FT_TLS_*``) the dashboard serves HTTPS. Who may use which endpoint, and
the connection limits: see ft.coordination.dashboard.server.

Quorum ids never repeat across restarts: the counter starts from the wall clock in microseconds
(a restarted lighthouse starts above every id the previous one can have issued, since issuing
an id takes far more than a microsecond), or from the id in ``quorum_id_file`` when that file exists
and holds a larger one (guards against a clock that steps back). The file is rewritten at every bump.

On the native gRPC server a steady round (the previous quorum's members asking again, nothing
changed but their steps) is answered in C++ without this module; every other round, and every
event that changes the rule's answer, is decided here (``_LighthouseState``, "the steady
round"; docs/design.md, "Layers").

A replica waiting in an open Quorum call counts as heartbeating (the call is a continuous
heartbeat; gRPC keepalive pings end the call of a stalled peer). Replicas whose heartbeat is older than ``heartbeat_timeout + dead_grace`` are forgotten (they
leave the dashboard). When a member of the current quorum misses its heartbeat deadline, every
``SubscribeFailures`` stream gets a ``FailureNotification`` at the next tick.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import collections
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

import grpc
from google.protobuf.message import DecodeError

from . import _rpc, wire
from ._proto import torchft_pb2 as pb
from .lighthouse_status import QuorumIdFile, status_document
from .metrics import render_metrics
from .rpc_server import Call, CallAborted, Method, RpcServer, ServesRpc
from ..utils.auth import (
    GRPC_PURPOSE,
    LIGHTHOUSE_SERVER_NAME,
    SecretLike,
    Verifier,
    check_exposure,
    new_server_id,
    resolve_secret,
)
from ..utils.tls import TLSConfig, resolve_tls, warn_cleartext
from ..utils.dashboard_login import DashboardSessions
from .dashboard.server import (  # noqa: F401  (CSRF_HEADER: re-exported)
    CSRF_HEADER,
    DASHBOARD_IDLE_TIMEOUT_S,
    DASHBOARD_MAX_CONNECTIONS,
    DashboardServer,
)
from ..utils import net
from ..utils.deadline import Deadline
from .quorum import (
    LighthouseOptions,
    Quorum,
    QuorumMember,
    next_quorum_id,
    quorum_compute,
    subscriber_replica,
)

logger = logging.getLogger("ft.lighthouse")

__all__ = ["LighthouseServer"]

# LighthouseServer(...) defaults: torchft's Python API (join 100 ms, tick 100 ms, heartbeat 5 s).
DEFAULT_JOIN_TIMEOUT_MS = 100
# The ft-lighthouse command's default join timeout (as torchft's lighthouse command).
CLI_DEFAULT_JOIN_TIMEOUT_MS = 60_000
DEFAULT_QUORUM_TICK_MS = 100
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000
DEFAULT_DEAD_GRACE_MS = 30_000
KEEPALIVE_S = 5.0
# The dashboard's kill: a ManagerServer that does not accept a connection within 2 s or answer
# within 5 s is not going to (the kill also ends the process, which may drop the answer).
KILL_CONNECT_TIMEOUT = _dt.timedelta(seconds=2)
KILL_TIMEOUT = _dt.timedelta(seconds=5)
MAX_DATA_BYTES = 64 * 1024


class _Unavailable(Exception):
    pass


@dataclass(eq=False)
class _Waiter:
    """An open Quorum call: answered by whichever request or tick issues its quorum."""

    replica_id: str
    call: Call
    deadline: Deadline


class _NoSteadyRound:
    """The steady round's interface (RpcServer.steady_*) where no server answers it: every
    Quorum request reaches Python (grpcio transport, and tests of the state alone)."""

    def steady_arm(self, quorum_id: int, identities: Dict[str, bytes]) -> bool:
        return False

    def steady_take(self) -> List[Tuple[Call, bytes, float]]:
        return []

    def steady_held_age(self) -> float:
        return 0.0

    def steady_rounds(self) -> Tuple[int, int, List[float], List[bytes], int]:
        return 0, 0, [], [], 0


@dataclass
class _Stats:
    quorums_issued: int = 0
    native_rounds: int = 0  # of quorums_issued: steady rounds the native server answered
    quorum_changes: int = 0
    failure_notifications: int = 0
    last_latency_s: float = 0.0
    latencies: List[float] = field(default_factory=list)  # last 1000


class FailureSubscribers:
    """The open failure-notification streams. Callers hold the lighthouse's lock."""

    def __init__(self) -> None:
        self._calls: Set[Call] = set()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: Call) -> None:
        self._calls.add(call)

    def discard(self, call: Call) -> None:
        self._calls.discard(call)

    def broadcast(self, data: bytes) -> None:
        """Writes ``data`` to every stream; one that is over, or so far behind that gRPC
        stopped queueing, is dropped (its client re-subscribes, and its stream end is handled
        like any other)."""
        for call in list(self._calls):
            if not call.write_serialized(data):
                self._calls.discard(call)
                call.finish(grpc.StatusCode.RESOURCE_EXHAUSTED, "failure stream fell behind")

    def finish_all(self) -> None:
        for call in self._calls:
            call.finish()
        self._calls.clear()


class _LighthouseState:
    """All lighthouse state, guarded by one lock; the gRPC and HTTP faces call into it.

    Quorum calls do not block a thread: each is a :class:`_Waiter` holding its gRPC call, and
    the request or tick that issues a quorum answers every member's call. The ticker thread
    expires waiters at their deadlines. gRPC's cancellation notices (a caller gone, a failure
    stream dropped) must not take ``lock`` (see rpc_server.Call.on_cancel): they queue an event
    in ``_events`` and wake the ticker, which handles it under the lock.
    """

    def __init__(
        self,
        opts: LighthouseOptions,
        tick_s: float,
        dead_grace_s: float,
        quorum_id_file: Optional[str],
    ) -> None:
        self.opts = opts
        self.tick_s = tick_s
        self.dead_grace_s = dead_grace_s
        self.quorum_ids = QuorumIdFile(quorum_id_file)
        self.lock = threading.Lock()
        self.participants: Dict[str, Tuple[float, QuorumMember]] = {}
        self.heartbeats: Dict[str, float] = {}
        # Replicas that said they are leaving (clean shutdown) -> when: never announced as
        # failed, and their late heartbeats are ignored until forgotten like the dead.
        self.left: Dict[str, float] = {}
        self.last_member: Dict[str, QuorumMember] = {}  # latest info per replica (dashboard, kill)
        self.waiters: Set[_Waiter] = set()
        self.prev: Optional[Quorum] = None
        # Set when a quorum is issued (and on close): the ticker re-plans its next wake-up.
        self.ticker_wakeup = threading.Event()
        # When the ticker will wake next on its own (a new waiter with an earlier deadline wakes it).
        self.ticker_planned_wake = 0.0
        # Cancellation notices for the ticker: ("stream_end", subscriber, time_remaining) or
        # ("cancelled",). Appended without the lock (deque appends are atomic).
        self._events: "collections.deque" = collections.deque()
        # Quorum calls not yet registered: (member, waiter), appended without the lock and
        # drained under it (see quorum()).
        self._arrivals: "collections.deque" = collections.deque()
        self.prev_issued_mono = 0.0
        self.quorum_id = self.quorum_ids.initial()
        self.reason = "no participants"
        self.notified: Set[Tuple[int, str]] = set()
        self.subscribers = FailureSubscribers()
        self.last_keepalive = time.monotonic()
        self.stats = _Stats()
        self.closed = False
        # Heartbeats the native gRPC server answered without Python (RpcServer.fast_heartbeat):
        # (replica_id, time.monotonic() of arrival). Applied under the lock by every method
        # that reads ``heartbeats``, so they count exactly as if this class had received them.
        self.take_fast_heartbeats: Callable[[], List[Tuple[str, float]]] = list
        # The native server's steady round (csrc/grpc_server/steady_quorum.hpp): armed after a
        # quorum is issued while nobody else waits, it answers the next rounds of the same
        # members in C++, and hands every held request back (steady_take) as soon as anything
        # else happens. Each replica's identity: its last request's member, serialized with
        # ``step`` cleared (what a steady request must repeat byte for byte).
        self.steady = _NoSteadyRound()
        self.steady_armed = False  # since the last arm, maybe disarmed since by the server
        self.identities: Dict[str, bytes] = {}

    # --- quorum -----------------------------------------------------------------------
    def _apply_fast_heartbeats_locked(self) -> None:
        for rid, arrived in self.take_fast_heartbeats():
            if rid not in self.left and arrived > self.heartbeats.get(rid, float("-inf")):
                self.heartbeats[rid] = arrived

    def quorum(
        self,
        member: QuorumMember,
        deadline: Deadline,
        call: Call,
        identity: bytes = b"",
        arrived: Optional[float] = None,
    ) -> None:
        """Registers ``call`` to be answered with ``member``'s next quorum (maybe at once).

        Arrivals are decided in batches: each is queued, and whichever caller gets the lock
        registers every queued arrival and evaluates the quorum rule once for all of them; a
        caller that finds its arrival already taken returns at once. Evaluating the rule costs
        O(replicas), so one evaluation per arrival made a round of N arrivals cost O(N^2),
        which at hundreds of replica groups was most of the round. Arrivals queued together
        were concurrent: deciding once after all of them gives the outcome of one order in
        which they could have arrived, so the rule (``quorum_compute``) is unchanged.
        """
        self._arrivals.append(
            (member, _Waiter(member.replica_id, call, deadline), identity, arrived)
        )
        with self.lock:
            if not self._arrivals:
                return  # a concurrent caller registered and decided this arrival
            self._apply_fast_heartbeats_locked()
            self._tick_locked(time.monotonic())

    def _register_arrivals_locked(self, now: float) -> None:
        """Registers every queued Quorum arrival as a waiting participant."""
        if self.steady_armed and self._arrivals:
            # A request that reached Python while the round was armed is decided here, with
            # the ones the server holds: no round is split between the two.
            self._take_steady_locked()
        if not self._arrivals:
            return
        arrived = []
        while self._arrivals:
            arrived.append(self._arrivals.popleft())
        if self.closed:
            for _, waiter, _, _ in arrived:
                waiter.call.finish(grpc.StatusCode.UNAVAILABLE, "lighthouse is shutting down")
            return
        wake = False
        for member, waiter, identity, at in arrived:
            rid = member.replica_id
            self.left.pop(rid, None)  # asking for a quorum again: it is back
            self.heartbeats[rid] = now
            self.last_member[rid] = member
            self.identities[rid] = identity
            joined = (
                self.participants[rid][0]
                if rid in self.participants
                else min(now, at if at is not None else now)
            )
            self.participants[rid] = (joined, member)
            self.waiters.add(waiter)
            waiter.call.on_cancel = self._on_waiter_cancelled
            wake = wake or waiter.deadline.at < self.ticker_planned_wake
        if wake:
            self.ticker_wakeup.set()

    # --- the steady round (native server) ---------------------------------------------
    def _arm_steady_locked(self, quorum: Quorum) -> None:
        """Lets the native server answer the next rounds of ``quorum`` itself, when they can
        only repeat it: nobody else is waiting, and no member asked for shrink_only or
        reported commit failures (either changes the rule's answer or the quorum id)."""
        if self.closed or self.waiters or self.participants or self._arrivals or self._events:
            return
        identities = {}
        for m in quorum.participants:
            identity = self.identities.get(m.replica_id)
            if not identity or m.shrink_only or m.commit_failures:
                return
            identities[m.replica_id] = identity
        self.steady_armed = self.steady.steady_arm(quorum.quorum_id, identities)

    def _take_steady_locked(self) -> None:
        """Disarms the steady round: rounds it answered update ``prev`` and the stats, and
        the requests it holds join the arrivals (``_register_arrivals_locked`` registers
        them). Called whenever something changes the rule's answer for them (a member
        failed, left or lost its subscription; shutdown), and by the ticker when a round did
        not complete within a tick."""
        self.steady_armed = False
        # Disarmed first: no round can complete between the rounds read below and the take.
        held = self.steady.steady_take()
        self._sync_steady_rounds_locked()
        for call, data, at in held:
            try:
                request = pb.LighthouseQuorumRequest.FromString(data)
                member, deadline, identity = _check_quorum_request(request, call)
            except DecodeError as e:  # the C++ parse is stricter: not expected
                call.finish(grpc.StatusCode.INVALID_ARGUMENT, f"Quorum: malformed request: {e}")
                continue
            except CallAborted:
                continue  # answered with the reason
            self._arrivals.append(
                (member, _Waiter(member.replica_id, call, deadline), identity, at)
            )

    def _sync_steady_rounds_locked(self) -> None:
        """Takes in the rounds the native server answered: ``prev`` (same members and id,
        their new steps), each member's latest info, and the stats."""
        quorum_id, count, latencies, members, created_ns = self.steady.steady_rounds()
        if not count:
            return
        st = self.stats
        st.quorums_issued += count
        st.native_rounds += count
        st.last_latency_s = latencies[-1]
        st.latencies.extend(latencies)
        del st.latencies[:-1000]
        if self.prev is None or quorum_id != self.prev.quorum_id:
            return  # rounds of a quorum Python has since replaced: its members are current
        try:
            ms = tuple(wire.member_from_pb(pb.QuorumMember.FromString(b)) for b in members)
        except DecodeError:  # the C++ parse is stricter: not expected
            logger.exception("a steady round's members did not parse")
            return
        created = _dt.datetime.fromtimestamp(created_ns / 1e9, _dt.timezone.utc)
        self.prev = Quorum(quorum_id=quorum_id, participants=ms, created=created)
        self.prev_issued_mono = time.monotonic() - max(0.0, time.time() - created_ns / 1e9)
        for m in ms:
            self.last_member[m.replica_id] = m
        self.reason = f"issued quorum {quorum_id} (steady round, answered natively)"

    def has_events(self) -> bool:
        return bool(self._events)

    def _on_waiter_cancelled(self) -> None:
        # A gRPC thread, maybe inside a Call method of a thread holding the lock: no lock here.
        self._events.append(("cancelled",))
        self.ticker_wakeup.set()

    def on_stream_end(self, subscriber: str, call: Call) -> None:
        """A failure stream ended without the server ending it (gRPC thread; no lock here)."""
        self._events.append(("stream_end", subscriber, call, call.time_remaining()))
        self.ticker_wakeup.set()

    def _handle_events_locked(self, now: float) -> None:
        while self._events:
            event = self._events.popleft()
            if event[0] == "stream_end":
                _, subscriber, call, remaining = event
                self.subscribers.discard(call)
                self._stream_ended_locked(subscriber, remaining, now)
            # "cancelled": _tick_locked drops every waiter whose call is over.

    def _stream_ended_locked(self, subscriber: str, remaining: float, now: float) -> None:
        """A subscriber named ``"{replica_id}/{rank}"`` (as ft.Manager subscribes) ties the
        stream to its replica's liveness: if the stream ends before its deadline and not by a
        server shutdown, the client went away (killed, or shut down)."""
        replica_id = subscriber_replica(subscriber)
        # less than 0.5 s left: the stream's deadline, and the client re-subscribes
        if replica_id is not None and not self.closed and remaining >= 0.5:
            self._connection_lost_locked(replica_id, now)

    def _connection_lost_locked(self, replica_id: str, now: float) -> None:
        """``replica_id``'s process dropped its failure subscription (it died, or shut down):
        its heartbeat counts as expired now instead of a heartbeat timeout later, so members
        of its quorum are notified at once and the next quorum does not wait for it. A live
        replica revives with its next heartbeat or Quorum request."""
        if replica_id not in self.heartbeats:
            return
        self._take_steady_locked()
        self._register_arrivals_locked(now)
        if any(w.replica_id == replica_id and w.call.is_active() for w in self.waiters):
            return  # still asking for a quorum: alive
        self.heartbeats[replica_id] = now - self.opts.heartbeat_timeout_s - 0.001
        # INFO: a clean shutdown looks the same; the failure notice below is the warning.
        logger.info("replica %s dropped its failure subscription: treated as dead", replica_id)

    def heartbeat(self, replica_id: str, leaving: bool = False) -> None:
        with self.lock:
            self._apply_fast_heartbeats_locked()  # an earlier heartbeat must not land after this
            if self.closed:
                raise _Unavailable("lighthouse is shutting down")
            now = time.monotonic()
            if leaving:
                self._leave_locked(replica_id, now)
            elif replica_id not in self.left:
                self.heartbeats[replica_id] = now

    def _leave_locked(self, replica_id: str, now: float) -> None:
        """``replica_id`` shuts down cleanly: it stops counting as healthy at once (the next
        quorum goes on without it, and it no longer counts toward the split-brain guard), but
        members of its quorum get no failure notification: a peer that leaves after its last
        step must not abort the others' tail of that step's collectives."""
        self._take_steady_locked()
        self._register_arrivals_locked(now)
        self.left[replica_id] = now
        self.heartbeats.pop(replica_id, None)
        self.participants.pop(replica_id, None)
        logger.info("replica %s left", replica_id)
        self.ticker_wakeup.set()

    def next_expiry_in(self) -> float:
        """Seconds until the earliest heartbeat deadline of a current quorum member not yet
        reported dead, or the earliest Quorum call deadline (inf if none): the ticker wakes
        then, so the failure notification or the timeout goes out at the deadline rather than
        up to a tick later."""
        with self.lock:
            self._apply_fast_heartbeats_locked()
            wait = float("inf")
            if self.waiters:
                wait = min(w.deadline.at for w in self.waiters) - time.monotonic()
            if self.prev is not None:
                now = time.monotonic()
                timeout = self.opts.heartbeat_timeout_s
                for m in self.prev.participants:
                    last = self.heartbeats.get(m.replica_id)
                    if last is None or (self.prev.quorum_id, m.replica_id) in self.notified:
                        continue
                    # +1 ms: the detector needs age >= timeout when it runs.
                    wait = min(wait, last + timeout - now + 0.001)
            return wait

    def tick(self) -> None:
        with self.lock:
            self._apply_fast_heartbeats_locked()
            if not self.closed:
                now = time.monotonic()
                if self.steady.steady_held_age() >= self.tick_s:
                    # A round that did not complete within a tick: the rule decides it here
                    # (a member may be slow, dead or gone; the join timeout may run out).
                    self._take_steady_locked()
                self._handle_events_locked(now)
                self._tick_locked(now)
                if now - self.last_keepalive >= KEEPALIVE_S:
                    self.last_keepalive = now
                    self.subscribers.broadcast(_KEEPALIVE)

    def _tick_locked(self, now: float) -> None:
        self._register_arrivals_locked(now)
        # An open Quorum call is a continuous heartbeat: its caller is alive and listening (a
        # dropped connection ends the call, and gRPC keepalive catches a stalled peer).
        gone = []
        for w in self.waiters:
            if not w.call.is_active():
                gone.append(w)
            elif now >= w.deadline.at:
                w.call.finish(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"no quorum for {w.replica_id} before its deadline; last state: {self.reason}",
                )
                gone.append(w)
            else:
                self.heartbeats[w.replica_id] = now
        for w in gone:
            self.waiters.discard(w)
            if not any(o.replica_id == w.replica_id for o in self.waiters):
                # Nobody is waiting for this replica any more: it is no longer a participant.
                self.participants.pop(w.replica_id, None)
        self._detect_failures_locked(now)
        # A failed member takes back the steady round's requests: they wait here now.
        self._register_arrivals_locked(now)
        self._forget_dead_locked(now)
        decision = quorum_compute(now, self.participants, self.heartbeats, self.prev, self.opts)
        self.reason = decision.reason
        if decision.members is not None:
            self._issue_locked(now, decision.members, decision.reason)

    def _issue_locked(self, now: float, members, why_ready: str) -> None:
        new_id, why_id = next_quorum_id(self.prev, self.quorum_id, members)
        first_joined = min(self.participants[m.replica_id][0] for m in members)
        changed = new_id != self.quorum_id
        self.quorum_id = new_id
        if changed:
            self.quorum_ids.save(self.quorum_id)
        quorum = Quorum(quorum_id=new_id, participants=tuple(members))
        self.prev = quorum
        self.prev_issued_mono = now
        ids = {m.replica_id for m in members}
        self.participants.clear()
        # One serialized answer for every member.
        answer = pb.LighthouseQuorumResponse(quorum=wire.quorum_to_pb(quorum)).SerializeToString()
        for w in list(self.waiters):
            if w.replica_id in ids:
                self.waiters.discard(w)
                w.call.reply_serialized(answer)
            elif w.replica_id not in self.participants:
                # Not in this quorum: stays a participant for the next round.
                self.participants[w.replica_id] = (now, self.last_member[w.replica_id])
        latency = now - first_joined
        st = self.stats
        st.quorums_issued += 1
        st.last_latency_s = latency
        st.latencies.append(latency)
        del st.latencies[:-1000]
        if changed:
            st.quorum_changes += 1
            logger.info(
                "quorum %d: %s; %s; members: %s",
                new_id,
                why_id,
                why_ready,
                ", ".join(sorted(ids)),
            )
        self.reason = f"issued quorum {new_id} ({why_ready})"
        self._arm_steady_locked(quorum)
        if changed:
            # New members: the ticker re-plans its wake-up for their heartbeat deadlines. The
            # same members keep deadlines no earlier than planned (heartbeats only advance).
            self.ticker_wakeup.set()

    def _detect_failures_locked(self, now: float) -> None:
        if self.prev is None:
            return
        timeout = self.opts.heartbeat_timeout_s
        for m in self.prev.participants:
            key = (self.prev.quorum_id, m.replica_id)
            if m.replica_id in self.left:
                continue
            last = self.heartbeats.get(m.replica_id)
            age = None if last is None else now - last
            if key in self.notified or (age is not None and age < timeout):
                continue
            self.notified.add(key)
            # The steady round can no longer complete: its requests are decided here now.
            self._take_steady_locked()
            msg = pb.FailureNotification(
                replica_id=m.replica_id,
                error_message=(
                    f"replica {m.replica_id} missed its heartbeat deadline "
                    f"({timeout:.3f}s) in quorum {self.prev.quorum_id}"
                ),
                quorum_id=self.prev.quorum_id,
                heartbeat_age_s=age if age is not None else float("inf"),
            )
            msg.detected.GetCurrentTime()
            self.stats.failure_notifications += 1
            logger.warning("%s", msg.error_message)
            self.subscribers.broadcast(msg.SerializeToString())
        # Forget notifications of old quorums.
        self.notified = {k for k in self.notified if k[0] == self.prev.quorum_id}

    def _forget_dead_locked(self, now: float) -> None:
        limit = self.opts.heartbeat_timeout_s + self.dead_grace_s
        waiting = {w.replica_id for w in self.waiters}
        for rid, when in list(self.left.items()):
            if now - when > limit:
                del self.left[rid]
                self.last_member.pop(rid, None)
                self.identities.pop(rid, None)
        for rid, last in list(self.heartbeats.items()):
            if now - last > limit and rid not in waiting:
                del self.heartbeats[rid]
                self.participants.pop(rid, None)
                in_prev = self.prev is not None and rid in {
                    p.replica_id for p in self.prev.participants
                }
                if not in_prev:
                    self.last_member.pop(rid, None)
                    self.identities.pop(rid, None)

    # --- subscriptions ----------------------------------------------------------------
    def subscribe(self, call: Call) -> None:
        with self.lock:
            if self.closed:
                raise _Unavailable("lighthouse is shutting down")
            # The first message tells the subscriber it is subscribed; if it cannot be sent,
            # the caller is already gone.
            if call.write_serialized(_KEEPALIVE):
                self.subscribers.add(call)

    def close(self) -> None:
        self.ticker_wakeup.set()
        with self.lock:
            self._take_steady_locked()
            self._register_arrivals_locked(time.monotonic())
            self.closed = True
            for w in self.waiters:
                w.call.finish(grpc.StatusCode.UNAVAILABLE, "lighthouse is shutting down")
            self.waiters.clear()
            self.subscribers.finish_all()

    # --- observation ------------------------------------------------------------------
    def status(self) -> dict:
        """The status document (lighthouse_status.status_document): what the dashboard,
        its JSON and the metrics show."""
        with self.lock:
            self._apply_fast_heartbeats_locked()
            self._sync_steady_rounds_locked()
            return status_document(self, time.monotonic(), time.time())


_SERVICE = "/torchft.LighthouseService/"
_KEEPALIVE = pb.FailureNotification(keepalive=True).SerializeToString()
_HEARTBEAT_OK = pb.LighthouseHeartbeatResponse().SerializeToString()


def _check_quorum_request(
    request: pb.LighthouseQuorumRequest, call: Call
) -> Tuple[QuorumMember, Deadline, bytes]:
    """A Quorum request's member, the deadline to answer by, and the member's identity (see
    _LighthouseState.identities). Aborts the call INVALID_ARGUMENT, naming the field, when
    the request is malformed."""
    deadline = _rpc.server_deadline(call, "Quorum")
    if not request.HasField("requester"):
        _rpc.bad(call, "Quorum: requester is required")
    r = request.requester
    _rpc.check_name(call, "requester.replica_id", r.replica_id)
    _rpc.check_name(call, "requester.address", r.address, allow_empty=True)
    _rpc.check_name(call, "requester.store_address", r.store_address, allow_empty=True)
    if r.step < 0:
        _rpc.bad(call, f"requester.step must be >= 0, got {r.step}")
    if r.world_size > _rpc.MAX_RANK:
        _rpc.bad(call, f"requester.world_size {r.world_size} is too large")
    if r.commit_failures < 0:
        _rpc.bad(call, f"requester.commit_failures must be >= 0, got {r.commit_failures}")
    if len(r.data) > MAX_DATA_BYTES:
        _rpc.bad(call, f"requester.data is too large ({len(r.data)} > {MAX_DATA_BYTES} bytes)")
    if r.data:
        try:
            json.loads(r.data)
        except ValueError as e:
            _rpc.bad(call, f"requester.data is not valid JSON: {e}")
    member = wire.member_from_pb(r)
    identity = pb.QuorumMember()
    identity.CopyFrom(r)
    identity.ClearField("step")
    return member, deadline, identity.SerializeToString()


def _methods(state: _LighthouseState) -> Dict[str, Method]:
    """The torchft.LighthouseService methods, answered from ``state``."""

    def quorum(request: pb.LighthouseQuorumRequest, call: Call) -> None:
        member, deadline, identity = _check_quorum_request(request, call)
        state.quorum(member, deadline, call, identity, call.arrived)

    def heartbeat(request: pb.LighthouseHeartbeatRequest, call: Call) -> None:
        _rpc.server_deadline(call, "Heartbeat")
        _rpc.check_name(call, "replica_id", request.replica_id)
        try:
            state.heartbeat(request.replica_id, leaving=request.leaving)
        except _Unavailable as e:
            call.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        call.reply_serialized(_HEARTBEAT_OK)

    def subscribe_failures(request: pb.SubscribeFailuresRequest, call: Call) -> None:
        _rpc.server_deadline(call, "SubscribeFailures")
        _rpc.check_name(call, "subscriber", request.subscriber, allow_empty=True)
        subscriber = request.subscriber
        call.on_cancel = lambda: state.on_stream_end(subscriber, call)
        try:
            state.subscribe(call)
        except _Unavailable as e:
            call.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    return {
        _SERVICE + "Quorum": Method(pb.LighthouseQuorumRequest, quorum),
        _SERVICE + "Heartbeat": Method(pb.LighthouseHeartbeatRequest, heartbeat),
        _SERVICE + "SubscribeFailures": Method(
            pb.SubscribeFailuresRequest, subscribe_failures, streaming=True
        ),
    }


# --- dashboard (HTTP) ----------------------------------------------------------------------
# The dashboard's server, its endpoints and who may use them: ft.coordination.dashboard.server.


class LighthouseServer(ServesRpc):
    """Runs the lighthouse gRPC service, its ticker and its HTTP dashboard in this process.

    Args:
        bind: gRPC address, e.g. ``"[::]:29510"``; port 0 picks a free port.
        min_replicas: fewest replica groups in a (non fast-path) quorum.
        join_timeout_ms: how long the earliest participant waits for heartbeating stragglers
            (default 100 ms, torchft's ``LighthouseServer`` default; the ``ft-lighthouse``
            command defaults to 60,000 ms instead).
        quorum_tick_ms: period of the quorum evaluation and failure detection (default 100).
        heartbeat_timeout_ms: a replica is dead after this long without a heartbeat (default
            5,000).
        http_bind: dashboard address; default: the gRPC host with an ephemeral port. ``""``
            disables the dashboard.
        auth_token: an operator token for the dashboard (its actions and ``/api/status``),
            accepted besides a login ticket; default env ``FT_AUTH_TOKEN``.
        dead_grace_ms: dead replicas leave the dashboard this long after their heartbeat expired.
        quorum_id_file: optional file persisting the last quorum id (see module docstring).
        hostname: host name to advertise in :meth:`address` (default: derived from ``bind``).
        max_workers: most Quorum calls open at once with the grpcio transport.
        transport: gRPC server: ``"auto"`` (the native C++ one when built), ``"native"``,
            ``"grpcio"`` (see ft.coordination.rpc_server). Env ``FT_LIGHTHOUSE_TRANSPORT``
            overrides ``"auto"``.
        secret: the job secret (ft.utils.auth; default: ``FT_JOB_SECRET_FILE`` /
            ``FT_JOB_SECRET``). With it, every gRPC call must be signed with it, and the
            dashboard's status and actions need a session signed in with a login ticket made
            from it (ft.utils.dashboard_login); the secret itself is never a dashboard
            credential. Without TLS, the first server of the process to start logs a warning.
        tls: serve gRPC, and the dashboard, over TLS (ft.utils.tls; default: ``FT_TLS_*``).
        insecure: allow serving beyond loopback without a secret (default: ``FT_INSECURE``);
            without it such a start raises :class:`ft.utils.auth.InsecureServerError`.
        dashboard_idle_timeout_s: a dashboard connection that has not sent its whole request
            this long after connecting (or after its previous answer) is closed (default
            :data:`DASHBOARD_IDLE_TIMEOUT_S`).
        dashboard_max_connections: most dashboard connections open at once; more are refused
            at once (default :data:`DASHBOARD_MAX_CONNECTIONS`).
    """

    def __init__(
        self,
        bind: str,
        min_replicas: int,
        join_timeout_ms: Optional[int] = None,
        quorum_tick_ms: Optional[int] = None,
        heartbeat_timeout_ms: Optional[int] = None,
        *,
        http_bind: Optional[str] = None,
        auth_token: Optional[str] = None,
        dead_grace_ms: Optional[int] = None,
        quorum_id_file: Optional[str] = None,
        hostname: Optional[str] = None,
        max_workers: int = 1024,
        transport: str = "auto",
        secret: SecretLike = None,
        tls: Optional[TLSConfig] = None,
        insecure: Optional[bool] = None,
        dashboard_idle_timeout_s: float = DASHBOARD_IDLE_TIMEOUT_S,
        dashboard_max_connections: int = DASHBOARD_MAX_CONNECTIONS,
    ) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        if transport == "auto":
            transport = os.environ.get("FT_LIGHTHOUSE_TRANSPORT", "auto")
        join_timeout_ms = DEFAULT_JOIN_TIMEOUT_MS if join_timeout_ms is None else join_timeout_ms
        quorum_tick_ms = DEFAULT_QUORUM_TICK_MS if quorum_tick_ms is None else quorum_tick_ms
        heartbeat_timeout_ms = (
            DEFAULT_HEARTBEAT_TIMEOUT_MS if heartbeat_timeout_ms is None else heartbeat_timeout_ms
        )
        dead_grace_ms = DEFAULT_DEAD_GRACE_MS if dead_grace_ms is None else dead_grace_ms
        for name, v in (
            ("join_timeout_ms", join_timeout_ms),
            ("heartbeat_timeout_ms", heartbeat_timeout_ms),
            ("dead_grace_ms", dead_grace_ms),
        ):
            if v < 0:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if quorum_tick_ms <= 0:
            raise ValueError(f"quorum_tick_ms must be > 0, got {quorum_tick_ms}")
        if auth_token is None:
            auth_token = os.environ.get("FT_AUTH_TOKEN") or None
        self._auth_token = auth_token
        self._secret = resolve_secret(secret)
        self._tls = tls = resolve_tls(tls)
        bind_host, _ = net.split_hostport(bind)
        check_exposure(bind_host, self._secret, insecure, "the lighthouse")
        warn_cleartext(self._secret, tls, "the lighthouse")
        opts = LighthouseOptions(
            min_replicas=min_replicas,
            join_timeout_s=join_timeout_ms / 1000,
            heartbeat_timeout_s=heartbeat_timeout_ms / 1000,
        )
        self._state = _LighthouseState(
            opts, quorum_tick_ms / 1000, dead_grace_ms / 1000, quorum_id_file
        )

        self._server = RpcServer(
            bind,
            _methods(self._state),
            # Ping idle connections so that a stalled waiter's call ends.
            keepalive_ms=max(1000, heartbeat_timeout_ms),
            transport=transport,
            max_workers=max_workers,
            # Signatures are bound to this server life (docs/security.md, "Bound to one server").
            verifier=(
                Verifier(self._secret, GRPC_PURPOSE, server_id=new_server_id())
                if self._secret is not None
                else None
            ),
            name=LIGHTHOUSE_SERVER_NAME,
            tls=tls,
            # Routine heartbeats are answered in C++ (native server): the lighthouse's CPU per
            # replica group stays small when thousands of groups heartbeat.
            fast_heartbeat=_SERVICE + "Heartbeat",
            fast_heartbeat_stream=_SERVICE + "HeartbeatStream",
            # Steady rounds (the previous quorum's members asking again) are answered in C++.
            steady_quorum=_SERVICE + "Quorum",
            # Quorum calls as messages of one long-lived call per client (the native client's
            # default): no new HTTP/2 stream, headers and call object per request.
            call_streams={_SERVICE + "QuorumStream": _SERVICE + "Quorum"},
        )
        self._state.take_fast_heartbeats = self._server.take_heartbeats
        self._state.steady = self._server
        self._port = self._server.port
        self._host = _rpc.advertised_host(bind_host, hostname)

        self._http: Optional[DashboardServer] = None
        self._http_thread: Optional[threading.Thread] = None
        if http_bind is None:
            http_bind = net.join_hostport(bind_host or "::", 0)
        if http_bind:
            check_exposure(
                net.split_hostport(http_bind)[0],
                self._secret,
                insecure,
                "the lighthouse dashboard",
            )
            try:
                self._start_http(http_bind, dashboard_idle_timeout_s, dashboard_max_connections)
            except OSError:
                self._server.shutdown(0)
                raise

        self._stop = threading.Event()
        self._ticker = threading.Thread(
            target=self._tick_loop, name="ft-lighthouse-tick", daemon=True
        )
        self._ticker.start()
        logger.info(
            "lighthouse serving gRPC (%s server) on %s, dashboard on %s (min_replicas=%d, join_timeout_ms=%d, "
            "quorum_tick_ms=%d, heartbeat_timeout_ms=%d, first quorum id > %d)",
            self._server.transport,
            self.address(),
            self.dashboard_address() or "(disabled)",
            min_replicas,
            join_timeout_ms,
            quorum_tick_ms,
            heartbeat_timeout_ms,
            self._state.quorum_id,
        )

    def _start_http(self, http_bind: str, idle_timeout_s: float, max_connections: int) -> None:
        host, port = net.split_hostport(http_bind)
        host = host.strip("[]")
        if host in ("", "*"):
            host = "::"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        tls = self._tls
        self._http = DashboardServer(
            (host, port),
            status=self._state.status,
            metrics=lambda: render_metrics(self._state.status()),
            kill=lambda rid, msg: self._kill(rid, msg),  # looked up at each call
            sessions=DashboardSessions(self._secret, self._auth_token),
            ssl_context=tls.server_context() if tls is not None and tls.can_serve else None,
            family=family,
            idle_timeout_s=idle_timeout_s,
            max_connections=max_connections,
        )
        self._http_thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="ft-lighthouse-http",
            daemon=True,
        )
        self._http_thread.start()

    def _tick_loop(self) -> None:
        """Ticks every ``quorum_tick_ms``, at each current quorum member's heartbeat deadline,
        at each open Quorum call's deadline, and when woken (``ticker_wakeup``): by a new
        quorum or an earlier deadline (to re-plan), or by a cancellation notice (to handle)."""
        st = self._state
        next_regular = Deadline.after(st.tick_s)
        while not self._stop.is_set():
            # While planning, any new waiter wakes the ticker (its deadline is < inf): none
            # can slip in between the plan and its record.
            st.ticker_planned_wake = float("inf")
            try:
                expiry = st.next_expiry_in()
            except Exception:  # never let the ticker die
                logger.exception("lighthouse tick planning failed")
                expiry = st.tick_s
            wait = max(min(next_regular.remaining(), expiry), 0.0)
            st.ticker_planned_wake = time.monotonic() + wait
            woken = st.ticker_wakeup.wait(wait)
            if woken:
                st.ticker_wakeup.clear()
            if self._stop.is_set():
                return
            if woken and not st.has_events():
                continue
            try:
                st.tick()
            except Exception:  # never let the ticker die
                logger.exception("lighthouse tick failed")
            if next_regular.expired:
                next_regular = Deadline.after(st.tick_s)

    def _kill(self, replica_id: str, msg: str) -> Tuple[int, dict]:
        with self._state.lock:
            member = self._state.last_member.get(replica_id)
        if member is None:
            return 404, {"error": f"unknown replica_id {replica_id!r}"}
        if not member.address:
            return 409, {"error": f"replica {replica_id!r} has no manager address"}
        from .clients import ManagerClient

        # Signed for that replica's server alone: it refuses the kill of any other replica.
        client = ManagerClient(
            member.address,
            connect_timeout=KILL_CONNECT_TIMEOUT,
            secret=self._secret,
            tls=self._tls,
            replica_id=replica_id,
        )
        try:
            client.kill(msg, timeout=KILL_TIMEOUT)
        except Exception as e:  # the process may die before answering
            logger.warning("kill of %s at %s: %s", replica_id, member.address, e)
            return 502, {"error": f"kill of {replica_id} failed: {e}"}
        finally:
            client.close()
        logger.warning("killed %s (%s): %s", replica_id, member.address, msg)
        return 200, {"killed": replica_id}

    def dashboard_address(self) -> Optional[str]:
        """``http://host:port`` of the dashboard (``https://`` with TLS), or None when
        disabled."""
        if self._http is None:
            return None
        port = self._http.server_address[1]
        return f"{self._http.scheme}://{net.join_hostport(self._host, port)}"

    @property
    def transport(self) -> str:
        """The gRPC server serving: ``"native"`` or ``"grpcio"``."""
        return self._server.transport

    def status(self) -> dict:
        """The dashboard's status document (for tests and tools)."""
        return self._state.status()

    def shutdown(self, grace: float = 0.5) -> None:
        """Stops serving; waiting Quorum calls get UNAVAILABLE, failure streams end."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._server.close_heartbeat_fast_path()  # heartbeats now get "shutting down"
        self._state.close()
        self._server.shutdown(grace)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()  # also ends every open dashboard connection
            self._http.join_threads(2.0)
        self._ticker.join(timeout=5)
        logger.info("lighthouse %s stopped", self.address())

    def __enter__(self) -> "LighthouseServer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
