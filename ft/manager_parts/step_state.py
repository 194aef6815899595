"""The state of a replica's current step that the Manager's parts share: its counters, the
quorum it stepped into and its part in it, and the two settings torchft's tests change on a
live Manager.

Contract (StepState):
  * ``step``, ``batches_committed`` and ``commit_failures`` change on the training thread
    (the vote), or on the quorum thread while the training thread waits for it (a heal that
    sets the counters it received).
  * ``quorum_id`` and ``quorum_replica_ids`` change together under ``lock``, which a failure
    notification (another thread) takes to read them.
  * ``participation`` and ``healing`` are set while a quorum is taken in, before the step's
    collectives may start.

``Forward`` gives an owner's attribute a second name on the class that holds the owner: the
Manager answers torchft's private names (its tests read and set them) from the parts that
own them.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, FrozenSet, Optional

from ft.coordination.quorum import Participation

__all__ = ["Forward", "StepState"]


@dataclasses.dataclass
class StepState:
    """One replica's step counters, its quorum and its participation (module docstring)."""

    use_async_quorum: bool
    """Quorums run on a worker thread, overlapping the forward pass."""
    init_sync: bool
    """Heal every replica from one primary at step 0."""
    step: int = 0
    """Steps committed."""
    batches_committed: int = 0
    """Batches committed across every replica."""
    commit_failures: int = 0
    """Consecutive votes that did not commit."""
    quorum_id: int = -1
    """The latest quorum this replica joined (-1 before the first)."""
    quorum_replica_ids: FrozenSet[str] = frozenset()
    """That quorum's members."""
    participation: Participation = Participation(rank=None, contributors=0, commit_size=0)
    """This replica's part in the step (its rank among the contributors, how many there are)."""
    healing: bool = False
    """This replica receives a heal this step: it contributes zeros and does not count."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)
    """Guards ``quorum_id`` with ``quorum_replica_ids``."""

    # torchft's two names for the participation, which its tests set one at a time.
    @property
    def participating_rank(self) -> Optional[int]:
        return self.participation.rank

    @participating_rank.setter
    def participating_rank(self, rank: Optional[int]) -> None:
        self.participation = dataclasses.replace(self.participation, rank=rank)

    @property
    def participating_world_size(self) -> int:
        return self.participation.contributors

    @participating_world_size.setter
    def participating_world_size(self, size: int) -> None:
        self.participation = dataclasses.replace(
            self.participation, contributors=size, commit_size=size
        )

    def counters(self) -> Dict[str, int]:
        """What the Manager's state_dict holds."""
        return {"step": self.step, "batches_committed": self.batches_committed}

    def load_counters(self, counters: Dict[str, int]) -> None:
        self.step = int(counters["step"])
        self.batches_committed = int(counters["batches_committed"])

    def enter_quorum(self, quorum_id: int, replica_ids: Any) -> bool:
        """Records the quorum taken in; True if it is a new one (the group is rebuilt)."""
        with self.lock:
            new = quorum_id != self.quorum_id
            self.quorum_id = quorum_id
            self.quorum_replica_ids = frozenset(replica_ids)
        return new

    def in_quorum(self, quorum_id: int, replica_id: str) -> bool:
        """Whether ``replica_id`` is a member of this replica's quorum ``quorum_id``."""
        with self.lock:
            return quorum_id == self.quorum_id and replica_id in self.quorum_replica_ids


class Forward:
    """A class attribute that reads and writes ``getattr(obj, owner).name`` (module
    docstring)."""

    def __init__(self, owner: str, name: str) -> None:
        self._owner = owner
        self._name = name

    def __get__(self, obj: Optional[Any], objtype: Optional[type] = None) -> Any:
        if obj is None:
            return self
        return getattr(getattr(obj, self._owner), self._name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self._owner), self._name, value)
