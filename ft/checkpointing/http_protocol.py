"""The HTTP checkpoint protocol, as both of its ends speak it (checkpoint_server.py serves it,
fetcher.py asks for it); a change to the wire is a change here.

Wire protocol (with a job secret, every request carries ``Authorization: FT-HMAC <signature>``
of the address it dials, its path and its query, see ft.utils.auth)::

    GET /ft/v1/checkpoint/{step}/meta?chunks=N&wait=S
        -> 200, body = header JSON (serialization.encode_header) + CRC32 (4 bytes, big endian)
           response header X-FT-Lease: a lease id for the data requests that follow
           If {step} is ahead of what is staged, the server waits up to S seconds for it.
    GET /ft/v1/checkpoint/{step}/data?staging=ID&lease=L&start=A&end=B
        -> 200, body = bytes [A, B) of the concatenated tensor bytes + CRC-32C of those bytes

    GET /ft/v1/checkpoint/{step}/meta?chunks=N&wait=S&stripe=primary|helper
        -> as above, for a striped receiver (one that takes ranges from several sources): the
           lease lasts until its done request; only a "primary" lease (the receiver's assigned
           source) then counts as a delivery. Refused (410) once the source was told its
           receivers have the checkpoint (it may change the tensors from then on).
    GET /ft/v1/checkpoint/{step}/digest?staging=ID&lease=L
        -> 200, body = encode_digest: the CRC-32C of each of the source's same-host ranges,
           which a striped receiver compares across its sources and with what it received
    GET /ft/v1/checkpoint/{step}/done?staging=ID&lease=L&ok=0|1
        -> 200: a striped receiver ends its lease (ok=1: it has the whole checkpoint)

    403: missing, wrong or replayed signature. 404: step not staged. 409: the source failed to
    produce the step (abandon_checkpoint). 410: withdrawn. 503: shutting down.

With a job secret the source also signs what it serves, bound to the request it answers
(HMAC-SHA256 with the secret's checkpoint-content key): the metadata answer carries
``X-FT-Content-MAC: hex(MAC("meta", request signature, header))``, and each data range's
trailer is its CRC-32C followed by ``MAC("data", request signature, start, end, CRC)``. The
receiver checks the metadata MAC before it parses a byte of the header, and each range's MAC
with its CRC before anything is returned; a source that does not know the secret cannot make
either, so a replica never loads weights that a job member did not serve. A digest answer
carries ``X-FT-Content-MAC: hex(MAC("digest", request signature, body))``. Signing covers the
checksums, not the bytes again: the bytes are read once, for the CRC.

The same-host path (same_host.py) answers with these statuses too, so a refusal means the same
CheckpointError on either path.
"""

from __future__ import annotations

import json
import struct
from typing import List, Tuple

from ft.utils.deadline import Deadline

from ft.checkpointing import same_host
from ft.checkpointing import serialization as ser
from ft.checkpointing.errors import (
    CheckpointAuthError,
    CheckpointNotAvailableError,
    CheckpointTransferError,
)

__all__ = [
    "Refused",
    "bracket",
    "decode_digest",
    "encode_digest",
    "plan_chunks",
    "raise_for_status",
    "range_bytes",
]

PREFIX = "/ft/v1/checkpoint/"
LEASE_HEADER = "X-FT-Lease"
# A signed source's MAC of its metadata answer (response header, hex) and of each range (the
# range trailer's last bytes): HMAC-SHA256.
CONTENT_MAC_HEADER = "X-FT-Content-MAC"
MAC_SIZE = 32
TRAILER = struct.Struct(">I")  # the CRC after a metadata body or a data range
SLICE = 1 << 20  # bytes per read/crc/write step, on both ends
MIN_CHUNK = 1 << 20  # a transfer is not split into ranges smaller than this
MAX_CHUNKS = same_host.MAX_RANGES  # most ranges of one transfer (and leases per metadata)
MAX_HEADER = ser.MAX_HEADER_BYTES  # metadata a receiver accepts, checked before reading it


class Refused(Exception):
    """A request the source will not answer, with the HTTP status that says why (both paths
    send it: as the HTTP status, or in a same-host refusal frame)."""

    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


def range_bytes(start: int, end: int) -> bytes:
    """What a data range's MAC covers besides the request signature and the CRC."""
    return struct.pack(">QQ", start, end)


def plan_chunks(total: int, num_chunks: int) -> List[Tuple[int, int]]:
    """Splits ``[0, total)`` into at most ``num_chunks`` contiguous byte ranges (>= 1 MiB)."""
    if total <= 0:
        return []
    n = max(1, min(num_chunks, MAX_CHUNKS, -(-total // MIN_CHUNK)))
    bounds = [total * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def encode_digest(digest: List[Tuple[int, int, int]]) -> bytes:
    """A digest answer's body: JSON ``[[start, end, crc32c], ...]``."""
    return json.dumps([list(d) for d in digest], separators=(",", ":")).encode()


def decode_digest(body: bytes, total: int) -> List[Tuple[int, int, int]]:
    """Checks a digest body: consecutive non-empty ranges covering ``[0, total)``, each with a
    32-bit CRC. Raises ValueError naming the first problem."""
    raw = json.loads(body.decode("utf-8"))
    if type(raw) is not list:
        raise ValueError("a digest is a list")
    ranges = same_host.parse_ranges([r[:2] if type(r) is list else r for r in raw], total)
    crcs = [r[2] if type(r) is list and len(r) == 3 else None for r in raw]
    if not all(type(c) is int and 0 <= c < 1 << 32 for c in crcs):
        raise ValueError("a digest's checksums are 32-bit integers")
    return [(a, b, c) for (a, b), c in zip(ranges, crcs)]  # type: ignore[misc]


def raise_for_status(status: int, text: str) -> None:
    """Raises the CheckpointError a refusal with this (HTTP) status means."""
    if status in (401, 403):
        raise CheckpointAuthError(text)
    if status in (404, 409, 410):
        raise CheckpointNotAvailableError(text, code=status)
    raise CheckpointTransferError(text)


def bracket(host: str) -> str:
    """``host`` as it stands in a URL's authority (an IPv6 literal in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


# Of the time left, a source may spend all but a reserve on waiting for the step to be staged,
# so that a step staged at the last moment still leaves its transfer some time: 1 s, or a
# quarter of a short timeout (which must not go mostly to waiting). The source usually has the
# step staged already, and then answers at once and the transfer gets all the time left.
TRANSFER_RESERVE_S = 1.0
TRANSFER_RESERVE_SHARE = 0.25


def server_wait(deadline: Deadline) -> float:
    """The ``wait`` a receiver asks of a source: how long it may wait for the step to be
    staged (see TRANSFER_RESERVE_S)."""
    remaining = deadline.remaining()
    return max(0.0, remaining - min(TRANSFER_RESERVE_S, remaining * TRANSFER_RESERVE_SHARE))
