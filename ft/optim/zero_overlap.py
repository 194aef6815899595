"""ZeRO overlapped with DDP: the state of ``ZeroRedundancyOptimizer(overlap_with_ddp=True)``.

:class:`ZeroOverlap` is what the hooks of :mod:`ft.optim.zero_hooks` call, on the backward
(autograd) thread and in bucket order, so every rank issues the same collectives in the same
order. See :mod:`ft.optim.zero`, "Overlap with DDP", for the behaviour.
"""

from __future__ import annotations

import copy
import enum
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ft.optim.functional import FunctionalOptimizer
from ft.optim.partition import Partition
from ft.optim.zero_local import (
    accepts_empty_flag,
    class_name,
    functional_hyper,
    hyper,
    hyper_to_functional,
)

__all__ = [
    "OverlapStatus",
    "Assignment",
    "OverlapInfo",
    "assign_buckets",
    "bucket_gradients",
    "ZeroOverlap",
]

logger = logging.getLogger(__name__)


class OverlapStatus(enum.IntEnum):
    """Where an overlapped ZeRO stands (torch's names): waiting for DDP to fix its buckets,
    recording them, or stepping."""

    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


@dataclass
class Assignment:
    """The parameters ``params`` of DDP bucket ``bucket_index`` (its positions
    ``offset .. offset+len(params)-1``) that ``rank`` steps and broadcasts. After
    initialization every rank holds ``flat``: the parameters are views into it, so one
    broadcast of ``flat`` from ``rank`` updates them everywhere."""

    bucket_index: int
    rank: int
    offset: int
    params: List[torch.Tensor]
    flat: Optional[torch.Tensor] = None


@dataclass
class OverlapInfo:
    """``zero.overlap.info`` (attribute names as those of torch's ``zero._overlap_info``,
    contents ft's own).

    Fixed once initialized: ``params_per_bucket`` (DDP's buckets, in reduction order),
    ``assignments[b]`` (the :class:`Assignment` s of bucket ``b``, by rank),
    ``assigned_ranks_per_bucket``, ``params_per_rank`` (each rank's local optimizer order:
    bucket order), ``offsets`` (bucket index -> position of that bucket's first parameter in
    this rank's local optimizer; only buckets this rank steps), ``num_bucket_assignments``,
    ``total_size``. Per iteration: the buckets and hook futures waiting for their step, and
    the broadcast handles.
    """

    world_size: int
    status: OverlapStatus = OverlapStatus.UNINITIALIZED
    shard_buckets: bool = False
    params_per_bucket: List[List[torch.Tensor]] = field(default_factory=list)
    assignments: List[List[Assignment]] = field(default_factory=list)
    assigned_ranks_per_bucket: List[set] = field(default_factory=list)
    params_per_rank: List[List[torch.Tensor]] = field(default_factory=list)
    offsets: Dict[int, int] = field(default_factory=dict)
    num_bucket_assignments: int = 0
    total_size: Optional[int] = None
    # Per iteration.
    bucket_index_to_bucket: Dict[int, Any] = field(default_factory=dict)
    bucket_index_to_future: Dict[int, Any] = field(default_factory=dict)
    bucket_indices_seen: List[int] = field(default_factory=list)
    broadcast_handles: List[Any] = field(default_factory=list)

    def clear_per_iter_info(self) -> None:
        self.bucket_index_to_bucket.clear()
        self.bucket_index_to_future.clear()
        self.bucket_indices_seen.clear()
        self.broadcast_handles.clear()


