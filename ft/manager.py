"""The Manager: ft's per-step fault-tolerance protocol, on every rank (docs/design.md, "The step protocol").

One training step::

    manager.start_quorum()          # 1. quorum (sync, or async on a worker thread); on a new
                                    #    quorum id: pg.configure(); send / receive a checkpoint
    work = manager.allreduce(grad)  # 2. through the replica-dimension process group
    work.wait()
    if manager.should_commit():     # 3. group-wide AND vote; step += 1 on success
        optimizer.step()

The public surface (constructor, methods, environment variables) is torchft 0.2.0's.

Errors
    Everything that goes wrong inside a step (a failed collective, a failed heal, a failed
    ``pg.configure``, an error the user reports) is *reported*, never raised: the Manager
    records it (:meth:`errored`) and the step is not committed. A communication failure (a
    collective that cannot be issued, a failed heal or ``pg.configure``) also aborts the process
    group, so that peers waiting in a collective for this replica fail at once instead of
    waiting out the op timeout, and later allreduces of the step become no-ops; the next quorum
    then has ``commit_failures > 0`` and gets a new quorum id, which rebuilds the group. An
    error that leaves the process group usable (one the user reports with
    :meth:`Manager.report_error`, e.g. a NaN loss, as in torchft, or an allreduce whose Work
    failed) only marks the step as failed: later allreduces of the step still communicate,
    because the other replica groups issue them too and would otherwise wait for this one
    until their timeout.
    Quorum failures (e.g. a missing local rank, :class:`TimeoutError`) are raised by
    :meth:`start_quorum` (sync) or :meth:`wait_quorum` (async), as in torchft.

Persistent failures (docs/design.md, "Persistent failures"; the rule: :mod:`ft.manager_parts.step_failures`)
    Consecutive steps that fail with the same error (type, normalized message, phase) while
    the quorum's members stay the same are a persistent fault, not a storm to retry at full
    speed: from the third such failure the Manager backs off before each next quorum (logged
    at ERROR), and at ``max_consecutive_failures`` :meth:`should_commit` raises
    :class:`~ft.manager_parts.step_failures.PersistentStepFailure`. A committed step or a membership change
    ends the streak.

Proactive abort (docs/design.md, "Failure notifications")
    Every rank subscribes to the lighthouse's failure notifications. When a member of the
    current quorum misses its heartbeat deadline, the rank aborts its process group at once: a
    collective hung on the dead (or stopped) replica fails within about one heartbeat timeout,
    the step is not committed, and the next quorum leaves the dead replica out.

Logs
    Logger ``ft.manager``: one line per quorum, heal, commit decision and error, each starting
    with ``replica_id=... rank=... quorum_id=... step=...``; the same fields (plus the event
    name) are attached to the record as ``record.ft`` for structured handlers.
"""

from __future__ import annotations

import os
import threading
import warnings
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft.checkpointing import CheckpointTransport
from ft.coordination import (
    FailureNotification,
    ManagerClient,
    ManagerServer,
    QuorumResult,
)
from ft.manager_parts.assembly import StepHooks, StepParts
from ft.manager_parts.group_rebuild import (
    configure_for_quorum,
    configures,
    name_group_rank,
    prepare_group,
    reconfigure_from_handles,
    require_rebuildable,
)
from ft.manager_parts.heal import Healer
from ft.manager_parts.managed_work import ManagedWork, managed_allreduce, reporting_future
from ft.manager_parts.settings import (  # noqa: F401 (torchft's names, re-exported)
    CONNECT_TIMEOUT_SEC_ENV,
    LIGHTHOUSE_ENV,
    QUORUM_RETRIES_ENV,
    QUORUM_TIMEOUT_SEC_ENV,
    TIMEOUT_SEC_ENV,
    ManagerSettings,
    get_timeout,
)
from ft.manager_parts.step_errors import ExceptionWithTraceback
from ft.manager_parts.step_failures import PersistentStepFailure
from ft.manager_parts.step_queries import StepQueries
from ft.manager_parts.wiring import (  # noqa: F401 (the store keys: torchft's names, re-exported)
    LIGHTHOUSE_ADDR_KEY,
    MANAGER_ADDR_KEY,
    MANAGER_PORT_ENV,
    REPLICA_ID_KEY,
    GroupWiring,
)
from ft.observability.spans import span
from ft.protocols import GroupServerClient
from ft.utils.deadline import to_timedelta
from ft.work import _DummyWork  # torchft's name for a Work that already succeeded

