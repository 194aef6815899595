"""Python face of the ft backend: torchft-compatible process groups (imported by users through
:mod:`ft.process_group`, torchft's path, which adds the names that stand above the Manager).

`ProcessGroupGloo` / `ProcessGroupNCCL` are torch ProcessGroups whose CPU and
CUDA ops go to one `ft._C.FtBackend`. Unlike torch's process groups they are
built empty and then `configure()`d, again and again, inside one process:
every configure aborts the current generation and connects a new one (new
store prefix, rank and world size). Use them wherever torch takes a process
group (`dist.all_reduce(t, group=pg)`, `DistributedDataParallel(...,
process_group=pg)`).

Importing this module registers the torch backend "ft", so
`torch.distributed.init_process_group("ft")` works too.

Lanes: each generation has `num_lanes` independent communicators. Ops go to
the calling thread's current lane, chosen with `with ft.lane(k): ...`.

torchft's other process groups live here too (see "torchft's process-group family" below):
the `ProcessGroup` base class (configure / register / unregister / abort(errored=) /
errored), `ProcessGroupWrapper` and its error-swallowing and fault-injecting subclasses
(the Manager-backed one, `ManagedProcessGroup`, lives above the Manager:
`ft/managed_process_group.py`), `ProcessGroupDummy`, the `ProcessGroupBaby*` names, the XCCL
groups, and `create_store_client`.

Contract (torchft family):
* `ProcessGroup` is a torch ProcessGroup; `configure(store_addr, replica_id, rank,
  world_size)` reconnects it, `abort()` fails in-flight ops, `errored()` reports a sticky
  failure or None, `register(name)` makes it visible to torch's group registry (functional
  collectives, DeviceMesh), `unregister()` removes (and shuts) it.
* A `ProcessGroupWrapper` sends every op to its `parent` (the group it wraps, or the one it
  created at configure); its subclasses change what an op's Work does, never the data path.
* The XCCL groups exist everywhere and fail at configure() with an error naming the missing
  Intel XPU device where there is none.

torch 2.13 note: torch's C++ ProcessGroup keeps the world size it was created
with. The facade overrides `size()`/`rank()` and `getSize()`/`getRank()`, so
Python callers and torch's C++ code (e.g. DDP's reducer) see the live values
through the Python override. A group made by `init_process_group("ft")` is
never reconfigured, so its size is always right.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import logging
import os
import secrets
import socket
import threading
import uuid as _uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed import ProcessGroup as _TorchProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

from ft import _C  # ft's compiled extension (torch's _C naming)
from ft.utils import net
from ft.observability import records
from ft.utils.deadline import Deadline, to_timedelta
from ft.utils.retry import retry_until
from ft.work import _DummyWork  # torchft's name for a completed Work

__all__ = [
    "ProcessGroup",
    "ProcessGroupFt",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "ProcessGroupXCCL",
    "ProcessGroupWrapper",
    "ProcessGroupDummy",
    "ErrorSwallowingProcessGroupWrapper",
    "FakeProcessGroupWrapper",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
    "ProcessGroupBabyXCCL",
    "connect_store_client",
    "create_store_client",
    "trigger_nccl_fr_trace_through_pipe",
    "lane",
    "parse_store_addr",
    "ReconfigureOptions",
    "reconfigure_with_store",
]

logger = logging.getLogger(__name__)

DEFAULT_NUM_LANES = 2
BACKEND_NAME = "ft"


class ProcessGroupErrored(RuntimeError):
    """The process group's current generation failed (sticky until configure)."""


class ProcessGroupTimeout(ProcessGroupErrored, TimeoutError):
    """An op missed its deadline and the generation was aborted."""


def _failure_to_exception(failure: Optional[Tuple[str, str]]) -> Optional[Exception]:
    if failure is None:
        return None
    kind, message = failure
    if kind == "deadline":
        return ProcessGroupTimeout(message)
    # The generation is aborted once it fails; saying so keeps torchft's wording, which code
    # written against torchft matches on ("aborted").
    return ProcessGroupErrored(f"{kind}: {message} (generation aborted; configure() again)")


def current_lane() -> int:
    """The lane the calling thread's ops run on (0 unless inside a :func:`lane` block)."""
    return _C.get_current_lane()


@contextlib.contextmanager
def lane(index: int) -> Iterator[int]:
    """Runs the calling thread's ops inside the block on lane `index` (docs/design.md,
    "Lanes"). Lanes are chosen only through this: a thread's lane is its own, and it returns
    to the previous one when the block ends."""
    previous = _C.get_current_lane()
    _C.set_current_lane(index)
    try:
        yield index
    finally:
        _C.set_current_lane(previous)


