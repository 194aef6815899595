"""What the workers' ``@ft-progress`` records (:mod:`ft.launch.worker`) say about a run.

Contract:
* :meth:`RunProgress.apply` takes one record of one rank and updates its group's view (step,
  loss, participants, quorum) and counters, and the run's totals. Only rank 0 speaks for a
  group's steps and heals; every rank's ``done`` record is kept (each carries its own hash).
* A record of an attempt other than the group's current one still counts (steps, heals,
  commits), but never changes what the group shows.
* Quorum ids are numbered 1, 2, ... in the order they are first reported
  (:meth:`RunProgress.quorum_number`); a new one is announced through ``say`` (the first only
  when ``verbose``).
* A step that did not commit and says why (``error``) sets its group's :attr:`Group.failing`
  until a step commits; a new cause is announced once through ``say``.
* :attr:`RunProgress.finishing` turns true once any group reports its stop phase (or the
  launcher asks the run to stop) and stays true.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

from .group import Group


class RunProgress:
    """The run's view of its groups' progress, fed one record at a time."""

    def __init__(
        self, say: Callable[[str], None], clock: Callable[[], float], verbose: bool = False
    ) -> None:
        self.say = say
        self.clock = clock  # seconds into the run, for first-step times
        self.verbose = verbose
        self.quorum_ids: Dict[Any, int] = {}  # quorum id -> its number, in order of appearance
        self.max_step = 0  # the highest training step any group reported
        self.commits_after_last_chaos = 0
        self.finishing = False
        self._chaos_seen = False

    def quorum_number(self, quorum_id: Any) -> Optional[int]:
        """Quorum ids are large and sparse; they are shown as #1, #2, ... instead."""
        return self.quorum_ids.get(quorum_id)

    def chaos_injected(self) -> None:
        """A failure was injected: commits are counted from zero again."""
        self._chaos_seen = True
        self.commits_after_last_chaos = 0

    def finish(self) -> bool:
        """Marks the run as finishing; returns whether it was not already."""
        first = not self.finishing
        self.finishing = True
        return first

    def apply(self, group: Group, attempt: int, rank: int, record: Dict[str, Any]) -> None:
        event = record.get("event")
        current = attempt == group.attempt
        if event == "heal":
            if rank == 0:
                group.stats.heals += 1
                self.say(
                    f"group {group.gid}: healed from a live peer, step "
                    f"{record.get('from_step')} -> {record.get('to_step')}"
                )
        elif event == "final":
            if current:
                group.final = True
            if self.finish():
                self.say(
                    f"group {group.gid} reached its stop phase at step {record.get('step')}; "
                    "no more chaos"
                )
        elif event == "done":
            group.done[rank] = record
            if record.get("accuracy") is not None:
                group.accuracy = record.get("accuracy")
            if record.get("step") is not None:
                group.step = record.get("step")
        elif event == "step" and rank == 0:
            self._step(group, current, record)
        elif event == "gave_up":
            group.stats.gave_up = record.get("error") or "a persistent step failure"
            group.last_error = group.stats.gave_up
            self.say(f"group {group.gid} rank {rank}: gave up: {group.stats.gave_up}")

    def _step(self, group: Group, current: bool, record: Dict[str, Any]) -> None:
        if group.stats.count_step(record) and self._chaos_seen:
            self.commits_after_last_chaos += 1
        if not current:
            return
        self._cause(group, record)
        if not group.progressing:
            group.progressing = True
            group.first_step_times.append(self.clock())
        if record.get("barrier"):
            # Stop-phase steps (no update) keep showing the last training step; a group that
            # healed straight into the stop phase shows the step it healed to.
            if group.step is None:
                group.step = record.get("step")
            return
        group.step = record.get("step", group.step)
        if isinstance(group.step, int):
            self.max_step = max(self.max_step, group.step)
        if record.get("loss") is not None:
            group.loss = record["loss"]
        group.participants = record.get("participants", group.participants)
        self._quorum(group, record.get("quorum_id"))

    def _cause(self, group: Group, record: Dict[str, Any]) -> None:
        """Keeps why the group's steps fail; says it when the cause is new, so a storm of
        identical failures is one line, not one per step."""
        if record.get("committed"):
            group.failing = None
            return
        error = record.get("error")
        if not error:
            return
        if error != group.failing and error != group.last_error:
            self.say(f"group {group.gid}: step {record.get('step')} failed: {error}")
        group.failing = group.last_error = error

    def _quorum(self, group: Group, quorum_id: Any) -> None:
        if quorum_id is None or quorum_id == group.quorum_id:
            return
        if group.quorum_id is not None:
            group.stats.quorum_changes += 1
        group.quorum_id = quorum_id
        if quorum_id in self.quorum_ids:
            return
        self.quorum_ids[quorum_id] = len(self.quorum_ids) + 1
        if len(self.quorum_ids) > 1 or self.verbose:
            self.say(
                f"new quorum #{self.quorum_ids[quorum_id]} (id {quorum_id}): "
                f"{group.participants} participant(s), first reported by group {group.gid} "
                f"at step {group.step}"
            )
