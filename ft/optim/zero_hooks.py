"""DDP comm hooks that run :class:`ft.optim.ZeroRedundancyOptimizer`'s step inside backward.

::

    model = torch.nn.parallel.DistributedDataParallel(module)        # any backend: "ft", gloo
    zero = ft.optim.ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam,
                                            overlap_with_ddp=True, lr=1e-3)
    model.register_comm_hook(None, hook_with_zero_step(allreduce_hook, model, zero))
    for batch in data:
        zero.zero_grad()
        loss_fn(model(batch), target).backward()   # parameters are updated when this returns

Contract (torch's ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``, same names
and signatures):
    * ``hook_with_zero_step(hook, ddp, zero, shard_buckets=False)`` and
      ``hook_with_zero_step_interleaved(...)`` wrap ``hook`` (the gradient reduction, e.g.
      torch's ``allreduce_hook``; it must leave the averaged gradients in ``bucket.buffer()``
      or return them as one flat tensor) and return the hook to register on ``ddp``.
    * ``zero`` must be built with ``overlap_with_ddp=True`` (``ValueError`` otherwise) over
      the same ranks as ``ddp``; register the hook before training starts.
    * The first iteration in which DDP reports rebuilt buckets records them; the shards are
      assigned at its end (each bucket wholly to one rank, or with ``shard_buckets=True`` cut
      across ranks) and the parameters are updated from the next iteration on. Iterations
      before that update nothing (with ``static_graph=False``: the first two), as in torch.
    * From then on every rank steps its share of each bucket once the bucket's reduction has
      finished and broadcasts it; every broadcast has finished when ``backward()`` returns.
      ``zero.step()`` does nothing.
    * ``hook_with_zero_step`` steps all buckets when the last one is ready (the backward
      computation runs uninterrupted); ``hook_with_zero_step_interleaved`` steps bucket ``k``
      when bucket ``k+1`` is ready (its reduction has had a bucket's worth of backward to
      finish), so updates and broadcasts overlap the rest of the backward pass.

Why ft issues every collective from the backward thread: DDP calls the hooks there, in bucket
order, on every rank. Torch's interleaved hook starts broadcasts from the reduction's completion
callback instead, whose timing differs between ranks, so the order of collectives can differ
across ranks; torch therefore refuses Gloo. ft's order (reductions, then each bucket's
broadcasts by rank, in bucket order) is the same on every rank, so Gloo is accepted too.

Not ``ft.DistributedDataParallel`` for these two: its gradient average is the Manager's allreduce across
replica groups, whose membership changes with each quorum, while this ZeRO shards over one
fixed process group; and a step applied inside backward would be applied before
``manager.should_commit()``, so a step the Manager rejects would still change parameters and
optimizer state. (DDP also takes one comm hook, and ft's DDP already registers the Manager's.)
Fault tolerance across replica groups is :class:`ft.optim.FaultTolerantZeroRedundancyOptimizer`;
its overlapped mode has its own DDP, :class:`FaultTolerantZeroDDP` below: the Manager's
allreduce per bucket, then the bucket's shards stepped into staging copies and their new
parameters exchanged during backward, applied only if ``step()``'s vote commits
(``ft/optim/zero_ft.py``, "Overlap with DDP").
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the returned
# hook's annotations and accepts only the real dist.GradBucket / Future[Tensor] objects.
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ft.ddp import DistributedDataParallel as FtDDP
from ft.optim.zero import ZeroRedundancyOptimizer
from ft.optim.zero_overlap import ZeroOverlap

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved", "FaultTolerantZeroDDP"]

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _check(hook: Any, ddp: Any, zero: Any, shard_buckets: bool) -> None:
    if not isinstance(zero, ZeroRedundancyOptimizer):
        raise TypeError(
            "zero must be an ft.optim.ZeroRedundancyOptimizer, got "
            f"{type(zero).__module__}.{type(zero).__qualname__}"
        )
    if zero.overlap is None:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with "
            "overlap_with_ddp=True to be stepped by a DDP hook"
        )
    if isinstance(ddp, FtDDP):
        raise TypeError(
            "ft.DistributedDataParallel cannot carry a ZeRO hook: it averages gradients across "
            "replica groups through the Manager (a membership that changes with each quorum, "
            "and a step that counts only after manager.should_commit()), while an overlapped "
            "ZeRO shards over one fixed process group and applies the update inside backward, "
            "before the commit vote. Use torch.nn.parallel.DistributedDataParallel over your "
            "process group (the 'ft' backend works), or, across replica groups, "
            "ft.optim.FaultTolerantZeroRedundancyOptimizer(overlap_with_ddp=True) with "
            "ft.optim.FaultTolerantZeroDDP."
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            "ddp must be a torch.nn.parallel.DistributedDataParallel, got "
            f"{type(ddp).__module__}.{type(ddp).__qualname__}"
        )
    if not callable(hook):
        raise TypeError(f"hook must be a DDP comm hook (state, bucket) -> Future, got {hook!r}")
    ddp_size = dist.get_world_size(ddp.process_group)
    if ddp_size != zero.world_size:
        raise ValueError(
            f"DDP reduces over {ddp_size} rank(s) but the ZeroRedundancyOptimizer shards over "
            f"{zero.world_size}: both must use the same ranks"
        )
    zero.overlap.use_shard_buckets(bool(shard_buckets))


def hook_with_zero_step(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: "ZeroRedundancyOptimizer",
    shard_buckets: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """``hook`` plus ``zero``'s step: when DDP's last bucket is ready, each rank steps its
    share of every bucket in order (waiting for that bucket's reduction) and starts its
    broadcasts; all broadcasts are waited for before the hook returns.

    Overlaps the optimizer's computation and broadcasts with the reductions still in flight;
    preferable when communication is slow relative to computation. See the module docstring.
    """

    def step_after_last(overlap: ZeroOverlap, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            for index in range(bucket.index() + 1):
                overlap.step_bucket(index)
            overlap.finish_iteration()

    return _hook_stepping(hook, ddp, zero, shard_buckets, step_after_last)


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: "ZeroRedundancyOptimizer",
    shard_buckets: bool = False,
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """``hook`` plus ``zero``'s step, interleaved with backward: when bucket ``k`` is ready,
    each rank steps its share of bucket ``k-1`` and starts that bucket's broadcasts; the last
    bucket is stepped right away, then all broadcasts are waited for.

    Overlaps the optimizer with the backward computation as well; preferable when
    communication is fast relative to computation. See the module docstring.
    """

    def step_previous(overlap: ZeroOverlap, bucket: dist.GradBucket) -> None:
        index = bucket.index()
        if index > 0:
            overlap.step_bucket(index - 1)
        if bucket.is_last():
            overlap.step_bucket(index)
            overlap.finish_iteration()

    return _hook_stepping(hook, ddp, zero, shard_buckets, step_previous)


def _hook_stepping(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: "ZeroRedundancyOptimizer",
    shard_buckets: bool,
    step: Callable[[ZeroOverlap, dist.GradBucket], None],
) -> Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]:
    """``hook``, then ``step(overlap, bucket)`` once ``zero``'s overlap has recorded the
    bucket's reduction (a bucket it does not take, as on a warm-up iteration, only ``hook``)."""
    _check(hook, ddp, zero, shard_buckets)
    ddp_ref = weakref.ref(ddp)  # ddp holds the hook: a strong reference would be a cycle
    overlap = zero.overlap

    def hook_with_zero_fn(
        state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        if overlap.prepare(ddp_ref(), bucket):
            overlap.record(bucket, fut)
            step(overlap, bucket)
        return fut

    return hook_with_zero_fn


class FaultTolerantZeroDDP(FtDDP):
    """``ft.DistributedDataParallel(manager, module, **kwargs)`` that also runs ``zero``'s
    overlapped fault-tolerant step (``ft/optim/zero_ft.py``, "Overlap with DDP").

    Each bucket is reduced by the Manager's allreduce, as in ``ft.DistributedDataParallel``;
    then ``zero`` (a :class:`ft.optim.FaultTolerantZeroRedundancyOptimizer` built with
    ``overlap_with_ddp=True`` over this module's parameters and the same Manager) steps the
    shards of bucket ``k`` into staging when bucket ``k+1`` is ready (``interleaved=True``: the
    optimizer's work overlaps the rest of the backward computation) or every bucket when the
    last one is ready (``interleaved=False``: the backward computation runs uninterrupted, the
    optimizer overlaps the reductions still in flight), and starts the bucket's parameter
    exchange. ``zero.step()`` after ``backward()`` casts the vote and applies the staging.
    """

    def __init__(
        self,
        manager: Any,
        module: torch.nn.Module,
        zero: Any,
        interleaved: bool = True,
        **kwargs: Any,
    ) -> None:
        from ft.optim.zero_ft import FaultTolerantZeroRedundancyOptimizer

        if not isinstance(zero, FaultTolerantZeroRedundancyOptimizer):
            raise TypeError(
                "zero must be an ft.optim.FaultTolerantZeroRedundancyOptimizer, got "
                f"{type(zero).__module__}.{type(zero).__qualname__}"
            )
        if zero.manager is not manager:
            raise ValueError("zero must use the same Manager as the DDP")
        if zero.overlap is None:
            raise ValueError(
                "FaultTolerantZeroRedundancyOptimizer must be constructed with "
                "overlap_with_ddp=True to be stepped by FaultTolerantZeroDDP"
            )
        zero.overlap.attach(self)
        super().__init__(manager, module, **kwargs)
        self._ft_zero = zero
        self._ft_interleaved = bool(interleaved)

    # Overrides ft's DDP hook (registered by its constructor as ``self._comm_hook``): DDP
    # takes one comm hook, and this one is the Manager's allreduce plus the staging.
    def _comm_hook(  # type: ignore[override]
        self, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:
        # The overridden hook itself: ft.ddp registers only its own ``_comm_hook``.
        fut = FtDDP._comm_hook(state, bucket)
        self._ft_zero.overlap.bucket_ready(bucket, fut, self._ft_interleaved)
        return fut