def parse_store_addr(store_addr: str) -> Tuple[str, int, str]:
    """Splits "host:port/prefix" (host may be "[v6]") into its parts."""
    if not isinstance(store_addr, str) or not store_addr:
        raise ValueError(f"store_addr must be 'host:port/prefix', got {store_addr!r}")
    hostport, _, prefix = store_addr.partition("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"store_addr must be 'host:port/prefix', got {store_addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port_number = int(port)
    if not 0 < port_number < 65536:
        raise ValueError(f"store_addr port out of range in {store_addr!r}")
    return host, port_number, prefix


SHARED_GPU_POLICIES = ("host-staged", "error")


def _shared_gpu_policy(value: Optional[str]) -> str:
    policy = value if value is not None else os.environ.get("FT_SHARED_GPU", "host-staged")
    if policy not in SHARED_GPU_POLICIES:
        raise ValueError(
            f"shared_gpu (or FT_SHARED_GPU) must be one of {SHARED_GPU_POLICIES}, got {policy!r}"
        )
    return policy


def _check_agreement_default(value: Optional[bool]) -> bool:
    if value is not None:
        return bool(value)
    return os.environ.get("FT_CHECK_AGREEMENT", "0") not in ("", "0", "false", "False")


def _lock_timeout(deadline: Deadline) -> float:
    left = deadline.remaining()
    return -1 if left == float("inf") else left


def _fd_links(kind: str) -> Dict[int, str]:
    """This process's descriptors whose /proc link starts with ``kind`` ("socket:",
    "anon_inode:[eventpoll]"): fd -> link (empty where /proc is not)."""
    out: Dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith(kind):
            out[int(name)] = link
    return out


def _socket_links() -> Dict[int, str]:
    """This process's socket descriptors: fd -> "socket:[inode]"."""
    return _fd_links("socket:")


def _shut_new_connections(before: Dict[int, str], port: int) -> int:
    """Shuts down the TCP connections to ``port`` that this process opened since ``before``
    (a snapshot of _socket_links); returns how many."""
    known = set(before.values())
    cut = 0
    for fd, link in _socket_links().items():
        if link in known:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)  # not a socket any more (the number was reused)
            continue
        try:
            with s:
                peer = s.getpeername()
                if s.type == socket.SOCK_STREAM and isinstance(peer, tuple) and peer[1] == port:
                    s.shutdown(socket.SHUT_RDWR)  # the descriptor's owner sees the end at once
                    cut += 1
        except OSError:
            pass  # not connected (yet), or not a socket any more
    return cut


def _probe(host: str, port: int, deadline: Deadline) -> None:
    """Returns once ``host:port`` accepts a TCP connection, retrying refusals with backoff;
    raises the last failure when the deadline does not leave time for another try."""

    def connect(remaining: float) -> None:
        socket.create_connection((host, port), timeout=remaining).close()

    retry_until(
        connect,
        deadline,
        retry_on=lambda e: isinstance(e, OSError) and not isinstance(e, TimeoutError),
    )


# (thread, port, sockets before it) of store connects abandoned at their deadline: joined at exit
_stray_connects: List[Tuple[threading.Thread, int, Dict[int, str]]] = []


def _connect_store(host: str, port: int, deadline: Deadline) -> TCPStore:
    """A client of the TCPStore at ``host:port`` by ``deadline``, or an OSError by then.

    TCPStore's own timeout does not bound its constructor: it retries a refused connection
    with a backoff that overshoots the timeout (7.5 s for 4 s, measured), and it waits for the
    server's answer to its first request without any limit (a server that accepts and stays
    silent holds it forever). So: this process first connects itself, retrying refusals within
    the deadline; then the constructor runs on a helper thread (it releases the GIL while it
    waits), with a timeout that ends just before the deadline. At the deadline the
    connections it opened to the store are shut down, which ends its wait for the answer,
    and, its own timeout being over, it raises instead of trying again.
    """
    _probe(host, port, deadline)
    before = _socket_links()
    box: Dict[str, object] = {}
    done = threading.Event()
    left = deadline.remaining()
    store_timeout = max(0.001, min(left - min(0.1, left * 0.05), 365 * 86400.0))

    def connect() -> None:
        try:
            box["store"] = TCPStore(
                host,
                port,
                is_master=False,
                timeout=timedelta(seconds=store_timeout),
                wait_for_workers=False,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    helper = threading.Thread(target=connect, daemon=True, name="ft-store-connect")
    helper.start()
    if deadline.wait_event(done):
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box["store"]  # type: ignore[return-value]
    _shut_new_connections(before, port)
    # It ends at once, its own timeout being over (a store made too late is dropped, and
    # closed, with it); kept to be joined at exit in case it does not.
    _stray_connects[:] = [c for c in _stray_connects if c[0].is_alive()]
    _stray_connects.append((helper, port, before))
    box.clear()
    raise TimeoutError("timed out: the store there never answered")


@atexit.register
def _join_stray_connects() -> None:
    # A helper still inside TCPStore's constructor when the interpreter finalizes would be
    # killed mid-C++ (std::terminate): end and join it while the interpreter is whole.
    end = Deadline.after(5.0)
    for thread, port, before in _stray_connects:
        while thread.is_alive() and not end.expired:
            _shut_new_connections(before, port)
            thread.join(0.05)


class ProcessGroup(_TorchProcessGroup):
    """torchft's base class of reconfigurable process groups (a torch ProcessGroup).

    Subclasses implement :meth:`configure` (and usually ``size``/``rank``/``getBackendName``).
    Collectives are torch's: a subclass either registers a backend (ft's own groups) or
    overrides the op methods in Python (the wrappers below).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        """Reconnects the group: ``store_addr`` ("host:port/prefix", a fresh prefix every
        time), this process's ``rank`` among ``world_size``. Blocks until connected."""
        raise NotImplementedError(f"{type(self).__name__} does not implement configure()")

    # -- the reconfigure API (torchft-nightly's; torch 2.14's names) ---------------------

    @property
    def supports_reconfigure(self) -> bool:
        """True: every group of this family can be rebuilt with :meth:`reconfigure` (a
        subclass that implements only torchft 0.2.0's ``configure`` gets it from the
        default :meth:`reconfigure`)."""
        return True

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: Optional[int] = None,
    ) -> None:
        """This process's identity: its replica group, its rank and the number of ranks in
        that group, and its job-wide rank (carried in the reconfigure handle, so that every
        member learns its peers' global ranks). The Manager calls it once."""
        self._rank_info = (replica_id, group_rank, group_world_size, global_rank)

    def _rank_info_or_default(self) -> Tuple[Optional[str], Optional[int], Optional[int], Any]:
        return getattr(self, "_rank_info", None) or (None, None, None, None)

    def _handle_id(self) -> str:
        """The id this group's reconfigure handle carries: random, fixed for the group's
        life, so a group finds its own rank among ordered handles."""
        hid = getattr(self, "_reconfigure_id", None)
        if hid is None:
            hid = self._reconfigure_id = _uuid.uuid4().hex
        return hid

    def _hosted_store_addr(self) -> str:
        """``host:port`` of the rendezvous store this group hosts, started on the first call."""
        with _hosting_lock:
            store = getattr(self, "_rendezvous_store", None)
            if store is None:
                store = TCPStore(
                    host_name=net.advertise_host(),
                    port=0,
                    is_master=True,
                    wait_for_workers=False,
                )
                self._rendezvous_store = store
        host = net.advertise_host()
        return f"[{host}]:{store.port}" if ":" in host else f"{host}:{store.port}"

    def get_reconfigure_handle(self) -> str:
        """An opaque string naming this group to its peers (JSON: its id, the address of a
        rendezvous store this group hosts, its global rank). Exchanged out of band (the
        Manager: through the lighthouse; :func:`reconfigure_with_store`: through a store)
        and handed to every member's :meth:`reconfigure` in rank order. The store is started
        on the first call and lives as long as the group."""
        return json.dumps(
            {
                "id": self._handle_id(),
                "store": self._hosted_store_addr(),
                "global_rank": self._rank_info_or_default()[3],
            }
        )

    def reconfigure(self, opts: "ReconfigureOptions") -> dist.Work:
        """Rebuilds the group from ``opts``: ``opts.handles``, every member's
        :meth:`get_reconfigure_handle` in rank order (this group's rank is the index of its
        own), ``opts.uuid``, an id fresh for every reconfiguration and the same on every
        member. The members meet on the first handle's store, under ``torchft/<uuid>``.

        Blocks until the group is connected and returns a completed Work; raises if it
        cannot connect. This default rendezvouses and calls :meth:`configure`, so a group
        written for torchft 0.2.0 (``configure`` only) reconfigures too."""
        rdv = _rendezvous(opts, self._handle_id())
        replica_id = self._rank_info_or_default()[0]
        self.configure(rdv.store_addr, replica_id or "0", rdv.rank, rdv.world_size)
        return _DummyWork(None)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        raise NotImplementedError(f"{type(self).__name__} does not implement getBackendName()")

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts one tensor from ``root`` (a shorthand for ``broadcast([tensor], ...)``)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        return self.broadcast([tensor], opts)

    def register(self, name: str) -> "ProcessGroup":
        """Makes this group known to torch's process-group registry under
        ``"<getBackendName()>:<name>"`` (needed by functional collectives and DeviceMesh) and
        returns it. torch sees a group of this process alone (a resizable group does not fit
        its registry), so scaling by the world size is the group's business, not torch's.

        Needs torch's default process group (``init_process_group``); call it once per name.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__}.register({name!r}) needs torch.distributed's default "
                f"process group (call torch.distributed.init_process_group first): torch's "
                f"group registry belongs to it"
            )
        group_name = f"{self.getBackendName()}:{name}"

        def creator(store: Any, rank: int, world_size: int, timeout: timedelta) -> "ProcessGroup":
            return self  # torch takes a ProcessGroup returned here as the group itself

        devices = ["cpu"]
        if torch.cuda.is_available():
            devices.append("cuda")
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            devices.append("xpu")
        dist.Backend.register_backend(group_name, creator, devices=devices)
        group = dist.new_group(
            ranks=[dist.get_rank()],
            backend=group_name,
            group_desc=group_name,
            timeout=timedelta(seconds=60),  # unused: the group keeps its own timeout
        )
        return group  # type: ignore[return-value]

    def unregister(self) -> None:
        """Removes the group from torch's registry (which also shuts it down, as
        ``torch.distributed.destroy_process_group`` does). Must be registered first."""
        dist.destroy_process_group(self)

    # torch keeps a group's name on its backends (C++), and a wrapper group has none: the name
    # torch gives it at register() would be lost, and DeviceMesh, DTensor and functional
    # collectives find a group by that name. So the name is also kept here, in Python.
    def _set_group_name(self, name: str) -> None:
        self._ft_group_name = name
        try:
            super()._set_group_name(name)  # torch's ProcessGroup method
        except RuntimeError:
            pass  # no backend to hold it (a wrapper): the Python copy is the name

    @property
    def group_name(self) -> str:
        name = getattr(self, "_ft_group_name", None)
        return name if name is not None else super().group_name

    def abort(self, errored: bool = True) -> None:
        """Fails in-flight ops. ``errored=False`` marks a planned abort (before a
        reconfigure), which is not logged as a failure."""
        super().abort()

    def errored(self) -> Optional[Exception]:
        """An asynchronous error that requires a reconfigure, or None."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ProcessGroupFt(ProcessGroup):
    """A reconfigurable torch ProcessGroup backed by ft's C++ backend.

    Thread safety: configure/abort/shutdown/errored may be called from any
    thread; abort() is meant to be called while another thread is blocked in
    an op (it fails that op at once).
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        num_lanes: int = DEFAULT_NUM_LANES,
        check_agreement: Optional[bool] = None,
        shared_gpu: Optional[str] = None,
    ) -> None:
        """
        Args:
            timeout: deadline of every op (and of connecting in configure()).
            num_lanes: independent communicators per generation (`ft.lane`).
            check_agreement: verify before each collective that every rank
                calls the same op on same-shaped tensors, raising a clear
                error instead of letting Gloo abort the process. Costs one
                small round trip per op. Default: env FT_CHECK_AGREEMENT=1.
            shared_gpu: what CUDA collectives do when two ranks of the group
                sit on one physical GPU, which NCCL cannot serve:
                ``"host-staged"`` carries them over Gloo through pinned host
                copies (one warning says so), ``"error"`` refuses them with a
                ValueError naming the ranks. Default: env FT_SHARED_GPU, else
                ``"host-staged"``.
        """
        super().__init__(0, 1)
        self._timeout = to_timedelta(timeout)
        host_staged = _shared_gpu_policy(shared_gpu) == "host-staged"
        self._backend = _C.FtBackend(0, 1, self._timeout, num_lanes)
        self._backend.check_agreement = _check_agreement_default(check_agreement)
        self._backend.host_stage_shared_gpu = host_staged
        for device in ("cpu", "cuda"):
            self._register_backend(
                torch.device(device), ProcessGroup.BackendType.CUSTOM, self._backend
            )
        self._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        self._store_lock = threading.Lock()
        self._store_key: Optional[Tuple[str, int]] = None
        self._store: Optional[TCPStore] = None
        self._replica_id: Optional[str] = None
        self._quorum_id: Optional[int] = None
        self._global_ranks: Optional[List[int]] = None

    # -- configuration -------------------------------------------------------

    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        """Aborts the current generation and connects a new one.

        store_addr is "host:port/prefix"; the prefix must be fresh for every
        call (the Manager puts the quorum id in it). Reaching the store is
        bounded by the group's timeout, from the start of the call: an
        unreachable or silent store fails it with DistStoreError then, and
        the group stays usable.

        ``global_ranks`` (torchft's): the job-wide ranks of this group's members, in rank
        order; kept as :attr:`global_ranks` and named in the abort log.
        """
        self._configure_by(
            Deadline.after(self._timeout), store_addr, replica_id, rank, world_size,
            quorum_id, group_rank, group_world_size, global_ranks,
        )  # fmt: skip

    def _configure_by(
        self,
        deadline: Deadline,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int],
        group_rank: Optional[int],
        group_world_size: Optional[int],
        global_ranks: Optional[List[int]],
    ) -> None:
        """:meth:`configure`, with reaching the store and the peers bounded by ``deadline``."""
        if global_ranks is not None and len(global_ranks) != world_size:
            raise ValueError(
                f"global_ranks has {len(global_ranks)} entries for world_size {world_size}"
            )
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is out of range for world_size {world_size}")
        host, port, prefix = parse_store_addr(store_addr)
        store = self._client_store(host, port, deadline)
        self._replica_id = replica_id
        self._quorum_id = quorum_id
        self._global_ranks = list(global_ranks) if global_ranks is not None else None
        _configuring.deadline = deadline  # bounds the lanes' connects (see _new_gloo)
        try:
            self._backend.configure(PrefixStore(f"{prefix}/ft", store), rank, world_size)
        except Exception:
            # The store server may be gone; connect afresh next time.
            self._drop_store(host, port)
            raise
        finally:
            _configuring.deadline = None

    def reconfigure(self, opts: "ReconfigureOptions") -> dist.Work:
        """Rebuilds the group in place from ordered handles (see
        :meth:`ProcessGroup.reconfigure`): a new generation on the first handle's store, under
        ``torchft/<uuid>``, with the members' global ranks where the handles carry them. The
        same object, backend and registration before and after. Connecting is bounded by
        ``opts.timeout`` where it is set, and never longer than the group's timeout
        (:meth:`set_timeout`)."""
        rdv = _rendezvous(opts, self._handle_id())
        replica_id, group_rank, group_world_size, _ = self._rank_info_or_default()
        deadline = Deadline.after(self._timeout)
        if getattr(opts, "timeout", None):
            deadline = deadline.sooner(opts.timeout)
        self._configure_by(
            deadline, rdv.store_addr, replica_id or "0", rdv.rank, rdv.world_size, rdv.uuid,
            group_rank, group_world_size, rdv.global_ranks,
        )  # fmt: skip
        return _DummyWork(None)

    def _client_store(self, host: str, port: int, deadline: Deadline) -> TCPStore:
        what = (
            f"ft: cannot reach the store at {host}:{port} within "
            f"{self._timeout.total_seconds():.1f}s"
        )
        if not self._store_lock.acquire(timeout=_lock_timeout(deadline)):
            raise dist.DistStoreError(f"{what}: another configure() held the store")
        try:
            if self._store_key != (host, port) or self._store is None:
                self._store = None
                try:
                    self._store = _connect_store(host, port, deadline)
                except Exception as e:  # names the address; the group stays usable
                    raise dist.DistStoreError(f"{what}: {e}") from e
                self._store_key = (host, port)
            return self._store
        finally:
            self._store_lock.release()

    def _drop_store(self, host: str, port: int) -> None:
        with self._store_lock:
            if self._store_key == (host, port):
                self._store, self._store_key = None, None

    def abort(self, errored: bool = True) -> None:
        """Fails every in-flight op of the current generation at once.

        ``errored`` (torchft's flag) only decides whether the abort is logged as a failure;
        the abort is the same either way."""
        if errored:
            logger.info(
                "process group aborted (replica_id=%s rank=%s quorum_id=%s global_ranks=%s)",
                self._replica_id,
                self.rank(),
                self._quorum_id,
                self._global_ranks,
            )
            records.record(
                records.ERRORS,
                replica_id=self._replica_id,
                rank=self.rank(),
                error="process_group_abort",
            )
        self._backend.abort()

    def shutdown(self) -> None:
        self._backend.shutdown()

    def errored(self) -> Optional[Exception]:
        """The current generation's sticky error, or None. Never blocks."""
        return _failure_to_exception(self._backend.errored())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = to_timedelta(timeout)
        self._backend.set_timeout(self._timeout)

    @property
    def timeout(self) -> timedelta:
        """Every op's deadline (from its start), as set at construction or by set_timeout."""
        return self._timeout

    @property
    def global_ranks(self) -> Optional[List[int]]:
        """The job-wide ranks of this group's members given to the last configure(), or None."""
        return self._global_ranks

    @property
    def backend(self):
        """The underlying ft._C.FtBackend."""
        return self._backend

    @property
    def num_lanes(self) -> int:
        return self._backend.num_lanes

    # -- torch.distributed.ProcessGroup surface ------------------------------

    def size(self) -> int:
        return self._backend.current_size()

    def rank(self) -> int:
        return self._backend.current_rank()

    def getSize(self) -> int:  # noqa: N802 - torch's C++ name
        return self.size()

    def getRank(self) -> int:  # noqa: N802 - torch's C++ name
        return self.rank()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(generation={self._backend.generation()}, "
            f"rank={self.rank()}, size={self.size()}, lanes={self.num_lanes})"
        )


class ProcessGroupGloo(ProcessGroupFt):
    """torchft's name for the CPU process group (ft backend underneath)."""


class ProcessGroupNCCL(ProcessGroupFt):
    """torchft's name for the CUDA process group (ft backend underneath).

    CUDA tensors need an NCCL build of ft (`ft._C.has_nccl`). When CUDA is
    available, configure() creates every lane's NCCL communicator eagerly on
    the current CUDA device (so a missing peer fails configure() at its
    deadline, and `last_reconfigure_timings()` reports the NCCL init time);
    otherwise lanes connect on their first CUDA op.
    """

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, *args, **kwargs
    ) -> None:
        if _C.has_nccl and torch.cuda.is_available():
            self._backend.set_cuda_device(torch.cuda.current_device())
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    def abort(self, errored: bool = True) -> None:
        if os.environ.get(TORCHFT_TRIGGER_FR_ON_ABORT, "false") == "true":
            # torchft's switch: ask NCCL's flight recorder for a trace of the hung ops.
            rank = dist.get_rank() if dist.is_initialized() else self.rank()
            trigger_nccl_fr_trace_through_pipe(rank)
        super().abort(errored)

    def last_reconfigure_timings(self) -> dict:
        """Milliseconds per step of the last configure(): abort_ms (old
        generation, ncclCommAbort included), gloo_ms, nccl_ms, total_ms."""
        return self._backend.last_reconfigure_timings()


def create_backend(store, rank: int, world_size: int, timeout: timedelta):
    """Creator for `init_process_group("ft")`: one generation, never reconfigured."""
    backend = _C.FtBackend(rank, world_size, timeout, DEFAULT_NUM_LANES)
    backend.check_agreement = _check_agreement_default(None)
    backend.configure(store, rank, world_size)
    _keepalive.append(backend)  # TORCH_DISTRIBUTED_DEBUG=DETAIL wraps the object
    return backend


_keepalive: list = []


def _register() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_backend, extended_api=False, devices=["cpu", "cuda"]
    )