def assign_buckets(
    numels_per_bucket: List[List[int]], world_size: int, shard_buckets: bool
) -> List[List[Tuple[int, int, int]]]:
    """``out[b]``: the ``(rank, offset, length)`` pieces of bucket ``b``, by rank.

    Whole buckets (``shard_buckets=False``): in bucket order, each bucket to the rank with
    the fewest elements so far (lowest rank on ties: round robin for equal buckets, and a
    small first bucket does not unbalance the rest). Sharded: the buckets, concatenated in
    order, are cut at parameter boundaries into one contiguous range per rank; a parameter
    belongs to the rank whose ``[r, r+1) * total / world_size`` range holds its midpoint, so
    every rank is within one parameter of ``total / world_size``.
    """
    out: List[List[Tuple[int, int, int]]] = []
    if not shard_buckets:
        loads = [0] * world_size
        for numels in numels_per_bucket:
            r = min(range(world_size), key=lambda k: (loads[k], k))
            loads[r] += sum(numels)
            out.append([(r, 0, len(numels))])
        return out
    total = sum(sum(n) for n in numels_per_bucket)
    start = 0
    for numels in numels_per_bucket:
        pieces: List[Tuple[int, int, int]] = []
        for i, n in enumerate(numels):
            mid2 = 2 * start + n  # twice the midpoint: integer arithmetic, no rounding
            r = min(world_size - 1, (mid2 * world_size) // (2 * total)) if total else 0
            if pieces and pieces[-1][0] == r:
                pieces[-1] = (r, pieces[-1][1], pieces[-1][2] + 1)
            else:
                pieces.append((r, i, 1))
            start += n
        out.append(pieces)
    return out


def bucket_gradients(bucket: Any, result: Any) -> List[torch.Tensor]:
    """The reduced gradients of ``bucket``'s parameters, from the hook future's value.

    A hook may reduce in place (``bucket.buffer()``, torch's allreduce hook) or return a new
    flat tensor (DDP copies that back only after the backward pass): read the result.
    """
    if isinstance(result, (list, tuple)):
        result = result[0]
    grads = bucket.gradients()
    buf = bucket.buffer()
    if result is None or (result.data_ptr() == buf.data_ptr() and result.numel() == buf.numel()):
        return grads
    base = buf.storage_offset()
    return [result.narrow(0, g.storage_offset() - base, g.numel()).view_as(g) for g in grads]


class ZeroOverlap:
    """The overlapped step of one ``ZeroRedundancyOptimizer(overlap_with_ddp=True)``.

    Owns everything that exists only with overlap: the bucket assignment (``info``), the
    partition derived from it (``partition``), the local functional optimizer
    (``optimizer``), and the per-iteration bookkeeping of the DDP hooks. The ZeRO optimizer
    owns the exposed ``param_groups`` (whose single group this reads for hyperparameters) and
    is told through ``on_iteration_done`` when the hooks have stepped. Kept apart so that the
    hooks drive the overlapped step through this public interface, in this order per bucket:
    ``prepare`` (False: nothing to step this iteration), ``record``, then ``step_bucket`` for
    every bucket in order and ``finish_iteration`` after the last.
    """

    def __init__(
        self,
        param_groups: List[Dict[str, Any]],
        rank: int,
        world_size: int,
        process_group: Any,
        optimizer_class: Any,
        constructor: Any,
        defaults: Dict[str, Any],
        on_iteration_done: Callable[[], None],
    ) -> None:
        if len(param_groups) != 1:
            raise ValueError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                f"group (its functional optimizer has one); got {len(param_groups)}"
            )
        self.group = param_groups[0]
        self.params: List[torch.Tensor] = self.group["params"]
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.constructor = constructor
        self.defaults = defaults
        self.on_iteration_done = on_iteration_done
        self.info = OverlapInfo(world_size)
        self.partition: Optional[Partition] = None
        self.optimizer: Any = None
        # Build the optimizers once, on no real parameter, now: bad hyperparameters fail here
        # and not inside the backward pass. Their hyperparameters fill in param_groups (for LR
        # schedulers, and so that state_dict() has the same groups as without overlap).
        if isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer):
            ref = self.params[0]
            dummy = torch.zeros(1, dtype=ref.dtype, device=ref.device)
            try:
                plain = optimizer_class([dummy], **defaults)
            except TypeError as e:
                raise TypeError(
                    f"could not build {optimizer_class.__name__} with {sorted(defaults)}: {e}"
                ) from e
            for k, v in hyper(plain.param_groups[0]).items():
                self.group.setdefault(k, v)
        if accepts_empty_flag(constructor):
            try:
                probe = constructor([], **defaults, _allow_empty_param_list=True)
            except TypeError as e:
                raise TypeError(
                    f"could not build {class_name(constructor)} with {sorted(defaults)}: {e}"
                ) from e
            for k, v in functional_hyper(probe).items():
                self.group.setdefault(k, v)
        self.trainable_mask = self._trainable_mask()

    def _trainable_mask(self) -> List[bool]:
        return [p.requires_grad for p in self.params]

    @property
    def initialized(self) -> bool:
        return self.info.status == OverlapStatus.INITIALIZED

    def check_initialized(self) -> None:
        if not self.initialized:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not initialized yet: the "
                "shards follow DDP's gradient buckets, which are assigned during the first "
                "iterations of training (see ft.optim.zero_hooks). Call this after them."
            )

    def use_shard_buckets(self, shard_buckets: bool) -> None:
        """How the buckets will be assigned (a hook's ``shard_buckets``); fixed once they are."""
        info = self.info
        if info.status != OverlapStatus.UNINITIALIZED and shard_buckets != info.shard_buckets:
            raise ValueError(
                "the buckets of this ZeroRedundancyOptimizer are already assigned with "
                f"shard_buckets={info.shard_buckets}"
            )
        info.shard_buckets = shard_buckets

    # ----------------------------------------------------------------------------- local optimizer
    # A functional optimizer: one parameter group, hyperparameters in ``defaults``, no
    # state_dict methods.

    def push_hyper(self) -> None:
        """Exposed ``param_groups`` hyperparameters -> the functional optimizer."""
        hyper_to_functional(self.group, self.optimizer)

    def local_params(self) -> List[torch.Tensor]:
        return list(self.info.params_per_rank[self.rank])

    def local_state_dict(self) -> Dict[str, Any]:
        """The functional optimizer's state as ``Optimizer.state_dict`` would give it."""
        params = self.local_params()
        state = {
            i: dict(self.optimizer.state[p])
            for i, p in enumerate(params)
            if p in self.optimizer.state
        }
        group = dict(hyper(self.group), params=list(range(len(params))))
        return {"state": state, "param_groups": [group]}

    def load_local_state(self, local: Dict[str, Any]) -> None:
        # As Optimizer.load_state_dict: copies, floating state cast to the parameter's dtype
        # and device; 'step' keeps its own (a CPU scalar unless the optimizer is fused).
        params = self.local_params()
        self.optimizer.state.clear()
        for i, st in local["state"].items():
            p = params[i]
            new = {}
            for k, v in st.items():
                if not torch.is_tensor(v):
                    new[k] = copy.deepcopy(v)
                elif k == "step":
                    fused = bool(getattr(self.optimizer, "fused", False))
                    new[k] = v.to(device=p.device, copy=True) if fused else v.clone()
                else:
                    new[k] = v.to(
                        device=p.device,
                        dtype=p.dtype if v.is_floating_point() else v.dtype,
                        copy=True,
                    )
            self.optimizer.state[p] = new

    # ----------------------------------------------------------------------------- the hooks' calls

    def prepare(self, ddp: Any, bucket: Any) -> bool:
        """Per bucket, before anything else: True when this iteration steps, False while the
        buckets are still being learned (as torch: nothing is updated then)."""
        info = self.info
        index = bucket.index()
        if info.status == OverlapStatus.INITIALIZED:
            if index == 0:
                self._begin_iteration()
            return True
        # torch's DDP keeps this flag private; it is the only sign that the buckets are final.
        if not ddp._has_rebuilt_buckets:
            # DDP reorders its buckets after the first iteration(s): nothing to learn yet.
            return False
        if info.status == OverlapStatus.UNINITIALIZED:
            if index != 0:
                return False  # registered mid-iteration: start with the next one
            info.status = OverlapStatus.DDP_HAS_REBUILT_BUCKETS
            info.params_per_bucket = []
        if index != len(info.params_per_bucket):
            raise AssertionError(
                f"DDP bucket {index} arrived out of order while recording "
                f"(expected {len(info.params_per_bucket)})"
            )
        info.params_per_bucket.append(list(bucket.parameters()))
        if bucket.is_last():
            self._initialize()
        return False

    def _initialize(self) -> None:
        """Assign the recorded buckets, flatten each assignment, build the local optimizer."""
        info = self.info
        buckets = info.params_per_bucket
        params = self.params
        index_of = {id(p): i for i, p in enumerate(params)}
        seen = set()
        for b, bp in enumerate(buckets):
            for p in bp:
                if id(p) not in index_of:
                    raise ValueError(
                        f"DDP bucket {b} holds a parameter of shape {tuple(p.shape)} that is not "
                        "a parameter of this ZeroRedundancyOptimizer: pass it the same "
                        "parameters as the DDP model (model.parameters())"
                    )
                seen.add(id(p))
        missing = [tuple(p.shape) for p in params if p.requires_grad and id(p) not in seen]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) of this ZeroRedundancyOptimizer (shapes "
                f"{missing[:4]}) are in no DDP bucket, so no hook would ever update them: pass "
                "only the DDP model's parameters"
            )
        numels = [[p.numel() for p in bp] for bp in buckets]
        if self.world_size > 1:
            # DDP syncs its rebuilt buckets from rank 0; check rather than corrupt silently.
            mine = torch.tensor(
                [len(buckets), zlib.crc32(repr(numels).encode())],
                dtype=torch.int64,
                device=params[0].device,
            )
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(everyone, mine, group=self.process_group)
            if any(not torch.equal(t, everyone[0]) for t in everyone):
                raise RuntimeError(
                    "ZeroRedundancyOptimizer overlap: ranks disagree on DDP's bucket layout "
                    f"[buckets, crc]: {[t.tolist() for t in everyone]}"
                )
        pieces = assign_buckets(numels, self.world_size, info.shard_buckets)
        info.total_size = sum(sum(n) for n in numels) if info.shard_buckets else None
        info.params_per_rank = [[] for _ in range(self.world_size)]
        info.assignments, info.assigned_ranks_per_bucket, info.offsets = [], [], {}
        for b, bp in enumerate(buckets):
            row = []
            for r, off, n in pieces[b]:
                a = Assignment(b, r, off, bp[off : off + n])
                flat = torch.empty(
                    sum(p.numel() for p in a.params),
                    dtype=a.params[0].dtype,
                    device=a.params[0].device,
                )
                o = 0
                with torch.no_grad():
                    for p in a.params:
                        flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
                        p.data = flat[o : o + p.numel()].view_as(p)
                        o += p.numel()
                a.flat = flat
                if r == self.rank:
                    info.offsets[b] = len(info.params_per_rank[r])
                info.params_per_rank[r].extend(a.params)
                row.append(a)
            info.assignments.append(row)
            info.assigned_ranks_per_bucket.append({a.rank for a in row})
        info.num_bucket_assignments = sum(len(row) for row in info.assignments)

        owner = [-1] * len(params)
        per_rank = []
        for r, ps in enumerate(info.params_per_rank):
            idx = tuple(index_of[id(p)] for p in ps)
            for i in idx:
                owner[i] = r
            per_rank.append((idx,))
        self.partition = Partition(
            world_size=self.world_size,
            per_rank=tuple(per_rank),
            owner=(tuple(owner),),
            loads=tuple(sum(p.numel() for p in ps) for ps in info.params_per_rank),
        )

        local = list(info.params_per_rank[self.rank])
        try:
            if accepts_empty_flag(self.constructor):
                self.optimizer = self.constructor(
                    local, **self.defaults, _allow_empty_param_list=True
                )
            else:
                self.optimizer = self.constructor(local, **self.defaults)
        except TypeError as e:
            raise TypeError(
                f"could not build {class_name(self.constructor)} with {sorted(self.defaults)}: {e}"
            ) from e
        if not callable(getattr(self.optimizer, "step", None)):
            raise TypeError(f"{class_name(self.constructor)} has no step(gradients)")
        self.push_hyper()
        self.trainable_mask = self._trainable_mask()
        info.status = OverlapStatus.INITIALIZED
        logger.info(
            "ZeRO overlap: rank %d steps %d parameter(s) in %d bucket(s); %d bucket(s), "
            "%d assignment(s)",
            self.rank,
            len(local),
            len(info.offsets),
            len(buckets),
            info.num_bucket_assignments,
        )

    def _begin_iteration(self) -> None:
        info = self.info
        if info.bucket_index_to_future or info.broadcast_handles:
            raise AssertionError(
                "ZeRO overlap: the previous iteration did not finish (a DDP "
                "backward pass was interrupted?)"
            )
        if self._trainable_mask() != self.trainable_mask:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True does not support changing "
                "requires_grad at run time: its shards follow DDP's gradient buckets, which "
                "were fixed with the old set of trainable parameters"
            )
        # Once per iteration, on every rank alike: an LR scheduler's changes take effect here.
        self.push_hyper()

    def record(self, bucket: Any, fut: Any) -> None:
        """Keep ``bucket`` and its reduction future until its step (owned buckets only)."""
        info = self.info
        index = bucket.index()
        seen = info.bucket_indices_seen
        if (seen[-1] + 1 if seen else 0) != index:
            raise AssertionError(f"DDP bucket {index} arrived out of order (after {seen})")
        seen.append(index)
        if index in info.offsets:
            info.bucket_index_to_bucket[index] = bucket
            info.bucket_index_to_future[index] = fut

    @torch.no_grad()
    def step_bucket(self, index: int) -> None:
        """Step this rank's share of bucket ``index`` (waits for its reduction), then start
        the broadcasts of every share of the bucket, by rank."""
        info = self.info
        if index in info.offsets:
            bucket = info.bucket_index_to_bucket.pop(index)
            fut = info.bucket_index_to_future.pop(index)
            fut.wait()
            grads = bucket_gradients(bucket, fut.value())
            mine = next(a for a in info.assignments[index] if a.rank == self.rank)
            start, n = info.offsets[index], len(mine.params)
            mine_grads = grads[mine.offset : mine.offset + n]
            if isinstance(self.optimizer, FunctionalOptimizer):
                # ft's own functional optimizers update a subset directly: O(bucket), not
                # O(all local parameters) per bucket as a list of None-padded gradients.
                self.optimizer.step_params(mine.params, mine_grads)
            else:
                # Any other functional optimizer: torch's protocol, one entry per local
                # parameter, None for "do not update".
                gradients: List[Optional[torch.Tensor]] = [None] * len(
                    self.info.params_per_rank[self.rank]
                )
                gradients[start : start + n] = mine_grads
                self.optimizer.step(gradients)
        for a in info.assignments[index]:
            info.broadcast_handles.append(
                dist.broadcast(a.flat, group=self.process_group, group_src=a.rank, async_op=True)
            )

    def finish_iteration(self) -> None:
        """Wait for every broadcast: the parameters are final when backward() returns."""
        info = self.info
        if len(info.broadcast_handles) != info.num_bucket_assignments:
            raise AssertionError(
                f"ZeRO overlap: {len(info.broadcast_handles)} broadcasts for "
                f"{info.num_bucket_assignments} bucket assignments"
            )
        for w in info.broadcast_handles:
            w.wait()
        info.clear_per_iter_info()
        self.on_iteration_done()
