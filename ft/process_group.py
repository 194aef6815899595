"""Python face of the ft backend: torchft-compatible process groups.

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

torch 2.13 note: torch's C++ ProcessGroup keeps the world size it was created
with. The facade overrides `size()`/`rank()` and `getSize()`/`getRank()`, so
Python callers and torch's C++ code (e.g. DDP's reducer) see the live values
through the Python override. A group made by `init_process_group("ft")` is
never reconfigured, so its size is always right.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
from datetime import timedelta
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, PrefixStore, TCPStore

from ft import _C
from ft.utils import net
from ft.utils.deadline import Deadline
from ft.utils.retry import retry_until

__all__ = [
    "ProcessGroup",
    "ProcessGroupFt",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",
    "lane",
    "parse_store_addr",
]

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
    return ProcessGroupErrored(f"{kind}: {message}")


@contextlib.contextmanager
def lane(index: int) -> Iterator[int]:
    """Runs the calling thread's ops inside the block on lane `index`."""
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


def _check_agreement_default(value: Optional[bool]) -> bool:
    if value is not None:
        return bool(value)
    return os.environ.get("FT_CHECK_AGREEMENT", "0") not in ("", "0", "false", "False")


def _to_timedelta(timeout) -> timedelta:
    if isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, (int, float)):
        return timedelta(seconds=timeout)
    raise TypeError(f"timeout must be a timedelta or seconds, got {type(timeout).__name__}")


def _lock_timeout(deadline: Deadline) -> float:
    left = deadline.remaining()
    return -1 if left == float("inf") else left


def _socket_links() -> Dict[int, str]:
    """This process's socket descriptors: fd -> "socket:[inode]" (empty where /proc is not)."""
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
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


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

    retry_until(connect, deadline,
                retry_on=lambda e: isinstance(e, OSError) and not isinstance(e, TimeoutError))


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
            box["store"] = TCPStore(host, port, is_master=False,
                                   timeout=timedelta(seconds=store_timeout),
                                   wait_for_workers=False)
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
    ) -> None:
        """
        Args:
            timeout: deadline of every op (and of connecting in configure()).
            num_lanes: independent communicators per generation (`ft.lane`).
            check_agreement: verify before each collective that every rank
                calls the same op on same-shaped tensors, raising a clear
                error instead of letting Gloo abort the process. Costs one
                small round trip per op. Default: env FT_CHECK_AGREEMENT=1.
        """
        super().__init__(0, 1)
        self._timeout = _to_timedelta(timeout)
        self._backend = _C.FtBackend(0, 1, self._timeout, num_lanes)
        self._backend.check_agreement = _check_agreement_default(check_agreement)
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
        """
        deadline = Deadline.after(self._timeout)
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} is out of range for world_size {world_size}")
        host, port, prefix = parse_store_addr(store_addr)
        store = self._client_store(host, port, deadline)
        self._replica_id = replica_id
        self._quorum_id = quorum_id
        _configuring.deadline = deadline  # bounds the lanes' connects (see _new_gloo)
        try:
            self._backend.configure(PrefixStore(f"{prefix}/ft", store), rank, world_size)
        except Exception:
            # The store server may be gone; connect afresh next time.
            self._drop_store(host, port)
            raise
        finally:
            _configuring.deadline = None

    def _client_store(self, host: str, port: int, deadline: Deadline) -> TCPStore:
        what = (f"ft: cannot reach the store at {host}:{port} within "
                f"{self._timeout.total_seconds():.1f}s")
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

    def abort(self) -> None:
        """Fails every in-flight op of the current generation at once."""
        self._backend.abort()

    def shutdown(self) -> None:
        self._backend.shutdown()

    def errored(self) -> Optional[Exception]:
        """The current generation's sticky error, or None. Never blocks."""
        return _failure_to_exception(self._backend.errored())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = _to_timedelta(timeout)
        self._backend.set_timeout(self._timeout)

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

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  *args, **kwargs) -> None:
        if _C.has_nccl and torch.cuda.is_available():
            self._backend.set_cuda_device(torch.cuda.current_device())
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)

    def last_reconfigure_timings(self) -> dict:
        """Milliseconds per step of the last configure(): abort_ms (old
        generation, ncclCommAbort included), gloo_ms, nccl_ms, total_ms."""
        return self._backend.last_reconfigure_timings()


def _create_backend(store, rank: int, world_size: int, timeout: timedelta):
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
        BACKEND_NAME, _create_backend, extended_api=False, devices=["cpu", "cuda"]
    )


_register()


@atexit.register
def _release_before_interpreter_exit() -> None:
    # Communicator threads that touch a tensor after the interpreter starts
    # finalizing are killed by Python mid-destructor (std::terminate). Tear
    # every generation down while the interpreter is whole, then drop the
    # references ops still hold, here, with the GIL.
    _C._shutdown_all(timedelta(seconds=5))
    _C._drain_releaser(True)


def _new_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """torch's ProcessGroupGloo for one lane of the ft backend (called from C++).

    Gloo listens on, and tells its peers, the replica's advertised address
    (:func:`ft.utils.net.chosen_advertise_host`): by default Gloo resolves the host name, which on
    many machines is 127.0.0.1, and peers on other hosts could never connect. An explicit
    ``GLOO_SOCKET_IFNAME`` still wins.

    Gloo's timeout bounds both its connect and, later, its ops. Called from a configure(), the
    connect gets only what is left of that call's deadline, and the ops ``timeout`` after it.
    """
    deadline: Optional[Deadline] = getattr(_configuring, "deadline", None)
    connect_timeout = timeout
    if deadline is not None:
        left = deadline.remaining()
        if left <= 0:
            raise TimeoutError("configure()'s deadline passed before this lane could connect")
        connect_timeout = min(timeout, timedelta(seconds=left))
    host = net.chosen_advertise_host()
    if host is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        pg = dist.ProcessGroupGloo(store, rank, size, connect_timeout)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = connect_timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host.strip("[]"))]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    if connect_timeout != timeout:
        pg.set_timeout(timeout)  # the ops' bound (its connections and contexts too)
    return pg


# The deadline of the configure() running on this thread (None outside one): _new_gloo runs
# inside it, called back from C++ on the same thread.
_configuring = threading.local()