_register()


@atexit.register
def _release_before_interpreter_exit() -> None:
    # Communicator threads that touch a tensor after the interpreter starts
    # finalizing are killed by Python mid-destructor (std::terminate). Tear
    # every generation down while the interpreter is whole, then drop the
    # references ops still hold, here, with the GIL.
    _C._shutdown_all(timedelta(seconds=5))
    _C._drain_releaser(True)  # ft's compiled extension: drop what finished ops still hold


def _new_gloo(
    store: dist.Store, rank: int, size: int, timeout: timedelta
) -> Tuple[dist.ProcessGroupGloo, List[int]]:
    """torch's ProcessGroupGloo for one lane of the ft backend (called from C++), and the
    epoll instances of its Gloo devices (see :func:`_gloo_devices`).

    Gloo listens on, and tells its peers, the replica's advertised address
    (:func:`ft.utils.net.chosen_advertise_host`): by default Gloo resolves the host name, which on
    many machines is 127.0.0.1, and peers on other hosts could never connect. An explicit
    ``GLOO_SOCKET_IFNAME`` still wins.

    Gloo's timeout bounds both its connect and, later, its ops. Called from a configure(), the
    connect gets only what is left of that call's deadline, and the ops ``timeout`` after it.
    """
    # The devices first: building them may wait for another lane's (a process-wide lock), and
    # that wait comes out of the connect's share of the deadline.
    devices, epolls = _gloo_devices()
    deadline: Optional[Deadline] = getattr(_configuring, "deadline", None)
    connect_timeout = timeout
    if deadline is not None:
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError("configure()'s deadline passed before this lane could connect")
        connect_timeout = min(timeout, timedelta(seconds=left))
    # torch's Python constructor takes no devices and one timeout for both the connect and
    # the ops: its Options (private names) are the only way to set them
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = connect_timeout  # the connect's bound (torch's private Options field)
    opts._devices = devices  # Gloo's devices (torch's private Options field)
    opts._threads = 2 * len(devices)  # as torch's own constructor sets it
    pg = dist.ProcessGroupGloo(store, rank, size, opts)
    if connect_timeout != timeout:
        pg.set_timeout(timeout)  # the ops' bound (its connections and contexts too)
    return pg, epolls


