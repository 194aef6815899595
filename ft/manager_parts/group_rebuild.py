"""How the Manager rebuilds its process group at a new quorum, and reads the group's errors.

Two kinds of group:
  * ft's groups, and groups written for torchft 0.2.0, are rebuilt with ``configure()`` on
    the quorum's store (:func:`configure_for_quorum`);
  * torch's own groups made with ``enable_reconfigure=True`` (torch 2.14 and later), and
    groups that implement only ``reconfigure``, are rebuilt with ``reconfigure(opts)`` on the
    handles the members exchanged through the lighthouse (:func:`reconfigure_from_handles`).
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ft.backend.process_group import ProcessGroup as FtProcessGroup
from ft.backend.process_group import ReconfigureOptions, can_reconfigure
from ft.coordination import QuorumResult

__all__ = [
    "can_rebuild",
    "configure_for_quorum",
    "configures",
    "group_error",
    "keyword_parameters",
    "name_group_rank",
    "prepare_group",
    "reconfigure_from_handles",
    "require_rebuildable",
    "store_address",
]


class _EveryName:
    """Holds every name: the keyword names of a function that takes ``**kwargs``."""

    def __contains__(self, _name: object) -> bool:
        return True


_EVERY_NAME = _EveryName()


def configures(pg: Any) -> bool:
    """Whether ``pg`` is rebuilt with ``configure()`` (module docstring)."""
    if not callable(getattr(pg, "configure", None)):
        return False
    impl = getattr(type(pg), "configure", None)
    # None: an instance attribute (a mock, a duck-typed group); else it must be a real one.
    return impl is None or impl is not FtProcessGroup.configure


def can_rebuild(pg: Any) -> bool:
    """Whether the Manager can rebuild ``pg`` at a new quorum, one way or the other."""
    return configures(pg) or can_reconfigure(pg)


def group_error(pg: Any) -> Optional[Exception]:
    """The process group's pending error, or None: ``errored()`` of a group that has it (ft's,
    torchft's); else the error its backends report (``get_error()``, torch's own groups)."""
    errored = getattr(pg, "errored", None)
    if errored is not None:
        return errored()
    for device in getattr(pg, "_device_types", None) or ():  # torch's groups: no public list
        try:
            backend = pg._get_backend(device)  # torch's own accessor (no public one)
        except RuntimeError:
            continue
        get_error = getattr(backend, "get_error", None)
        error = get_error() if get_error is not None else None
        # torch exports the backend error type only from its C module
        if error is not None and error != torch._C._distributed_c10d.ErrorType.SUCCESS:
            return dist.DistBackendError(f"the process group's {device} backend reports {error}")
    return None


def keyword_parameters(fn: Callable[..., Any]) -> Any:
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


def configure_for_quorum(
    pg: Any, quorum: QuorumResult, rank: int, world_size: int, replica_id: str, takes: Any
) -> None:
    """``pg.configure()`` for ``quorum``, on its store under a prefix of its own. ``takes``:
    the keyword names ``pg.configure`` accepts (:func:`keyword_parameters`): a group written
    against torchft's base class may take only the four positional arguments, so ft's extra
    facts go only to a configure() that names them."""
    extras = {
        "quorum_id": quorum.quorum_id,
        "group_rank": rank,
        "group_world_size": world_size,
        # This rank's peers across the replica groups, as job-wide ranks (replica r's group
        # rank g is r * group_world_size + g), for the backend's logs.
        "global_ranks": [r * world_size + rank for r in range(quorum.replica_world_size)],
    }
    pg.configure(
        store_address(quorum, rank),
        replica_id,
        quorum.replica_rank,
        quorum.replica_world_size,
        **{k: v for k, v in extras.items() if k in takes},
    )


def store_address(quorum: QuorumResult, rank: int) -> str:
    """The store prefix the group of ``quorum`` rendezvouses under, for group rank ``rank``."""
    return f"{quorum.store_address}/torchft/{quorum.quorum_id}/{rank}"


def reconfigure_from_handles(
    pg: Any, communicator_id: int, handles: List[str], timeout: timedelta
) -> None:
    """``pg.reconfigure`` on the members' handles in replica rank order, ``communicator_id``
    (the quorum id) as their uuid, bounded by ``timeout``. Raises what it raises, or
    RuntimeError where a member sent no handle."""
    if not handles or not all(handles):
        raise RuntimeError(
            f"cannot reconfigure {type(pg).__name__} for quorum {communicator_id}: "
            f"not every member sent a reconfigure handle ({len(handles)} handles; a "
            f"member running torchft 0.2.0 or an ft release before the reconfigure API "
            f"sends none)"
        )
    opts = ReconfigureOptions()
    opts.uuid = communicator_id
    opts.handles = list(handles)
    opts.timeout = timeout
    pg.reconfigure(opts).wait()


def require_rebuildable(pg: Any) -> None:
    """Raises ValueError, naming what to pass instead, unless the Manager can rebuild ``pg``."""
    if not can_rebuild(pg):
        raise ValueError(
            f"Manager(pg=...): {type(pg).__name__} cannot be reconfigured at a new quorum. "
            f"Pass one of ft's process groups (ft.ProcessGroupGloo, ft.ProcessGroupNCCL, "
            f"...), or a torch process group created with enable_reconfigure=True (torch "
            f"2.14 and later, with a backend that supports reconfigure)"
        )


def prepare_group(pg: Any, timeout: timedelta) -> Any:
    """Bounds ``pg``'s collectives by ``timeout`` (Manager(timeout=) bounds every collective,
    as in torchft, through the one deadline the backend already enforces per op: the tighter
    of the two wins); returns the keyword names its ``configure`` takes (none where it is
    rebuilt from handles)."""
    pg_timeout = getattr(pg, "timeout", None)
    if isinstance(pg_timeout, timedelta) and hasattr(pg, "set_timeout") and timeout < pg_timeout:
        pg.set_timeout(timeout)
    return keyword_parameters(pg.configure) if configures(pg) else frozenset()


def name_group_rank(pg: Any, replica_id: str, rank: int, world_size: int, group_id: str) -> None:
    """Tells one of ft's groups its replica and rank: its reconfigure handle names its job-wide
    rank where the group id is a number (REPLICA_GROUP_ID, torchft's launchers), as torchft's
    does."""
    if isinstance(pg, FtProcessGroup):
        job_rank = int(group_id) * world_size + rank if group_id.isdigit() else None
        pg.set_rank_info(replica_id, rank, world_size, job_rank)
