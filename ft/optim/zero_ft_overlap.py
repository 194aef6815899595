"""The overlapped step of a fault-tolerant ZeRO: each DDP bucket's shards stepped into staging
during backward and their new parameters exchanged (:mod:`ft.optim.zero_ft`, "Overlap with
DDP")."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import ReduceOp

from ft.optim.zero_ft_exchange import missing_senders, refuse_incomplete_exchange
from ft.optim.zero_ft_shards import HeldShards
from ft.optim.zero_overlap import bucket_gradients
from ft.protocols import ManagerLike
from ft.utils.tensors import clone_state

__all__ = ["ExchangeBucket", "BucketOptimizers", "StagedOverlap"]


@dataclass(slots=True)
class ExchangeBucket:
    """One DDP bucket as the overlapped step sees it: which of this optimizer's parameters it
    holds (global index, position in the bucket, offset in ``xbuf``) and the exchange buffer
    (the bucket's parameters, flat, in the order of ``entries``, then one sent-mark per
    participant: see :func:`ft.optim.zero_ft_exchange.missing_senders`)."""

    index: int
    ids: Tuple[int, ...]
    entries: List[Tuple[int, int, int]]
    xbuf: Any
    participants: int

    def marks(self) -> torch.Tensor:
        return self.xbuf[self.xbuf.numel() - self.participants :]


@dataclass(slots=True)
class BucketOptimizers:
    """The staging optimizers of one bucket for one layout: the owned parameters stepped on
    views into the bucket's exchange buffer, the standby ones on scratch tensors."""

    own: List[Tuple[int, int]]  # (global index, position in the bucket)
    own_t: List[torch.Tensor]
    own_opt: Optional[torch.optim.Optimizer]
    sb: List[Tuple[int, int]]
    sb_t: List[torch.Tensor]
    sb_opt: Optional[torch.optim.Optimizer]