def _epoll_fds() -> set:
    """This process's epoll descriptors."""
    return set(_fd_links("anon_inode:[eventpoll]"))


# Serializes the creation of ft's Gloo devices in this process (see _gloo_devices).
_gloo_device_lock = threading.Lock()
_GLOO_DEVICE_TRIES = 8


def _gloo_devices() -> Tuple[list, List[int]]:
    """The Gloo devices of one lane, as torch's own ProcessGroupGloo constructor would pick
    them (``GLOO_SOCKET_IFNAME``'s interfaces, else the advertised address, else the default
    device), and the epoll instances they created.

    Gloo has no abort, so aborting a generation shuts down the sockets its lanes' devices
    registered in their epoll instances (csrc/gloo_comm.hpp). Those must be exactly this lane's:
    several groups, or several ranks of one group, may connect at the same time in one process,
    and a socket of theirs cut by our abort breaks their ops (a peer shutting down then fails
    the survivors' send/recv in the same process). Each Gloo device creates one epoll instance
    when it is built, so the devices are built here, one lane at a time in this process, between
    two looks at /proc/self/fd: the epoll instances that appeared are theirs. Should another
    thread create an epoll instance meanwhile, the devices are dropped and built again.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    host = None if ifname else net.chosen_advertise_host()
    create_device = dist.ProcessGroupGloo.create_device

    def build() -> list:
        if len(ifname) > 1:  # torch's rule
            return [create_device(interface=name) for name in ifname.split(",")]
        if host is None:
            return [dist.ProcessGroupGloo.create_default_device()]
        return [create_device(hostname=host.strip("[]"))]

    with _gloo_device_lock:
        for attempt in range(_GLOO_DEVICE_TRIES):
            before = _epoll_fds()
            devices = build()
            new = _epoll_fds() - before
            if len(new) == len(devices) or attempt == _GLOO_DEVICE_TRIES - 1:
                break
            if not before and not new:
                break  # no /proc to read: nothing a retry could tell apart
            devices.clear()  # drops them, closing their epoll instances; try again
    if not new:
        logger.warning(
            "ft: this process's epoll instances cannot be read (/proc/self/fd): an abort cannot "
            "cut this lane's Gloo sockets, so a stuck op lasts until Gloo's own timeout"
        )
    elif len(new) != len(devices):
        # Other threads kept creating epoll instances: own every new one (an abort may then
        # also cut their sockets) rather than none (a stuck op would outlive the abort).
        logger.warning(
            "ft: %d epoll instances appeared while this lane's %d Gloo devices were built; "
            "an abort of this generation shuts down the sockets of all of them",
            len(new),
            len(devices),
        )
    return devices, sorted(new)


# The deadline of the configure() running on this thread (None outside one): _new_gloo runs
# inside it, called back from C++ on the same thread.
_configuring = threading.local()


# ===================================================================================
# torchft's process-group family: store client, wrappers, dummy, Baby*, XCCL
# ===================================================================================

TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
TORCHFT_TRIGGER_FR_ON_ABORT = "TORCHFT_TRIGGER_FR_ON_ABORT"


def trigger_nccl_fr_trace_through_pipe(rank: int) -> bool:
    """Asks NCCL's flight recorder of ``rank`` to dump its trace, through the pipe torch opens
    when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set (``<prefix><rank>.pipe``).

    Returns True when the request was written, False when the pipe is not enabled or nobody
    reads it. Never blocks: the pipe is opened non-blocking (a FIFO without a reader would
    otherwise hang the caller, typically an abort path). Unlike torchft it does not then sleep
    60 s for the dump to finish; the dump is written by torch's watchdog on its own.
    """
    prefix = os.environ.get(TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR, "")
    if not prefix:
        logger.info(
            "[rank %d] no flight-recorder dump: %s is not set",
            rank,
            TORCH_NCCL_DEBUG_INFO_PIPE_FILE_ENV_VAR,
        )
        return False
    path = f"{prefix}{rank}.pipe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:  # ENOENT: no pipe; ENXIO: no reader on it
        logger.info("[rank %d] no flight-recorder dump: cannot open %s (%s)", rank, path, e)
        return False
    try:
        os.write(fd, b"1\n")
    except OSError as e:
        logger.info("[rank %d] no flight-recorder dump: writing %s failed (%s)", rank, path, e)
        return False
    finally:
        os.close(fd)
    logger.info("[rank %d] flight-recorder dump requested through %s", rank, path)
    return True


def connect_store_client(host: str, port: int, timeout: timedelta) -> TCPStore:
    """A TCPStore client of ``host:port``, connected within ``timeout`` as a whole.

    Raises ``torch.distributed.DistStoreError`` naming the address when nothing answers as a
    store in time: a refused port, or a listener that accepts and stays silent (another
    program on that port), which torch's own constructor would wait on without end.
    """
    timeout = to_timedelta(timeout)
    try:
        return _connect_store(host, port, Deadline.after(timeout))
    except Exception as e:  # noqa: BLE001 - re-raised naming the address
        raise dist.DistStoreError(
            f"cannot reach the store at {host}:{port} within {timeout.total_seconds():.1f}s: {e}"
        ) from e


def create_store_client(store_addr: str, timeout: timedelta) -> Store:
    """A ``PrefixStore(prefix, TCPStore client)`` for ``"host:port/prefix"`` (host may be
    ``[v6]``), connected within ``timeout``.

    Reaching the store is bounded by ``timeout`` as a whole (torch's own TCPStore constructor
    can overrun its timeout, see ``_connect_store``). Raises ValueError for a malformed
    address and ``torch.distributed.DistStoreError`` naming the address when the store does
    not answer in time.
    """
    host, port, prefix = parse_store_addr(store_addr)
    return PrefixStore(prefix, connect_store_client(host, port, timeout))


# -- reconfigure handles --------------------------------------------------------------------

try:  # torch 2.14 and later: torch's own options type
    from torch._C._distributed_c10d import ReconfigureOptions
except ImportError:  # torch < 2.14: a stand-in with the same fields

    @dataclass
    class ReconfigureOptions:  # type: ignore[no-redef]
        """What a reconfiguration needs (torch 2.14's ``ReconfigureOptions``): ``uuid``, an
        id fresh for every reconfiguration and equal on every member; ``handles``, the
        members' reconfigure handles (a list assigns ranks by position; ft's groups need a
        list); ``timeout`` (None: the group's own); ``hints``, backend-specific settings."""

        uuid: int = 0
        handles: Union[List[str], Set[str]] = field(default_factory=list)
        timeout: Optional[timedelta] = None
        hints: Dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Rendezvous:
    """Where and as what one member of a reconfiguration connects: the store prefix all
    members share, its rank and the world size, and the members' global ranks (None unless
    every handle names one)."""

    store_addr: str
    rank: int
    world_size: int
    uuid: int
    global_ranks: Optional[List[int]]


def can_reconfigure(pg: Any) -> bool:
    """Whether ``pg`` has the reconfigure API and supports it. torch 2.14's plain
    ``ProcessGroup`` with no backend raises on ``supports_reconfigure`` ("Could not find the
    default backend type"): that group cannot be reconfigured either."""
    try:
        return bool(getattr(pg, "supports_reconfigure", False))
    except RuntimeError:
        return False


def _rendezvous(opts: Any, handle_id: str) -> _Rendezvous:
    """Reads ordered handles (ft's and torchft's JSON handles): the rank is the index of the
    handle whose id is ``handle_id``; every member meets on the first handle's store under
    ``torchft/<uuid>``, a prefix no other reconfiguration uses."""
    handles = opts.handles
    if not isinstance(handles, (list, tuple)):
        raise ValueError(
            "ft's process groups need the handles in rank order (a list), got "
            f"{type(handles).__name__}"
        )
    if not handles:
        raise ValueError("reconfigure needs at least this group's own handle")
    try:
        peers = [json.loads(h) for h in handles]
        ids = [p["id"] for p in peers]
        first_store = peers[0]["store"]
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"not a reconfigure handle of this process-group family: {e}") from e
    if handle_id not in ids:
        raise ValueError(f"this group's handle (id {handle_id}) is not among the {len(ids)} given")
    ranks = [p.get("global_rank") for p in peers]
    return _Rendezvous(
        store_addr=f"{first_store}/torchft/{opts.uuid}",
        rank=ids.index(handle_id),
        world_size=len(peers),
        uuid=opts.uuid,
        global_ranks=None if any(r is None for r in ranks) else [int(r) for r in ranks],
    )


