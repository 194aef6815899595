"""A step's heal duties, as the step protocol orders them (docs/design.md, "Heal"): when this
replica sends its state and on which thread, when a received state is applied, and how a
failed heal counts. The transfer itself is the Healer's (heal.py).

Contract (HealDuties):
  * ``run(quorum, defer_send)`` runs on the quorum thread once the quorum is taken in: a
    source sends its state there (sync quorum, or a transport that cannot confirm delivery)
    and waits until its receivers have it; a healing replica receives, sets the step counters
    it received, and keeps the state ``pending`` until the training thread applies it.
  * ``announce(quorum, allow_heal)``, before the group is configured: a source announces its
    checkpoint to the transport, so that receivers wait for it even at a step whose earlier
    attempt withdrew it. ``defers()``: where a source sends from the training thread instead
    (an async quorum on a transport that confirms delivery), ``send_due`` is set once the
    group is configured, and ``send_pending()`` (the training thread, at should_commit at the
    latest) sends it, unless the step already failed: then its receivers are told to give up
    now.
  * ``apply_pending()`` (the training thread) loads a received state; a state that does not
    load puts the counters back, so that the next quorum heals this replica again.
  * Every failure is reported (``report``), with phase "heal", aborting the process group.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from ft.checkpointing.dtensor_codec import restore_dtensors
from ft.coordination import QuorumResult
from ft.manager_parts.heal import Healer
from ft.manager_parts.state_dicts import RegisteredState
from ft.manager_parts.step_errors import StepErrors
from ft.manager_parts.step_log import StepLog, logger
from ft.manager_parts.step_state import StepState
from ft.manager_parts.progress_watch import ProgressWatch
from ft.observability.spans import span_block

__all__ = ["HealDuties"]


class HealDuties:
    """When this replica sends and applies heals within a step (module docstring)."""

    def __init__(
        self,
        state: StepState,
        registered: RegisteredState,
        errors: StepErrors,
        report: Callable[[Exception, bool, str], None],
        log: StepLog,
        watch: ProgressWatch,
        checkpoint: Callable[[], Dict[str, Any]],
        group_failed: Callable[[], bool],
        rank: int,
        timeout: timedelta,
    ) -> None:
        """``report(error, abort, phase)`` fails the step; ``checkpoint()``: the Manager's
        state dict as a heal sends it; ``group_failed()``: whether the process group reports
        an error. The Healer comes with the group's links (``healer``, set once they are
        made)."""
        self.healer: Healer = None  # type: ignore[assignment]
        self._state = state
        self._registered = registered
        self._errors = errors
        self._report_error = report
        self._log = log
        self._watch = watch
        self._checkpoint = checkpoint
        self._group_failed = group_failed
        self._rank = rank
        self._timeout = timeout
        # Async quorum: the quorum whose heal this replica, as a source, sends from the
        # training thread (send_pending, at should_commit at the latest).
        self.send_due: Optional[QuorumResult] = None
        # A received state the training thread has yet to apply; the step counters before
        # the heal set them, put back should it not load.
        self.pending: Optional[Dict[str, Any]] = None
        self._prior_counters: Optional[Dict[str, int]] = None

    def _report(self, e: Exception) -> None:
        self._report_error(e, True, "heal")

    def step_failed(self) -> bool:
        """This step can no longer commit: an error was reported, or the process group
        failed (a collective, or an abort after a peer's death)."""
        return self._errors.first is not None or self._group_failed()

    # ------------------------------------------------------------------ source

    def announce(self, quorum: QuorumResult, allow_heal: bool) -> bool:
        """Whether this replica is a source of the quorum's heal; if so its checkpoint is
        announced now, before the process group is configured, which its receivers wait for
        before they ask: they then wait for it even where an earlier attempt at this step
        (a step that failed and is tried again) withdrew or abandoned it."""
        source = allow_heal and self.healer.serves(quorum) and not quorum.heal
        if source:
            self.healer.announce(quorum)
        return source

    def defers(self) -> bool:
        """Whether a source sends from the training thread (module docstring)."""
        return self._state.use_async_quorum and self.healer.confirms_delivery()

    def send_pending(self) -> None:
        """Sends the heal ``send_due`` names, on the calling thread (module docstring)."""
        quorum, self.send_due = self.send_due, None
        if quorum is None:
            return
        if self.step_failed():
            # Often because a receiver died; either way the receivers will not commit this
            # step: they fail their heal now and retry at the next quorum.
            why = (
                self._errors.first if self._errors.first is not None else "its process group failed"
            )
            self.healer.abandon(quorum, f"the source's step failed: {why}")
            return
        try:
            self._send(quorum)
        except Exception as e:  # noqa: BLE001
            self._log.error("heal", f"sending the checkpoint failed: {type(e).__name__}: {e}")
            self._report(e)
            return
        # The state stays readable until the receivers have it: after the vote the caller
        # changes it.
        self._wait_delivered(quorum)

    def abandon_pending(self, reason: str) -> None:
        """Tells the receivers of a heal still due that it will not come."""
        quorum, self.send_due = self.send_due, None
        if quorum is None:
            return
        try:
            self.healer.abandon(quorum, reason)
        except Exception:  # noqa: BLE001 - the receivers then wait out their timeout
            logger.exception("abandoning the checkpoint of step %d failed", quorum.max_step)

    def _send(self, quorum: QuorumResult) -> None:
        self._log.info(
            "heal_send",
            f"sending the checkpoint to replica ranks {quorum.recover_dst_replica_ranks}"
            # a donor of a striped heal stages for the other donors' receivers too
            + (" and striped receivers" if self.healer.striped(quorum) else ""),
            max_step=quorum.max_step,
        )
        with span_block("torchft::manager::_checkpoint_transport::send_checkpoint"):
            self.healer.send(quorum, self._checkpoint, self._timeout)

    def _wait_delivered(self, quorum: QuorumResult) -> None:
        """Waits until the receivers of the checkpoint just sent have it (the transport keeps
        references to the caller's tensors, not a copy), at most the timeout. A receiver that
        dies meanwhile fails this step (its failure aborts the process group), which ends the
        wait; so does the timeout, after which the receivers are told to give up (they retry
        at the next quorum)."""
        t0 = time.monotonic()
        if self.healer.wait_delivered(quorum, self._timeout, self.step_failed):
            self._log.info(
                "heal_sent",
                f"replica ranks {quorum.recover_dst_replica_ranks} have the checkpoint "
                f"({(time.monotonic() - t0) * 1000:.1f} ms after it was staged)",
                max_step=quorum.max_step,
            )
        else:
            self._log.warning(
                "heal_send",
                f"not every receiver took the checkpoint within {self._timeout}",
                max_step=quorum.max_step,
            )
            self.healer.abandon(quorum, "the receivers did not take it in time")

    # ------------------------------------------------------------------ the quorum thread

    def run(self, quorum: QuorumResult, defer_send: bool) -> None:
        """Sends and receives the heals the quorum asks for, on the quorum thread."""
        try:
            # Assigned receivers, or a donor of a striped heal (docs/design.md, "Striped heal").
            # With defer_send the training thread reads and sends the state instead: reading
            # it here would race the forward pass.
            if self.healer.serves(quorum) and not defer_send:
                # Sync mode (the training thread waits in start_quorum meanwhile), or a
                # transport that cannot tell when its receivers have the state.
                self._send(quorum)
                if self.healer.confirms_delivery():
                    # The training thread changes the state as soon as start_quorum returns
                    # (a DiLoCo inner step changes the model it registered): the receivers
                    # must have it first.
                    self._wait_delivered(quorum)
            if quorum.heal:
                self._receive(quorum)
        except Exception as e:  # noqa: BLE001
            self._log.error("heal", f"recovery failed: {type(e).__name__}: {e}")
            self.pending = None
            self._report(e)

    def _receive(self, quorum: QuorumResult) -> None:
        t0 = time.monotonic()
        self._watch.phase(
            "heal",
            f"replica rank {quorum.recover_src_replica_rank} at "
            f"{quorum.recover_src_manager_address}",
        )
        with span_block("torchft::manager::_checkpoint_transport::recv_checkpoint"):
            got = self.healer.receive(
                quorum,
                self._rank,
                self._timeout,
                self._registered.load_fns,
                donors=quorum.heal_donors,
            )
        # DTensors arrive as their pieces and become DTensors again when the state is applied,
        # on the training thread (reading this rank's own state here, on the quorum thread,
        # would race an FSDP forward that swaps the parameters).
        self.pending = got.state
        self._prior_counters = self._state.counters()
        self._watch.phase("step", f"collectives with {quorum.replica_ids}")
        self._state.load_counters(got.state["torchft"])
        self._state.step = quorum.max_step
        self._log.info(
            "heal_recv",
            f"received the checkpoint from replica rank {quorum.recover_src_replica_rank} "
            f"({got.metadata}) in {(time.monotonic() - t0) * 1000:.1f} ms (metadata "
            f"{got.metadata_s * 1000:.1f} ms)" + (f" ({got.path} path)" if got.path else ""),
            max_step=quorum.max_step,
        )

    # ------------------------------------------------------------------ the training thread

    def apply_pending(self) -> None:
        """Loads the received state (module docstring)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return  # the heal failed; the error is already reported
        try:
            # DTensors become DTensors again on this rank's own meshes, checked against its
            # own state (docs/design.md, "HSDP"); a mismatch loads nothing.
            user = restore_dtensors(pending["user"], self._registered.read)
        except Exception as e:  # noqa: BLE001
            # Not healed after all: back to this replica's own step, so that the next quorum
            # heals it again instead of counting it as up to date.
            if self._prior_counters is not None:
                self._state.load_counters(self._prior_counters)
            self._log.error("heal", f"recovery failed: {type(e).__name__}: {e}")
            self._report(e)
            return
        self._registered.load(user)
        self._log.info("heal_applied", "applied the healed state")
