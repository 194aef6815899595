"""The checkpoint transport interface (its errors are in :mod:`ft.checkpointing.errors`).

A transport moves one replica's state dict to the replicas that must heal. The Manager calls
``send_checkpoint`` on the healthy source and ``recv_checkpoint`` on the recovering ones;
``metadata()`` is the opaque string the source publishes (through the ManagerServer) so that
receivers can find it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, List, Optional, TypeVar

from ft.checkpointing import errors

# The errors stay importable from here, where they were defined before they had a module of
# their own (and where code written for ft imports them from).
from ft.checkpointing.errors import *  # noqa: F403

__all__ = ["CheckpointTransport"]
__all__ += errors.__all__

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Moves a state dict from one replica to others (torchft-compatible interface)."""

    @abstractmethod
    def metadata(self) -> str:
        """Returns what a receiver needs to find this sender (for HTTP: its URL)."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: List[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Makes ``state_dict`` for ``step`` available to (or sends it to) ``dst_ranks``."""

    # Whether wait_delivered can tell when the receivers have the checkpoint (or
    # send_checkpoint returns only then). Only then does an async-quorum Manager send from its
    # training thread at should_commit (docs/design.md, "Heal"); otherwise it sends from its
    # quorum thread, before the step's collectives, as torchft does.
    confirms_delivery: bool = False

    def expect_checkpoint(self, step: int) -> None:
        """Announces that ``send_checkpoint`` will stage ``step`` soon (again, after a failed
        attempt at the same step): receivers asking for it wait for it meanwhile instead of
        being told it was withdrawn or abandoned."""

    def wait_delivered(self, step: int, receivers: int, timeout: timedelta) -> bool:
        """Waits until ``receivers`` receivers have the whole checkpoint of ``step`` that
        ``send_checkpoint`` staged (True), or ``timeout`` passes or it is no longer staged
        (False). The default suits transports whose ``send_checkpoint`` returns once
        delivered."""
        return True

    def disallow_checkpoint(self) -> None:
        """Withdraws a staged checkpoint; after it returns the state dict is no longer read."""

    def abandon_checkpoint(self, step: int, reason: str) -> None:
        """Tells receivers waiting for ``step`` that this source cannot produce it.

        Called by the Manager when building or staging the state dict failed, so that a
        healing replica fails its heal at once (and retries on the next quorum) instead of
        waiting out its timeout for a checkpoint that will never come. Transports whose
        receivers already fail fast when the source errors (PGTransport: the source aborts
        the process group) keep this default no-op.
        """

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receives the state dict for ``step`` from ``src_rank`` (found via ``metadata``)."""

    @property
    def last_recv_path(self) -> Optional[str]:
        """How the last ``recv_checkpoint`` moved the bytes ("http", "same-host", ...), for
        the heal log; None where a transport has only one path or nothing was received."""
        return None

    def shutdown(self, wait: bool = True) -> None:
        """Releases the transport's resources (servers, threads)."""