__all__ = [
    "Manager",
    "WorldSizeMode",
    "ExceptionWithTraceback",
    "PersistentStepFailure",
    "get_timeout",
]

T = TypeVar("T")

# torchft's private name, which its tests import from here (those that build one pass
# torchft's own arguments and are known failures: scripts/torchft_suite.py).
_ManagedWork = ManagedWork


class WorldSizeMode(Enum):
    """How many replicas take part in a step.

    DYNAMIC: every replica in the quorum (at least ``min_replica_size`` to commit).
    FIXED_WITH_SPARES: exactly ``min_replica_size`` replicas take part; the others are spares
    that contribute zeros (and stay up to date, ready to replace a failed one).
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


# ------------------------------------------------------------------------------- manager


class Manager(StepQueries):
    """Per-step fault tolerance for one rank of one replica group (torchft 0.2.0 signature).

    Args:
        pg: the replica-dimension process group (``ft.ProcessGroupGloo``/``ProcessGroupNCCL``),
            reconfigured on every new quorum.
        load_state_dict / state_dict: optional; registered under the key ``"default"``.
        min_replica_size: fewest participating replicas for a step to commit.
        use_async_quorum: run the quorum (and the heal) on a worker thread, overlapping the
            forward/backward pass. A healing replica then contributes zeros for that step.
        timeout: bound for collectives (pg), checkpoint transfers and ShouldCommit.
        quorum_timeout: bound for one quorum.
        connect_timeout: bound for connecting to the lighthouse, the ManagerServer and the store.
        rank / world_size: this rank in its replica group (default env ``RANK``/``WORLD_SIZE``).
        world_size_mode: see :class:`WorldSizeMode`.
        store_addr / store_port: the replica group's TCPStore (default env
            ``MASTER_ADDR``/``MASTER_PORT``). Group rank 0 hosts it (unless torchrun's agent
            already does) and also the group's ManagerServer.
        lighthouse_addr: default env ``TORCHFT_LIGHTHOUSE``; needed by group rank 0 only (the
            other ranks take it from rank 0 through the store).
        replica_id: the group's name; the Manager appends ``":" + uuid4`` (new on every start).
        port: the ManagerServer's port (default env ``TORCHFT_MANAGER_PORT`` or any).
        hostname: the host peers use to reach this replica (its ManagerServer, checkpoint
            server, store and Gloo). Default: ``FT_ADVERTISE_HOST``, else the address of
            the interface that routes to the lighthouse (docs/multihost.md, "Addresses").
        heartbeat_interval: ManagerServer heartbeats to the lighthouse.
        checkpoint_transport: default ``HTTPTransport(timeout=timeout, num_chunks=0)``.
        init_sync: heal every replica from one primary at step 0 (identical initial state).
        max_retries: raise RuntimeError after this many consecutive failed commits.
        quorum_retries: at most this many extra lighthouse attempts per quorum (env
            ``TORCHFT_QUORUM_RETRIES``); None (default): a lost lighthouse connection is
            retried until ``quorum_timeout``, so a lighthouse outage or a partition shorter
            than that ends no process.
        max_consecutive_failures: an ft extension: ``should_commit`` raises
            :class:`~ft.manager_parts.step_failures.PersistentStepFailure` once this many consecutive steps
            failed with the same error (type, normalized message, phase) while the quorum's
            members stayed the same; from the third such failure the Manager backs off
            before each next quorum. None: env ``FT_MAX_CONSECUTIVE_FAILURES``, else 20; 0:
            never raise. The variable, when set, wins over the keyword (as ``TORCHFT_*``
            variables do); ``FT_FAILURE_BACKOFF_AFTER`` and ``FT_FAILURE_BACKOFF_MAX_SEC``
            tune the backoff (docs/design.md, "Persistent failures").
    """

    def __init__(
        self,
        pg: Any,
        load_state_dict: Optional[Callable[[T], None]],
        state_dict: Optional[Callable[[], T]],
        min_replica_size: int,
        use_async_quorum: bool = True,
        timeout: timedelta = timedelta(seconds=60),
        quorum_timeout: timedelta = timedelta(seconds=60),
        connect_timeout: timedelta = timedelta(seconds=60),
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        world_size_mode: WorldSizeMode = WorldSizeMode.DYNAMIC,
        store_addr: Optional[str] = None,
        store_port: Optional[int] = None,
        lighthouse_addr: Optional[str] = None,
        replica_id: Optional[str] = None,
        port: Optional[int] = None,
        hostname: Optional[str] = None,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        checkpoint_transport: Optional[CheckpointTransport[Dict[str, T]]] = None,
        init_sync: bool = True,
        max_retries: Optional[int] = None,
        quorum_retries: Optional[int] = None,
        max_consecutive_failures: Optional[int] = None,
    ) -> None:
        require_rebuildable(pg)
        settings = ManagerSettings.resolve(
            min_replica_size, timeout, quorum_timeout, connect_timeout, rank, world_size,
            lighthouse_addr, quorum_retries,
        )  # fmt: skip
        self._pg_configure_takes = prepare_group(pg, settings.timeout)
        self._pg = pg
        self._timeout, self._quorum_timeout = settings.timeout, settings.quorum_timeout
        self._rank, self._world_size = settings.rank, settings.world_size
        self._replica_id = replica_id or ""
        self._lighthouse_addr = settings.lighthouse_addr
        self._closed = False
        self._closing = threading.Event()  # set at shutdown: ends a backoff wait at once
        self._adopt_parts(
            StepParts.build(
                settings,
                StepHooks(
                    self._links, self._rebuild_group, self._manager_state_dict, self._log_context
                ),
                use_async_quorum,
                init_sync,
                min_replica_size,
                min_replica_size if world_size_mode == WorldSizeMode.FIXED_WITH_SPARES else None,
                max_retries,
                max_consecutive_failures,
            )
        )
        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)
        self._wiring: Optional[GroupWiring] = None
        try:
            self._adopt(
                GroupWiring(
                    **settings.wiring(),
                    replica_name=self._replica_id,
                    store_addr=store_addr,
                    store_port=store_port,
                    port=port,
                    hostname=hostname,
                    heartbeat_interval=heartbeat_interval,
                    transport=checkpoint_transport,
                    # this module's name, looked up now: torchft's tests substitute it
                    client_factory=ManagerClient,
                    on_failure=self._on_failure_notification,
                )
            )
        except BaseException:
            self._teardown(wait=False)
            raise
        name_group_rank(
            pg,
            self._replica_id,
            self._rank,
            self._world_size,
            os.environ.get("REPLICA_GROUP_ID", ""),
        )
        self._log.info(
            "start",
            f"manager ready (world_size={self._world_size}, "
            f"lighthouse={self._lighthouse_addr}, async_quorum={use_async_quorum})",
        )

    # ---------------------------------------------------------------- the parts' view

    def _adopt_parts(self, parts: StepParts) -> None:
        self._state, self._log, self._errors = parts.state, parts.log, parts.errors
        self._registered, self._watch, self._parts = parts.registered, parts.watch, parts
        self._vote, self._heal, self._round = parts.vote, parts.heal, parts.round

    def _adopt(self, wiring: GroupWiring) -> None:
        """Takes the group's links (they do not change until shutdown closes them)."""
        self._wiring = wiring
        self._replica_id = wiring.replica_id
        self._lighthouse_addr = wiring.lighthouse_addr
        # the group's store and its port, which tests and test workers read
        self._store, self._store_port = wiring.store, wiring.store_port
        self._manager: Optional[ManagerServer] = wiring.server
        self._client: GroupServerClient = cast(GroupServerClient, wiring.client)
        self._heal.healer = cast(Healer, wiring.healer)

    def _links(self) -> Dict[str, Any]:
        """What the parts reach through the Manager, read at each use: torchft's tests
        replace the group, the client and the transport on a live Manager."""
        return {
            "pg": self._pg,
            "client": self._client,
            "transport": self._checkpoint_transport,
            "replica_id": self._replica_id,
            "lighthouse": self._lighthouse_addr,
        }

    def _log_context(self) -> Dict[str, Any]:
        s = self._state
        return {
            "replica_id": self._replica_id,
            "rank": self._rank,
            "quorum_id": s.quorum_id,
            "step": s.step,
        }

    def _teardown(self, wait: bool) -> None:
        if self._wiring is not None:
            self._wiring.close(wait)
        self._parts.close(wait)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the Manager's servers, subscription and threads (not the process group)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._heal.abandon_pending("the source shut down")
        self._teardown(wait)
        self._log.info("shutdown", "manager shut down")

    # ---------------------------------------------------------------- state dicts

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers state to send to (and load on) healing replicas under ``key``."""
        self._registered.register(key, cast(Callable[[Any], None], load_state_dict), state_dict)

    def set_state_dict_fns(
        self, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Deprecated (as in torchft): registers the functions under the key
        ``"set_state_dict_fns"``; use :meth:`register_state_dict_fn`."""
        warnings.warn(
            "Manager.set_state_dict_fns is deprecated; use register_state_dict_fn",
            DeprecationWarning,
            stacklevel=2,
        )
        self.register_state_dict_fn("set_state_dict_fns", load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        """Lets checkpoint transfers read the registered state again."""
        self._registered.allow_reads()

    def disallow_state_dict_read(self) -> None:
        """Blocks reads of the registered state (while the caller mutates it)."""
        self._registered.disallow_reads()

    def _manager_state_dict(self) -> Dict[str, Any]:
        return {"user": self._registered.read(), "torchft": self.state_dict()}

    def state_dict(self) -> Dict[str, int]:
        """The Manager's own state: ``{"step", "batches_committed"}``."""
        return self._state.counters()

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self._state.load_counters(state_dict)

    # ---------------------------------------------------------------- errors

    def report_error(self, e: Exception) -> None:
        """Marks the current step as failed: :meth:`should_commit` returns False for it (on
        every replica of the quorum).

        As in torchft, this does not abort the process group (users call it to skip a bad
        step, e.g. a NaN loss), and later allreduces of the step still communicate: the other
        groups, which know nothing of this error, issue them too. Communication failures the
        Manager detects itself do abort it, and make later allreduces of the step no-ops.
        """
        self._report_error(e, False)

    def abort_step(self, e: Exception) -> None:
        """Marks the current step as failed, like :meth:`report_error`, and also aborts the
        process group, so that the other groups' matching collectives fail at once. For code
        that cannot issue the collectives its peers expect this step (an ft extension);
        the next :meth:`start_quorum` reconfigures the group."""
        self._report_error(e, True)

    def _report_error(self, e: Exception, abort: bool, phase: str = "user") -> None:
        self._parts.report(e, abort, phase)

    def wrap_future(
        self, fut: torch.futures.Future, default: T, timeout: Optional[timedelta] = None
    ) -> torch.futures.Future:
        """Returns a future that never fails: on error, reports it and yields ``default``.

        If ``fut`` has not completed within ``timeout`` (default: the Manager's ``timeout``),
        the returned future completes with ``default`` then, and a :class:`TimeoutError` is
        reported (the step will not commit), as in torchft.
        """
        t = to_timedelta(timeout) if timeout is not None else self._timeout
        return reporting_future(fut, default, t, self._report_error)

    def _on_failure_notification(self, n: FailureNotification) -> None:
        if not self._closed:
            self._parts.on_member_failure(n, self._replica_id, self._pg)

    # ---------------------------------------------------------------- quorum

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: Optional[timedelta] = None,
    ) -> None:
        """Starts the quorum for the next step (on a worker thread in async mode).

        In sync mode this waits for the quorum and applies a healed state before returning
        (raising the quorum's failure, e.g. :class:`TimeoutError`).
        """
        if self._closed:
            raise RuntimeError("Manager is shut down")
        self._round.settle_previous()
        self._parts.begin_step(self._closing)
        self._round.start(
            allow_heal,
            shrink_only,
            to_timedelta(timeout) if timeout is not None else self._quorum_timeout,
        )
        if not self._state.use_async_quorum:
            self.wait_quorum()
            self._apply_heal()

    @span("torchft::manager::wait_quorum")
    def wait_quorum(self) -> None:
        """Waits for the quorum started by :meth:`start_quorum` (raises its failure).

        With a sync quorum that includes a heal this replica receives. With an async one it
        does not: the heal is applied at :meth:`should_commit`, and its source sends the state
        only at its own should_commit, after the step's collectives, which this replica must
        join first (a wait for the heal here would hold both until the heal timed out)."""
        if self._round.future is None:
            raise RuntimeError("start_quorum() must be called before wait_quorum()")
        if self._state.use_async_quorum:
            self._round.wait_decided()
        else:
            self._round.wait_done()

    def _apply_heal(self) -> None:
        """Loads a healed state, on the training thread (start_quorum in sync mode,
        should_commit in async mode)."""
        if self._state.healing:
            self._heal.apply_pending()
            self._state.healing = False

    def send_pending_heal(self) -> None:
        """Sends this replica's state to the replicas that the step's quorum heals from it,
        now, on the calling thread, if that is still due (an ft extension).

        In async mode a heal source reads its state on the training thread, never on the
        quorum thread while the forward pass runs (FSDP2's state-dict hooks swap the
        parameters that forward uses): :meth:`should_commit` sends it before its vote. Call
        this earlier only where the state changes within the step before should_commit
        (``ft.optim.apply_optimizer_in_backward`` does). A failure is reported (the step
        does not commit) and the receivers are told at once."""
        self._heal.send_pending()

    def _rebuild_group(self, quorum: QuorumResult) -> None:
        self._configuring = quorum
        try:
            self._reconfigure_pg(
                quorum.quorum_id, list(getattr(quorum, "reconfigure_handles", None) or [])
            )
        finally:
            self._configuring = None

    def _reconfigure_pg(self, communicator_id: int, handles: List[str]) -> None:
        """Rebuilds the process group for a new quorum (torchft-nightly's name and
        arguments): with ``configure()`` on the quorum's store where the group has one (the
        quorum is the one being taken in), else with ``reconfigure`` on the members' handles
        (ft.manager_parts.group_rebuild). Raises what either raises."""
        quorum = getattr(self, "_configuring", None)
        if quorum is not None and configures(self._pg):
            self._configure_pg(quorum)
        else:
            reconfigure_from_handles(self._pg, communicator_id, handles, self._timeout)

    def _configure_pg(self, quorum: QuorumResult) -> None:
        configure_for_quorum(
            self._pg,
            quorum,
            self._rank,
            self._world_size,
            self._replica_id,
            self._pg_configure_takes,
        )

    # ---------------------------------------------------------------- collectives

    @span("torchft::manager::allreduce")
    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: Union[bool, torch.dtype] = False,
        reduce_op: ReduceOp = ReduceOp.AVG,
    ) -> dist.Work:
        """Allreduces ``tensor`` in place across the participating replicas.

        Never raises for communication failures: they are reported (the step will not commit)
        and the returned Work completes with the tensor's current contents. AVG runs as SUM,
        then divides by :meth:`num_participants`; replicas that do not participate contribute
        zeros. With ``should_quantize`` a floating-point tensor crosses the wire as int8 with
        blockwise scales and is accumulated in fp32 (:func:`ft.collectives.allreduce_quantized`);
        an ft extension: ``should_quantize=torch.float8_e4m3fn`` (or ``float8_e5m2``) sends fp8.
        """
        # Only after an abort: the peers' matching collectives fail with it. After an error that
        # leaves the group usable, every group still issues the same collectives in the same
        # order; skipping here, where the error is seen at a different moment on each group
        # (a Work's failure arrives on a callback), would leave a peer waiting for this one.
        if self._errors.aborted:
            return _DummyWork(tensor)
        self._round.wait_decided()
        if not self.is_participating():
            tensor.zero_()
        return managed_allreduce(
            self._pg,
            tensor,
            self.num_participants(),
            should_quantize,
            reduce_op,
            self._report_error,
        )

    # ---------------------------------------------------------------- commit

    @span("torchft::manager::should_commit")
    def should_commit(self, timeout: Optional[timedelta] = None) -> bool:
        """The group-wide decision to commit this step (docs/design.md, "The step protocol", step 3).

        Raises:
            RuntimeError: ``max_retries`` consecutive failed commits were exceeded.
            PersistentStepFailure: ``max_consecutive_failures`` consecutive steps failed with
                the same error in the same membership (a RuntimeError; its message names the
                error, the phase and the count).
        """
        if self._round.future is not None:
            # Here a healing replica waits for its state (its source sends it at its own
            # should_commit, after the step's collectives).
            self._round.wait_done()
        # This step's state, still unchanged, for the replicas healing from this one: read
        # here, on the training thread, before the vote that lets anyone change it.
        self._heal.send_pending()
        self._apply_heal()
        return self._vote.vote(to_timedelta(timeout) if timeout is not None else self._timeout)
