"""The seams between ft's layers, as ``typing.Protocol`` classes.

* :class:`ManagerLike`: what an algorithm needs from a Manager.
* :class:`GroupServerClient`: what a Manager needs from its group's ManagerServer. Rank 0 talks
  to the server in its own process (``LocalManagerClient``), the other ranks over gRPC
  (``ManagerClient``); both provide this, with the same errors.

Algorithms (LocalSGD, DiLoCo, the fault-tolerant averager and ZeRO, the optimizer wrappers) are
written against :class:`ManagerLike`, not against ``ft.Manager``'s internals, so that a test
double (``tests/diloco/fake_manager.py``) or another manager can stand in, and a change inside
the Manager cannot silently break them. ``tests/manager/test_protocols.py`` checks that
``ft.Manager`` and the test double both provide every member.

The protocols are ``runtime_checkable``: ``isinstance(x, ManagerLike)`` checks that the members
exist (not their signatures).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Protocol, TypeVar, Union, runtime_checkable

import torch

__all__ = ["ManagerLike", "GroupServerClient"]

T = TypeVar("T")


@runtime_checkable
class ManagerLike(Protocol):
    """What an algorithm needs from the Manager of its replica group (docs/design.md, "The step
    protocol"): a quorum per step, collectives across the replica groups, the commit vote, and
    the registration of the state that a healing group receives."""

    @property
    def use_async_quorum(self) -> bool:
        """Whether ``start_quorum`` returns before the quorum is known."""
        ...

    @property
    def num_lanes(self) -> int:
        """How many independent lanes the replica process group has (at least 1)."""
        ...

    def start_quorum(
        self,
        allow_heal: bool = True,
        shrink_only: bool = False,
        timeout: Optional[timedelta] = None,
    ) -> None: ...

    def wait_quorum(self) -> None: ...

    def send_pending_heal(self) -> None: ...

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: Union[bool, torch.dtype] = False,
        reduce_op: Any = ...,
    ) -> Any:
        """In place, across the participating replica groups; returns a Work (``.wait()``)."""
        ...

    def should_commit(self, timeout: Optional[timedelta] = None) -> bool: ...

    def current_step(self) -> int: ...

    def num_participants(self) -> int: ...

    def is_participating(self) -> bool: ...

    def participating_rank(self) -> Optional[int]: ...

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[T], None], state_dict: Callable[[], T]
    ) -> None: ...

    def report_error(self, e: Exception) -> None: ...

    def errored(self) -> Optional[BaseException]: ...

    def abort_step(self, e: Exception) -> None:
        """Fails the step and aborts the process group: for when this group cannot issue the
        collectives its peers expect."""
        ...

    def step_aborted(self) -> bool:
        """Whether an error this step aborted the process group: the step's later collectives
        are skipped on this group (its peers' fail with the abort). After any other error they
        still run, on every group alike."""
        ...


@runtime_checkable
class GroupServerClient(Protocol):
    """A client of the replica group's ManagerServer (docs/design.md, "Roles"). A missed
    deadline raises TimeoutError; any other failure a CoordinationError naming the call.

    ``_quorum`` and ``_checkpoint_metadata`` are torchft's names for ``quorum`` and
    ``checkpoint_metadata`` (the same calls); the Manager and the Healer call these and
    ``should_commit``, torchft client's methods, so that a stand-in for torchft's client (a
    ``mock.patch("torchft.manager.ManagerClient", autospec=True)`` ported to ft) drives them.
    """

    def quorum(
        self,
        group_rank: int,
        step: int,
        checkpoint_metadata: str,
        shrink_only: bool,
        timeout: Any,
        init_sync: bool = True,
        commit_failures: int = 0,
    ) -> Any:
        """This rank's QuorumResult (ft.coordination.quorum) once the group's quorum forms."""
        ...

    def checkpoint_metadata(self, rank: int, timeout: Any) -> str:
        """The checkpoint metadata ``rank`` sent with its latest quorum request."""
        ...

    # torchft's names for the same calls (the clients define them the same way).
    _quorum = quorum
    _checkpoint_metadata = checkpoint_metadata

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: Any) -> bool:
        """This rank's vote; returns the group's decision once every rank voted."""
        ...

    def close(self) -> None: ...
