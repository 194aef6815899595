"""How a ZeRO step distributes the updated parameters: each rank's shard broadcast from its
owner, planned identically on every rank."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["BroadcastPlan", "PACK_BYTES"]

# Without parameters_as_bucket_view, parameters smaller than this are packed into one flat
# buffer per owner for the broadcast; larger ones are broadcast in place.
PACK_BYTES = 256 * 1024


class BroadcastPlan:
    """What is broadcast from whom, and the buffers it goes through, for one
    ``ZeroRedundancyOptimizer`` without overlap.

    Owns the per-owner plan and, with ``parameters_as_bucket_view``, the flat buffers the
    parameters are views into. The ZeRO optimizer decides who owns what and rebuilds the plan
    (:meth:`rebuild`) whenever the owned trainable parameters change; :meth:`broadcast` is
    the collective of every step. Kept apart from the partition so that the packing rules
    (small parameters packed per owner, large ones in place, or one bucket per owner) live in
    one place.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, bucket_view: bool) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.bucket_view = bucket_view
        self.plan: List[Any] = []
        self.buckets: List[Optional[torch.Tensor]] = []

    def rebuild(self, owned_trainable: List[List[torch.Tensor]], all_params: List[Any]) -> None:
        """Decide, identically on every rank, what is broadcast from whom and how
        (``owned_trainable[r]``: the trainable parameters rank ``r`` owns, in order)."""
        self.plan = []
        if self.bucket_view:
            self._build_buckets(owned_trainable, all_params)
            return
        for r in range(self.world_size):
            small, large = [], []
            for p in owned_trainable[r]:
                if p.numel() * p.element_size() < PACK_BYTES or not p.data.is_contiguous():
                    small.append(p)
                else:
                    large.append(p)
            flat = None
            if small:
                flat = torch.empty(
                    sum(p.numel() for p in small), dtype=small[0].dtype, device=self.device
                )
            self.plan.append({"small": small, "large": large, "flat": flat})

    def _build_buckets(
        self, owned_trainable: List[List[torch.Tensor]], all_params: List[Any]
    ) -> None:
        old_members = {id(p) for plan in self.plan for p in plan.get("params", [])}
        self.plan = []
        self.buckets = []
        owned_all = set()
        for r in range(self.world_size):
            params = owned_trainable[r]
            owned_all.update(id(p) for p in params)
            if not params:
                self.buckets.append(None)
                self.plan.append({"params": []})
                continue
            bucket = torch.empty(
                sum(p.numel() for p in params), dtype=params[0].dtype, device=self.device
            )
            off = 0
            for p in params:
                n = p.numel()
                bucket[off : off + n].copy_(p.data.reshape(-1))
                p.data = bucket[off : off + n].view_as(p)
                off += n
            self.buckets.append(bucket)
            self.plan.append({"params": params})
        # Parameters that left the buckets (now frozen) get storage of their own again.
        for p in all_params:
            if id(p) in old_members and id(p) not in owned_all:
                p.data = p.data.detach().clone()

    def broadcast(self, group: Any) -> None:
        """Broadcast every shard from its owner (collective); all are issued before the first
        wait."""
        works: List[Tuple[int, Any]] = []
        if self.bucket_view:
            for r, bucket in enumerate(self.buckets):
                if bucket is not None:
                    works.append(
                        (r, dist.broadcast(bucket, group=group, group_src=r, async_op=True))
                    )
            for _, w in works:
                w.wait()
            return
        mine = self.plan[self.rank]
        if mine["flat"] is not None:
            torch.cat([p.detach().reshape(-1) for p in mine["small"]], out=mine["flat"])
        pending: List[Tuple[int, List[Any]]] = []
        for r, plan in enumerate(self.plan):
            ws = []
            if plan["flat"] is not None:
                ws.append(dist.broadcast(plan["flat"], group=group, group_src=r, async_op=True))
            for p in plan["large"]:
                ws.append(dist.broadcast(p.data, group=group, group_src=r, async_op=True))
            pending.append((r, ws))
        for r, ws in pending:
            for w in ws:
                w.wait()
            plan = self.plan[r]
            if r != self.rank and plan["flat"] is not None:
                off = 0
                flat = plan["flat"]
                with torch.no_grad():
                    for p in plan["small"]:
                        n = p.numel()
                        p.data.copy_(flat[off : off + n].view_as(p))
                        off += n
