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

import dataclasses
import inspect
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future as _ConcurrentFuture
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, TypeVar, Union, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft.collectives import allreduce_quantized
from ft.checkpointing import CheckpointTransport, RWLock
from ft.checkpointing.dtensor_codec import restore_dtensors
from ft.coordination import (
    FailureNotification,
    LighthouseClient,
    ManagerClient,
    ManagerServer,
    QuorumResult,
)
from ft.coordination.quorum import Participation, participation
from ft.backend.process_group import ProcessGroup as _FtProcessGroup
from ft.backend.process_group import ReconfigureOptions, can_reconfigure
from ft.manager_parts.progress_watch import ProgressWatch
from ft.manager_parts.state_dicts import RegisteredState
from ft.manager_parts.step_errors import ExceptionWithTraceback, StepErrors
from ft.manager_parts.step_outcomes import StepOutcomes
from ft.manager_parts.wiring import (  # noqa: F401 (the store keys: torchft's names, re-exported)
    LIGHTHOUSE_ADDR_KEY,
    MANAGER_ADDR_KEY,
    MANAGER_PORT_ENV,
    REPLICA_ID_KEY,
    GroupWiring,
)
from ft.work import _DummyWork
from ft.observability import records
from ft.manager_parts.heal import Healer
from ft.protocols import GroupServerClient
from ft.observability.spans import span, span_block
from ft.manager_parts.step_failures import (
    PersistentStepFailure,
    StepFailure,
    StepFailurePolicy,
)
from ft.utils.deadline import Deadline, to_seconds, to_timedelta

__all__ = [
    "Manager",
    "WorldSizeMode",
    "ExceptionWithTraceback",
    "PersistentStepFailure",
    "get_timeout",
]

T = TypeVar("T")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
TIMEOUT_SEC_ENV = "TORCHFT_TIMEOUT_SEC"
QUORUM_TIMEOUT_SEC_ENV = "TORCHFT_QUORUM_TIMEOUT_SEC"
CONNECT_TIMEOUT_SEC_ENV = "TORCHFT_CONNECT_TIMEOUT_SEC"
QUORUM_RETRIES_ENV = "TORCHFT_QUORUM_RETRIES"

logger = logging.getLogger("ft.manager")


class WorldSizeMode(Enum):
    """How many replicas take part in a step.

    DYNAMIC: every replica in the quorum (at least ``min_replica_size`` to commit).
    FIXED_WITH_SPARES: exactly ``min_replica_size`` replicas take part; the others are spares
    that contribute zeros (and stay up to date, ready to replace a failed one).
    """

    DYNAMIC = 0
    FIXED_WITH_SPARES = 1


def _env_timeout(name: str, default: timedelta) -> timedelta:
    """The timeout in seconds that environment variable ``name`` sets, else ``default``."""
    return get_timeout(os.environ.get(name), default)


def get_timeout(timeout_sec_env: Optional[str], default_timeout_sec: timedelta) -> timedelta:
    """torchft's helper: ``timeout_sec_env`` is the *value* of a seconds variable (e.g.
    ``os.environ.get("TORCHFT_TIMEOUT_SEC")``); None or empty gives ``default_timeout_sec``.

    torchft parses the value with ``int``; ft also accepts fractional seconds ("1.5").
    """
    if timeout_sec_env is None or str(timeout_sec_env).strip() == "":
        return default_timeout_sec
    try:
        return timedelta(seconds=float(timeout_sec_env))
    except ValueError:
        raise ValueError(f"a timeout in seconds was expected, got {timeout_sec_env!r}") from None


# ------------------------------------------------------------------------------- works


def _caller_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device, or None without CUDA (never initializes CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def _future_within(fut: torch.futures.Future, timeout: timedelta) -> torch.futures.Future:
    """A future with ``fut``'s outcome, or a :class:`TimeoutError` if ``fut`` has not completed
    ``timeout`` from now (``fut`` itself is left alone)."""
    if fut.done():
        return fut
    devices = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else None
    )
    out: torch.futures.Future = torch.futures.Future(devices=devices)
    lock = threading.Lock()
    settled = [False]

    def settle(set_outcome: Callable[[], None]) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        set_outcome()

    def expire() -> None:
        settle(
            lambda: out.set_exception(
                TimeoutError(f"future did not complete within {timeout.total_seconds():g}s")
            )
        )

    timer = threading.Timer(max(0.0, to_seconds(timeout) or 0.0), expire)
    timer.daemon = True
    timer.start()

    def done(f: torch.futures.Future) -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - passed on
            settle(lambda err=e: out.set_exception(err))
            return
        settle(lambda: out.set_result(value))

    fut.add_done_callback(done)
    return out


class _ManagedWork(dist.Work):
    """Wraps a backend Work: failures are reported to the Manager, never raised.

    ``get_future()`` returns a future whose value is the reduced tensor (divided for AVG); it
    never completes with an error, so DDP's reducer and user callbacks never see one.
    ``wait(timeout)`` with a timeout that passes first reports a TimeoutError to the Manager
    (through ``on_timeout``: the step fails and nobody commits it) and returns False, as
    torchft's does.
    """

    def __init__(
        self,
        fut: torch.futures.Future,
        on_timeout: Optional[Callable[[Exception], None]] = None,
    ) -> None:
        super().__init__()
        self._fut = fut
        self._on_timeout = on_timeout

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        # Never raises: the callback chain turns failures into a reported error. For CUDA
        # values this makes the current stream wait (no CPU block).
        # torch's C++ callers pass 0 for "no timeout" (c10d's kNoTimeout).
        if timeout is not None and to_seconds(timeout) > 0 and not self._fut.done():
            finished = threading.Event()
            self._fut.add_done_callback(lambda _f: finished.set())
            if not Deadline.after(timeout).wait_event(finished):
                error = TimeoutError(
                    f"allreduce did not complete within {to_seconds(timeout):g}s "
                    "(the timeout given to wait())"
                )
                if self._on_timeout is not None:
                    self._on_timeout(error)
                return False
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


