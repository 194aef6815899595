"""What the Manager remembers of the steps that ended: the streak of identical failures, the
wait owed before the next quorum, and why the last step did not commit (docs/design.md,
"Persistent failures"). The rule itself is ``step_failures.next_streak`` (pure); this holds
its state from step to step.

Contract:
  * ``new_step()`` at each quorum's start; each step is settled once, by ``settle`` (the
    vote) or ``quorum_failed`` (however many calls surface the quorum's failure).
  * ``settle`` returns the PersistentStepFailure to raise once the streak reaches the
    policy's bound, else None; it sets the wait owed before the next quorum (one jittered
    exponential sequence per streak, ``ft.utils.retry.backoff_delays``) and logs a backoff or
    a give-up at ERROR (a backoff while short of replicas, which is no fault, at WARNING).
  * ``take_backoff()`` returns the wait owed and clears it.
  * ``last_error`` is "phase: Type: message" of the last step that did not commit, None after
    a commit.
"""

from __future__ import annotations

from typing import Any, FrozenSet, Iterator, Optional, Union

from ft.manager_parts.step_failures import (
    FailureStreak,
    PersistentStepFailure,
    StepFailure,
    StepFailurePolicy,
    next_streak,
)
from ft.utils.retry import backoff_delays

__all__ = ["StepOutcomes"]


class StepOutcomes:
    """The failure streak across steps and what it owes (module docstring)."""

    def __init__(self, policy: StepFailurePolicy, log: Any) -> None:
        """``log``: the Manager's step logger (``error(event, message, **fields)``)."""
        self.policy = policy
        self.streak = FailureStreak()
        self.last_error: Optional[str] = None
        self._log = log
        self._delays: Optional[Iterator[float]] = None
        self._owed_s = 0.0
        # this step's outcome once settled: the exception to raise again, or False
        self._settled: Optional[Union[bool, BaseException]] = None

    def new_step(self) -> None:
        self._settled = None

    def take_backoff(self) -> float:
        """The wait owed before the next quorum (0: none); cleared."""
        delay, self._owed_s = self._owed_s, 0.0
        return delay

    def quorum_failed(
        self, e: Exception, members: FrozenSet[str], step: int, why_not: str
    ) -> Exception:
        """What to raise for this step's failed quorum ``e``: ``e`` itself, or the
        PersistentStepFailure it completes. ``why_not``: as for :meth:`settle`."""
        if self._settled is None:
            give_up = self.settle(
                False, StepFailure.from_exception(e, "quorum"), members, step, why_not
            )
            self._settled = give_up if give_up is not None else False
        if isinstance(self._settled, Exception):
            return self._settled
        return e

    def settle(
        self,
        committed: bool,
        failure: Optional[StepFailure],
        members: FrozenSet[str],
        step: int,
        why_not: str,
    ) -> Optional[PersistentStepFailure]:
        """Feeds the step's outcome to the streak. ``failure`` None on a step that did not
        commit: too few replicas, which ``why_not`` says in one line (no fault: backed off
        from, never given up on)."""
        decision = next_streak(
            self.policy, self.streak, committed=committed, failure=failure, members=members
        )
        streak = self.streak = decision.streak
        if committed:
            self.last_error = None
        else:
            self.last_error = failure.one_line() if failure is not None else why_not
        if decision.backoff_attempt is None:
            self._delays = None
            self._owed_s = 0.0
        else:
            if decision.backoff_attempt == 0 or self._delays is None:
                self._delays = backoff_delays(
                    self.policy.initial_backoff_s, self.policy.max_backoff_s
                )
            self._owed_s = next(self._delays)
        if self._settled is None:
            self._settled = False
        if streak.failure is None:
            if decision.backoff_attempt is not None:
                self._log.warning(
                    "short_of_replicas_backoff",
                    f"step {step} did not commit {streak.count} times in a row, short of "
                    f"replicas while the quorum's {len(streak.members)} members stayed the "
                    f"same ({why_not}); waiting {self._owed_s:.2f}s before the next quorum",
                    backoff_s=round(self._owed_s, 3),
                    consecutive_failures=streak.count,
                )
            return None
        fields = {
            "phase": streak.failure.phase,
            "consecutive_failures": streak.count,
            "members": len(streak.members),
        }
        if decision.give_up:
            exc = PersistentStepFailure.of(streak, self.policy, step)
            self._log.error("persistent_failure", str(exc), **fields)
            self._settled = exc
            return exc
        if decision.backoff_attempt is not None:
            bound = self.policy.max_consecutive_failures
            self._log.error(
                "step_failure_backoff",
                f"step {step} failed {streak.count} times in a row in phase "
                f"{streak.failure.phase} with the same error while the quorum's "
                f"{len(streak.members)} members stayed the same: {streak.failure.one_line()}; "
                f"waiting {self._owed_s:.2f}s before the next quorum, then retrying step "
                f"{step} (quorum, configure, collectives, vote); "
                + (
                    f"should_commit raises PersistentStepFailure at {bound} "
                    "(max_consecutive_failures)"
                    if bound
                    else "never giving up (max_consecutive_failures=0)"
                ),
                backoff_s=round(self._owed_s, 3),
                **fields,
            )
        return None
