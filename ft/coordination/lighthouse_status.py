"""What the lighthouse shows of itself: the status document its dashboard, the dashboard's
JSON and the Prometheus metrics (metrics.py) are made from, and the quorum-id file that keeps
quorum ids increasing across a lighthouse's restarts.

``status_document`` reads a lighthouse state's public fields; the caller holds its lock.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Optional, Set

if TYPE_CHECKING:
    from .lighthouse import _LighthouseState

__all__ = ["QuorumIdFile", "status_document"]

logger = logging.getLogger("ft.lighthouse")


class QuorumIdFile:
    """Where a lighthouse keeps its last quorum id, so that a restarted lighthouse issues
    larger ones (None: nowhere; ids then start from the clock, in microseconds)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def initial(self) -> int:
        """The first id to count from: the clock's microseconds, or the saved id if larger
        (an unreadable file is named in a warning and ignored)."""
        seed = time.time_ns() // 1000
        if self.path and os.path.exists(self.path):
            try:
                with open(self.path) as f:
                    seed = max(seed, int(f.read().strip()))
            except (OSError, ValueError) as e:
                logger.warning("ignoring unreadable quorum_id_file %s: %s", self.path, e)
        return seed

    def save(self, quorum_id: int) -> None:
        """Saves ``quorum_id`` atomically (a write that fails is named in a warning)."""
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(str(quorum_id))
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("could not persist quorum id to %s: %s", self.path, e)


def status_document(state: "_LighthouseState", now: float, wall: float) -> dict:
    """The status of ``state`` at monotonic time ``now`` (wall clock ``wall``)."""
    timeout = state.opts.heartbeat_timeout_s

    def age(rid: str) -> Optional[float]:
        t = state.heartbeats.get(rid)
        return None if t is None else round(now - t, 3)

    def alive(rid: str) -> bool:
        a = age(rid)
        return a is not None and a < timeout

    quorum = None
    in_quorum: Set[str] = set()
    if state.prev is not None:
        max_step = max(m.step for m in state.prev.participants)
        in_quorum = {m.replica_id for m in state.prev.participants}
        quorum = {
            "quorum_id": state.prev.quorum_id,
            "created": state.prev.created.timestamp(),
            "age_s": round(now - state.prev_issued_mono, 3),
            "max_step": max_step,
            "members": [
                {
                    "replica_id": m.replica_id,
                    "address": m.address,
                    "store_address": m.store_address,
                    "step": m.step,
                    "world_size": m.world_size,
                    "recovering": m.step != max_step,
                    "shrink_only": m.shrink_only,
                    "commit_failures": m.commit_failures,
                    "heartbeat_age_s": age(m.replica_id),
                    "alive": alive(m.replica_id),
                }
                for m in state.prev.participants
            ],
        }
    known = sorted(set(state.heartbeats) | in_quorum)
    replicas = [
        {
            "replica_id": rid,
            "heartbeat_age_s": age(rid),
            "alive": alive(rid),
            "participating": rid in state.participants,
            "in_quorum": rid in in_quorum,
            "address": state.last_member[rid].address if rid in state.last_member else "",
            "step": state.last_member[rid].step if rid in state.last_member else None,
        }
        for rid in known
    ]
    lat = state.stats.latencies
    return {
        "now": wall,
        "quorum": quorum,
        "next_quorum": {
            "reason": state.reason,
            "participants": sorted(state.participants),
        },
        "replicas": replicas,
        "config": {
            "min_replicas": state.opts.min_replicas,
            "join_timeout_ms": int(state.opts.join_timeout_s * 1000),
            "heartbeat_timeout_ms": int(state.opts.heartbeat_timeout_s * 1000),
            "quorum_tick_ms": int(state.tick_s * 1000),
            "dead_grace_ms": int(state.dead_grace_s * 1000),
        },
        "stats": {
            "quorums_issued": state.stats.quorums_issued,
            "native_rounds": state.stats.native_rounds,
            "quorum_changes": state.stats.quorum_changes,
            "failure_notifications": state.stats.failure_notifications,
            "last_quorum_latency_s": state.stats.last_latency_s,
            "median_quorum_latency_s": statistics.median(lat) if lat else 0.0,
            "subscribers": len(state.subscribers),
        },
    }