class _EveryName:
    """Holds every name: the keyword names of a function that takes ``**kwargs``."""

    def __contains__(self, _name: object) -> bool:
        return True


_EVERY_NAME = _EveryName()


def _configures(pg: Any) -> bool:
    """Whether the Manager rebuilds ``pg`` with ``configure()`` on the quorum's store (ft's
    groups, and groups written for torchft 0.2.0) rather than with ``reconfigure(opts)`` on
    handles exchanged through the lighthouse (torch's own groups made with
    ``enable_reconfigure=True``, and subclasses that implement only ``reconfigure``)."""
    if not callable(getattr(pg, "configure", None)):
        return False
    impl = getattr(type(pg), "configure", None)
    # None: an instance attribute (a mock, a duck-typed group); else it must be a real one.
    return impl is None or impl is not _FtProcessGroup.configure


def _group_error(pg: Any) -> Optional[Exception]:
    """The process group's pending error, or None: ``errored()`` of a group that has it (ft's,
    torchft's); else the error its backends report (``get_error()``, torch's own groups)."""
    errored = getattr(pg, "errored", None)
    if errored is not None:
        return errored()
    for device in getattr(pg, "_device_types", None) or ():
        try:
            backend = pg._get_backend(device)
        except RuntimeError:
            continue
        get_error = getattr(backend, "get_error", None)
        error = get_error() if get_error is not None else None
        if error is not None and error != torch._C._distributed_c10d.ErrorType.SUCCESS:
            return dist.DistBackendError(f"the process group's {device} backend reports {error}")
    return None


def _can_rebuild(pg: Any) -> bool:
    return _configures(pg) or can_reconfigure(pg)


def _keyword_parameters(fn: Callable[..., Any]) -> Any:
    """The keyword names ``fn`` accepts (a set-like that holds every name if it takes
    ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return _EVERY_NAME
    return frozenset(
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    )


class _Log:
    """Formats the Manager's structured log lines."""

    def __init__(self, manager: "Manager") -> None:
        self._m = manager

    def _emit(
        self, level: int, event: str, msg: str, exc_info: bool = False, **fields: Any
    ) -> None:
        if not logger.isEnabledFor(level):
            return
        m = self._m
        base = {
            "event": event,
            "replica_id": m._replica_id,
            "rank": m._rank,
            "quorum_id": m._quorum_id,
            "step": m._step,
        }
        base.update(fields)
        text = " ".join(f"{k}={v}" for k, v in base.items() if k != "event")
        logger.log(level, "%s %s: %s", event, text, msg, exc_info=exc_info, extra={"ft": base})

    def info(self, event: str, msg: str = "", **fields: Any) -> None:
        self._emit(logging.INFO, event, msg, **fields)

    def warning(self, event: str, msg: str = "", **fields: Any) -> None:
        self._emit(logging.WARNING, event, msg, **fields)

    def error(self, event: str, msg: str = "", exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, msg, exc_info=exc_info, **fields)


# ------------------------------------------------------------------------------- manager