_hosting_lock = threading.Lock()


RECONFIGURE_TIMEOUT = timedelta(seconds=60)


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = RECONFIGURE_TIMEOUT,
    store_client: Optional[Callable[[str, timedelta], Store]] = None,
) -> None:
    """Rebuilds ``pg`` as ``rank`` of ``world_size`` without a Manager: the members swap
    their reconfigure handles through the store at ``store_addr`` ("host:port/prefix", a
    prefix used for this one reconfiguration), rank 0 draws the uuid, and every member
    calls ``pg.reconfigure`` with the handles in rank order and waits for it.

    Works for every group with the reconfigure API: ft's, and torch's own made with
    ``enable_reconfigure=True`` (torch 2.14). Raises ``DistStoreError`` when a member's
    handle does not arrive within ``timeout`` (``pg`` is then left as it was), and what
    ``pg.reconfigure`` raises. ``store_client``: how to reach the store (default
    :func:`create_store_client`).
    """
    timeout = to_timedelta(timeout)
    store = (store_client or create_store_client)(store_addr, timeout)
    store.set(f"handle/{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        store.set("uuid", str(secrets.randbits(63)))
    keys = ["uuid"] + [f"handle/{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    got = store.multi_get(keys)
    opts = ReconfigureOptions()
    opts.uuid = int(got[0])
    opts.handles = [h.decode() if isinstance(h, bytes) else str(h) for h in got[1:]]
    opts.timeout = timeout
    pg.reconfigure(opts).wait()


def _configure_group(
    pg: Any, store_addr: str, replica_id: str, rank: int, world_size: int, extra: Dict[str, Any]
) -> None:
    """``pg.configure(...)``, passing on only the keyword arguments it accepts: the Manager
    passes ft's extras (quorum_id, group_rank, ...), a torchft-style group takes four."""
    configure = getattr(pg, "configure", None)
    if configure is None:
        raise TypeError(
            f"cannot configure {pg!r}: it has no configure() method (wrap a "
            f"reconfigurable group such as ft.ProcessGroupGloo)"
        )
    if extra:
        try:
            params = inspect.signature(configure).parameters
        except (TypeError, ValueError):
            params = {}
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            extra = {k: v for k, v in extra.items() if k in params}
    configure(store_addr, replica_id, rank, world_size, **extra)


def _forwarded_op(
    name: str,
    n_args: int,
    *,
    output_in_list: bool = False,
    default_opts: Optional[Callable[[], Any]] = None,
    takes_opts: bool = True,
) -> Callable[..., dist.Work]:
    """A :class:`ProcessGroupWrapper` method for the c10d op ``name``.

    It takes the op's ``n_args`` arguments, then (``takes_opts``) its options, positionally or
    as ``opts=`` (torch passes both ways); where torch may leave the options out,
    ``default_opts()`` stands in. The options go through the wrapper's ``_opts_hook``, the op
    is issued on the wrapped group through ``_dispatch``, and the op's future holds its first
    argument, the output (``[output]`` for the ops whose output is one tensor).
    """

    def op(self: "ProcessGroupWrapper", *args: Any, **kwargs: Any) -> dist.Work:
        op_args = args[:n_args]
        rest = args[n_args:]
        opts = None
        if takes_opts:
            opts = rest[0] if rest else kwargs.pop("opts", None)
            rest = rest[1:]
            if opts is None and default_opts is not None:
                opts = default_opts()
            if opts is None:
                raise TypeError(f"{name}() needs its options after {n_args} arguments")
            opts = self._opts_hook(opts)
        if len(op_args) < n_args or rest or kwargs:
            raise TypeError(
                f"{name}() takes {n_args} arguments"
                + (" and the options" if takes_opts else "")
                + f", got {len(args)} and {sorted(kwargs)}"
            )
        call_args = (*op_args, opts) if takes_opts else op_args
        output = op_args[0] if op_args else None
        result = [output] if output_in_list else output
        return self._dispatch(lambda pg: getattr(pg, name)(*call_args), result, opts)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"c10d's ``{name}``, issued on the wrapped group."
    return op


class ProcessGroupWrapper(ProcessGroup):
    """Sends every op to another process group, its ``parent``.

    Args:
        timeout: bound for reaching the store when this wrapper creates its group itself.
        pg: the group to wrap. Without it, :meth:`configure` creates one with
            ``_create_pg(store, rank, world_size)`` (subclasses implement it) and replaces it
            at every configure.

    A wrapped ``pg`` is kept across :meth:`abort` (its next configure reconnects it); torchft
    drops it, so that a wrapper around a given group could not be configured again.

    Subclass hooks: ``_create_pg``, ``_opts_hook(opts)`` (rewrite options before the op),
    ``_run_context()`` (a context around issuing the op), ``_wrap_work(work, opts)`` and
    ``_dispatch(call, result, opts)`` (issue one op; ``result`` is what the op's future holds:
    its output tensors).
    """

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        pg: Optional[_TorchProcessGroup] = None,
    ) -> None:
        super().__init__(0, 1)
        self._pg: Optional[_TorchProcessGroup] = pg
        self._owns_pg = pg is None
        self._timeout = to_timedelta(timeout)
        self._replica_id: Optional[str] = None
        self._rank: Optional[int] = None

    # -- lifecycle ---------------------------------------------------------------------

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **kwargs: Any
    ) -> None:
        self._new_group_starts()
        self._replica_id = replica_id
        self._rank = rank
        if not self._owns_pg:
            _configure_group(self._pg, store_addr, replica_id, rank, world_size, kwargs)
            return
        self.abort(errored=False)  # the previous group, if any
        store = create_store_client(store_addr, timeout=self._timeout)
        self._pg = self._create_pg(store, rank, world_size)

    def _new_group_starts(self) -> None:
        """Called first by every configure and reconfigure: what a subclass recorded about the
        previous group (an error, a pending injection) is forgotten here."""

    def _create_pg(self, store: Store, rank: int, world_size: int) -> _TorchProcessGroup:
        raise NotImplementedError(
            f"{type(self).__name__} wraps no group: pass pg=... or implement _create_pg()"
        )

    def _delegates_reconfigure(self) -> bool:
        """Whether reconfiguring goes to the wrapped group itself (one it was given that has
        the reconfigure API: ft's, or torch's made with ``enable_reconfigure=True``)."""
        pg = self._pg
        return not self._owns_pg and (isinstance(pg, ProcessGroup) or can_reconfigure(pg))

    def set_rank_info(self, *args: Any, **kwargs: Any) -> None:
        """:meth:`ProcessGroup.set_rank_info`, passed on to a wrapped ft group as well."""
        super().set_rank_info(*args, **kwargs)
        if isinstance(self._pg, ProcessGroup):
            self._pg.set_rank_info(*args, **kwargs)

    def _handle_id(self) -> str:
        if not self._owns_pg and isinstance(self._pg, ProcessGroup):
            return self._pg._handle_id()  # torchft-nightly's name (its tests call it)
        return super()._handle_id()  # torchft-nightly's name (its tests call it)

    def get_reconfigure_handle(self) -> str:
        if self._delegates_reconfigure():
            return self._pg.get_reconfigure_handle()
        return super().get_reconfigure_handle()

    def reconfigure(self, opts: "ReconfigureOptions") -> dist.Work:
        """Reconfigures the wrapped group when it has the reconfigure API; otherwise (a group
        this wrapper creates, or one with only ``configure``) rendezvouses on the handles and
        configures it as :meth:`configure` does."""
        self._new_group_starts()
        if self._delegates_reconfigure():
            if isinstance(self._pg, ProcessGroup):
                self._rank = _rendezvous(opts, self._handle_id()).rank
            return self._pg.reconfigure(opts)
        rdv = _rendezvous(opts, self._handle_id())
        replica_id = self._rank_info_or_default()[0]
        self.configure(rdv.store_addr, replica_id or "0", rdv.rank, rdv.world_size)
        return _DummyWork(None)

    def abort(self, errored: bool = True) -> None:
        if errored:
            logger.info(
                "process group aborted (replica_id=%s rank=%s)", self._replica_id, self._rank
            )
        self._end_group("abort")

    def shutdown(self) -> None:
        self._end_group("shutdown")

    def _end_group(self, how: str) -> None:
        """Aborts or shuts down the wrapped group; one this wrapper created is then dropped
        (the next configure creates another), a given one kept."""
        pg = self._pg
        if pg is None:
            return
        getattr(pg, how)()
        if self._owns_pg:
            self._pg = None

    def errored(self) -> Optional[Exception]:
        pg = self._pg
        check = getattr(pg, "errored", None)
        return check() if check is not None else None

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = to_timedelta(timeout)
        pg = self._pg
        if pg is not None and hasattr(pg, "set_timeout"):
            pg.set_timeout(self._timeout)

    @property
    def parent(self) -> _TorchProcessGroup:
        pg = self._pg
        if pg is None:
            raise RuntimeError(
                f"{type(self).__name__} has no process group yet: call configure() first"
            )
        return pg

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        pg = self._pg
        if isinstance(pg, ProcessGroup):
            return pg.getBackendName()
        raise NotImplementedError(f"{type(self).__name__} has no backend name")

    # Before the first configure a created group does not exist: a group of one, rank 0.
    def size(self) -> int:
        return self._pg.size() if self._pg is not None else 1

    def rank(self) -> int:
        return self._pg.rank() if self._pg is not None else 0

    def getSize(self) -> int:  # noqa: N802 - torch's C++ name (DDP's reducer reads it)
        return self.size()

    def getRank(self) -> int:  # noqa: N802 - torch's C++ name
        return self.rank()

    # -- op plumbing ---------------------------------------------------------------------

    def _opts_hook(self, opts: Any) -> Any:
        return opts

    def _run_context(self) -> Any:
        return contextlib.nullcontext()

    def _wrap_work(self, work: dist.Work, opts: Any) -> dist.Work:
        return work

    def _dispatch(
        self, call: Callable[[_TorchProcessGroup], dist.Work], result: Any, opts: Any
    ) -> dist.Work:
        parent = self.parent
        with self._run_context():
            work = call(parent)
        return self._wrap_work(work, opts)

    # -- ops: torchft's list, then the tensor-in/tensor-out ops torch's front end and
    # ft.collectives call (the "_base" and "_single" names; torch 2.13's all_gather_into_tensor,
    # reduce_scatter_tensor and all_to_all_single call the "_single" ones). Each forwards its
    # arguments as it got them; the number is how many come before the options.

    allgather = _forwarded_op("allgather", 2)
    allgather_into_tensor_coalesced = _forwarded_op("allgather_into_tensor_coalesced", 2)
    allreduce = _forwarded_op("allreduce", 1)
    allreduce_coalesced = _forwarded_op("allreduce_coalesced", 1)
    alltoall_base = _forwarded_op("alltoall_base", 4, output_in_list=True)
    barrier = _forwarded_op("barrier", 0, default_opts=dist.BarrierOptions)
    broadcast = _forwarded_op("broadcast", 1)
    recv = _forwarded_op("recv", 3, takes_opts=False)
    reduce_scatter = _forwarded_op("reduce_scatter", 2)
    reduce_scatter_tensor_coalesced = _forwarded_op("reduce_scatter_tensor_coalesced", 2)
    send = _forwarded_op("send", 3, takes_opts=False)
    _allgather_base = _forwarded_op(
        "_allgather_base", 2, output_in_list=True, default_opts=AllgatherOptions
    )
    _reduce_scatter_base = _forwarded_op(
        "_reduce_scatter_base", 2, output_in_list=True, default_opts=ReduceScatterOptions
    )
    all_gather_single = _forwarded_op(
        "all_gather_single", 2, output_in_list=True, default_opts=AllgatherOptions
    )
    reduce_scatter_single = _forwarded_op(
        "reduce_scatter_single", 2, output_in_list=True, default_opts=ReduceScatterOptions
    )
    all_to_all_single = _forwarded_op(
        "all_to_all_single", 4, output_in_list=True, default_opts=dist.AllToAllOptions
    )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(pg={self._pg!r})"


