"""A replica's step machinery, built in one place from its settings: which part gets which
collaborator (the parts themselves import none of each other's construction).

``StepHooks`` are what the parts call back into the Manager for: the group's current links
(torchft's tests replace the group, the client and the transport on a live Manager), the
group's rebuild (the Manager keeps torchft-nightly's ``_reconfigure_pg``, which its tests
replace), the checkpoint a heal sends, and the fields every log line starts with.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, Dict, Optional

from ft.coordination import FailureNotification, QuorumResult
from ft.manager_parts.commit_vote import CommitVote
from ft.manager_parts.group_rebuild import group_error
from ft.manager_parts.heal_duties import HealDuties
from ft.manager_parts.progress_watch import ProgressWatch
from ft.manager_parts.quorum_round import QuorumRound
from ft.manager_parts.settings import ManagerSettings
from ft.manager_parts.state_dicts import RegisteredState
from ft.manager_parts.step_errors import StepErrors
from ft.manager_parts.step_failures import StepFailurePolicy
from ft.manager_parts.step_log import StepLog, logger
from ft.manager_parts.step_outcomes import StepOutcomes
from ft.manager_parts.step_state import StepState

__all__ = ["StepHooks", "StepParts"]


@dataclasses.dataclass(frozen=True)
class StepHooks:
    """The Manager's side of the parts (module docstring)."""

    links: Callable[[], Dict[str, Any]]
    """The group's current ``pg``, ``client``, ``transport``, ``replica_id``, ``lighthouse``."""
    rebuild: Callable[[QuorumResult], None]
    """Rebuilds the process group for a new quorum."""
    checkpoint: Callable[[], Dict[str, Any]]
    """The Manager's state dict, as a heal sends it."""
    log_context: Callable[[], Dict[str, Any]]
    """The fields every log line starts with."""


@dataclasses.dataclass
class StepParts:
    """The parts of one replica's step protocol (ft.manager_parts)."""

    state: StepState
    log: StepLog
    errors: StepErrors
    report: Callable[..., None]
    """``report(e, abort, phase="user")`` fails the step with ``e`` (``phase``: where in the
    step it arose, ft.manager_parts.step_failures.PHASES; ``abort``: abort the group too)."""
    registered: RegisteredState
    watch: ProgressWatch
    vote: CommitVote
    heal: HealDuties
    round: QuorumRound

    @classmethod
    def build(
        cls,
        settings: ManagerSettings,
        hooks: StepHooks,
        use_async_quorum: bool,
        init_sync: bool,
        min_replica_size: int,
        spares_above: Optional[int],
        max_retries: Optional[int],
        max_consecutive_failures: Optional[int],
    ) -> "StepParts":
        state = StepState(use_async_quorum=use_async_quorum, init_sync=init_sync)
        log = StepLog(hooks.log_context)
        errors = StepErrors(
            abort_group=lambda: hooks.links()["pg"].abort(),
            on_first=lambda e: log.error("error", f"{type(e).__name__}: {e}"),
        )
        registered = RegisteredState(lock_timeout_s=settings.timeout.total_seconds())
        watch = ProgressWatch(
            settings.quorum_timeout.total_seconds(),
            lambda: (
                f"replica {hooks.links()['replica_id']} step={state.step} "
                f"quorum_id={state.quorum_id} members={sorted(state.quorum_replica_ids)}"
            ),
        )

        def report(e: Exception, abort: bool, phase: str = "user") -> None:
            watch.error(e)
            errors.report(e, abort, phase)

        outcomes = StepOutcomes(
            StepFailurePolicy.from_settings(max_consecutive_failures, os.environ), log
        )
        vote = CommitVote(
            state, errors, report, outcomes, log, watch, hooks.links,
            settings.rank, min_replica_size, max_retries,
        )  # fmt: skip
        heal = HealDuties(
            state, registered, errors, report, log, watch, hooks.checkpoint,
            lambda: group_error(hooks.links()["pg"]) is not None,
            settings.rank, settings.timeout,
        )  # fmt: skip
        round_ = QuorumRound(
            state, heal, log, watch, report, vote.quorum_failed, hooks.links,
            hooks.rebuild, settings.rank, spares_above,
        )  # fmt: skip
        return cls(state, log, errors, report, registered, watch, vote, heal, round_)

    def begin_step(self, closing: threading.Event) -> None:
        """Clears what the last step left: a heal it owed and never sent is abandoned (its
        receivers learn now instead of at their timeout), then the backoff it owes is waited
        (``closing`` ends that wait, with RuntimeError)."""
        self.heal.abandon_pending("the source began its next step without sending it")
        self.vote.back_off(closing)
        self.errors.clear()
        self.vote.outcomes.new_step()
        self.state.healing = False
        self.heal.pending = None

    def on_member_failure(self, n: FailureNotification, own_replica_id: str, pg: Any) -> None:
        """A member of this replica's quorum died: abort the group at once, so that a
        collective hung on it fails now (ft.manager's docstring, "Proactive abort")."""
        if n.replica_id == own_replica_id or not self.state.in_quorum(n.quorum_id, n.replica_id):
            return
        self.log.warning(
            "proactive_abort",
            f"quorum member {n.replica_id} died ({n.error_message}); aborting the process group",
            dead=n.replica_id,
        )
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - logged; the group's own deadline still applies
            logger.exception("pg.abort() failed")

    def close(self, wait: bool) -> None:
        self.watch.close()
        self.round.close(wait)
