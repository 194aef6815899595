"""The step's commit vote and what it leaves for the next steps (docs/design.md, "The step
protocol", step 3, and "Persistent failures").

Contract (CommitVote):
  * ``vote(timeout)``: this rank votes yes only with enough replicas and no error this step
    (an error the process group reports counts too: collectives FSDP issues straight on the
    group report only there); the group's ManagerServer ANDs the votes of every rank. The
    step's checkpoint stops being served before it returns (the caller changes its state
    next). A commit advances the counters; a failed vote counts toward ``max_retries``
    (RuntimeError once exceeded) and the failure streak (PersistentStepFailure at its bound).
  * ``quorum_failed(e)``: what a failed quorum raises (``e``, or a PersistentStepFailure).
  * ``back_off(closing)``: waits what the last failed step owes before the next quorum.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

import torch

from ft.manager_parts.group_rebuild import group_error
from ft.manager_parts.progress_watch import ProgressWatch
from ft.manager_parts.step_errors import StepErrors
from ft.manager_parts.step_failures import StepFailure
from ft.manager_parts.step_log import StepLog
from ft.manager_parts.step_outcomes import StepOutcomes
from ft.manager_parts.step_state import StepState
from ft.observability import records
from ft.utils.deadline import Deadline

__all__ = ["CommitVote"]


class CommitVote:
    """The vote of one rank and the failure bookkeeping across steps (module docstring)."""

    def __init__(
        self,
        state: StepState,
        errors: StepErrors,
        report: Callable[[Exception, bool, str], None],
        outcomes: StepOutcomes,
        log: StepLog,
        watch: ProgressWatch,
        links: Callable[[], Dict[str, Any]],
        rank: int,
        min_replica_size: int,
        max_retries: Optional[int],
    ) -> None:
        """``links()``: the group's current ``pg``, ``client``, ``transport`` and
        ``replica_id`` (read at each use: torchft's tests replace some)."""
        self._state = state
        self._errors = errors
        self._report = report
        self.outcomes = outcomes
        self._log = log
        self._watch = watch
        self._links = links
        self._rank = rank
        self._min_replica_size = min_replica_size
        self._max_retries = max_retries

    def vote(self, timeout: timedelta) -> bool:
        state = self._state
        links = self._links()
        self._watch.phase("should_commit", "the group's vote at its ManagerServer")
        # On CUDA, wait for the work queued on the current stream first, so that a collective
        # still in flight has had its chance to fail.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.current_stream().synchronize()
        pg_error = group_error(links["pg"])
        if pg_error is not None:
            # A collective issued straight on the group (FSDP's), or one aborted under it.
            self._report(pg_error, False, "allreduce")
        enough_replicas = state.participation.enough(self._min_replica_size)
        local_should_commit = enough_replicas and self._errors.first is None
        should_commit = links["client"].should_commit(
            self._rank, state.step, local_should_commit, timeout=timeout
        )
        records.record(
            records.COMMITS,
            replica_id=links["replica_id"],
            rank=self._rank,
            quorum_id=state.quorum_id,
            step=state.step,
            commit_result=should_commit,
        )
        # Transfers of this step's state must end before the caller mutates it.
        links["transport"].disallow_checkpoint()
        if should_commit:
            self._committed()
        else:
            self._not_committed(local_should_commit, enough_replicas)
        return should_commit

    def _committed(self) -> None:
        state = self._state
        self._watch.committed()
        state.step += 1
        state.batches_committed += state.participation.contributors
        state.commit_failures = 0
        self._log.info("commit", "committed", participants=state.participation.contributors)
        self.outcomes.settle(True, None, state.quorum_replica_ids, state.step, "")

    def _not_committed(self, local_should_commit: bool, enough_replicas: bool) -> None:
        state = self._state
        state.commit_failures += 1
        self._log.warning(
            "commit",
            f"not committed (local vote={local_should_commit}, enough_replicas="
            f"{enough_replicas}, errored={self._errors.first!r})",
            commit_failures=state.commit_failures,
        )
        give_up = self.outcomes.settle(
            False,
            self._step_failure(enough_replicas),
            state.quorum_replica_ids,
            state.step,
            self._short_of_replicas(),
        )
        if self._max_retries is not None and state.commit_failures > self._max_retries:
            msg = (
                f"should_commit failed {state.commit_failures} times in a row, "
                f"exceeding max_retries={self._max_retries}"
            )
            self._log.error("max_retries", msg)
            raise RuntimeError(msg)
        if give_up is not None:
            raise give_up

    def _short_of_replicas(self) -> str:
        """Why a step that nobody failed did not commit, in one line."""
        return (
            f"commit: {self._state.participation.commit_size} replica(s) would hold the step, "
            f"min_replica_size={self._min_replica_size}"
        )

    def _step_failure(self, enough_replicas: bool) -> Optional[StepFailure]:
        """Why this step did not commit, as the streak counts it; None when the only reason
        is too few replicas (waiting for one to come back is no fault)."""
        if self._errors.first is not None:
            return StepFailure.from_exception(self._errors.first, self._errors.phase)
        if not enough_replicas:
            return None
        # This rank's vote was yes: another rank of the group (or a vote for another step)
        # said no; that rank's log names its error.
        return StepFailure(
            phase="commit",
            error_type="",
            message="another rank of this replica group voted not to commit",
        )

    def quorum_failed(self, e: Exception) -> Exception:
        """What to raise for this step's failed quorum ``e``: ``e`` itself or, once as many
        identical failures as ``max_consecutive_failures`` have happened, a
        PersistentStepFailure caused by it."""
        return self.outcomes.quorum_failed(
            e, self._state.quorum_replica_ids, self._state.step, self._short_of_replicas()
        )

    def back_off(self, closing: threading.Event) -> None:
        """Waits the backoff the last failed step owes before the next quorum, if any. Bounded
        by the delay; ``closing`` (shutdown) ends it, and then raises RuntimeError."""
        delay = self.outcomes.take_backoff()
        if delay <= 0:
            return
        self._watch.phase("backoff", f"{delay:.2f}s after {self.outcomes.streak.count} failures")
        Deadline.after(delay).wait_event(closing)
        if closing.is_set():
            raise RuntimeError("Manager is shut down")