class Manager:
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
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be >= 1, got {min_replica_size}")
        if not _can_rebuild(pg):
            raise ValueError(
                f"Manager(pg=...): {type(pg).__name__} cannot be reconfigured at a new quorum. "
                f"Pass one of ft's process groups (ft.ProcessGroupGloo, ft.ProcessGroupNCCL, "
                f"...), or a torch process group created with enable_reconfigure=True (torch "
                f"2.14 and later, with a backend that supports reconfigure)"
            )
        self._pg = pg
        # A process group written against torchft's base class may take only the four
        # positional arguments: ft's extra facts go only to a configure() that names them.
        self._pg_configure_takes = (
            _keyword_parameters(pg.configure) if _configures(pg) else frozenset()
        )
        self._min_replica_size = min_replica_size
        self._use_async_quorum = use_async_quorum
        self._world_size_mode = world_size_mode
        self._init_sync = init_sync
        self._max_retries = max_retries
        self._timeout = _env_timeout(TIMEOUT_SEC_ENV, to_timedelta(timeout))
        # Manager(timeout=) bounds every collective, as in torchft, through the one deadline
        # the backend already enforces per op: the tighter of the two wins.
        pg_timeout = getattr(pg, "timeout", None)
        if (
            isinstance(pg_timeout, timedelta)
            and hasattr(pg, "set_timeout")
            and self._timeout < pg_timeout
        ):
            pg.set_timeout(self._timeout)
        self._quorum_timeout = _env_timeout(QUORUM_TIMEOUT_SEC_ENV, to_timedelta(quorum_timeout))
        self._connect_timeout = _env_timeout(CONNECT_TIMEOUT_SEC_ENV, to_timedelta(connect_timeout))
        env_retries = os.environ.get(QUORUM_RETRIES_ENV)
        if env_retries:
            quorum_retries = int(env_retries)

        self._rank = int(rank if rank is not None else os.environ.get("RANK", "0"))
        self._world_size = int(
            world_size if world_size is not None else os.environ.get("WORLD_SIZE", "1")
        )
        if not 0 <= self._rank < self._world_size:
            raise ValueError(f"rank {self._rank} out of range for world_size {self._world_size}")

        # state
        self._step = 0
        self._batches_committed = 0
        self._commit_failures = 0
        self._quorum_id = -1
        self._quorum_replica_ids: frozenset = frozenset()
        self._quorum_lock = threading.Lock()
        # This step's first error, where it arose, whether it aborted the process group.
        self._errors = StepErrors(
            abort_group=lambda: self._pg.abort(),
            on_first=lambda e: self._log.error("error", f"{type(e).__name__}: {e}"),
        )
        # Set at shutdown: ends a backoff wait at once.
        self._closing = threading.Event()
        self._healing = False
        self._pending_state_dict: Optional[Dict[str, Any]] = None
        # The step counters before a heal set them, put back should the healed state not load.
        self._pending_prior_counters: Optional[Dict[str, int]] = None
        self._participation = Participation(rank=None, contributors=0, commit_size=0)
        self._quorum_future: Optional[_ConcurrentFuture] = None
        # Set once the quorum of the step is decided and the process group configured (or the
        # quorum failed: then _quorum_error); a heal may still be arriving (docs/design.md,
        # "Heal"). Collectives wait for this, not for the heal.
        self._decided = threading.Event()
        self._quorum_error: Optional[BaseException] = None
        # Async quorum: the quorum whose heal this replica, as a source, sends from the
        # training thread (send_pending_heal, at should_commit at the latest).
        self._heal_send_due: Optional[QuorumResult] = None
        self._state = RegisteredState(lock_timeout_s=self._timeout.total_seconds())
        self._replica_id = replica_id or ""
        self._log = _Log(self)
        # The failure streak across steps, the wait it owes, the last step's error.
        self._outcomes = StepOutcomes(
            StepFailurePolicy.from_settings(max_consecutive_failures, os.environ), self._log
        )
        self._closed = False
        # The group's links (ft.manager_parts.wiring), made below; read through the
        # attributes _adopt sets.
        self._wiring: Optional[GroupWiring] = None
        self._manager: Optional[ManagerServer] = None
        self._lighthouse_client: Optional[LighthouseClient] = None
        self._healer: Optional[Healer] = None
        self._watch = ProgressWatch(
            self._quorum_timeout.total_seconds(),
            lambda: (
                f"replica {self._replica_id} step={self._step} quorum_id={self._quorum_id} "
                f"members={sorted(self._quorum_replica_ids)}"
            ),
        )

        if load_state_dict is not None and state_dict is not None:
            self.register_state_dict_fn("default", load_state_dict, state_dict)

        lighthouse_addr = lighthouse_addr or os.environ.get(LIGHTHOUSE_ENV)
        if not lighthouse_addr and self._rank == 0:
            raise ValueError(f"lighthouse_addr is required (or set {LIGHTHOUSE_ENV})")
        # Other group ranks may take it from rank 0 (_setup_group).
        self._lighthouse_addr: Optional[str] = lighthouse_addr or None

        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-async-quorum")
        try:
            # The default checkpoint transport is made once the advertised host is known, so
            # that it listens on that interface only.
            self._adopt(
                GroupWiring(
                    rank=self._rank,
                    world_size=self._world_size,
                    replica_name=self._replica_id,
                    lighthouse_addr=self._lighthouse_addr,
                    store_addr=store_addr,
                    store_port=store_port,
                    port=port,
                    hostname=hostname,
                    heartbeat_interval=heartbeat_interval,
                    quorum_retries=quorum_retries,
                    timeout=self._timeout,
                    connect_timeout=self._connect_timeout,
                    transport=checkpoint_transport,
                    # this module's name, looked up now: torchft's tests substitute it
                    client_factory=ManagerClient,
                    on_failure=self._on_failure_notification,
                )
            )
        except BaseException:
            self._teardown(wait=False)
            raise
        if isinstance(pg, _FtProcessGroup):
            # Its reconfigure handle names its job-wide rank where the group id is a number
            # (REPLICA_GROUP_ID, torchft's launchers), as torchft's does.
            group_id = os.environ.get("REPLICA_GROUP_ID", "")
            pg.set_rank_info(
                self._replica_id,
                self._rank,
                self._world_size,
                int(group_id) * self._world_size + self._rank if group_id.isdigit() else None,
            )
        self._log.info(
            "start",
            f"manager ready (world_size={self._world_size}, "
            f"lighthouse={lighthouse_addr}, async_quorum={use_async_quorum})",
        )

    # ---------------------------------------------------------------- setup / teardown

    def _adopt(self, wiring: GroupWiring) -> None:
        """Takes the group's links (they do not change until shutdown closes them)."""
        self._wiring = wiring
        self._replica_id = wiring.replica_id
        self._lighthouse_addr = wiring.lighthouse_addr
        self._advertise_host = wiring.advertise_host
        self._store = wiring.store
        self._store_addr = wiring.store_addr
        self._store_port = wiring.store_port
        self._manager = wiring.server
        self._client: GroupServerClient = cast(GroupServerClient, wiring.client)
        self._lighthouse_client = wiring.lighthouse_client
        self._healer = wiring.healer

    @property
    def _checkpoint_transport(self) -> Optional[CheckpointTransport[Dict[str, Any]]]:
        """The checkpoint transport heals go through. Assigning one (torchft's tests replace
        it after construction) hands it to the Healer as well, so the next heal uses it, and
        shutdown ends it."""
        return self._wiring.transport if self._wiring is not None else None

    @_checkpoint_transport.setter
    def _checkpoint_transport(self, transport: CheckpointTransport[Dict[str, Any]]) -> None:
        assert self._wiring is not None and self._healer is not None
        self._wiring.transport = transport
        self._healer.transport = transport

    # torchft's private names its tests read (and replace, the lock): ft keeps these in the
    # Manager's parts (ft.manager_parts).
    @property
    def _errored(self) -> Optional[ExceptionWithTraceback]:
        return self._errors.first

    @property
    def _state_dict_lock(self) -> RWLock:
        return self._state.lock

    @_state_dict_lock.setter
    def _state_dict_lock(self, lock: RWLock) -> None:
        self._state.lock = lock

    @property
    def _is_state_dict_read_allowed(self) -> bool:
        return self._state.reads_allowed

    # torchft's names for this step's participation (its tests set them directly); ft keeps
    # the three numbers in one Participation, which these read and replace.
    @property
    def _participating_replica_rank(self) -> Optional[int]:
        return self._participation.rank

    @_participating_replica_rank.setter
    def _participating_replica_rank(self, rank: Optional[int]) -> None:
        self._participation = dataclasses.replace(self._participation, rank=rank)

    @property
    def _participating_replica_world_size(self) -> int:
        return self._participation.contributors

    @_participating_replica_world_size.setter
    def _participating_replica_world_size(self, size: int) -> None:
        self._participation = dataclasses.replace(
            self._participation, contributors=size, commit_size=size
        )

    def _teardown(self, wait: bool) -> None:
        self._watch.close()
        if self._wiring is not None:
            self._wiring.close(wait)
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def shutdown(self, wait: bool = True) -> None:
        """Stops the Manager's servers, subscription and threads (not the process group)."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._abandon_pending_heal("the source shut down")
        self._teardown(wait)
        self._log.info("shutdown", "manager shut down")

    # ---------------------------------------------------------------- state dicts

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None:
        """Registers state to send to (and load on) healing replicas under ``key``."""
        self._state.register(key, cast(Callable[[Any], None], load_state_dict), state_dict)

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
        self._state.allow_reads()

    def disallow_state_dict_read(self) -> None:
        """Blocks reads of the registered state (while the caller mutates it)."""
        self._state.disallow_reads()

    def _manager_state_dict(self) -> Dict[str, Any]:
        return {"user": self._state.read(), "torchft": self.state_dict()}

    def state_dict(self) -> Dict[str, int]:
        """The Manager's own state: ``{"step", "batches_committed"}``."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def _apply_pending_state_dict(self) -> None:
        """Loads the healed state, on the training thread (start_quorum in sync mode,
        should_commit in async mode)."""
        pending = self._pending_state_dict
        self._pending_state_dict = None
        if pending is None:
            return  # the heal failed; the error is already reported
        try:
            # DTensors become DTensors again on this rank's own meshes, checked against its
            # own state (docs/design.md, "HSDP"); a mismatch loads nothing.
            user = restore_dtensors(pending["user"], lambda: self._manager_state_dict()["user"])
        except Exception as e:  # noqa: BLE001
            # Not healed after all: back to this replica's own step, so that the next quorum
            # heals it again instead of counting it as up to date.
            if self._pending_prior_counters is not None:
                self.load_state_dict(self._pending_prior_counters)
            self._log.error("heal", f"recovery failed: {type(e).__name__}: {e}")
            self._report_error(e, abort=True, phase="heal")
            return
        self._state.load(user)
        self._log.info("heal_applied", "applied the healed state")

    # ---------------------------------------------------------------- errors

    def report_error(self, e: Exception) -> None:
        """Marks the current step as failed: :meth:`should_commit` returns False for it (on
        every replica of the quorum).

        As in torchft, this does not abort the process group (users call it to skip a bad
        step, e.g. a NaN loss), and later allreduces of the step still communicate: the other
        groups, which know nothing of this error, issue them too. Communication failures the
        Manager detects itself do abort it, and make later allreduces of the step no-ops.
        """
        self._report_error(e, abort=False)

    def abort_step(self, e: Exception) -> None:
        """Marks the current step as failed, like :meth:`report_error`, and also aborts the
        process group, so that the other groups' matching collectives fail at once. For code
        that cannot issue the collectives its peers expect this step (an ft extension);
        the next :meth:`start_quorum` reconfigures the group."""
        self._report_error(e, abort=True)

    def step_aborted(self) -> bool:
        """Whether an error this step aborted the process group (a communication failure the
        Manager detected). The step's later allreduces are then no-ops: the peers' matching
        collectives fail with the abort. After an error that did not abort
        (:meth:`report_error`, a failed Work), collectives still run, and an algorithm that
        issues its own (ZeRO's parameter exchange) must issue them too, or the other groups
        wait for them until their op timeout."""
        return self._errors.aborted

    def _report_error(self, e: Exception, abort: bool, phase: str = "user") -> None:
        """``phase``: where in the step ``e`` arose (ft.manager_parts.step_failures.PHASES);
        "user" for an error the training code reports."""
        self._watch.error(e)
        self._errors.report(e, abort, phase)

    def errored(self) -> Optional[ExceptionWithTraceback]:
        """The first error reported during this step, or None.

        An :class:`ExceptionWithTraceback` (torchft's type) that is also an instance of the
        reported exception's type, so ``isinstance(m.errored(), TimeoutError)`` holds for a
        reported TimeoutError; the reported exception is its ``original_exception``.
        """
        return self._errors.first

    def wrap_future(
        self, fut: torch.futures.Future, default: T, timeout: Optional[timedelta] = None
    ) -> torch.futures.Future:
        """Returns a future that never fails: on error, reports it and yields ``default``.

        If ``fut`` has not completed within ``timeout`` (default: the Manager's ``timeout``),
        the returned future completes with ``default`` then, and a :class:`TimeoutError` is
        reported (the step will not commit), as in torchft.
        """
        t = to_timedelta(timeout) if timeout is not None else self._timeout

        def callback(f: torch.futures.Future) -> Any:
            try:
                return f.value()
            except Exception as e:  # noqa: BLE001
                self._report_error(e, abort=False, phase="allreduce")
                return default

        return _future_within(fut, t).then(callback)

    # ---------------------------------------------------------------- failure notifications

    def _on_failure_notification(self, n: FailureNotification) -> None:
        if self._closed or n.replica_id == self._replica_id:
            return
        with self._quorum_lock:
            if n.quorum_id != self._quorum_id or n.replica_id not in self._quorum_replica_ids:
                return
            self._log.warning(
                "proactive_abort",
                f"quorum member {n.replica_id} died ({n.error_message}); aborting the process group",
                dead=n.replica_id,
            )
            try:
                self._pg.abort()
            except Exception:  # noqa: BLE001
                logger.exception("pg.abort() failed")

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
        if self._quorum_future is not None:
            try:
                self._quorum_future.result()
            except Exception:  # noqa: BLE001 - already surfaced by wait_quorum, or moot
                pass
        # A heal the last step owed and never sent (its should_commit did not run): its
        # receivers learn now instead of at their timeout.
        self._abandon_pending_heal("the source began its next step without sending it")
        self._back_off()
        self._errors.clear()
        self._outcomes.new_step()
        self._healing = False
        self._pending_state_dict = None
        self._decided.clear()
        self._quorum_error = None
        quorum_timeout = to_timedelta(timeout) if timeout is not None else self._quorum_timeout
        self._quorum_future = self._executor.submit(
            self._async_quorum_on_device,
            _caller_cuda_device(),
            allow_heal,
            shrink_only,
            quorum_timeout,
        )
        if not self._use_async_quorum:
            self.wait_quorum()
            if self._healing:
                # Apply the healed state now so that the forward pass uses it.
                self._apply_pending_state_dict()
                self._healing = False

    @span("torchft::manager::wait_quorum")
    def wait_quorum(self) -> None:
        """Waits for the quorum started by :meth:`start_quorum` (raises its failure).

        With a sync quorum that includes a heal this replica receives. With an async one it
        does not: the heal is applied at :meth:`should_commit`, and its source sends the state
        only at its own should_commit, after the step's collectives, which this replica must
        join first (a wait for the heal here would hold both until the heal timed out)."""
        if self._quorum_future is None:
            raise RuntimeError("start_quorum() must be called before wait_quorum()")
        if self._use_async_quorum:
            self._wait_decided()
            return
        self._wait_quorum_done()

    def _wait_quorum_done(self) -> None:
        """Waits for the whole quorum of this step, a heal this replica receives included
        (raises its failure)."""
        try:
            self._quorum_future.result()
        except Exception as e:  # noqa: BLE001 - raised again, or as what it amounts to
            failure = self._quorum_failed(e)
            if failure is e:
                raise
            raise failure from e

    def _wait_decided(self) -> None:
        """Waits until the quorum of this step is decided and the process group configured
        (raises the quorum's failure), not for a heal this replica receives: a healing
        replica's collectives contribute zeros and go on while its state arrives, and its
        source may send that state only at its own should_commit (docs/design.md, "Heal")."""
        fut = self._quorum_future
        if fut is None:
            raise RuntimeError("start_quorum() must be called before the step's collectives")
        # Bounded by the quorum thread, whose every call has a deadline; the future's end is
        # checked too, so that no path that skips the event can hang this.
        while not self._decided.wait(0.1):
            if fut.done():
                break
        try:
            if fut.done():
                fut.result()
            elif self._quorum_error is not None:
                raise self._quorum_error
        except Exception as e:  # noqa: BLE001 - raised again, or as what it amounts to
            failure = self._quorum_failed(e)
            if failure is e:
                raise
            raise failure from e

    # ---------------------------------------------------------------- persistent failures

    def _back_off(self) -> None:
        """Waits the backoff the last failed step owes before the next quorum, if any
        (docs/design.md, "Persistent failures"). Bounded by the delay; shutdown ends it."""
        delay = self._outcomes.take_backoff()
        if delay <= 0:
            return
        self._watch.phase("backoff", f"{delay:.2f}s after {self._outcomes.streak.count} failures")
        Deadline.after(delay).wait_event(self._closing)
        if self._closed:
            raise RuntimeError("Manager is shut down")

    def _quorum_failed(self, e: Exception) -> Exception:
        """What to raise for this step's failed quorum ``e``: ``e`` itself or, once as many
        identical failures as ``max_consecutive_failures`` have happened, a
        PersistentStepFailure caused by it (ft.manager_parts.step_outcomes)."""
        return self._outcomes.quorum_failed(
            e, self._quorum_replica_ids, self._step, self._short_of_replicas()
        )

    def _short_of_replicas(self) -> str:
        """Why a step that nobody failed did not commit, in one line."""
        return (
            f"commit: {self._participation.commit_size} replica(s) would hold the step, "
            f"min_replica_size={self._min_replica_size}"
        )

    def _step_failure(self, enough_replicas: bool) -> Optional[StepFailure]:
        """Why this step did not commit, as the streak counts it; None when the only reason
        is too few replicas (waiting for one to come back is no fault)."""
        if self._errors.first is not None:
            return StepFailure.from_exception(self._errors.first, self._errors.phase)
        if not enough_replicas:
            return None
        # This rank's vote was yes: another rank of the group (or a vote for another step)
        # said no; that rank's log names its error.
        return StepFailure(
            phase="commit",
            error_type="",
            message="another rank of this replica group voted not to commit",
        )

    def send_pending_heal(self) -> None:
        """Sends this replica's state to the replicas that the step's quorum heals from it,
        now, on the calling thread, if that is still due (an ft extension).

        In async mode a heal source reads its state on the training thread, never on the
        quorum thread while the forward pass runs (FSDP2's state-dict hooks swap the
        parameters that forward uses): :meth:`should_commit` sends it before its vote. Call
        this earlier only where the state changes within the step before should_commit
        (``ft.optim.apply_optimizer_in_backward`` does). A failure is reported (the step
        does not commit) and the receivers are told at once."""
        quorum, self._heal_send_due = self._heal_send_due, None
        if quorum is None:
            return
        if self._step_failed():
            # Often because a receiver died; either way the receivers will not commit this
            # step: they fail their heal now and retry at the next quorum.
            why = (
                self._errors.first if self._errors.first is not None else "its process group failed"
            )
            self._healer.abandon(quorum, f"the source's step failed: {why}")
            return
        try:
            self._send_heal(quorum)
        except Exception as e:  # noqa: BLE001
            self._log.error("heal", f"sending the checkpoint failed: {type(e).__name__}: {e}")
            self._report_error(e, abort=True, phase="heal")
            return
        # The state stays readable until the receivers have it: after the vote the caller
        # changes it.
        self._wait_heal_delivered(quorum)

    def _wait_heal_delivered(self, quorum: QuorumResult) -> None:
        """Waits until the receivers of the checkpoint just sent have it (the transport keeps
        references to the caller's tensors, not a copy), at most the Manager's timeout. A
        receiver that dies meanwhile fails this step (its failure aborts the process group),
        which ends the wait; so does the timeout, after which the receivers are told to give
        up (they retry at the next quorum)."""
        t0 = time.monotonic()
        if self._healer.wait_delivered(quorum, self._timeout, self._step_failed):
            self._log.info(
                "heal_sent",
                f"replica ranks {quorum.recover_dst_replica_ranks} have the checkpoint "
                f"({(time.monotonic() - t0) * 1000:.1f} ms after it was staged)",
                max_step=quorum.max_step,
            )
        else:
            self._log.warning(
                "heal_send",
                f"not every receiver took the checkpoint within {self._timeout}",
                max_step=quorum.max_step,
            )
            self._healer.abandon(quorum, "the receivers did not take it in time")

    def _step_failed(self) -> bool:
        """This step can no longer commit: an error was reported, or the process group
        failed (a collective, or an abort after a peer's death)."""
        if self._errors.first is not None:
            return True
        return _group_error(self._pg) is not None

    def _abandon_pending_heal(self, reason: str) -> None:
        quorum, self._heal_send_due = self._heal_send_due, None
        if quorum is None:
            return
        try:
            self._healer.abandon(quorum, reason)
        except Exception:  # noqa: BLE001 - the receivers then wait out their timeout
            logger.exception("abandoning the checkpoint of step %d failed", quorum.max_step)

    def _send_heal(self, quorum: QuorumResult) -> None:
        self._log.info(
            "heal_send",
            f"sending the checkpoint to replica ranks {quorum.recover_dst_replica_ranks}"
            # a donor of a striped heal stages for the other donors' receivers too
            + (" and striped receivers" if self._healer.striped(quorum) else ""),
            max_step=quorum.max_step,
        )
        with span_block("torchft::manager::_checkpoint_transport::send_checkpoint"):
            self._healer.send(quorum, self._manager_state_dict, self._timeout)

    def _async_quorum_on_device(self, device: Optional[int], *args: Any) -> None:
        # The quorum thread reconfigures the process group (NCCL communicators are created for
        # the thread's current CUDA device) and receives heals: it must use the caller's
        # device, not cuda:0, on a host with several GPUs (as torchft does).
        if device is not None and torch.cuda.current_device() != device:
            torch.cuda.set_device(device)
        self._async_quorum(*args)

    @span("torchft::manager::_async_quorum")
    def _async_quorum(self, allow_heal: bool, shrink_only: bool, quorum_timeout: timedelta) -> None:
        t0 = time.monotonic()
        self._watch.phase(
            "quorum", f"lighthouse {self._lighthouse_addr} (through the group's ManagerServer)"
        )
        try:
            quorum = self._quorum_call(shrink_only, quorum_timeout)
        except BaseException as e:
            self._watch.error(e)
            self._quorum_error = e
            self._decided.set()
            raise
        # A source whose transport confirms delivery sends from the training thread, at
        # should_commit (docs/design.md, "Heal"). Announced before the process group is
        # configured, which its receivers must wait for before they ask: they wait for the
        # checkpoint even where an earlier attempt at this step withdrew or abandoned it.
        defer = (
            allow_heal
            and self._use_async_quorum
            and self._healer.serves(quorum)
            and not quorum.heal
            and self._healer.confirms_delivery()
        )
        if defer:
            self._healer.announce(quorum)
        try:
            configured = self._decide(quorum, t0, allow_heal)
            if configured and defer:
                # Due before the step is decided: a training thread that wait_quorum() lets
                # go on sends it at its next send_pending_heal (an optimizer-in-backward hook
                # sends it before its first update).
                self._heal_send_due = quorum
        finally:
            self._decided.set()
        if not configured:
            if defer:
                self._healer.abandon(quorum, "the source could not configure its process group")
            return
        if allow_heal:
            self._heal(quorum, defer)

    @span("torchft::manager::_client::_quorum")
    def _quorum_call(self, shrink_only: bool, quorum_timeout: timedelta) -> QuorumResult:
        # torchft's name for the call (GroupServerClient), so a stand-in written for torchft's
        # client drives the Manager.
        # The group's reconfigure handle goes with the request only where the group is
        # rebuilt from the handles (it is carried through the lighthouse to every peer).
        handle = (
            {}
            if _configures(self._pg)
            else {"reconfigure_handle": self._pg.get_reconfigure_handle()}
        )
        return self._client._quorum(
            group_rank=self._rank,
            step=self._step,
            checkpoint_metadata=self._checkpoint_transport.metadata(),
            shrink_only=shrink_only,
            timeout=quorum_timeout,
            init_sync=self._init_sync,
            commit_failures=self._commit_failures,
            **handle,
        )

    def _reconfigure_pg(self, communicator_id: int, handles: List[str]) -> None:
        """Rebuilds the process group for a new quorum (torchft-nightly's name and
        arguments): with ``configure()`` on the quorum's store where the group has one
        (:func:`_configures`; the quorum is the one :meth:`_decide` is taking in), else with
        ``reconfigure`` on the members' handles in replica rank order, ``communicator_id``
        (the quorum id) as their uuid. Raises what either raises."""
        quorum = getattr(self, "_configuring", None)
        if quorum is not None and _configures(self._pg):
            self._configure_pg(quorum)
            return
        if not handles or not all(handles):
            raise RuntimeError(
                f"cannot reconfigure {type(self._pg).__name__} for quorum {communicator_id}: "
                f"not every member sent a reconfigure handle ({len(handles)} handles; a "
                f"member running torchft 0.2.0 or an ft release before the reconfigure API "
                f"sends none)"
            )
        opts = ReconfigureOptions()
        opts.uuid = communicator_id
        opts.handles = list(handles)
        opts.timeout = self._timeout
        self._pg.reconfigure(opts).wait()

    def _configure_pg(self, quorum: QuorumResult) -> None:
        store_prefixed_addr = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{self._rank}"
        extras = {
            "quorum_id": quorum.quorum_id,
            "group_rank": self._rank,
            "group_world_size": self._world_size,
            # This rank's peers across the replica groups, as job-wide ranks (replica r's
            # group rank g is r * group_world_size + g), for the backend's logs.
            "global_ranks": [
                r * self._world_size + self._rank for r in range(quorum.replica_world_size)
            ],
        }
        self._pg.configure(
            store_prefixed_addr,
            self._replica_id,
            quorum.replica_rank,
            quorum.replica_world_size,
            **{k: v for k, v in extras.items() if k in self._pg_configure_takes},
        )

    def _decide(self, quorum: QuorumResult, t0: float, allow_heal: bool) -> bool:
        """Takes in the quorum: participation, and the process group reconfigured for a new
        one. False: configuring failed (reported)."""
        t_quorum = time.monotonic() - t0

        plan = participation(
            quorum,
            use_async_quorum=self._use_async_quorum,
            allow_heal=allow_heal,
            init_sync=self._init_sync,
            spares_above=(
                self._min_replica_size
                if self._world_size_mode == WorldSizeMode.FIXED_WITH_SPARES
                else None
            ),
        )
        self._participation = plan

        reconfigure = quorum.quorum_id != self._quorum_id
        with self._quorum_lock:
            self._quorum_id = quorum.quorum_id
            self._quorum_replica_ids = frozenset(quorum.replica_ids)
        self._log.info(
            "quorum",
            f"{'new' if reconfigure else 'same'} quorum in {t_quorum * 1000:.1f} ms",
            replica_rank=quorum.replica_rank,
            replica_world_size=quorum.replica_world_size,
            participants=plan.contributors,
            commit_size=plan.commit_size,
            max_step=quorum.max_step,
            heal=quorum.heal,
            commit_failures=quorum.commit_failures,
        )
        if reconfigure:
            records.record(
                records.QUORUMS,
                replica_id=self._replica_id,
                rank=self._rank,
                quorum_id=quorum.quorum_id,
                step=quorum.max_step,
            )
            store_prefixed_addr = f"{quorum.store_address}/torchft/{quorum.quorum_id}/{self._rank}"
            self._watch.phase(
                "configure", f"store {quorum.store_address} with replicas {quorum.replica_ids}"
            )
            t1 = time.monotonic()
            self._configuring = quorum
            try:
                with span_block("torchft::manager::_pg::configure"):
                    self._reconfigure_pg(
                        quorum.quorum_id, list(getattr(quorum, "reconfigure_handles", None) or [])
                    )
            except Exception as e:  # noqa: BLE001
                self._log.error("configure", f"pg.configure({store_prefixed_addr}) failed")
                self._report_error(e, abort=True, phase="configure")
                return False
            finally:
                self._configuring = None
            self._log.info(
                "configure",
                f"process group configured in {(time.monotonic() - t1) * 1000:.1f} ms",
                store=store_prefixed_addr,
            )

        self._watch.phase("step", f"collectives with {quorum.replica_ids}")
        # Before the collectives may start: a healing replica contributes zeros.
        self._healing = allow_heal and quorum.heal
        return True

    def _heal(self, quorum: QuorumResult, defer_send: bool) -> None:
        """Sends and receives the heals the quorum asks for (docs/design.md, "Heal")."""
        try:
            # Assigned receivers, or a donor of a striped heal (docs/design.md, "Striped heal").
            # With defer_send the training thread reads and sends the state instead
            # (send_pending_heal; _async_quorum made it due): reading it here would race the
            # forward pass.
            if self._healer.serves(quorum) and not defer_send:
                # Sync mode (the training thread waits in start_quorum meanwhile), or a
                # transport that cannot tell when its receivers have the state.
                self._send_heal(quorum)
                if self._healer.confirms_delivery():
                    # The training thread changes the state as soon as start_quorum returns
                    # (a DiLoCo inner step changes the model it registered): the receivers
                    # must have it first.
                    self._wait_heal_delivered(quorum)
            if quorum.heal:
                t2 = time.monotonic()
                self._watch.phase(
                    "heal",
                    f"replica rank {quorum.recover_src_replica_rank} at "
                    f"{quorum.recover_src_manager_address}",
                )
                with span_block("torchft::manager::_checkpoint_transport::recv_checkpoint"):
                    got = self._healer.receive(
                        quorum,
                        self._rank,
                        self._timeout,
                        self._state.load_fns,
                        donors=quorum.heal_donors,
                    )
                # DTensors arrive as their pieces and become DTensors again when the state is
                # applied, on the training thread (reading this rank's own state here, on the
                # quorum thread, would race an FSDP forward that swaps the parameters).
                self._pending_state_dict = got.state
                self._pending_prior_counters = self.state_dict()
                self._watch.phase("step", f"collectives with {quorum.replica_ids}")
                self.load_state_dict(got.state["torchft"])
                self._step = quorum.max_step
                self._log.info(
                    "heal_recv",
                    f"received the checkpoint from replica rank "
                    f"{quorum.recover_src_replica_rank} ({got.metadata}) in "
                    f"{(time.monotonic() - t2) * 1000:.1f} ms (metadata "
                    f"{got.metadata_s * 1000:.1f} ms)"
                    + (f" ({got.path} path)" if got.path else ""),
                    max_step=quorum.max_step,
                )
        except Exception as e:  # noqa: BLE001
            self._log.error("heal", f"recovery failed: {type(e).__name__}: {e}")
            self._pending_state_dict = None
            self._report_error(e, abort=True, phase="heal")

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
        self._wait_decided()
        num_participants = self.num_participants()
        if not self.is_participating():
            tensor.zero_()

        pg_op = reduce_op
        divide = reduce_op == ReduceOp.AVG
        if divide:
            if not torch.is_floating_point(tensor):
                raise ValueError("ReduceOp.AVG needs a floating point tensor")
            pg_op = ReduceOp.SUM
        try:
            opts = dist.AllreduceOptions()
            opts.reduceOp = pg_op
            if should_quantize and torch.is_floating_point(tensor):
                wire = torch.int8 if should_quantize is True else should_quantize
                work = allreduce_quantized([tensor], opts, self._pg, wire_dtype=wire)
            else:
                work = self._pg.allreduce([tensor], opts)
            fut = work.get_future()
        except Exception as e:  # noqa: BLE001
            self._report_error(e, abort=True, phase="allreduce")
            return _DummyWork(tensor)

        stream = None
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(tensor.device)

        def callback(f: torch.futures.Future) -> torch.Tensor:
            try:
                f.value()
            except Exception as e:  # noqa: BLE001
                self._report_error(e, abort=False, phase="allreduce")
                return tensor
            if divide and num_participants > 0:
                if stream is None:
                    tensor.div_(num_participants)
                else:
                    # Run on the issuing stream, ordered after the op and before later waiters.
                    cur = torch.cuda.current_stream(tensor.device)
                    stream.wait_stream(cur)
                    with torch.cuda.stream(stream):
                        tensor.div_(num_participants)
                    cur.wait_stream(stream)
            return tensor

        return _ManagedWork(
            fut.then(callback),
            on_timeout=lambda e: self._report_error(e, abort=True, phase="allreduce"),
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
        if self._quorum_future is not None:
            # Here a healing replica waits for its state (its source sends it at its own
            # should_commit, after the step's collectives).
            self._wait_quorum_done()
        # This step's state, still unchanged, for the replicas healing from this one: read
        # here, on the training thread, before the vote that lets anyone change it.
        self.send_pending_heal()
        if self._healing:
            self._apply_pending_state_dict()
            self._healing = False

        self._watch.phase("should_commit", "the group's vote at its ManagerServer")
        # Collectives issued straight on the process group (FSDP and HSDP issue their own, not
        # through allreduce() here) report a failure only to the group: let its error veto
        # the step too, as torchft does. On CUDA, wait for the work queued on the current
        # stream first, so that a collective still in flight has had its chance to fail.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        pg_error = _group_error(self._pg)
        if pg_error is not None:
            # A collective issued straight on the group (FSDP's), or one aborted under it.
            self._report_error(pg_error, abort=False, phase="allreduce")
        enough_replicas = self._participation.enough(self._min_replica_size)
        local_should_commit = enough_replicas and self._errors.first is None
        t = to_timedelta(timeout) if timeout is not None else self._timeout
        should_commit = self._client.should_commit(
            self._rank, self._step, local_should_commit, timeout=t
        )
        records.record(
            records.COMMITS,
            replica_id=self._replica_id,
            rank=self._rank,
            quorum_id=self._quorum_id,
            step=self._step,
            commit_result=should_commit,
        )
        # Transfers of this step's state must end before the caller mutates it.
        self._checkpoint_transport.disallow_checkpoint()

        if should_commit:
            self._watch.committed()
            self._step += 1
            self._batches_committed += self.num_participants()
            self._commit_failures = 0
            self._log.info("commit", "committed", participants=self.num_participants())
            self._outcomes.settle(True, None, self._quorum_replica_ids, self._step, "")
        else:
            self._commit_failures += 1
            self._log.warning(
                "commit",
                f"not committed (local vote={local_should_commit}, enough_replicas="
                f"{enough_replicas}, errored={self._errors.first!r})",
                commit_failures=self._commit_failures,
            )
            give_up = self._outcomes.settle(
                False,
                self._step_failure(enough_replicas),
                self._quorum_replica_ids,
                self._step,
                self._short_of_replicas(),
            )
            if self._max_retries is not None and self._commit_failures > self._max_retries:
                msg = (
                    f"should_commit failed {self._commit_failures} times in a row, "
                    f"exceeding max_retries={self._max_retries}"
                )
                self._log.error("max_retries", msg)
                raise RuntimeError(msg)
            if give_up is not None:
                raise give_up
        return should_commit

    # ---------------------------------------------------------------- accessors

    def current_step(self) -> int:
        """The number of committed steps."""
        return self._step

    def quorum_id(self) -> int:
        """The id of the latest quorum this replica joined (-1 before the first).

        An ft addition to torchft's API: it changes whenever the membership changes (or after
        commit failures), so state that depends on who takes part (e.g. a sharding plan) can
        be keyed by it. Waits for a quorum in flight.
        """
        if self._quorum_future is not None:
            self._wait_decided()
        return self._quorum_id

    def batches_committed(self) -> int:
        """The total number of batches committed across all replicas."""
        return self._batches_committed

    def last_step_error(self) -> Optional[str]:
        """Why the last step that ended did not commit, in one line ("phase: Type: message",
        docs/design.md, "Persistent failures"), or None after a commit (an ft extension;
        ft-launch's progress record shows it)."""
        return self._outcomes.last_error

    def participating_rank(self) -> Optional[int]:
        """This replica's rank among the participants of this step, or None."""
        if self._quorum_future is not None:
            self._wait_decided()
        return self._participation.rank

    def num_participants(self) -> int:
        """The number of replicas that take part in this step."""
        if self._quorum_future is not None:
            self._wait_decided()
        return self._participation.contributors

    def is_participating(self) -> bool:
        """Whether this replica's data counts in this step (healing replicas and spares don't)."""
        if self._participation.rank is None:
            return False
        if self._healing:
            return False
        return True

    @property
    def replica_id(self) -> str:
        """This group's replica id (``"{name}:{uuid4}"``)."""
        return self._replica_id

    @property
    def use_async_quorum(self) -> bool:
        """Whether :meth:`start_quorum` returns before the quorum (it then overlaps the
        forward pass, and a heal is applied at :meth:`should_commit`)."""
        return self._use_async_quorum

    @property
    def num_lanes(self) -> int:
        """How many independent lanes the process group has (1 for a group without lanes):
        collectives issued in different ``ft.process_group.lane(i)`` blocks can run at once."""
        lanes = getattr(self._pg, "num_lanes", None)
        return lanes if isinstance(lanes, int) and lanes > 0 else 1

    def _manager_address(self) -> Optional[str]:
        return self._manager.address() if self._manager is not None else None

    def __repr__(self) -> str:
        return (
            f"Manager(replica_id={self._replica_id!r}, rank={self._rank}, "
            f"quorum_id={self._quorum_id}, step={self._step})"
        )