class _WorkAround(dist.Work):
    """A Work around another one, ``_work``: :meth:`wait_inner` waits for it (with the
    caller's timeout, if any) and :meth:`is_completed` reports it."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work

    def wait_inner(self, timeout: Optional[timedelta]) -> None:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _ErrorSwallowingWork(_WorkAround):
    """A Work whose failure is reported to its wrapper instead of raised; its future then
    holds ``default_result`` (the op's output tensors, as they are)."""

    def __init__(
        self, pg: "ErrorSwallowingProcessGroupWrapper", work: dist.Work, default_result: Any
    ) -> None:
        super().__init__(work)
        self._pg = pg
        self._default_result = default_result

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        try:
            self.wait_inner(timeout)
        except Exception as e:  # noqa: BLE001 - swallowed by design, recorded on the wrapper
            self._pg.report_error(e)
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        def swallow(fut: torch.futures.Future) -> Any:
            try:
                return fut.value()
            except Exception as e:  # noqa: BLE001 - swallowed by design
                logger.warning("process group op failed; skipping the ops after it: %s", e)
                self._pg.report_error(e)
                return self._default_result

        return self._work.get_future().then(swallow)


class _WrapperWithPendingError(ProcessGroupWrapper):
    """A wrapper around a given ``pg`` that holds one error, ``_pending``, about the ops it
    issues (what the subclass makes of it), forgotten at every configure and reconfigure."""

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg=pg)
        self._pending: Optional[Exception] = None

    def _new_group_starts(self) -> None:
        self._pending = None


