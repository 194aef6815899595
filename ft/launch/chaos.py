"""``ft-launch --chaos``: failures injected into the ranks of a running training, on a timer.

Contract:
* :class:`ChaosInjector` injects at most one failure every ``every`` seconds, each into one
  random rank of a random healthy group (running, past its first step, not in its stop phase,
  every rank alive and none stopped), and only while at least two groups are healthy: the last
  healthy group is never taken down (it tries again at the next tick instead).
* Modes: ``kill`` SIGKILLs the rank; ``stop`` SIGSTOPs it for ``stop_seconds`` and then
  SIGCONTs it (``stop_action="cont"``) or SIGKILLs it (``"kill"``); ``allreduce`` sends SIGUSR1,
  which a worker using :mod:`ft.launch.worker` turns into a failed allreduce.
* Once :meth:`ChaosInjector.tick` is told the run is stopping, no failure is injected again; a
  stopped rank is still resumed (or killed) when its time is up.
* It signals only processes the launcher started and has not reaped; the same ``seed`` makes
  the same choices from the same sequence of healthy groups.
"""

from __future__ import annotations

import dataclasses
import random
import signal
from typing import Any, Callable, Dict, List, Optional, Sequence

from ft.utils.deadline import Deadline

from .group import Group, RankProc

CHAOS_MODES = ("kill", "stop", "allreduce")
STOP_ACTIONS = ("cont", "kill")


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    """What ``--chaos`` injects, and how often."""

    mode: Optional[str] = None
    """One of :data:`CHAOS_MODES`; None injects nothing."""
    every: float = 5.0
    """Seconds between injected failures (the first comes this long after the start)."""
    stop_seconds: float = 4.0
    """``stop``: how long a rank stays SIGSTOPped."""
    stop_action: str = "cont"
    """``stop``: what ends the stop, one of :data:`STOP_ACTIONS` (SIGCONT or SIGKILL)."""
    seed: Optional[int] = None
    """Seed of the random choices of group and rank."""


class ChaosInjector:
    """Injects the failures :class:`ChaosConfig` describes (see the module's contract)."""

    def __init__(
        self, config: ChaosConfig, say: Callable[[str], None], clock: Callable[[], float]
    ) -> None:
        self.config = config
        self.say = say
        self.clock = clock  # seconds into the run, for the log
        self.rng = random.Random(config.seed)
        self.next_at: Optional[Deadline] = Deadline.after(config.every) if config.mode else None
        # One record per injected failure: mode, group, rank, pid, time, step, max_step.
        self.log: List[Dict[str, Any]] = []

    def tick(self, groups: Sequence[Group], max_step: int, stopping: bool) -> bool:
        """Resumes stopped ranks whose time is up, then injects a failure if one is due.
        Returns whether one was injected."""
        self._end_stops(groups)
        if self.next_at is None or not self.next_at.expired:
            return False
        if stopping:
            self.next_at = None
            return False
        healthy = [group for group in groups if group.healthy()]
        if len(healthy) < 2:
            return False
        group = self.rng.choice(healthy)
        victim = self.rng.choice(group.ranks)
        injected = self._inject(victim)
        if injected is not None:
            self.log.append(
                {
                    "mode": self.config.mode,
                    "group": group.gid,
                    "rank": victim.rank,
                    "pid": victim.pid,
                    "time": self.clock(),
                    "step": group.step,
                    "max_step": max_step,
                }
            )
            self.say(
                f"chaos: {injected} -> group {group.gid} rank {victim.rank} "
                f"(pid {victim.pid}) at step {group.step}"
            )
        self.next_at = Deadline.after(self.config.every)
        return injected is not None

    def _inject(self, victim: RankProc) -> Optional[str]:
        """Signals ``victim``; returns what was done, or None if it was gone."""
        config = self.config
        if config.mode == "kill":
            return "SIGKILL" if victim.signal(signal.SIGKILL) else None
        if config.mode == "stop":
            if not victim.signal(signal.SIGSTOP):
                return None
            victim.stopped_until = Deadline.after(config.stop_seconds)
            return f"SIGSTOP for {config.stop_seconds:.1f}s then {config.stop_action.upper()}"
        if victim.signal(signal.SIGUSR1):
            return "SIGUSR1 (fail the next allreduce)"
        return None

    def _end_stops(self, groups: Sequence[Group]) -> None:
        for group in groups:
            for rank_proc in group.ranks:
                if rank_proc.stopped_until is None or not rank_proc.stopped_until.expired:
                    continue
                rank_proc.stopped_until = None
                where = f"group {group.gid} rank {rank_proc.rank} (pid {rank_proc.pid})"
                if self.config.stop_action == "kill":
                    rank_proc.signal(signal.SIGKILL)
                    self.say(f"chaos: SIGKILL stopped {where}")
                else:
                    rank_proc.signal(signal.SIGCONT)
                    self.say(f"chaos: SIGCONT {where}")