class StagedOverlap:
    """The staging of one ``FaultTolerantZeroRedundancyOptimizer(overlap_with_ddp=True)``.

    Owns what lives between ``zero_grad()`` and the vote: the buckets handed over by
    :class:`ft.optim.zero_hooks.FaultTolerantZeroDDP` (:meth:`bucket_ready`), the stepped
    state copies (``staged``), the exchanges in flight, and, across steps, each bucket's
    exchange buffer (``buckets``) and staging optimizers (``opts``, per layout). Never writes
    the live parameters or the held state before the vote: the optimizer's step calls
    :meth:`finish`, votes, and on a commit :meth:`apply_parameters` and takes ``staged``.
    Kept apart so that the step after backward and the overlapped step share only the held
    state (:class:`HeldShards`) and the layout the optimizer fixes in :meth:`begin`.
    """

    def __init__(self, manager: ManagerLike, shards: HeldShards, stats: Dict[str, int]) -> None:
        self.manager = manager
        self.shards = shards
        self.stats = stats
        self.ddp: Any = None  # the FaultTolerantZeroDDP that feeds this optimizer
        self.buckets: Dict[int, ExchangeBucket] = {}  # by DDP bucket index; fixed by ft's DDP
        self.opts: Dict[int, BucketOptimizers] = {}  # per bucket, for the current layout
        self.layout_key: Optional[Tuple[Any, ...]] = None
        self.owned: Set[int] = set()
        self.standby: Set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Forget the step's staging (nothing live refers to it)."""
        self.active = False  # begin() began an overlapped step
        self.exchanging = False  # its layout is fixed and the group not aborted
        self.ok = False  # ... and nothing has failed so far: it may commit
        self.pending: Dict[int, Tuple[ExchangeBucket, Any, Any]] = {}  # ready, not yet staged
        self.done: List[int] = []  # staged bucket indices, in order
        self.staged: Dict[int, Dict[str, Any]] = {}  # global index -> stepped state copy
        self.works: List[Any] = []  # the exchanges in flight
        for bo in self.opts.values():
            for opt in (bo.own_opt, bo.sb_opt):
                if opt is not None:
                    opt.state.clear()

    def forget_layout(self) -> None:
        """The shard layout changed: the staging optimizers are rebuilt for the new one."""
        self.opts = {}

    def begin(self) -> None:
        """An overlapped step begins (in ``zero_grad()``, before its layout is fixed)."""
        self.reset()
        self.active = True

    def use_layout(
        self,
        exchanging: bool,
        layout_key: Optional[Tuple[Any, ...]],
        owned: List[int],
        standby: List[int],
    ) -> None:
        """The step's shard layout; ``exchanging``: it is fixed and the group usable, so the
        step's exchanges run."""
        self.layout_key = layout_key
        self.owned, self.standby = set(owned), set(standby)
        self.exchanging = exchanging
        self.ok = self.exchanging and self.manager.errored() is None

    @property
    def has_buckets(self) -> bool:
        """Whether a bucket went through the DDP hook since :meth:`begin`."""
        return self.active and bool(self.done or self.pending)

    def attach(self, ddp: Any) -> None:
        if self.ddp is not None and self.ddp() is not None:
            raise ValueError("this optimizer is already attached to a FaultTolerantZeroDDP")
        self.ddp = weakref.ref(ddp)

    def _bucket(self, bucket: Any) -> ExchangeBucket:
        """This optimizer's view of DDP bucket ``bucket`` (built once; ft's DDP fixes its
        bucket layout at construction, and a changed layout is rebuilt)."""
        index = bucket.index()
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        participants = self.layout_key[1] if self.layout_key is not None else 0
        b = self.buckets.get(index)
        if b is not None and b.ids == ids and b.participants == participants:
            return b
        entries: List[Tuple[int, int, int]] = []
        off, dtype = 0, None
        for pos, p in enumerate(params):
            i = self.shards.index_of.get(id(p))
            if i is None:
                continue  # a module parameter this optimizer does not step
            entries.append((i, pos, off))
            off += p.numel()
            dtype = p.dtype
        xbuf = torch.zeros(
            off + participants, dtype=dtype or torch.float32, device=bucket.buffer().device
        )
        b = ExchangeBucket(index, ids, entries, xbuf, participants)
        self.buckets[index] = b
        self.opts.pop(index, None)
        return b

    def _bucket_opts(self, b: ExchangeBucket) -> BucketOptimizers:
        bo = self.opts.get(b.index)
        if bo is not None:
            return bo
        params = self.shards.params
        own = [(i, pos) for i, pos, _ in b.entries if i in self.owned]
        own_t = [
            b.xbuf[o : o + params[i].numel()].view_as(params[i])
            for i, _, o in b.entries
            if i in self.owned
        ]
        sb = [(i, pos) for i, pos, _ in b.entries if i in self.standby]
        sb_t = [torch.empty_like(params[i]) for i, _ in sb]
        bo = BucketOptimizers(
            own,
            own_t,
            self.shards.build_opt([i for i, _ in own], own_t),
            sb,
            sb_t,
            self.shards.build_opt([i for i, _ in sb], sb_t),
        )
        self.opts[b.index] = bo
        return bo

    def bucket_ready(self, bucket: Any, fut: Any, interleaved: bool = True) -> None:
        """Called by :class:`ft.optim.zero_hooks.FaultTolerantZeroDDP`'s comm hook on the
        backward thread, after it started bucket ``bucket``'s gradient allreduce (``fut``)."""
        if not self.active:
            return  # no zero_grad() began this step: step() steps after backward
        index = bucket.index()
        if index in self.pending or index in self.done:
            raise RuntimeError(
                f"DDP bucket {index} is ready twice in one step: with overlap_with_ddp=True "
                "each step runs one backward pass through the DDP (accumulate gradients "
                "under ddp.no_sync())"
            )
        self.pending[index] = (self._bucket(bucket), bucket, fut)
        if interleaved and index - 1 in self.pending:
            self._stage(index - 1)
        if bucket.is_last():
            for k in sorted(self.pending):
                self._stage(k)

    @torch.no_grad()
    def _stage(self, index: int) -> None:
        """Step the owned and standby parameters of bucket ``index`` into staging (waiting for
        its averaged gradient), then start the exchange of its owned parameters."""
        b, bucket, fut = self.pending.pop(index)
        self.done.append(index)
        fut.wait()  # the Manager's futures complete (with the tensor) even when they fail
        m = self.manager
        if not self.exchanging or m.step_aborted():
            # Aborted: the peers' exchanges fail with it; nothing to stage or send.
            self.exchanging = self.ok = False
            return
        if not b.entries:
            return  # none of this optimizer's parameters: nothing to step or exchange
        if not self.ok or m.errored() is not None:
            # The step will not commit: stage nothing, but exchange (zeros) as the other
            # groups do, which may know nothing of this error (docs/optim.md, "Errors
            # within a step").
            self.ok = False
            b.xbuf.zero_()
            self.works.append(m.allreduce(b.xbuf, reduce_op=ReduceOp.SUM))
            return
        grads = bucket_gradients(bucket, fut.value())
        bo = self._bucket_opts(b)
        params = self.shards.params
        b.xbuf.zero_()  # the slots of parameters this replica does not own stay zero
        for (i, _), t in zip(bo.own, bo.own_t):
            t.copy_(params[i].detach())
        for (i, _), t in zip(bo.sb, bo.sb_t):
            t.copy_(params[i].detach())
        for ents, ts, opt in ((bo.own, bo.own_t, bo.own_opt), (bo.sb, bo.sb_t, bo.sb_opt)):
            if opt is None:
                continue
            for (i, pos), t in zip(ents, ts):
                t.grad = grads[pos]
                st = clone_state(self.shards.held[i])
                self.staged[i] = st
                opt.state[t] = st
            self.shards.sync_hyper(opt)
            opt.step()
            for t in ts:
                t.grad = None  # the gradients are views of DDP's bucket
        rank = self.layout_key[2] if self.layout_key is not None else None
        if rank is not None:
            b.marks()[rank] = 1
        self.works.append(m.allreduce(b.xbuf, reduce_op=ReduceOp.SUM))
        self.stats["param_bytes"] += b.xbuf.numel() * b.xbuf.element_size()

    def finish(self) -> bool:
        """After backward, before the vote: stages what is left, waits for the exchanges and
        refuses an incomplete one. True when this replica's staging may commit."""
        for k in sorted(self.pending):  # buckets whose successor never came (defensive)
            self._stage(k)
        params = self.shards.params
        covered = {i for k in self.done for i, _, _ in self.buckets[k].entries}
        stray = [i for i, p in enumerate(params) if p.grad is not None and i not in covered]
        if stray:
            self.reset()
            raise ValueError(
                f"parameters {stray} of FaultTolerantZeroRedundancyOptimizer have gradients "
                "but are not in the FaultTolerantZeroDDP's buckets: with overlap_with_ddp=True "
                "the optimizer's parameters must be the DDP module's"
            )
        for w in self.works:
            w.wait()
        if self.ok:
            missing = set()
            for k in self.done:
                b = self.buckets[k]
                if b.entries:
                    missing.update(missing_senders(b.marks()))
            refuse_incomplete_exchange(self.manager, sorted(missing))
        return self.ok

    def apply_parameters(self) -> None:
        """After a committed vote: every parameter takes its exchanged value."""
        params = self.shards.params
        for k in self.done:
            b = self.buckets[k]
            for i, _, o in b.entries:
                p = params[i]
                p.detach().copy_(b.xbuf[o : o + p.numel()].view_as(p))
