"""Pure coordination algorithms: data in, data out. No I/O, no clocks, no threads.

* :func:`quorum_compute` is the lighthouse rule (docs/design.md, "The quorum rule"): given the participants, the
  heartbeats, the previous quorum and the options, is a quorum ready now, with whom, and why (or
  why not).
* :func:`next_quorum_id` decides whether a quorum is a new one (membership change or commit
  failures).
* :func:`compute_quorum_result` is a ManagerServer's per-rank answer (docs/design.md, "The quorum rule"): replica
  rank, max step, the primary's store address, and the heal assignment (round-robin over the
  up-to-date members, offset by the group rank; every up-to-date member is a donor of a
  striped heal).
* :func:`participation` is a replica's own reading of its answer: whether its gradients count
  this step, how many replicas the average divides by, and how many count toward
  ``min_replica_size``.
* :func:`merge_group_requests` folds the Quorum requests of all local ranks of one replica group
  into the one member that the ManagerServer sends to the lighthouse.

Times are plain floats in seconds on any monotonic clock the caller chooses.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "QuorumMember",
    "Quorum",
    "QuorumResult",
    "FailureNotification",
    "LighthouseOptions",
    "QuorumDecision",
    "GroupRequest",
    "quorum_compute",
    "next_quorum_id",
    "compute_quorum_result",
    "merge_group_requests",
    "Participation",
    "participation",
    "subscriber_replica",
]


@dataclass(frozen=True)
class QuorumMember:
    """One replica group as the lighthouse sees it (proto ``QuorumMember``).

    Args:
        replica_id: the group's id.
        address: its ManagerServer's address.
        store_address: its TCPStore's ``host:port``.
        step: the step it is at.
        world_size: its number of ranks.
        shrink_only: it asks for a quorum of the previous quorum's members only.
        data: user data it sent with its request (JSON-encodable), or None.
        commit_failures: how many commits in a row it failed.
        reconfigure_handles: each group rank's process-group reconfigure handle, in group
            rank order ("" where a rank sent none; torchft-nightly's field). Carried, never
            compared: not part of the member's identity in the quorum rule.
    """

    replica_id: str
    address: str = ""
    store_address: str = ""
    step: int = 0
    world_size: int = 0
    shrink_only: bool = False
    # The user data the replica sent with its request, decoded (``None``: none sent). It
    # crosses the wire as a JSON string (proto ``data``); ft.coordination._rpc converts.
    data: Optional[Any] = field(default=None, hash=False)
    commit_failures: int = 0
    reconfigure_handles: Tuple[str, ...] = field(default=(), compare=False, hash=False)


@dataclass(frozen=True)
class Quorum:
    """An issued quorum (proto ``Quorum``).

    Args:
        quorum_id: increases with every new quorum (membership change or commit failures).
        participants: the members, sorted by replica_id.
        created: when the lighthouse issued it.
    """

    quorum_id: int
    participants: Tuple[QuorumMember, ...]
    created: _dt.datetime = field(
        default_factory=lambda: _dt.datetime.now(_dt.timezone.utc), compare=False
    )

    @property
    def replica_ids(self) -> List[str]:
        return [p.replica_id for p in self.participants]


@dataclass
class QuorumResult:
    """One rank's answer from its ManagerServer (mirrors proto ``ManagerQuorumResponse``)."""

    quorum_id: int = 0
    replica_rank: int = 0
    replica_world_size: int = 0
    recover_src_manager_address: str = ""
    recover_src_replica_rank: Optional[int] = None
    recover_dst_replica_ranks: List[int] = field(default_factory=list)
    store_address: str = ""
    max_step: int = 0
    max_replica_rank: Optional[int] = None
    max_world_size: int = 0
    heal: bool = False
    commit_failures: int = 0
    replica_ids: List[str] = field(default_factory=list)
    heal_donors: List[Tuple[int, str]] = field(default_factory=list)
    """(replica rank, ManagerServer address) of every member that can serve this quorum's
    heal (the up-to-date ones), in replica rank order; empty when nobody heals. An ft
    extension (proto field 1001): a striped heal takes from all of them."""
    reconfigure_handles: List[str] = field(default_factory=list)
    """This group rank's reconfigure handle in every member, in replica rank order ("" where
    a member sent none): what ``ProcessGroup.reconfigure`` takes (torchft-nightly's field)."""


@dataclass(frozen=True)
class FailureNotification:
    """A lighthouse's report that a member of the current quorum failed (proto
    ``FailureNotification``)."""

    replica_id: str
    error_message: str
    quorum_id: int
    heartbeat_age_s: float
    detected: _dt.datetime


@dataclass(frozen=True)
class LighthouseOptions:
    min_replicas: int = 1
    join_timeout_s: float = 60.0
    heartbeat_timeout_s: float = 5.0


@dataclass(frozen=True)
class QuorumDecision:
    """Result of :func:`quorum_compute`.

    ``members`` is None when no quorum is ready; ``reason`` says why (for logs and dashboard).
    """

    members: Optional[Tuple[QuorumMember, ...]]
    reason: str
    fast_path: bool = False

    @property
    def ready(self) -> bool:
        return self.members is not None


def _ids(ids) -> str:
    ids = sorted(ids)
    if len(ids) > 8:
        return ", ".join(ids[:8]) + f", ... (+{len(ids) - 8})"
    return ", ".join(ids)


def quorum_compute(
    now: float,
    participants: Mapping[str, Tuple[float, QuorumMember]],
    heartbeats: Mapping[str, float],
    prev: Optional[Quorum],
    opts: LighthouseOptions,
) -> QuorumDecision:
    """The lighthouse quorum rule (docs/design.md, "The quorum rule").

    Args:
        now: current time.
        participants: replica_id -> (joined time, member) of every replica waiting in Quorum.
        heartbeats: replica_id -> time of its last heartbeat (a Quorum request counts as one).
        prev: the previously issued quorum, if any.
        opts: min_replicas, join timeout and heartbeat timeout.

    Rules, in order:
      1. healthy = heartbeat younger than the heartbeat timeout; candidates = healthy
         participants sorted by replica_id.
      2. shrink_only if any healthy participant asked for it.
      3. with a previous quorum: under shrink_only keep only its members; if every member of the
         previous quorum is a healthy participant, issue the candidates at once (fast path,
         ignores min_replicas and the join wait).
      4. otherwise wait while candidates < min_replicas, or while healthy participants are at
         most half of the heartbeating replicas (split-brain guard).
      5. if some heartbeating replicas are not participating, wait until the earliest healthy
         participant has waited the join timeout.

    Note on 4: the min_replicas check counts the candidates (after the shrink_only filter),
    which equals the healthy participants unless shrink_only drops someone; this way a quorum
    smaller than min_replicas is never issued.
    """
    heartbeating = {rid for rid, t in heartbeats.items() if now - t < opts.heartbeat_timeout_s}
    healthy = {rid: (joined, m) for rid, (joined, m) in participants.items() if rid in heartbeating}
    candidates = [healthy[rid][1] for rid in sorted(healthy)]
    shrink_only = any(m.shrink_only for _, m in healthy.values())

    if not candidates:
        if participants:
            return QuorumDecision(
                None,
                f"no healthy participants ({len(participants)} waiting with expired heartbeats)",
            )
        return QuorumDecision(None, "no participants: waiting for replicas to request a quorum")

    if prev is not None:
        prev_ids = {p.replica_id for p in prev.participants}
        if shrink_only:
            candidates = [m for m in candidates if m.replica_id in prev_ids]
        if prev_ids and prev_ids.issubset(healthy.keys()) and candidates:
            return QuorumDecision(
                tuple(candidates),
                f"fast path: all {len(prev_ids)} members of quorum {prev.quorum_id} are participating",
                fast_path=True,
            )

    if len(candidates) < opts.min_replicas:
        return QuorumDecision(
            None,
            f"waiting: {len(candidates)} healthy participants < min_replicas {opts.min_replicas}"
            + (" (shrink_only)" if shrink_only else ""),
        )
    if 2 * len(healthy) <= len(heartbeating):
        return QuorumDecision(
            None,
            f"waiting: split-brain guard: {len(healthy)} healthy participants is not more than "
            f"half of {len(heartbeating)} heartbeating replicas",
        )
    stragglers = heartbeating - healthy.keys()
    if stragglers:
        first_joined = min(joined for joined, _ in healthy.values())
        waited = now - first_joined
        if waited < opts.join_timeout_s:
            return QuorumDecision(
                None,
                f"waiting: {len(candidates)} participants ready, waiting for "
                f"{len(stragglers)} heartbeating replicas to join ({_ids(stragglers)}); "
                f"join timeout in {opts.join_timeout_s - waited:.1f}s",
            )
        return QuorumDecision(
            tuple(candidates),
            f"join timeout elapsed: issuing {len(candidates)} without "
            f"{len(stragglers)} stragglers ({_ids(stragglers)})",
        )
    return QuorumDecision(
        tuple(candidates), f"all {len(candidates)} heartbeating replicas are participating"
    )


def next_quorum_id(
    prev: Optional[Quorum], current_id: int, members: Sequence[QuorumMember]
) -> Tuple[int, str]:
    """Returns (quorum_id for ``members``, why).

    The id is bumped when the sorted replica_id list differs from the previous quorum's, or
    when any member reports ``commit_failures > 0``.
    """
    ids = sorted(m.replica_id for m in members)
    if prev is None:
        return current_id + 1, "first quorum"
    prev_ids = sorted(p.replica_id for p in prev.participants)
    if ids != prev_ids:
        joined = set(ids) - set(prev_ids)
        left = set(prev_ids) - set(ids)
        parts = []
        if joined:
            parts.append(f"joined: {_ids(joined)}")
        if left:
            parts.append(f"left: {_ids(left)}")
        return current_id + 1, "membership changed (" + "; ".join(parts) + ")"
    failing = [m.replica_id for m in members if m.commit_failures > 0]
    if failing:
        return current_id + 1, f"commit failures reported by {_ids(failing)}"
    return current_id, "unchanged"


def compute_quorum_result(
    quorum_id: int,
    participants: Sequence[QuorumMember],
    replica_id: str,
    group_rank: int,
    init_sync: bool = True,
) -> QuorumResult:
    """A rank's answer to Quorum (docs/design.md, "The quorum rule").

    Raises:
        ValueError: ``replica_id`` is not in ``participants`` or ``participants`` is empty.
    """
    members = sorted(participants, key=lambda m: m.replica_id)
    ids = [m.replica_id for m in members]
    if replica_id not in ids:
        raise ValueError(f"replica {replica_id!r} is not a member of quorum {quorum_id}")
    if group_rank < 0:
        raise ValueError(f"group_rank must be >= 0, got {group_rank}")
    replica_rank = ids.index(replica_id)

    max_step = max(m.step for m in members)
    max_members = [m for m in members if m.step == max_step]
    max_ids = [m.replica_id for m in max_members]
    max_replica_rank = max_ids.index(replica_id) if replica_id in max_ids else None
    primary = max_members[group_rank % len(max_members)]

    # Recovering members, in replica order; up-to-date members are the rest.
    recovering = [
        i
        for i, m in enumerate(members)
        if m.step != max_step
        or (init_sync and max_step == 0 and m.replica_id != primary.replica_id)
    ]
    recovering_set = set(recovering)
    up_to_date = [i for i in range(len(members)) if i not in recovering_set]

    # The i-th recovering member heals from up_to_date[(i + group_rank) % len(up_to_date)].
    assignment: Dict[int, int] = {
        dst: up_to_date[(i + group_rank) % len(up_to_date)] for i, dst in enumerate(recovering)
    }

    heal = replica_rank in recovering_set
    result = QuorumResult(
        quorum_id=quorum_id,
        replica_rank=replica_rank,
        replica_world_size=len(members),
        store_address=primary.store_address,
        max_step=max_step,
        max_replica_rank=max_replica_rank,
        max_world_size=len(max_members),
        heal=heal,
        commit_failures=max(m.commit_failures for m in members),
        replica_ids=ids,
        # Every member's answer names the donors, so that an up-to-date member assigned no
        # receiver knows to stage its state for the striped heal too.
        heal_donors=[(i, members[i].address) for i in up_to_date] if recovering else [],
        reconfigure_handles=[
            m.reconfigure_handles[group_rank] if group_rank < len(m.reconfigure_handles) else ""
            for m in members
        ],
    )
    if heal:
        src = assignment[replica_rank]
        result.recover_src_replica_rank = src
        result.recover_src_manager_address = members[src].address
    else:
        result.recover_dst_replica_ranks = sorted(
            dst for dst, src in assignment.items() if src == replica_rank
        )
    return result


@dataclass(frozen=True)
class Participation:
    """Who takes part in one step, as one replica reads its :class:`QuorumResult`."""

    rank: Optional[int]
    """This replica's rank among the contributors; None when its gradients do not count
    (it heals during the step, or it is a spare)."""
    contributors: int
    """How many replicas' gradients enter the step's average: the allreduce divisor and what
    ``Manager.num_participants()`` reports."""
    commit_size: int
    """How many replicas hold the committed state once the step commits: the count checked
    against ``min_replica_size``. It differs from ``contributors`` only at step 0 under
    ``init_sync`` with an async quorum, where every replica but the primary heals to the
    primary's state during the step and so ends it holding the same state."""

    def enough(self, min_replica_size: int) -> bool:
        """Whether the step may commit under ``min_replica_size``."""
        return self.commit_size >= min_replica_size


def participation(
    result: QuorumResult,
    *,
    use_async_quorum: bool,
    allow_heal: bool,
    init_sync: bool,
    spares_above: Optional[int] = None,
) -> Participation:
    """The participation rule (docs/design.md, "Who takes part in a step").

    * Sync quorum with healing: every replica heals before the forward pass, so all of the
      quorum contributes and commits.
    * Async quorum, or no healing: the replicas at the quorum's max step take part. A replica
      behind it heals while the step runs and sits the step out (it counts in neither number).
    * Async quorum with ``init_sync`` at step 0: every replica is at the max step, but all but
      the primary heal to the primary's initial state during the step. Their gradients were
      computed on state that the heal replaces, so only the primary contributes; all of them
      end the step with the same state, so all count toward ``min_replica_size``. (Counting
      only the primary there would keep a ``min_replica_size >= 2`` job at step 0 forever.)
    * ``spares_above=k`` (``WorldSizeMode.FIXED_WITH_SPARES``): at most k replicas take part;
      ranks k and above are spares.
    """
    if not use_async_quorum and allow_heal:
        rank: Optional[int] = result.replica_rank
        contributors = commit_size = result.replica_world_size
    elif use_async_quorum and allow_heal and init_sync and result.max_step == 0:
        rank = None if result.heal else 0
        contributors, commit_size = 1, result.max_world_size
    else:
        rank = result.max_replica_rank
        contributors = commit_size = result.max_world_size
    if spares_above is not None:
        contributors = min(contributors, spares_above)
        commit_size = min(commit_size, spares_above)
        if rank is not None and rank >= spares_above:
            rank = None
    return Participation(rank=rank, contributors=contributors, commit_size=commit_size)


@dataclass(frozen=True)
class GroupRequest:
    """One local rank's Quorum request to its ManagerServer."""

    group_rank: int
    step: int
    checkpoint_metadata: str = ""
    shrink_only: bool = False
    init_sync: bool = True
    commit_failures: int = 0
    reconfigure_handle: str = ""


def merge_group_requests(
    requests: Mapping[int, GroupRequest], world_size: int
) -> Tuple[int, bool, bool, int]:
    """Folds every local rank's request into (step, shrink_only, init_sync, commit_failures).

    The ranks of a group normally agree. Where they do not, the merge is conservative:
    step = the minimum (a group with a lagging rank heals), shrink_only and init_sync = any,
    commit_failures = the maximum.

    Raises:
        ValueError: not exactly ranks 0..world_size-1.
    """
    if sorted(requests) != list(range(world_size)):
        raise ValueError(
            f"need requests from group ranks 0..{world_size - 1}, have {sorted(requests)}"
        )
    reqs = list(requests.values())
    return (
        min(r.step for r in reqs),
        any(r.shrink_only for r in reqs),
        any(r.init_sync for r in reqs),
        max(r.commit_failures for r in reqs),
    )


def subscriber_replica(subscriber: str) -> Optional[str]:
    """The replica id of a failure subscriber named ``"{replica_id}/{rank}"`` (as ft.Manager
    subscribes), whose stream's end says its process went away; None for any other name."""
    replica_id, sep, rank = subscriber.rpartition("/")
    return replica_id if sep and replica_id and rank.isdigit() else None