class ErrorSwallowingProcessGroupWrapper(_WrapperWithPendingError):
    """Wraps ``pg`` so that failed ops never raise: the first error is recorded
    (:meth:`error`), and every op after it is skipped (a completed ``_DummyWork`` whose
    future holds the op's output tensors untouched) until the next :meth:`configure`.

    For code that cannot handle errors itself (model code inside a training step): check
    :meth:`error` afterwards, e.g. before ``should_commit``.

    Differences from torchft: every op is covered, not only ``allreduce``; the *first*
    error is kept (later ones are usually consequences of it), torchft keeps the last.
    """

    def report_error(self, e: Exception) -> None:
        """Records ``e`` (unless an error is already recorded): later ops are skipped until
        the next configure."""
        if self._pending is None:
            self._pending = e

    def error(self) -> Optional[Exception]:
        """The recorded error, or None."""
        return self._pending

    def _dispatch(
        self, call: Callable[[_TorchProcessGroup], dist.Work], result: Any, opts: Any
    ) -> dist.Work:
        if self._pending is not None:
            return _DummyWork(result)
        try:
            work = super()._dispatch(call, result, opts)  # the wrapper's hook this overrides
        except Exception as e:  # noqa: BLE001 - swallowed by design
            self.report_error(e)
            return _DummyWork(result)
        return _ErrorSwallowingWork(self, work, result)


class _InjectedFailureWork(_WorkAround):
    """A Work that lets the real op finish, then fails with an injected error."""

    def __init__(self, work: dist.Work, error: Exception) -> None:
        super().__init__(work)
        self._error = error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        try:
            self.wait_inner(timeout)
        except Exception:  # noqa: BLE001 - the injected failure wins over the op's own
            pass
        raise self._error

    def is_success(self) -> bool:
        return False

    def exception(self) -> Optional[Exception]:
        return self._error

    def get_future(self) -> torch.futures.Future:
        error = self._error
        out: torch.futures.Future = torch.futures.Future()
        # set_exception keeps the injected exception as it is (a raising .then() callback
        # would wrap it in a RuntimeError).
        self._work.get_future().add_done_callback(lambda _f: out.set_exception(error))
        return out


class FakeProcessGroupWrapper(_WrapperWithPendingError):
    """For tests: wraps ``pg`` and fails the *next* op on demand.

    After :meth:`report_future_error` the next op (of any kind) runs normally on ``pg``, and
    then its Work fails with the given exception: ``wait()`` raises it and ``get_future()``
    completes with it (so a Manager reports it and does not commit the step). One op per
    call; :meth:`configure` clears a pending injection.

    Difference from torchft: torchft attaches the failure to a future it discards, on
    ``allreduce`` only; here the returned Work itself fails, whatever the op.
    """

    def report_future_error(self, e: Exception) -> None:
        """Makes the next op's Work fail with ``e``."""
        self._pending = e

    def _dispatch(
        self, call: Callable[[_TorchProcessGroup], dist.Work], result: Any, opts: Any
    ) -> dist.Work:
        work = super()._dispatch(call, result, opts)  # the wrapper's hook this overrides
        error, self._pending = self._pending, None
        if error is None:
            return work
        return _InjectedFailureWork(work, error)


