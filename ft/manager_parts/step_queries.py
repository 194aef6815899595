"""The Manager's read side: what a training loop asks of its step (torchft's accessors), and
torchft's private names, which its tests read and set on a live Manager.

Contract (StepQueries): a base of :class:`ft.manager.Manager`, reading only what the Manager
holds: ``_state`` (StepState), ``_round`` (QuorumRound), ``_vote`` (CommitVote), ``_errors``
(StepErrors), ``_registered``, ``_wiring``, ``_pg``, ``_replica_id``, ``_rank`` and
``_manager`` (the ManagerServer on group rank 0). The answers about this step's participation
wait for a quorum in flight to be decided (and raise its failure); nothing here changes the
step.
"""

from __future__ import annotations

from typing import Any, Optional

from ft.manager_parts.step_errors import ExceptionWithTraceback
from ft.manager_parts.step_state import Forward

__all__ = ["StepQueries"]


class StepQueries:
    """The Manager's accessors (module docstring)."""

    _state: Any
    _round: Any
    _vote: Any
    _errors: Any
    _pg: Any
    _replica_id: str
    _rank: int
    _manager: Any

    # torchft's private names, which its tests read and set, answered by the parts that own
    # them (ft.manager_parts.step_state.Forward).
    _step = Forward("_state", "step")
    _batches_committed = Forward("_state", "batches_committed")
    _commit_failures = Forward("_state", "commit_failures")
    _quorum_id = Forward("_state", "quorum_id")
    _healing = Forward("_state", "healing")
    _participation = Forward("_state", "participation")
    _use_async_quorum = Forward("_state", "use_async_quorum")
    _init_sync = Forward("_state", "init_sync")
    _quorum_future = Forward("_round", "future")
    _errored = Forward("_errors", "first")
    _state_dict_lock = Forward("_registered", "lock")
    _is_state_dict_read_allowed = Forward("_registered", "reads_allowed")
    _participating_replica_rank = Forward("_state", "participating_rank")
    _participating_replica_world_size = Forward("_state", "participating_world_size")
    # Assigning one (torchft's tests do) hands it to the Healer too: the next heal uses it.
    _checkpoint_transport = Forward("_wiring", "transport")

    def step_aborted(self) -> bool:
        """Whether an error this step aborted the process group (a communication failure the
        Manager detected). The step's later allreduces are then no-ops: the peers' matching
        collectives fail with the abort. After an error that did not abort
        (:meth:`report_error`, a failed Work), collectives still run, and an algorithm that
        issues its own (ZeRO's parameter exchange) must issue them too, or the other groups
        wait for them until their op timeout."""
        return self._errors.aborted

    def errored(self) -> Optional[ExceptionWithTraceback]:
        """The first error reported during this step, or None.

        An :class:`ExceptionWithTraceback` (torchft's type) that is also an instance of the
        reported exception's type, so ``isinstance(m.errored(), TimeoutError)`` holds for a
        reported TimeoutError; the reported exception is its ``original_exception``.
        """
        return self._errors.first

    def current_step(self) -> int:
        """The number of committed steps."""
        return self._state.step

    def quorum_id(self) -> int:
        """The id of the latest quorum this replica joined (-1 before the first).

        An ft addition to torchft's API: it changes whenever the membership changes (or after
        commit failures), so state that depends on who takes part (e.g. a sharding plan) can
        be keyed by it. Waits for a quorum in flight.
        """
        self._wait_decided()
        return self._state.quorum_id

    def batches_committed(self) -> int:
        """The total number of batches committed across all replicas."""
        return self._state.batches_committed

    def last_step_error(self) -> Optional[str]:
        """Why the last step that ended did not commit, in one line ("phase: Type: message",
        docs/design.md, "Persistent failures"), or None after a commit (an ft extension;
        ft-launch's progress record shows it)."""
        return self._vote.outcomes.last_error

    def participating_rank(self) -> Optional[int]:
        """This replica's rank among the participants of this step, or None."""
        self._wait_decided()
        return self._state.participation.rank

    def num_participants(self) -> int:
        """The number of replicas that take part in this step."""
        self._wait_decided()
        return self._state.participation.contributors

    def _wait_decided(self) -> None:
        if self._round.future is not None:
            self._round.wait_decided()

    def is_participating(self) -> bool:
        """Whether this replica's data counts in this step (healing replicas and spares don't)."""
        return self._state.participation.rank is not None and not self._state.healing

    @property
    def replica_id(self) -> str:
        """This group's replica id (``"{name}:{uuid4}"``)."""
        return self._replica_id

    @property
    def use_async_quorum(self) -> bool:
        """Whether :meth:`start_quorum` returns before the quorum (it then overlaps the
        forward pass, and a heal is applied at :meth:`should_commit`)."""
        return self._state.use_async_quorum

    @property
    def num_lanes(self) -> int:
        """How many independent lanes the process group has (1 for a group without lanes):
        collectives issued in different ``ft.process_group.lane(i)`` blocks can run at once."""
        lanes = getattr(self._pg, "num_lanes", None)
        return lanes if isinstance(lanes, int) and lanes > 0 else 1

    def _manager_address(self) -> Optional[str]:
        return self._manager.address() if self._manager is not None else None

    def __repr__(self) -> str:
        return (
            f"Manager(replica_id={self._replica_id!r}, rank={self._rank}, "
            f"quorum_id={self._state.quorum_id}, step={self._state.step})"
        )
