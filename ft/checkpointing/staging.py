"""What a checkpoint source serves: one staged checkpoint (:class:`Staging`) and the leases of
the receivers reading it (:class:`Lease`). Both serving paths (HTTP, same-host) read the
tensors only through :meth:`Staging.slices`, which stops as soon as the checkpoint is withdrawn.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import same_host
from ft.checkpointing import serialization as ser
from ft.utils.deadline import Deadline, Timeout

__all__ = ["Abort", "Lease", "Staging", "join_preparer"]

logger = logging.getLogger(__name__)

# A receiver asks for all its ranges at once, right after the metadata: once a checkpoint is
# withdrawn, a lease that has been used but has no range in flight for this long is not waited
# for (its receiver stalled or went away).
LEASE_GRACE_S = 1.0
# The same-host path checks a transfer in this many byte ranges (>= 1 MiB each): the source
# checksums them one by one while the receiver copies (and checksums the one before).
LOCAL_RANGES = 16
# The background host copy checks between pieces of this size whether to stop.
HOST_COPY_PIECE = 16 << 20
# A withdrawn checkpoint's preparation stops within one 1 MiB checksum slice or one 16 MiB
# host-copy piece (milliseconds); this bounds the wait for it on a badly loaded host.
_PREPARER_STOP_S = 5.0
# A thread waiting for another's checksum of the same range re-checks this often whether the
# checkpoint was withdrawn (the computing thread then stops without notifying).
_WITHDRAWN_POLL_S = 0.05


class Abort(Exception):
    """The checkpoint was withdrawn while a reader was in it: stop reading its tensors."""


class Lease:
    """The data ranges one metadata answer entitles its receiver to, until ``deadline``.

    ``touched`` is None until a data transfer claims the lease (only a /meta answer holds
    it), then the time of its last claim or release; ``active`` counts its transfers in flight.

    A striped receiver's lease (``explicit``) is not used up by a count of ranges: the receiver
    takes as many ranges from this source as the others leave it, and ends the lease with a
    ``done`` request. Only a ``counted`` lease (the receiver's assigned source) then counts as
    a delivery; the others are sources that helped.
    """

    __slots__ = ("remaining", "deadline", "active", "touched", "explicit", "counted")

    def __init__(
        self, remaining: int, deadline: Deadline, explicit: bool = False, counted: bool = True
    ) -> None:
        self.remaining = remaining
        self.deadline = deadline
        self.active = 0
        self.touched: Optional[float] = None
        self.explicit = explicit
        self.counted = counted

    def idle(self, now: float) -> bool:
        """Nothing reads for it now: never started, or no range in flight for a grace period."""
        return self.active == 0 and (self.touched is None or now - self.touched >= LEASE_GRACE_S)


def _no_pace() -> None:
    pass


class Staging:
    """One staged checkpoint: references to its tensors plus bookkeeping.

    Contract: nothing here copies or serializes at staging time; readers take tensor i's bytes
    from ``cpu(i)`` (a host copy when one exists, else the caller's tensor: the same bytes, as
    the caller leaves them alone until disallow_checkpoint), and ``slices`` raises
    :class:`Abort` at the next 1 MiB slice once ``withdrawn`` is set. The server's condition
    guards ``closing``, ``withdrawn``, ``active``, ``conns`` and ``leases``.

    Args:
        pace: called once per 1 MiB slice read (a seam for tests that slow a source down).
    """

    def __init__(self, step: int, state_dict: object, pace: Callable[[], None] = _no_pace) -> None:
        self.id = uuid.uuid4().hex
        self.step = step
        self._pace = pace
        tree, self.specs, self.tensors = ser.flatten(state_dict)
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)
        self.total = self.offsets[-1]
        self.header = ser.encode_header(
            tree, self.specs, step=step, staging=self.id, total_bytes=self.total
        )
        ser.check_header_size(self.header, len(self.specs))
        self.closing = False  # no new transfers; started ones may finish
        self.regions_sent = False  # a same-host receiver has the tensors' addresses
        self.withdrawn = False  # nothing may read the tensors any more
        # wait_delivered returned True: the caller may change the tensors from now on, so no
        # new reader is let in (a striped receiver's late helper request gets 410)
        self.released = False
        self.served_bytes = 0  # data bytes sent over HTTP (ranges that completed)
        self.active = 0  # data responses currently reading tensors
        self.delivered = 0  # receivers that have read all of it (their leases used up)
        # metadata answers given (receivers that came for it, striped or not): a source that
        # helps a striped heal waits for its receivers to come (ServedCheckpoint.wait_asked)
        self.asked = 0
        self.conns: Set[socket.socket] = set()  # their connections, to cut them off
        self.leases: Dict[str, Lease] = {}
        self._cpu: Dict[int, torch.Tensor] = {}
        self._cpu_lock = threading.Lock()
        # the byte ranges a same-host receiver gets checksums of, and those checksums
        self.local_ranges = wire.plan_chunks(self.total, LOCAL_RANGES)
        self._range_crcs: List[Optional[int]] = [None] * len(self.local_ranges)
        self._range_busy = [False] * len(self.local_ranges)
        self._range_cond = threading.Condition()
        self.preparer: Optional[threading.Thread] = None  # see SameHostSource.prepare

    def lease(
        self,
        lease_id: str,
        ranges: int,
        timeout: Timeout,
        explicit: bool = False,
        counted: bool = True,
    ) -> None:
        """Entitles ``lease_id`` to ``ranges`` data ranges for ``timeout`` (``explicit``: to
        any number, until its receiver says ``done``; see :class:`Lease`)."""
        self.leases[lease_id] = Lease(ranges, Deadline.after(timeout), explicit, counted)

    def striped_readers(self) -> bool:
        """True while a striped receiver holds a lease (it may still read the tensors)."""
        return any(lease.explicit for lease in self.leases.values())

    def digest(self) -> List[Tuple[int, int, int]]:
        """``(start, end, CRC-32C)`` of every range in ``local_ranges``: what a striped
        receiver compares across its sources (computed once, usually in the background by
        the same-host preparation)."""
        return [(a, b, self.range_crc(k)) for k, (a, b) in enumerate(self.local_ranges)]

    def slices(self, start: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` of the staged tensors in slices of at most 1 MiB; raises
        :class:`Abort` as soon as the checkpoint is withdrawn (both serving paths read here)."""
        for i, lo, hi in same_host.segments(self.offsets, start, end):
            if self.withdrawn:
                raise Abort()
            view = self.view(i)
            for a in range(lo, hi, wire.SLICE):
                if self.withdrawn:
                    raise Abort()
                self._pace()
                yield view[a : min(hi, a + wire.SLICE)]

    def checksum(self, start: int, end: int) -> int:
        """CRC-32C of bytes ``[start, end)``."""
        crc = 0
        for piece in self.slices(start, end):
            crc = ser.crc32c(piece, crc)
        return crc

    def prepared(self) -> bool:
        """True once every same-host range has its checksum (the preparation is done)."""
        with self._range_cond:
            return None not in self._range_crcs

    def range_crc(self, k: int) -> int:
        """CRC-32C of ``local_ranges[k]``, computed once by whichever thread asks first; a
        thread asking meanwhile waits for that result."""
        with self._range_cond:
            while self._range_crcs[k] is None and self._range_busy[k]:
                if self.withdrawn:
                    raise Abort()
                self._range_cond.wait(_WITHDRAWN_POLL_S)
            crc = self._range_crcs[k]
            if crc is not None:
                return crc
            self._range_busy[k] = True
        try:
            crc = self.checksum(*self.local_ranges[k])
        except BaseException:
            with self._range_cond:
                self._range_busy[k] = False  # a waiting thread computes it instead
                self._range_cond.notify_all()
            raise
        with self._range_cond:
            self._range_crcs[k] = crc
            self._range_busy[k] = False
            self._range_cond.notify_all()
        return crc

    def cpu(self, i: int) -> torch.Tensor:
        """Tensor i in host memory (accelerator tensors are copied once, on first use)."""
        with self._cpu_lock:
            copy = self._cpu.get(i)
        if copy is not None:
            return copy
        t = self.tensors[i]
        if t.device.type == "cpu":
            return t
        copy = self._copy_to_host(i)
        assert copy is not None
        return copy

    def _copy_to_host(self, i: int, until_closing: bool = False) -> Optional[torch.Tensor]:
        """Copies tensor i into fresh host memory (huge pages from 2 MiB up). With
        ``until_closing`` (the background preparation) the copy goes in pieces and is abandoned
        (None) once the checkpoint is closing, so that disallow_checkpoint need not wait."""
        copy = ser.allocate(self.specs[i], torch.device("cpu"))
        src, dst = self.tensors[i].reshape(-1), copy.reshape(-1)
        step = max(1, HOST_COPY_PIECE // max(1, src.element_size()))
        for lo in range(0, src.numel(), step):
            if until_closing and self.closing:
                return None
            dst[lo : lo + step].copy_(src[lo : lo + step])
        with self._cpu_lock:
            return self._cpu.setdefault(i, copy)  # a concurrent copy may have won

    def cpu_bytes(self) -> int:
        return sum(s.nbytes for s, t in zip(self.specs, self.tensors) if t.device.type == "cpu")

    def copy_cpu_tensors_to_huge_pages(self) -> None:
        """Gives every CPU tensor of at least 2 MiB a host copy in huge pages. Why: the
        same-host path's kernel copy pins the source's pages one by one, ~3x a memcpy over
        4 KiB pages and ~1.5x over huge ones, and the caller's tensors rarely sit on whole huge
        pages. Stops once the checkpoint is withdrawn or a receiver got the addresses (it
        copies from wherever each tensor was then; later copies would only compete with it)."""
        for i, (spec, t) in enumerate(zip(self.specs, self.tensors)):
            if self.closing or self.regions_sent:
                return  # a receiver already copies from where the tensors are: stop competing
            if t.device.type == "cpu" and spec.nbytes >= ser.HUGE_PAGE_BYTES:
                self._copy_to_host(i, until_closing=True)

    def view(self, i: int) -> memoryview:
        return ser.memview(self.cpu(i))

    def prune(self) -> None:
        """Forgets the leases whose time is up."""
        for k in [k for k, lease in self.leases.items() if lease.deadline.expired]:
            del self.leases[k]

    def drop_idle_leases(self, now: float) -> None:
        """Forgets the leases nothing reads for (see Lease.idle): once closing, their
        receivers get 410 and nobody waits for them."""
        for k in [k for k, lease in self.leases.items() if lease.idle(now)]:
            del self.leases[k]


def join_preparer(st: Staging) -> None:
    """Waits for a withdrawn checkpoint's background preparation, which stops within one
    1 MiB checksum slice or one host-copy piece: after this nothing reads the tensors."""
    t = st.preparer
    if t is not None and t is not threading.current_thread():
        t.join(_PREPARER_STOP_S)
        if t.is_alive():
            logger.warning(
                "checkpoint step %d: preparation still running after withdrawal", st.step
            )
