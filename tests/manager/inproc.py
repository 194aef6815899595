"""Helpers for tests that run Managers: a real lighthouse, the loopback Manager factory, and
threads with bounded waits (several Managers in one process)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import ft
from ft.checkpointing import HTTPTransport
from tests.procs import in_threads, values  # noqa: F401  (re-exported)
from tests.procs import lighthouse  # noqa: F401  (re-exported: tests/gpu imports it here)

TO = timedelta(seconds=10)


def make_manager(
    lh_addr: str,
    name: str,
    rank: int = 0,
    world_size: int = 1,
    store_port: int = 0,
    pg_timeout: timedelta = TO,
    pg: Any = None,
    pg_lanes: Optional[int] = None,
    **kw: Any,
) -> ft.Manager:
    """The one way tests build a Manager on loopback: replica ``name`` of the lighthouse at
    ``lh_addr``, its store and checkpoint server on 127.0.0.1, a ``ProcessGroupGloo`` with
    ``pg_timeout`` (and ``pg_lanes`` lanes; default: the backend's) unless ``pg`` is given,
    and 10 s timeouts; ``kw`` overrides any other Manager argument. Used in-process (threads)
    and by the subprocess workers alike."""
    if pg is None:
        lanes = {} if pg_lanes is None else {"num_lanes": pg_lanes}
        pg = ft.ProcessGroupGloo(timeout=pg_timeout, **lanes)
    kw.setdefault(
        "checkpoint_transport", HTTPTransport(timeout=TO, num_chunks=0, advertise_host="127.0.0.1")
    )
    kw.setdefault("min_replica_size", 1)
    kw.setdefault("timeout", TO)
    kw.setdefault("quorum_timeout", TO)
    kw.setdefault("connect_timeout", TO)
    return ft.Manager(
        pg=pg,
        load_state_dict=kw.pop("load_state_dict", None),
        state_dict=kw.pop("state_dict", None),
        rank=rank,
        world_size=world_size,
        store_addr="127.0.0.1",
        store_port=store_port,
        lighthouse_addr=lh_addr,
        replica_id=name,
        hostname="127.0.0.1",
        **kw,
    )


def reporting_manager(
    step: int = 3,
    participants: int = 2,
    quorum_id: int = 9,
    last_step_error: Optional[str] = None,
    errored: Optional[BaseException] = None,
) -> Any:
    """A Manager-like object with only what ``ft.launch.worker.emit_step`` reads of one: the
    step, participants and quorum id, and why the step failed (``last_step_error``, a Manager's
    own summary, or ``errored``)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        current_step=lambda: step,
        num_participants=lambda: participants,
        quorum_id=lambda: quorum_id,
        last_step_error=lambda: last_step_error,
        errored=lambda: errored,
    )


def group_manager(
    store: Any, key: str, lh_addr: str, name: str, rank: int, world_size: int, **kw: Any
) -> ft.Manager:
    """Rank ``rank`` of replica group ``name`` (``world_size`` ranks, one per process): the
    group's store is hosted by its rank 0's Manager, which publishes its port under ``key`` in
    the test ``store``; the other ranks wait for it (60 s). ``kw``: :func:`make_manager`'s."""
    port = 0
    if rank != 0:
        store.wait([key], timedelta(seconds=60))
        port = int(store.get(key))
    manager = make_manager(lh_addr, name, rank=rank, world_size=world_size, store_port=port, **kw)
    if rank == 0:
        store.set(key, str(manager._store_port))
    return manager


def on_each(managers: List[ft.Manager], fn: Callable[..., Any], *args: Any) -> List[Any]:
    """``fn(i, m, *args)`` for every Manager ``m`` (index ``i``) of ``managers``, each on its
    own thread (bounded wait, :func:`in_threads`); their values, or the first error raised."""
    return values(in_threads([lambda i=i, m=m: fn(i, m, *args) for i, m in enumerate(managers)]))


def replica_managers(
    lh_addr: str,
    n: int,
    per_replica: Callable[[int], Dict[str, Any]] = lambda i: {},
    **kw: Any,
) -> List[ft.Manager]:
    """The Managers of replicas ``g0``, ``g1``... ``g{n-1}`` of the lighthouse at ``lh_addr``,
    made concurrently (so that all join the first quorum); ``kw`` goes to every
    :func:`make_manager` call, ``per_replica(i)`` to replica i's only."""
    return values(
        in_threads(
            [lambda i=i: make_manager(lh_addr, f"g{i}", **kw, **per_replica(i)) for i in range(n)]
        )
    )


def tensor_managers(
    lh_addr: str,
    state: List[Any],
    state_dict: Optional[Callable[[int], Any]] = None,
    per_replica: Callable[[int], Dict[str, Any]] = lambda i: {},
    **kw: Any,
) -> List[ft.Manager]:
    """One Manager per tensor of ``state`` (:func:`replica_managers`). Replica i heals by
    copying ``{"w": ...}`` into ``state[i]`` and sends ``state_dict(i)`` (default
    ``{"w": state[i]}``); ``kw`` goes to every :func:`make_manager` call, ``per_replica(i)`` to
    replica i's only."""

    def send(i: int) -> Any:
        return state_dict(i) if state_dict is not None else {"w": state[i]}

    def own(i: int) -> Dict[str, Any]:
        return dict(
            load_state_dict=lambda sd: state[i].copy_(sd["w"]),
            state_dict=lambda: send(i),
            **per_replica(i),
        )

    return replica_managers(lh_addr, len(state), own, **kw)
