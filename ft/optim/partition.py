"""Pure partition logic for ZeroRedundancyOptimizer (no torch, no I/O).

The rule (the same one torch's ``ZeroRedundancyOptimizer`` applies, so a model is
sharded identically by both):

* Parameters are assigned whole; a parameter is never split across ranks.
* One load counter per rank, shared by all parameter groups, starts at zero.
* Parameter groups are visited in order.  Within a group the parameters are sorted by
  number of elements, largest first.  The sort is stable: parameters of equal size keep
  their order inside the group (the first one listed goes first).
* Each parameter goes to the rank with the smallest load so far; on a tie, the lowest
  rank wins.  The rank's load then grows by the parameter's number of elements.
* Within a rank, a group's parameters are kept in assignment order (largest first).
  That order defines the rank's local optimizer indexing and its flat bucket layout.

Because the groups are visited in order with a running load, appending a group (as
``add_param_group`` does) never moves a parameter of an earlier group.

Frozen parameters (``requires_grad=False``) count like any other, as in torch: the
partition depends only on the sizes, never on trainability, so it cannot change
at run time.

The functions take plain integers and return plain lists, so they are table-testable
and can be reused by the fault-tolerant mode, which recomputes the partition from
the number of participating replicas whenever the quorum changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

__all__ = ["Partition", "partition_params", "buddy_rank"]


@dataclass(frozen=True)
class Partition:
    """Result of :func:`partition_params`.

    Attributes:
        world_size: number of ranks.
        per_rank: ``per_rank[rank][group]`` is the list of indices (into the group's
            parameter list) that ``rank`` owns, in assignment order.
        owner: ``owner[group][index]`` is the rank owning that parameter.
        loads: ``loads[rank]`` is the total number of elements ``rank`` owns.
    """

    world_size: int
    per_rank: Tuple[Tuple[Tuple[int, ...], ...], ...]
    owner: Tuple[Tuple[int, ...], ...]
    loads: Tuple[int, ...]

    def owned(self, rank: int) -> List[Tuple[int, int]]:
        """``(group, index)`` pairs owned by ``rank``, groups in order, then assignment order."""
        return [(g, i) for g, idx in enumerate(self.per_rank[rank]) for i in idx]


def partition_params(group_numels: Sequence[Sequence[int]], world_size: int) -> Partition:
    """Sorted-greedy assignment of whole parameters to ``world_size`` ranks.

    Args:
        group_numels: for each parameter group, the number of elements of each of its
            parameters, in the group's order.
        world_size: number of ranks (>= 1).

    Returns:
        A :class:`Partition`; see the module docstring for the rule.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    loads = [0] * world_size
    per_rank: List[List[List[int]]] = [[] for _ in range(world_size)]
    owner: List[Tuple[int, ...]] = []
    for g, numels in enumerate(group_numels):
        numels = list(numels)
        for n in numels:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"group {g}: numel must be a non-negative int, got {n!r}")
        for r in range(world_size):
            per_rank[r].append([])
        group_owner = [0] * len(numels)
        # Largest first; equal sizes keep the group's order (index as the tie-break).
        for i in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
            r = min(range(world_size), key=lambda k: (loads[k], k))
            per_rank[r][g].append(i)
            group_owner[i] = r
            loads[r] += numels[i]
        owner.append(tuple(group_owner))
    return Partition(
        world_size=world_size,
        per_rank=tuple(tuple(tuple(ix) for ix in groups) for groups in per_rank),
        owner=tuple(owner),
        loads=tuple(loads),
    )


def buddy_rank(rank: int, world_size: int) -> int:
    """The rank that keeps the standby copy of ``rank``'s shard in fault-tolerant mode.

    ``(rank + 1) % world_size``: every rank is the buddy of exactly one other rank, so
    each holds its own shard plus one standby shard (about 2/N of the full state).  With
    a single rank there is no buddy and ``rank`` itself is returned.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    return (rank + 1) % world_size
