"""ManagerServer: one per replica group, in group rank 0's process (docs/design.md, "Roles").

* Quorum: waits until all ``world_size`` local ranks asked, sends one request to the lighthouse
  (a member whose step is the group's step), and answers every rank with its own
  :class:`~ft.coordination.quorum.QuorumResult` (heal source/destinations, store address, ...).
  A lost lighthouse connection is retried with backoff until the callers' deadline (or
  ``quorum_retries`` times, when set); the final failure is sent to every waiting rank (never left to hang). A rank whose
  deadline passes before the others arrive gets DEADLINE_EXCEEDED naming the missing ranks.
* ShouldCommit: an AND vote over the group's ranks, answered to all once every rank voted. A vote
  whose step disagrees with the round's (the first vote's) step is rejected with
  FAILED_PRECONDITION and counts as a "no", so the group does not commit.
* CheckpointMetadata: the metadata the given rank sent with its latest Quorum request.
* Kill: answers, then exits the process with status 1.
* The hosting process (group rank 0) reaches the same logic through
  :class:`LocalManagerClient`, without a loopback RPC.
* Heartbeats to the lighthouse every ``heartbeat_interval`` from a background thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Set, Tuple

import grpc
from google.protobuf.message import Message

from . import _rpc
from ._proto import torchft_pb2 as pb
from ._rpc import CoordinationError, Timeout
from . import wire
from .clients import LighthouseClient, ManagerCalls
from .rpc_server import Call, Method, RpcServer, ServesRpc
from ..utils.auth import (
    GRPC_PURPOSE,
    SecretLike,
    Verifier,
    check_exposure,
    manager_server_name,
    new_server_id,
    resolve_secret,
)
from ..utils import net
from ..utils.deadline import Deadline, to_seconds
from ..utils.tls import TLSConfig, resolve_tls, warn_cleartext
from .quorum import (
    GroupRequest,
    Quorum,
    QuorumResult,
    compute_quorum_result,
    merge_group_requests,
)

logger = logging.getLogger("ft.manager_server")

__all__ = ["ManagerServer", "LocalManagerClient"]


@dataclass
class _QuorumRound:
    requests: Dict[int, GroupRequest] = field(default_factory=dict)
    arrived: Set[int] = field(default_factory=set)  # every rank that asked in this round
    launched: bool = False
    done: bool = False
    quorum: Optional[Quorum] = None
    init_sync: bool = True
    error: Optional[Tuple[grpc.StatusCode, str]] = None


@dataclass
class _CommitRound:
    votes: Dict[int, Tuple[bool, int]] = field(default_factory=dict)  # rank -> (vote, step)
    voted: Set[int] = field(default_factory=set)  # every rank that voted in this round
    decision: Optional[bool] = None

    def step(self) -> Optional[int]:
        return next(iter(self.votes.values()))[1] if self.votes else None


def _fail(code: grpc.StatusCode, details: str) -> CoordinationError:
    return CoordinationError(code, details)


def _check_rank(what: str, value: int, world_size: int) -> None:
    if value < 0:
        raise _fail(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be >= 0, got {value}")
    if value >= world_size:
        raise _fail(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{what} {value} is out of range for world_size {world_size}",
        )


_SERVICE = "/torchft.ManagerService/"


def _methods(
    server: "ManagerServer", pool: futures.ThreadPoolExecutor, workers: int
) -> Dict[str, Method]:
    """The torchft.ManagerService methods: unpack requests, run the server's logic, and turn its
    CoordinationErrors into statuses. The logic itself lives on ManagerServer so that the
    group's rank 0, which hosts the server, can call it without a loopback RPC.

    Quorum and ShouldCommit wait for the group's other ranks, so they run on ``pool`` (never on
    the serving threads, which must not block); the other two answer at once. At most
    ``workers`` such calls are open at once (more get RESOURCE_EXHAUSTED, as grpcio's limit
    answers), so none waits in the pool's queue: a queued call could join a round after its
    caller gave up."""
    slots = threading.BoundedSemaphore(workers)

    def answer_later(call: Call, work: Callable[[], Message]) -> None:
        def run() -> None:
            try:
                if not call.is_active():
                    return  # the caller is gone: do not join a round on its behalf
                try:
                    response = work()
                except CoordinationError as e:
                    call.finish(e.code, e.details)
                except Exception as e:  # noqa: BLE001 - a bug must still answer the caller
                    logger.exception("manager server: %s failed", call.method)
                    call.finish(grpc.StatusCode.INTERNAL, f"{call.method}: {type(e).__name__}: {e}")
                else:
                    call.reply(response)
            except Exception:  # noqa: BLE001 - answering itself failed; nothing more to do
                logger.exception("manager server: answering %s failed", call.method)
            finally:
                slots.release()

        if not slots.acquire(blocking=False):
            call.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"manager server: {workers} calls already open"
            )
        try:
            pool.submit(run)
        except RuntimeError:  # the pool is shut down: the server is stopping
            slots.release()
            call.abort(grpc.StatusCode.UNAVAILABLE, "manager server is shutting down")

    def quorum(request: pb.ManagerQuorumRequest, call: Call) -> None:
        deadline = _rpc.server_deadline(call, "Quorum")
        req = wire.group_request_from_pb(request)
        answer_later(call, lambda: wire.result_to_pb(server.quorum(req, deadline)))

    def checkpoint_metadata(request: pb.CheckpointMetadataRequest, call: Call) -> None:
        _rpc.server_deadline(call, "CheckpointMetadata")
        try:
            md = server.checkpoint_metadata(request.rank)
        except CoordinationError as e:
            call.abort(e.code, e.details)
        call.reply(pb.CheckpointMetadataResponse(checkpoint_metadata=md))

    def should_commit(request: pb.ShouldCommitRequest, call: Call) -> None:
        deadline = _rpc.server_deadline(call, "ShouldCommit")
        answer_later(
            call,
            lambda: pb.ShouldCommitResponse(
                should_commit=server.should_commit(
                    request.group_rank, request.step, bool(request.should_commit), deadline
                )
            ),
        )

    def kill(request: pb.KillRequest, call: Call) -> None:
        _rpc.server_deadline(call, "Kill")
        logger.error("replica %s: killed by request: %s", server.replica_id, request.msg[:1000])
        t = threading.Timer(0.2, server.exit_process, args=(1,))
        t.daemon = True
        t.start()
        call.reply(pb.KillResponse())

    return {
        _SERVICE + "Quorum": Method(pb.ManagerQuorumRequest, quorum),
        _SERVICE + "CheckpointMetadata": Method(pb.CheckpointMetadataRequest, checkpoint_metadata),
        _SERVICE + "ShouldCommit": Method(pb.ShouldCommitRequest, should_commit),
        _SERVICE + "Kill": Method(pb.KillRequest, kill),
    }


class ManagerServer(ServesRpc):
    """One replica group's coordination server (torchft-compatible constructor).

    Args:
        replica_id: this group's id (``"{name}:{uuid4}"``, new on every start).
        lighthouse_addr: ``"http://host:port"`` of the lighthouse.
        hostname: host name peers use to reach this server (part of :meth:`address`).
        bind: gRPC bind address, e.g. ``"[::]:0"``.
        store_addr: this group's store address, sent to the lighthouse (``store_address``).
        world_size: number of local ranks that join each quorum and vote.
        heartbeat_interval: period of heartbeats to the lighthouse (timedelta or seconds).
        connect_timeout: bound on connecting to the lighthouse (timedelta or seconds).
        quorum_retries: at most this many extra lighthouse attempts per quorum round; None
            (default): retry a lost connection until the round's deadline.
        transport: gRPC server, see :class:`~ft.coordination.rpc_server.RpcServer`: "auto"
            (the native server where it is built), "native" or "grpcio".
        secret: the job secret (ft.utils.auth; default: ``FT_JOB_SECRET_FILE`` /
            ``FT_JOB_SECRET``): calls to this server must be signed with it, and its calls to
            the lighthouse are.
        tls: TLS for this server and its lighthouse client (ft.utils.tls; default ``FT_TLS_*``).
        insecure: allow serving beyond loopback without a secret (default: ``FT_INSECURE``).
    """

    def __init__(
        self,
        replica_id: str,
        lighthouse_addr: str,
        hostname: str,
        bind: str,
        store_addr: str,
        world_size: int,
        heartbeat_interval: Timeout,
        connect_timeout: Timeout,
        quorum_retries: Optional[int] = None,
        transport: str = "auto",
        *,
        secret: SecretLike = None,
        tls: Optional[TLSConfig] = None,
        insecure: Optional[bool] = None,
    ) -> None:
        if not replica_id:
            raise ValueError("replica_id must not be empty")
        if world_size < 1 or world_size > _rpc.MAX_RANK:
            raise ValueError(f"world_size must be in [1, {_rpc.MAX_RANK}], got {world_size}")
        if quorum_retries is not None and quorum_retries < 0:
            raise ValueError(f"quorum_retries must be >= 0, got {quorum_retries}")
        self.replica_id = replica_id
        self._lighthouse_addr = lighthouse_addr
        self._store_addr = store_addr
        self._world_size = world_size
        self._heartbeat_interval = to_seconds(heartbeat_interval) or 0.1
        self._quorum_retries = quorum_retries
        # Kill ends the process at once, without interpreter teardown; tests replace it.
        self.exit_process = os._exit
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._round = _QuorumRound()
        self._commit = _CommitRound()
        self._checkpoint_metadata: Dict[int, str] = {}
        # time.monotonic() of the last Quorum request to the lighthouse (also a heartbeat).
        self._last_quorum_sent = float("-inf")
        secret = resolve_secret(secret)
        tls = resolve_tls(tls)
        check_exposure(
            net.split_hostport(bind)[0],
            secret,
            insecure,
            f"the manager server of replica {replica_id}",
        )
        warn_cleartext(secret, tls, f"the manager server of replica {replica_id}")
        self._lighthouse = LighthouseClient(
            lighthouse_addr, connect_timeout, secret=secret, tls=tls
        )

        # Quorum and ShouldCommit calls wait for the group's ranks: each holds a pool thread.
        workers = 64 + 4 * min(world_size, 1024)
        self._pool = futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="ft-manager-server"
        )
        try:
            self._server = RpcServer(
                bind,
                _methods(self, self._pool, workers),
                transport=transport,
                max_workers=workers,
                tls=tls,
                # Signatures are bound to this server life (docs/security.md, "Bound to one
                # server"); its name is what callers that know the replica check.
                verifier=(
                    Verifier(secret, GRPC_PURPOSE, server_id=new_server_id())
                    if secret is not None
                    else None
                ),
                name=manager_server_name(replica_id),
                # Each rank's per-step calls as messages of one long-lived call per rank
                # (native server): no new HTTP/2 stream, headers and call object per step.
                call_streams={
                    _SERVICE + "QuorumStream": _SERVICE + "Quorum",
                    _SERVICE + "ShouldCommitStream": _SERVICE + "ShouldCommit",
                },
            )
        except OSError as e:
            self._pool.shutdown(wait=False)
            raise OSError(f"manager server could not bind {bind!r}: {e}") from None
        self._port = self._server.port
        bind_host, _ = net.split_hostport(bind)
        self._host = _rpc.advertised_host(bind_host, hostname)

        self._stop = threading.Event()
        self._left = False
        self._heartbeater = threading.Thread(
            target=self._heartbeat_loop, name="ft-manager-heartbeat", daemon=True
        )
        self._heartbeater.start()
        logger.info(
            "manager server %s for replica %s (%s server, world_size=%d) on %s, lighthouse %s",
            self.address(),
            replica_id,
            self._server.transport,
            world_size,
            bind,
            lighthouse_addr,
        )

    def _heartbeat_loop(self) -> None:
        """Heartbeats every ``heartbeat_interval``, except when a Quorum request (which the
        lighthouse counts as a heartbeat) went out more recently: a job whose steps are
        shorter than the interval then sends no extra heartbeat RPCs at all."""
        timeout = max(1.0, self._heartbeat_interval)
        last_log = 0.0
        while not self._stop.is_set():
            due = self._last_quorum_sent + self._heartbeat_interval
            now = time.monotonic()
            if now < due:
                if self._stop.wait(due - now):
                    return
                continue
            try:
                self._lighthouse.heartbeat(self.replica_id, timeout=timeout, wait_for_ready=False)
            except (TimeoutError, CoordinationError) as e:
                now = time.monotonic()
                if now - last_log > 10:
                    last_log = now
                    logger.warning(
                        "replica %s: heartbeat to %s failed: %s",
                        self.replica_id,
                        self._lighthouse_addr,
                        e,
                    )
            if self._stop.wait(self._heartbeat_interval):
                return

    # --- the RPCs' logic (called by the gRPC servicer and, in-process, by LocalManagerClient)

    def quorum(self, req: GroupRequest, deadline: Deadline) -> QuorumResult:
        """One rank's Quorum: waits (until ``deadline``) for the group's
        other ranks and the lighthouse's answer; returns this rank's result.

        Raises:
            CoordinationError: with the status the RPC answers (DEADLINE_EXCEEDED names the
                missing ranks, INVALID_ARGUMENT a bad request, UNAVAILABLE a shutdown, or
                the lighthouse's failure).
        """
        _check_rank("group_rank", req.group_rank, self._world_size)
        if req.step < 0:
            raise _fail(grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {req.step}")
        if req.commit_failures < 0:
            raise _fail(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"commit_failures must be >= 0, got {req.commit_failures}",
            )
        rank = req.group_rank
        leader = False
        if deadline.expired:  # never join (or lead) a round for a caller gone
            raise _fail(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"replica {self.replica_id}: Quorum arrived after its deadline",
            )
        with self._cond:
            if self._closed:
                raise _fail(grpc.StatusCode.UNAVAILABLE, "manager server is shutting down")
            self._checkpoint_metadata[rank] = req.checkpoint_metadata
            rnd = self._round
            rnd.requests[rank] = req
            rnd.arrived.add(rank)
            if len(rnd.requests) == self._world_size:
                rnd.launched = True
                self._round = _QuorumRound()
                leader = True
        if leader:
            self._ask_lighthouse(rnd, deadline)
        with self._cond:
            deadline.wait(self._cond, lambda: rnd.done or self._closed)
            if not rnd.done:
                if self._closed:
                    raise _fail(grpc.StatusCode.UNAVAILABLE, "manager server is shutting down")
                if not rnd.launched:
                    if rnd.requests.get(rank) is req:
                        del rnd.requests[rank]
                    missing = sorted(set(range(self._world_size)) - rnd.arrived)
                    raise _fail(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"replica {self.replica_id}: timed out waiting for group ranks "
                        f"{missing} to request the quorum",
                    )
                raise _fail(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"replica {self.replica_id}: timed out waiting for the lighthouse quorum",
                )
        if rnd.error is not None:
            raise _fail(*rnd.error)
        assert rnd.quorum is not None
        try:
            return compute_quorum_result(
                rnd.quorum.quorum_id,
                rnd.quorum.participants,
                self.replica_id,
                rank,
                rnd.init_sync,
            )
        except ValueError as e:
            raise _fail(
                grpc.StatusCode.INTERNAL, f"lighthouse answered a bad quorum: {e}"
            ) from None

    def checkpoint_metadata(self, rank: int) -> str:
        """The checkpoint metadata ``rank`` sent with its latest Quorum request."""
        _check_rank("rank", rank, self._world_size)
        with self._lock:
            md = self._checkpoint_metadata.get(rank)
        if md is None:
            raise _fail(
                grpc.StatusCode.NOT_FOUND,
                f"replica {self.replica_id}: rank {rank} has not sent checkpoint metadata yet",
            )
        return md

    def should_commit(self, rank: int, step: int, vote: bool, deadline: Deadline) -> bool:
        """One rank's commit vote; returns the group's AND decision once every rank voted.

        A vote whose step disagrees with the other ranks' counts as "no" and raises
        FAILED_PRECONDITION for its sender.
        """
        _check_rank("group_rank", rank, self._world_size)
        if step < 0:
            raise _fail(grpc.StatusCode.INVALID_ARGUMENT, f"step must be >= 0, got {step}")
        if deadline.expired:  # a stale vote must not decide a later round
            raise _fail(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"replica {self.replica_id}: ShouldCommit arrived after its deadline",
            )
        with self._cond:
            rnd = self._commit
            # The round's step is that of the other ranks' votes (a re-vote replaces one's own).
            others = [st for r, (_, st) in rnd.votes.items() if r != rank]
            expected = others[0] if others else None
            mismatch = expected is not None and step != expected
            if mismatch:
                rnd.votes[rank] = (False, expected)
            else:
                rnd.votes[rank] = (vote, step)
            rnd.voted.add(rank)
            if len(rnd.votes) == self._world_size:
                rnd.decision = all(v for v, _ in rnd.votes.values())
                self._commit = _CommitRound()
                self._cond.notify_all()
                if not rnd.decision:
                    logger.info(
                        "replica %s: group voted not to commit step %s",
                        self.replica_id,
                        rnd.step(),
                    )
            deadline.wait(self._cond, lambda: rnd.decision is not None or self._closed)
            if rnd.decision is None:
                if self._closed:
                    raise _fail(grpc.StatusCode.UNAVAILABLE, "manager server is shutting down")
                rnd.votes.pop(rank, None)
                missing = sorted(set(range(self._world_size)) - rnd.voted)
                raise _fail(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"replica {self.replica_id}: timed out waiting for group ranks "
                    f"{missing} to vote on step {step}",
                )
        if mismatch:
            raise _fail(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"group rank {rank} voted for step {step} but the group is at step "
                f"{expected}; counted as a vote not to commit",
            )
        return bool(rnd.decision)

    def _ask_lighthouse(self, rnd: _QuorumRound, deadline: Deadline) -> None:
        step, shrink_only, init_sync, commit_failures = merge_group_requests(
            rnd.requests, self._world_size
        )
        attempts = [1]

        def on_retry(i: int, exc: BaseException, delay: float) -> None:
            attempts[0] += 1
            # Taken before sending, so it never postdates the lighthouse's record of it.
            self._last_quorum_sent = time.monotonic() + delay
            logger.warning(
                "replica %s: lighthouse quorum attempt %d failed (%s); retrying in "
                "%.2fs (until the quorum deadline, %.1fs from now)",
                self.replica_id,
                i + 1,
                exc,
                delay,
                deadline.remaining(),
            )

        quorum = None
        error = None
        self._last_quorum_sent = time.monotonic()
        try:
            if deadline.expired:
                raise TimeoutError("the quorum deadline passed before the lighthouse was asked")
            quorum = self._lighthouse.quorum(
                self.replica_id,
                timeout=deadline.remaining(),
                address=self.address(),
                store_address=self._store_addr,
                step=step,
                world_size=self._world_size,
                shrink_only=shrink_only,
                commit_failures=commit_failures,
                # Each rank's process-group handle, in group rank order: every member's rank g
                # gets the members' rank-g handles back (compute_quorum_result).
                reconfigure_handles=[
                    rnd.requests[r].reconfigure_handle for r in range(self._world_size)
                ],
                wait_for_ready=False,
                retries=self._quorum_retries,
                on_retry=on_retry,
            )
        except TimeoutError as e:
            error = (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"replica {self.replica_id}: lighthouse quorum timed out after "
                f"{attempts[0]} attempt(s): {e}",
            )
        except CoordinationError as e:
            # ABORTED, not the lighthouse's own code: this server already retried it, and a
            # transient code would make every rank's client retry the whole round again.
            error = (
                grpc.StatusCode.ABORTED,
                f"replica {self.replica_id}: lighthouse quorum failed after "
                f"{attempts[0]} attempt(s): {e}",
            )
        except Exception as e:  # pragma: no cover - defensive
            error = (grpc.StatusCode.INTERNAL, f"lighthouse quorum failed: {e!r}")
        if error is not None:
            logger.warning("%s", error[1])
        with self._cond:
            rnd.quorum = quorum
            rnd.init_sync = init_sync
            rnd.error = error
            rnd.done = True
            self._cond.notify_all()

    def leave(self, timeout: float = 1.0) -> None:
        """Stops heartbeating and tells the lighthouse that this replica leaves cleanly, so
        that its peers are not sent a failure notification (they may still be finishing the
        last step's collectives with it). Best effort, bounded by ``timeout``: a lighthouse that
        cannot be reached times the replica out as usual."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        self._heartbeater.join(timeout=5)
        try:
            self._lighthouse.heartbeat(
                self.replica_id, timeout=timeout, wait_for_ready=False, leaving=True
            )
        except (TimeoutError, CoordinationError) as e:
            logger.info(
                "replica %s: could not tell the lighthouse it leaves: %s", self.replica_id, e
            )

    def shutdown(self, grace: float = 0.5) -> None:
        if self._closed:
            return
        self._stop.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._server.shutdown(grace)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._heartbeater.join(timeout=5)
        self._lighthouse.close()

    def __enter__(self) -> "ManagerServer":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class LocalManagerClient(ManagerCalls):
    """A :class:`~ft.coordination.ManagerClient` for the process that hosts the ManagerServer.

    Group rank 0 runs the ManagerServer, and it asks for a quorum and votes every step. Going
    through loopback gRPC would cost it a serialization, a server thread hop and about 1 ms
    of CPU per call on the training process; this client calls the server's logic directly.
    Same methods, same errors (TimeoutError for a missed deadline, CoordinationError naming
    the method otherwise), same validation. Thread-safe, like the server.
    """

    def __init__(self, server: ManagerServer) -> None:
        self._server = server

    @staticmethod
    def _call(method: str, timeout: Timeout, fn):
        t = _rpc.required_seconds(timeout, method)
        if t <= 0:
            raise TimeoutError(f"{method}: timeout must be > 0, got {t}")
        try:
            return fn(Deadline.after(t))
        except CoordinationError as e:
            if e.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise _rpc.deadline_exceeded(method, e.details) from None
            raise CoordinationError(e.code, e.details, method) from None

    def _send_quorum(self, request: GroupRequest, timeout: Timeout) -> QuorumResult:
        return self._call(
            "Quorum", timeout, lambda deadline: self._server.quorum(request, deadline)
        )

    def _send_checkpoint_metadata(self, rank: int, timeout: Timeout) -> str:
        return self._call(
            "CheckpointMetadata", timeout, lambda _: self._server.checkpoint_metadata(rank)
        )

    def _send_should_commit(
        self, group_rank: int, step: int, should_commit: bool, timeout: Timeout
    ) -> bool:
        return self._call(
            "ShouldCommit",
            timeout,
            lambda deadline: self._server.should_commit(group_rank, step, should_commit, deadline),
        )

    def close(self) -> None:
        """Nothing to release: the server belongs to its owner."""
