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
from ft.checkpointing.transport import CheckpointTransport
from ft.checkpointing import errors

# The error hierarchy (CheckpointError and the kinds of failure), as errors.__all__ lists it.
from ft.checkpointing.errors import *  # noqa: F403

__all__ = ["CheckpointTransport", "HTTPTransport", "PGTransport", "RWLock"]
__all__ += errors.__all__
