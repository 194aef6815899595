"""The checkpoint transport interface and its errors.

A transport moves one replica's state dict to the replicas that must heal. The Manager calls
``send_checkpoint`` on the healthy source and ``recv_checkpoint`` on the recovering ones;
``metadata()`` is the opaque string the source publishes (through the ManagerServer) so that
receivers can find it.
"""

from __future__ import annotations

import urllib.error
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, List, Optional, TypeVar

T = TypeVar("T")

__all__ = [
    "CheckpointTransport",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointNotAvailableError",
    "CheckpointTransferError",
    "CheckpointAuthError",
    "CheckpointFormatError",
]


class CheckpointError(RuntimeError):
    """Base class of every failure of a checkpoint transfer.

    A Manager treats any of these as a failed heal: nothing received is loaded.
    """


class CheckpointCorruptError(CheckpointError):
    """The bytes that arrived do not match the checksum the sender computed."""


class CheckpointNotAvailableError(CheckpointError, urllib.error.HTTPError):
    """The source does not (or no longer) serve the requested step.

    Also a :class:`urllib.error.HTTPError` (so an :class:`OSError`): code that catches what
    torchft's HTTP transport raises for a refused request (it fetches with ``urlopen``) catches
    this too. ``code`` is the HTTP status of the refusal (404 when not from HTTP).
    """

    def __init__(self, message: str = "", code: int = 404, url: str = "") -> None:
        urllib.error.HTTPError.__init__(self, url, code, message, None, None)
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class CheckpointTransferError(CheckpointError, urllib.error.URLError):
    """The peer vanished, the connection broke, or the transfer ran past its timeout.

    Also a :class:`urllib.error.URLError` (so an :class:`OSError`): code that catches what
    torchft's HTTP transport raises when its ``urlopen`` fails catches this too.
    """

    def __init__(self, message: str = "") -> None:
        urllib.error.URLError.__init__(self, message)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class CheckpointAuthError(CheckpointError):
    """The source refused the request's token (HTTP 403)."""


class CheckpointFormatError(CheckpointError):
    """The peer sent metadata that is not a valid ft checkpoint description."""


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
