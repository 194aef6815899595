"""The one checkpoint a source serves: what is staged, the leases of its receivers, and what
they have been delivered. Both serving paths read it: the HTTP server (checkpoint_server.py)
and the same-host source (same_host_source.py).

Contract (ServedCheckpoint):
  - At most one checkpoint is staged; :meth:`stage` withdraws the one before. A step is
    served only under the step it was staged for; requests are refused (``Refused``: 404,
    409, 410, 503 as http_protocol.py says) otherwise. A metadata request waits (bounded)
    for a step that is announced (:meth:`expect`) or ahead of what is staged.
  - :meth:`claim` and :meth:`release` bracket every read of the tensors, on either path.
    After :meth:`withdraw` returns, nobody reads them.
  - :meth:`wait_delivered` returns True once enough receivers read everything; the staging
    is then released: the caller changes its tensors from then on, and nobody new reads it (a
    receiver asking for the same step again waits for it to be staged afresh).
  - ``cond`` guards all of it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from typing import Any, Callable, Optional, Tuple

from ft.checkpointing import http_protocol as wire
from ft.checkpointing import serialization as ser
from ft.checkpointing.http_protocol import Refused
from ft.checkpointing.staging import Staging, join_preparer
from ft.checkpointing.errors import CheckpointError
from ft.utils.deadline import Deadline

__all__ = ["ServedCheckpoint"]

logger = logging.getLogger(__name__)

# While withdrawing, how often the leases gone idle are looked for (they idle by the clock,
# see staging.LEASE_GRACE_S, not by a notification).
_WITHDRAW_POLL_S = 0.05
# Transfers cut off at withdrawal see their socket shut down and end within one write; this
# bounds the wait for them to say so on a badly loaded host.
_CUTOFF_GRACE_S = 5.0


class ServedCheckpoint:
    """The staged checkpoint, its leases and deliveries (module docstring).

    ``timeout_s`` bounds a withdrawal's wait for transfers in flight and every lease;
    ``pace`` is called once per 1 MiB slice served, on either path.
    """

    def __init__(self, timeout_s: float, pace: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._pace = pace
        self.cond = threading.Condition()
        self._staging: Optional[Staging] = None
        self._last_step: Optional[int] = None
        # (step, reason) of the last step this source failed to stage (abandon_checkpoint).
        self._abandoned: Optional[Tuple[int, str]] = None
        # A step the source announced it will stage (expect): requests for it wait for it.
        self._expected: Optional[int] = None
        # The step wait_delivered released last, until another staging (see _servable).
        self._released: Optional[int] = None
        self._closed = False
        # data bytes sent over HTTP, every staging together (ranges that completed)
        self.served_bytes = 0

    @property
    def staging(self) -> Optional[Staging]:
        """The checkpoint staged now (None if none)."""
        return self._staging

    # ------------------------------------------------------------------ staging

    def stage(self, step: int, state_dict: Any) -> Staging:
        """Withdraws the staged checkpoint, then serves ``state_dict`` as ``step``. Raises
        TypeError (naming the key path) for values that cannot be sent safely, before anything
        is withdrawn."""
        staging = Staging(step, state_dict, self._pace)
        self.withdraw(restaging=True)
        with self.cond:
            if self._closed:
                raise CheckpointError("HTTPTransport is shut down")
            self._staging = staging
            self._last_step = step
            self._released = None
            self._abandoned = None
            self._expected = None
            self.cond.notify_all()
        return staging

    def expect(self, step: int) -> None:
        """The source will stage ``step`` (again): requests for it wait for it instead of being
        told it was withdrawn or abandoned, until it is staged or abandoned."""
        with self.cond:
            self._expected = step
            if self._abandoned is not None and self._abandoned[0] == step:
                self._abandoned = None

    def wait_delivered(self, step: int, receivers: int, deadline: Deadline) -> bool:
        """Waits until ``receivers`` receivers have read all of the staged checkpoint of
        ``step``; False at the deadline, or once it is no longer staged."""
        with self.cond:

            def delivered() -> bool:
                st = self._staging
                return st.delivered >= receivers and not st.striped_readers()

            deadline.wait(self.cond, lambda: self._gone(step) or delivered())
            st = self._staging
            if st is None or st.step != step or not delivered():
                return False
            # The caller changes the tensors from now on: nobody new may start reading them.
            st.released = True
            self._released = step
            return True

    def wait_asked(self, step: int, receivers: int, deadline: Deadline) -> bool:
        """Waits until ``receivers`` receivers have been given the metadata of the staged
        checkpoint of ``step`` (each may still be reading it), or until nobody new can be (it
        is no longer staged, or released): True; False at the deadline."""
        with self.cond:
            return deadline.wait(
                self.cond,
                lambda: (
                    self._gone(step) or self._staging.released or self._staging.asked >= receivers
                ),
            )

    def _gone(self, step: int) -> bool:
        """``step`` is no longer staged (or is being withdrawn). Caller holds ``cond``."""
        st = self._staging
        return st is None or st.step != step or st.closing

    def check_staged(self, step: int) -> None:
        """Returns if ``step`` is being served; raises CheckpointError otherwise."""
        with self.cond:
            st = self._staging
            if st is not None and not st.closing and st.step == step:
                return
            staged = None if st is None or st.closing else st.step
        raise CheckpointError(
            f"allow_checkpoint({step}): no checkpoint of step {step} is staged "
            f"(staged: {staged}); send_checkpoint(dst_ranks, {step}, state_dict, timeout) "
            f"stages and serves one"
        )

    def abandon(self, step: int, reason: str) -> None:
        """Receivers waiting for ``step`` get 409 naming ``reason`` at once."""
        self.withdraw()
        with self.cond:
            self._abandoned = (step, reason)
            if self._expected == step:
                self._expected = None
            self.cond.notify_all()

    def withdraw(self, restaging: bool = False) -> None:
        """Withdraws the staged checkpoint: new requests get 410 at once, and so do receivers
        that got the metadata but have not started reading data (their leases are dropped, not
        waited for). Transfers that already started, and the other ranges of their receivers
        (asked for at the same moment), get up to ``timeout`` to finish; then they are cut off.
        ``restaging`` (``stage`` withdraws the previous one): receivers waiting for a released
        step to be staged again keep waiting.
        """
        with self.cond:
            if not restaging:
                self._released = None
            st = self._staging
            if st is None:
                return
            st.closing = True
            deadline = Deadline.after(self.timeout_s)
            while True:
                st.prune()
                st.drop_idle_leases(time.monotonic())
                if (not st.leases and st.active == 0) or deadline.expired:
                    break
                self.cond.wait(min(deadline.remaining(), _WITHDRAW_POLL_S))
            st.withdrawn = True
            conns = set(st.conns)
            if st.active:
                logger.warning("cutting off %d checkpoint transfer(s) still running", st.active)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed
        with self.cond:
            Deadline.after(_CUTOFF_GRACE_S).wait(self.cond, lambda: st.active == 0)
            if self._staging is st:
                self._staging = None
            self.cond.notify_all()
        join_preparer(st)

    # ------------------------------------------------------------------ leases

    def meta(
        self,
        step: int,
        wait_s: float,
        chunks: int,
        stripe: Optional[bool] = None,
        claim_on: Optional[socket.socket] = None,
    ) -> Tuple[Staging, bytes, str]:
        """Waits up to ``wait_s`` for ``step`` to be staged; returns the staging, its metadata
        body (header + CRC-32) and a lease for ``chunks`` data ranges. Raises Refused
        otherwise. ``stripe`` (a striped receiver): the lease lasts until its ``done``
        request, and counts as a delivery only if ``stripe`` is True (this is the receiver's
        assigned source, not a helper). ``claim_on`` (the same-host path, which reads at once
        over that connection): the transfer is claimed with the answer, under one hold of
        ``cond``, and counts as a delivery when it is released, even for a checkpoint without
        data; otherwise ``wait_delivered`` could count it at the answer and release the staging
        before the claim."""
        chunks = min(max(1, chunks), wire.MAX_CHUNKS)
        wait_s = min(max(0.0, wait_s), self.timeout_s)
        deadline = Deadline.after(wait_s)

        def servable() -> Optional[Staging]:
            st = self._servable(step)
            if st is None and stripe is False and self._released == step:
                # a striped helper is told at once that it is no source
                raise Refused(410, f"checkpoint for step {step} is no longer served")
            return st

        with self.cond:
            deadline.wait(self.cond, lambda: servable() is not None)
            st = servable()
            if st is None:
                last = self._last_step
                raise Refused(
                    404,
                    f"step {step} is not available "
                    + (
                        "(nothing staged)"
                        if last is None
                        else f"(step {step} was delivered and released, and not staged again)"
                        if self._released == step
                        else f"(last staged step {last})"
                    ),
                )
            lease = uuid.uuid4().hex
            n = len(wire.plan_chunks(st.total, chunks))
            if stripe is not None:
                st.lease(lease, n, self.timeout_s, explicit=True, counted=stripe)
            elif n or claim_on is not None:
                st.lease(lease, n, self.timeout_s)
            else:
                st.delivered += 1  # no data: the metadata is all of it
            st.asked += 1
            if claim_on is not None:
                self._claim_locked(st, lease, claim_on)
            self.cond.notify_all()
            return st, st.header + wire.TRAILER.pack(ser.crc32(st.header)), lease

    def _servable(self, step: int) -> Optional[Staging]:
        """The staging that serves ``step``, None if it may still come; raises Refused if it
        will not. Caller holds ``cond``."""
        if self._closed:
            raise Refused(503, "checkpoint server is shutting down")
        st = self._staging
        if st is not None and st.step == step and not st.closing and not st.released:
            return st
        if self._expected == step:
            return None  # announced: it comes
        if self._abandoned is not None and self._abandoned[0] == step:
            raise Refused(409, f"the source failed to produce step {step}: {self._abandoned[1]}")
        if self._released == step:
            # Its receivers have it and the source changes its tensors from now on: nobody
            # new reads them. One asking for the same step again (a second heal at an
            # unchanged step) waits for the source to stage it afresh.
            return None
        last = self._last_step
        if last is not None and step <= last:
            if step == last:
                raise Refused(410, f"checkpoint for step {step} was withdrawn")
            raise Refused(404, f"step {step} is not available (last staged step is {last})")
        return None

    def claim(self, step: int, staging_id: str, lease_id: str, conn: socket.socket) -> Staging:
        """Registers a transfer of the staged checkpoint (``withdraw`` waits for it, then cuts
        ``conn``). Raises Refused if it is not served."""
        with self.cond:
            st = self._staging
            if self._closed:
                raise Refused(503, "checkpoint server is shutting down")
            if st is None or st.step != step or st.id != staging_id or st.withdrawn:
                raise Refused(410, f"checkpoint for step {step} is no longer served")
            if (st.closing or st.released) and lease_id not in st.leases:
                raise Refused(410, f"checkpoint for step {step} was withdrawn")
            return self._claim_locked(st, lease_id, conn)

    @staticmethod
    def _claim_locked(st: Staging, lease_id: str, conn: socket.socket) -> Staging:
        lease = st.leases.get(lease_id)
        if lease is not None:
            lease.active += 1
            lease.touched = time.monotonic()
        st.active += 1
        st.conns.add(conn)
        return st

    def release(self, st: Staging, lease_id: str, conn: socket.socket, used: Optional[int]) -> None:
        """Ends a transfer registered by ``claim``. ``used``: how many of the lease's ranges
        it delivered (None: it failed, and the lease is dropped so nothing waits for it)."""
        with self.cond:
            st.active -= 1
            st.conns.discard(conn)
            lease = st.leases.get(lease_id)
            if lease is not None and lease.explicit:
                # a striped receiver's lease ends with its done request only
                lease.active = max(0, lease.active - 1)
                lease.touched = time.monotonic()
            elif lease is not None:
                lease.active = max(0, lease.active - 1)
                lease.touched = time.monotonic()
                lease.remaining -= used or 0
                if lease.remaining <= 0 or used is None:
                    del st.leases[lease_id]
                    if used is not None:
                        st.delivered += 1
            self.cond.notify_all()

    def finish_lease(self, step: int, staging_id: str, lease_id: str, ok: bool) -> None:
        """A striped receiver is done with this source: its lease ends, and counts as a
        delivery if ``ok`` and this was its assigned source."""
        with self.cond:
            st = self._staging
            if st is None or st.step != step or st.id != staging_id:
                return
            lease = st.leases.get(lease_id)
            if lease is None or not lease.explicit:
                return
            del st.leases[lease_id]
            if ok and lease.counted:
                st.delivered += 1
            self.cond.notify_all()

    def forget(self) -> None:
        """Drops a closed source's staging once its background preparation has ended."""
        with self.cond:
            st, self._staging = self._staging, None
        if st is not None:
            join_preparer(st)

    def close(self) -> bool:
        """Withdraws everything at once (no waiting: the serving paths are being cut); False
        if it was closed before."""
        with self.cond:
            if self._closed:
                return False
            self._closed = True
            st = self._staging
            if st is not None:
                st.closing = True
                st.withdrawn = True
            self.cond.notify_all()
        return True