class ProcessGroupDummy(ProcessGroup):
    """A group that moves no data: every op completes at once, as it would in a group of one
    (allreduce and broadcast leave the tensors as they are, allgather / alltoall /
    reduce_scatter copy the input into the output, send and recv do nothing).
    ``rank()``/``size()`` report the given values. For tests, and for discarding ops a
    library insists on issuing.

    Attributes: ``configure_count`` (configure calls), ``reconfigure_count`` (reconfigure
    calls), ``_work`` (the Works returned).
    torchft accepts only rank 0 of 1; ft accepts any ``0 <= rank < world``.
    """

    def __init__(self, rank: int, world: int) -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank {rank!r} is out of range for world {world}")
        super().__init__(rank, world)
        self._rank = rank
        self._world = world
        self.wait_count = 0
        self.get_future_count = 0
        self.configure_count = 0
        self.reconfigure_count = 0
        self._work: List[dist.Work] = []

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **kwargs: Any
    ) -> None:
        self.configure_count += 1

    def reconfigure(self, opts: "ReconfigureOptions") -> dist.Work:
        self.reconfigure_count += 1
        return _DummyWork(None)

    def _done(
        self, result: Any, copies: Iterable[Tuple[torch.Tensor, torch.Tensor]] = ()
    ) -> dist.Work:
        """A completed Work holding ``result``, after copying each ``(out, inp)`` of ``copies``
        (what a group of one moves)."""
        for out, inp in copies:
            out.copy_(inp)
        work = _DummyWork(result)
        self._work.append(work)
        return work

    def allgather(
        self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts: Any
    ) -> dist.Work:
        return self._done(output_tensors, zip(output_tensors[0], input_tensor))

    def allgather_into_tensor_coalesced(
        self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any
    ) -> dist.Work:
        flat = zip(output_tensors, input_tensors)
        return self._done(output_tensors, ((o.view(-1)[: i.numel()], i.view(-1)) for o, i in flat))

    def allreduce(self, tensors: List[torch.Tensor], opts: Any) -> dist.Work:
        return self._done(tensors)

    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any) -> dist.Work:
        return self._done(tensors)

    def alltoall_base(
        self,
        output_buffer: torch.Tensor,
        input_buffer: torch.Tensor,
        output_split_sizes: List[int],
        input_split_sizes: List[int],
        opts: Any,
    ) -> dist.Work:
        output_buffer.copy_(input_buffer)
        return self._done([output_buffer])

    def barrier(self, opts: Optional[Any] = None) -> dist.Work:
        return _DummyWork(None)

    def broadcast(self, tensor_list: List[torch.Tensor], opts: Any) -> dist.Work:
        return self._done(tensor_list)

    def recv(self, tensors: List[torch.Tensor], src_rank: int, tag: int) -> dist.Work:
        return _DummyWork(None)

    def reduce_scatter(
        self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]], opts: Any
    ) -> dist.Work:
        return self._done(output_tensors, zip(output_tensors, input_tensors[0]))

    def reduce_scatter_tensor_coalesced(
        self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any
    ) -> dist.Work:
        flat = zip(output_tensors, input_tensors)
        return self._done(output_tensors, ((o.view(-1), i.view(-1)[: o.numel()]) for o, i in flat))

    def send(self, tensors: List[torch.Tensor], dst_rank: int, tag: int) -> dist.Work:
        return _DummyWork(None)

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def getSize(self) -> int:  # noqa: N802 - torch's C++ name
        return self._world

    def getRank(self) -> int:  # noqa: N802 - torch's C++ name
        return self._rank

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ft-dummy"


# -- XCCL (Intel XPU) ------------------------------------------------------------------


def _require_xpu(what: str) -> None:
    """Raises a RuntimeError naming the missing piece when ``what`` cannot run XCCL here."""
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        raise RuntimeError(
            f"{what} needs an Intel XPU device, and this machine has none "
            f"(torch.xpu.is_available() is False); use ft.ProcessGroupGloo for CPU tensors "
            f"or ft.ProcessGroupNCCL for CUDA"
        )
    if not (hasattr(dist, "is_xccl_available") and dist.is_xccl_available()):
        raise RuntimeError(
            f"{what} needs torch built with XCCL, and this build has none "
            f"(torch.distributed.is_xccl_available() is False)"
        )


class ProcessGroupXCCL(ProcessGroupWrapper):
    """torch's XCCL process group (Intel XPU), made reconfigurable: every configure()
    creates a new one on a fresh store prefix; an op that has not been issued within
    ``timeout`` aborts the group (``errored()`` then reports it until the next configure).

    ft's own backend has no XCCL path, so this wraps torch's. It exists on every machine;
    configure() raises a RuntimeError naming the missing XPU device (or XCCL build) where
    there is none. Not exercised on XPU hardware by ft's tests.
    """

    def __init__(self, timeout: timedelta = timedelta(seconds=60.0)) -> None:
        super().__init__(timeout)
        self._errored: Optional[Exception] = None

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, **kwargs: Any
    ) -> None:
        _require_xpu(type(self).__name__)
        self._errored = None
        super().configure(store_addr, replica_id, rank, world_size, **kwargs)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> _TorchProcessGroup:
        from torch.distributed import ProcessGroupXCCL as _TorchXCCL  # only in XCCL builds

        # A ProcessGroup over one XCCL backend, assembled as torch's _new_process_group_helper
        # does, with torch's private calls: torch has no public one for it.
        pg = _TorchProcessGroup(store, rank, world_size)
        pg._set_default_backend(_TorchProcessGroup.BackendType.XCCL)  # torch's, see above
        backend = _TorchXCCL(store, rank, world_size, _TorchXCCL.Options())
        backend._set_sequence_number_for_group()  # torch's, see above
        backend.eager_connect_single_device(torch.device("xpu", torch.xpu.current_device()))
        # torch's, see above
        pg._register_backend(torch.device("xpu"), _TorchProcessGroup.BackendType.XCCL, backend)
        return pg

    def _run_context(self) -> Any:
        from ft.futures import context_timeout

        timeout = self._timeout

        def expire() -> None:
            logger.error("XCCL op not issued within %s; aborting the process group", timeout)
            self.abort()

        return context_timeout(expire, timeout)

    def abort(self, errored: bool = True) -> None:
        # Set first: an op failing because of the abort must find errored() already set.
        self._errored = RuntimeError("aborted")
        super().abort(errored)

    def errored(self) -> Optional[Exception]:
        if self._errored is None and hasattr(torch, "xpu") and torch.xpu.is_available():
            torch.xpu.current_stream().synchronize()  # errors surface once the stream drains
        return self._errored

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "ft-xccl"


# -- "Baby" groups -------------------------------------------------------------------------


class ProcessGroupBaby(ProcessGroupFt):
    """torchft's "Baby" process group, as an ft group.

    torchft runs the real group in a child process so that a collective hung inside the
    communication library can be ended by killing that process; the price is shared-memory
    copies of CPU tensors, a second CUDA context (about 1 GB) and options pickled across a
    pipe. ft's backend gets the same guarantee in place: ``abort()`` fails an in-flight op
    at once and ``configure()`` starts a new generation, in this process. So the Baby groups
    are ft's own groups under torchft's names, with torchft's constructor
    (``timeout`` in seconds or a timedelta); no child process is started.
    """

    def __init__(self, timeout: Union[float, timedelta] = 60.0) -> None:
        super().__init__(timeout=to_timedelta(timeout))


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """torchft's Baby Gloo group: ft's CPU group (see :class:`ProcessGroupBaby`). Unlike
    torchft's it supports reduce_scatter (ft's backend implements it)."""


class ProcessGroupBabyNCCL(ProcessGroupBaby, ProcessGroupNCCL):
    """torchft's Baby NCCL group: ft's NCCL group, aborted in place (see
    :class:`ProcessGroupBaby`); no second CUDA context, and Works synchronize like
    :class:`ProcessGroupNCCL`'s."""


class ProcessGroupBabyXCCL(ProcessGroupBaby):
    """torchft's Baby XCCL group. ft's backend has no XCCL path, so this group cannot
    run: configure() raises a RuntimeError naming the missing XPU device where there is
    none, and pointing to :class:`ProcessGroupXCCL` (torch's XCCL, reconfigurable) where
    there is one."""

    def configure(self, *args: Any, **kwargs: Any) -> None:
        """Raises: see the class."""
        _require_xpu(type(self).__name__)
        raise RuntimeError(
            "ProcessGroupBabyXCCL: ft's backend has no XCCL path; use ft.ProcessGroupXCCL "
            "(torch's XCCL group, reconfigured and aborted by ft)"
        )
