"""Socket reads bounded by one :class:`~ft.utils.deadline.Deadline`, for both transfer paths.

A socket timeout bounds one read; a peer that sends a byte just within it, again and again,
would stretch a transfer without end. Here every read gets only the time left before the
deadline, so the whole read ends by it.
"""

from __future__ import annotations

import math
import socket
from typing import Callable, Optional

from ft.utils.deadline import Deadline

__all__ = ["arm", "read_exact"]


def arm(sock: socket.socket, deadline: Deadline, stall_s: Optional[float] = None) -> None:
    """Gives ``sock``'s next operation the time left (at most ``stall_s``); raises
    TimeoutError once none is left (a socket timeout of 0 would make the socket non-blocking,
    not fail the read)."""
    left = deadline.remaining()
    if left <= 0:
        raise TimeoutError()
    if stall_s is not None:
        left = min(left, stall_s)
    sock.settimeout(None if math.isinf(left) else left)


def read_exact(
    sock: socket.socket,
    read_into: Callable[[memoryview], int],
    dst: memoryview,
    deadline: Deadline,
    stall_s: Optional[float] = None,
) -> None:
    """Fills ``dst`` by calling ``read_into`` (a reader on ``sock``: ``sock.recv_into``, an
    HTTP response's ``readinto``...) until it is full, each call bounded by the time left and
    by ``stall_s`` (a peer that sends nothing for that long is taken for gone: a striped
    receiver then takes the range from another source).

    Raises:
        TimeoutError: the deadline passed first (``socket.timeout`` is one too).
        EOFError: the peer closed the connection first.
    """
    filled = 0
    while filled < len(dst):
        arm(sock, deadline, stall_s)
        n = read_into(dst[filled:])
        if not n:
            raise EOFError("connection closed by peer")
        filled += n
