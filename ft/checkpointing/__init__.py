"""Checkpoint transports: how a recovering replica gets the live state from a healthy peer.

- :class:`HTTPTransport`: the sender serves its state dict over HTTP; receivers pull it in
  parallel byte ranges.
- :class:`PGTransport`: send/recv over a process group.

Both move tensors plus a safe JSON description of the state dict (never pickle), checksum
everything that crosses the wire, and raise :class:`CheckpointCorruptError` rather than return
corrupted state.
"""

from ft.checkpointing.http_transport import HTTPTransport
from ft.checkpointing.pg_transport import PGTransport
from ft.checkpointing.rwlock import RWLock
from ft.checkpointing.transport import (
    CheckpointAuthError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
    CheckpointTransport,
)

__all__ = [
    "CheckpointTransport",
    "HTTPTransport",
    "PGTransport",
    "RWLock",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointNotAvailableError",
    "CheckpointTransferError",
    "CheckpointAuthError",
    "CheckpointFormatError",
]
