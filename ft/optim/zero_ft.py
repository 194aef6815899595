"""Fault-tolerant ZeRO-1 across replica groups, through an :class:`ft.Manager` (docs/design.md,
"ZeRO and its fault-tolerant mode").

::

    manager = ft.Manager(pg, None, None, min_replica_size=1, ...)
    model = ft.DistributedDataParallel(manager, module)       # gradients averaged by the Manager
    opt = FaultTolerantZeroRedundancyOptimizer(manager, module.parameters(), torch.optim.Adam,
                                               lr=1e-3)
    manager.register_state_dict_fn("model", module.load_state_dict, module.state_dict)
    for batch in data:
        opt.zero_grad()          # manager.start_quorum()
        loss(model(batch)).backward()
        opt.step()               # see "One step" below

The constructor registers the optimizer's state with the Manager under ``state_key``
(default ``"zero_ft"``); the model is registered by the user, as with ``ft.Optimizer``.

Sharding
    The optimizer state is sharded across the *participating replicas* of the step (the
    Manager's replica dimension). The owner table is
    ``partition_params(numels, manager.num_participants())`` (:mod:`ft.optim.partition`, the
    same sorted-greedy rule as :class:`ft.optim.ZeroRedundancyOptimizer`) and this replica's
    index is ``manager.participating_rank()``: both are the same on every replica, so every
    replica computes the same table. It is recomputed whenever the quorum changes (new quorum
    id, participant count or rank). A replica that does not participate in a step (a
    replica healing in async mode, a spare) owns nothing in that step.

Buddy copy (shadow stepping), staleness bound 0 steps, 0 extra bytes per step
    Participant ``r`` also keeps a standby copy of the shard of participant ``r-1`` (its
    buddy is ``buddy_rank(r-1, N) = r``). All replicas hold the same averaged gradients and
    the same parameters before the step, so the buddy brings its standby copy forward by
    running the same optimizer over the same parameter list (same order, same hyperparameters)
    itself. No optimizer state crosses the wire per step, and the standby copy is never behind
    the owner's: after a committed step, owner and buddy both hold the state of that step.
    Memory: own shard + standby shard, about 2/N of the full state (N=2: everything; N=1: no
    buddy). Requires: every replica computes bitwise the same kernels on the same inputs
    (homogeneous hardware); the parameters themselves are always distributed from the owner.

One step (``step()``, stepping after backward; for overlap see below)
    1. If the quorum changed: re-partition and migrate state (below).
    2. Step *copies* of the owned shard's state and parameters (transient: +1/N of the state);
       the originals are kept aside, untouched.
    3. Step the owned shard; pack the owned parameters' new values into one flat buffer per
       dtype (zeros elsewhere) and ``manager.allreduce(..., SUM)`` it: every replica receives
       every updated parameter. All communication of the step happens *before the vote*.
       The exchange also carries one mark per participant, set by a participant that sent
       stepped shards: a group with an error that left the process group usable still
       exchanges (zeros, its mark unset), so no peer waits for it, and a group that finds a
       mark unset votes no (docs/optim.md, "Errors within a step").
    4. ``manager.should_commit()``.
       - True: step the standby shard locally (no communication), copy the received
         parameters into every parameter, drop state this replica no longer needs.
       - False: put the originals back; the standby shard was never stepped. Every shard's state
         and every parameter are exactly as before the step.

Quorum change: migration
    Every held shard entry carries a version (the committed step it is current for). On a new
    quorum, the replicas allreduce a ``[N, P]`` table of versions (8 bytes per parameter tensor
    per replica). For each parameter, the holders are the replicas with the newest version,
    which must equal the current step (else the state is lost, e.g. two adjacent replicas died
    at once: ``RuntimeError``). Each of the new owner and new buddy that lacks it receives it
    from the lowest-ranked holder, in one more allreduce of the moved state's bytes. If that
    fails the step does not commit and the migration is retried on the next quorum.

Healing
    The registered state (held entries + versions) is sent to a healing replica with the
    Manager's checkpoint. In sync-quorum mode it participates in the same step, so its loaded
    entries count as holders; whatever else its new shard needs comes from the migration.

Limitations: per-parameter optimizer state must be tensors (Adam, AdamW, SGD with momentum,
...); no ``closure``; the periodic owner/buddy checksum cross-check of the design is not
implemented.

Overlap with DDP (``overlap_with_ddp=True``)
    ::

        manager = ft.Manager(..., use_async_quorum=False)
        opt = FaultTolerantZeroRedundancyOptimizer(manager, module.parameters(),
                                                   torch.optim.Adam, overlap_with_ddp=True,
                                                   lr=1e-3)
        model = ft.optim.FaultTolerantZeroDDP(manager, module, opt)  # instead of ft's DDP
        for batch in data:
            opt.zero_grad()      # quorum, heal, and the step's shard layout (+ migration)
            loss(model(batch)).backward()   # shards stepped into staging, params exchanged
            opt.step()           # the vote; staging -> live only if it commits

    :class:`ft.optim.zero_hooks.FaultTolerantZeroDDP` is ``ft.DistributedDataParallel`` whose
    comm hook, after starting the Manager's allreduce of a bucket, hands the bucket to this
    optimizer. The step stays a transaction; what moves into the backward pass is everything
    that does not depend on the vote:

    - ``zero_grad()``: the quorum (sync: it returns with the participants known and any heal
      applied) and the layout of the step, migration included, are settled before forward,
      so the shards of every bucket are fixed before the first one is ready;
    - when bucket ``k+1`` is ready (``interleaved=True``; otherwise all buckets when the last
      is ready), bucket ``k``'s averaged gradient is waited for and the owned and standby
      parameters of the bucket are stepped into STAGED copies: copies of their state
      (``clone``), and for the parameters a per-bucket exchange buffer (owned: the stepped
      values; everything else zero) and scratch tensors (standby: its parameter results are
      not needed, every replica receives the owner's). Then the bucket's exchange buffer is
      SUM-allreduced, as the step-after-backward mode does for the whole model. Every replica
      issues these collectives from the backward thread in bucket order, so their order
      (gradient ``k+1``, exchange ``k``, ...) is the same everywhere;
    - ``step()``: waits for the exchanges, then ``manager.should_commit()``. Yes: every
      parameter takes its received value, the staged state replaces the held state (a swap of
      references) and versions advance. No: the staging is dropped; parameters, held state
      and versions were never touched, so nothing changed (the same guarantee as above).

    The live parameters and held state are never written before the vote, so a checkpoint
    served to a healing replica during the step is never half updated. Given the same
    averaged gradients the result is bitwise that of the step after backward on CPU (the same
    per-parameter kernels; with foreach/fused CUDA kernels the grouping differs per bucket).
    The gradients themselves can differ in the last bit with 3 or more replicas, because
    FaultTolerantZeroDDP's buckets are in another order than ft.DistributedDataParallel's
    and a ring allreduce's summation order depends on an element's position.

    Memory, beyond the held 2/N of the state: staged copies of the own and standby shards'
    state during the step (+2/N of the state, against +1/N when stepping after backward,
    where the buddy steps after the vote instead), one exchange buffer per bucket (a full
    copy of the parameters, persistent; the step-after-backward mode allocates the same per
    step), and scratch for the standby parameters (1/N of the parameters, persistent).

    Requires ``use_async_quorum=False`` (``ValueError`` otherwise): the layout must be fixed,
    and state migrated to new owners and buddies, before the first bucket is stepped. With
    an async quorum the participants are known only inside the first bucket's allreduce and
    a heal is applied at ``should_commit()``, after backward: the migration would then run as
    blocking collectives inside backward, ahead of every bucket, and a healed state would
    arrive after the shards were stepped. Not possible with overlap (as with torch's): code
    between ``backward()`` and ``step()`` that changes gradients (clipping, unscaling), and
    more than one backward pass through the DDP per step (use ``no_sync()`` to accumulate).
    The optimizer's parameters must be the DDP module's (``ValueError`` at ``step()``
    otherwise).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import ReduceOp

from ft.optim.partition import Partition, buddy_rank, partition_params
from ft.optim.zero_ft_exchange import missing_senders, refuse_incomplete_exchange
from ft.optim.zero_ft_overlap import StagedOverlap
from ft.optim.zero_ft_shards import HeldShards
from ft.optim.zero_local import check_optimizer_class
from ft.protocols import ManagerLike
from ft.utils.tensors import clone_state

__all__ = ["FaultTolerantZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class FaultTolerantZeroRedundancyOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over the replicas of a Manager, with a buddy copy of every shard.

    Args:
        manager: the :class:`ft.Manager` of this replica group.
        params: parameters or parameter groups (the same on every replica).
        optimizer_class: a ``torch.optim.Optimizer`` subclass whose per-parameter state is
            tensors (e.g. ``torch.optim.Adam``).
        state_key: key under which the state is registered with the Manager for healing.
        overlap_with_ddp: step the shards during backward, through
            :class:`ft.optim.zero_hooks.FaultTolerantZeroDDP` (module docstring, "Overlap with
            DDP"); needs a Manager with ``use_async_quorum=False``.
        **defaults: hyperparameters for ``optimizer_class``.
    """

    def __init__(
        self,
        manager: ManagerLike,
        params: Any,
        optimizer_class: Any,
        state_key: str = "zero_ft",
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        check_optimizer_class(optimizer_class)
        if overlap_with_ddp and manager.use_async_quorum:
            raise ValueError(
                "FaultTolerantZeroRedundancyOptimizer(overlap_with_ddp=True) requires a Manager "
                "with use_async_quorum=False: the shards of a step (and any state migrated to "
                "new owners) must be fixed before backward steps the first bucket. With an "
                "async quorum the participants are known only inside the first gradient "
                "allreduce, and a heal is applied at should_commit(), after backward would "
                "have stepped the shards"
            )
        full = optimizer_class(params, **defaults)  # no state until a step
        super().__init__(full.param_groups, full.defaults)
        self.manager = manager
        self.stats = {"migrated_bytes": 0, "param_bytes": 0, "steps": 0}
        self._shards = HeldShards(self, optimizer_class, manager.current_step(), self.stats)
        self._layout_key: Optional[Tuple[Any, ...]] = None
        self._partition: Optional[Partition] = None
        self._owned: List[int] = []
        self._standby: List[int] = []
        self._own_opt: Optional[torch.optim.Optimizer] = None
        self._standby_opt: Optional[torch.optim.Optimizer] = None
        # The overlapped step's staging (None without overlap_with_ddp), which
        # ft.optim.zero_hooks.FaultTolerantZeroDDP feeds bucket by bucket.
        self.overlap: Optional[StagedOverlap] = (
            StagedOverlap(manager, self._shards, self.stats) if overlap_with_ddp else None
        )
        manager.register_state_dict_fn(state_key, self._load_shards, self._shards.save)

    # ------------------------------------------------------------------ state exposure
    @property
    def state(self):  # type: ignore[override]
        """The owned shard's state, keyed by parameter."""
        shards = self._shards
        return {shards.params[i]: shards.held[i] for i in self._owned if i in shards.held}

    @state.setter
    def state(self, value: Any) -> None:  # set by Optimizer.__init__; ignored
        pass

    @property
    def owned_indices(self) -> List[int]:
        return list(self._owned)

    @property
    def standby_indices(self) -> List[int]:
        return list(self._standby)

    def shard_state(self, which: str = "owned") -> Dict[int, Dict[str, Any]]:
        """Copies of the held entries, by global parameter index: ``owned``, ``standby``, ``all``."""
        held = self._shards.held
        idx = {"owned": self._owned, "standby": self._standby, "all": sorted(held)}[which]
        return {i: clone_state(held[i]) for i in idx}

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this replica holds (own + standby shards)."""
        return self._shards.state_bytes()

    def _load_shards(self, sd: Dict[str, Any]) -> None:
        self._shards.load(sd)
        self._layout_key = None  # rebuild local optimizers over the new dicts

    # ------------------------------------------------------------------ layout
    def _bind_held(self) -> None:
        """Point the local optimizers at the held state dicts (after the overlapped step
        replaced them with the staged ones)."""
        self._shards.bind(self._own_opt, self._owned)
        self._shards.bind(self._standby_opt, self._standby)

    def _retire_unheld(self, step: int) -> None:
        """After a committed step: the owned and standby entries are current for ``step``;
        every other held entry (a shard this replica no longer owns or backs up) is dropped."""
        self._shards.retire_unheld(set(self._owned) | set(self._standby), step)

    def _ensure_layout(self) -> bool:
        m = self.manager
        n = m.num_participants()
        rank = m.participating_rank() if m.is_participating() else None
        quorum_id = getattr(m, "quorum_id", None)  # stand-in managers in tests may lack it
        key = (quorum_id() if callable(quorum_id) else None, n, rank)
        if key == self._layout_key:
            return True
        P = len(self._shards.params)
        numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
        part = partition_params(numels, max(n, 1))
        flat_owner: List[int] = [o for g in part.owner for o in g]
        # global index order = group order, then position in group
        targets: Dict[int, Set[int]] = {}
        for i in range(P):
            o = flat_owner[i]
            targets[i] = {o, buddy_rank(o, n)} if n > 1 else {o}
        if not self._shards.migrate(m, n, rank, targets):
            return False
        if rank is None:
            self._owned, self._standby = [], []
        else:
            index_of = self._shards.index_of
            gidx = [[index_of[id(p)] for p in g["params"]] for g in self.param_groups]
            self._owned = [gidx[g][j] for g, j in part.owned(rank)]
            prev = (rank - 1) % n
            self._standby = [gidx[g][j] for g, j in part.owned(prev)] if n > 1 else []
        self._partition = part
        self._own_opt = self._shards.build_opt(self._owned)
        self._standby_opt = self._shards.build_opt(self._standby)
        if self.overlap is not None:
            self.overlap.forget_layout()
        self._layout_key = key
        logger.info(
            "zero_ft layout: participants=%d rank=%s owned=%d standby=%d",
            n,
            rank,
            len(self._owned),
            len(self._standby),
        )
        return True

    # ------------------------------------------------------------------ step
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the quorum for the step (``manager.start_quorum()``), then zeroes gradients.
        With ``overlap_with_ddp``, also fixes the step's shard layout (migrating state on a
        quorum change), before forward."""
        self.manager.start_quorum()
        super().zero_grad(set_to_none)
        if self.overlap is not None:
            self.overlap.begin()
            self.overlap.use_layout(
                self._layout_for_step(), self._layout_key, self._owned, self._standby
            )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("FaultTolerantZeroRedundancyOptimizer does not support closures")
        if self.overlap is not None and self.overlap.has_buckets:
            self._overlap_step()
        else:
            # No bucket went through the DDP hook this step (no FaultTolerantZeroDDP, or no
            # backward through it): the step after backward gives the same result.
            if self.overlap is not None:
                self.overlap.reset()
            self._plain_step()
        return None

    def _layout_for_step(self) -> bool:
        """Fixes the step's shard layout (migrating state on a quorum change); False when the
        step's exchange must not run: the group was aborted (its peers' collectives fail
        with it), or fixing the layout failed, which aborts it."""
        m = self.manager
        if m.step_aborted():
            return False
        try:
            ok = self._ensure_layout()
        except RuntimeError:
            raise
        except Exception as e:  # noqa: BLE001 - reported: the step will not commit
            # This replica skips the step's collectives: abort the group so that its peers
            # fail at once instead of waiting out the timeout.
            m.abort_step(e)
            return False
        return ok and not m.step_aborted()

    def _plain_step(self) -> None:
        """The step after backward (module docstring, "One step")."""
        m = self.manager
        params, held = self._shards.params, self._shards.held
        snapshot: Optional[Tuple[Dict[int, Dict[str, Any]], List[torch.Tensor]]] = None  # originals
        flats: Dict[torch.dtype, torch.Tensor] = {}
        offsets: List[Tuple[int, torch.dtype, int]] = []
        if self._layout_for_step():
            # After an error that did not abort the group (report_error: a NaN loss seen by
            # this group only) the step will not commit, but the exchange still runs, with
            # nothing stepped: the other groups issue it too (docs/optim.md, "Errors within
            # a step").
            stepping = m.errored() is None
            _, participants, rank = self._layout_key  # type: ignore[misc]
            if stepping:
                # Step copies of the owned state and parameters: the originals stay untouched
                # (a checkpoint being served to a healing replica may still reference them)
                # and are put back if the step does not commit.
                old_states = {i: held[i] for i in self._owned}
                old_data = [params[i].data for i in self._owned]
                for i in self._owned:
                    p = params[i]
                    new = clone_state(held[i])
                    held[i] = new
                    if self._own_opt is not None:
                        self._own_opt.state[p] = new
                    p.data = p.data.clone()
                snapshot = (old_states, old_data)
                if self._own_opt is not None:
                    self._shards.sync_hyper(self._own_opt)
                    self._own_opt.step()
            sizes: Dict[torch.dtype, int] = {}
            for i, p in enumerate(params):
                offsets.append((i, p.dtype, sizes.get(p.dtype, 0)))
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
            # The participants' sent-marks follow the first dtype's parameters.
            marks_dt = next(iter(sizes), torch.float32)
            sizes[marks_dt] = sizes.get(marks_dt, 0) + participants
            flats = {dt: torch.zeros(s, dtype=dt) for dt, s in sizes.items()}
            owned = set(self._owned) if stepping else set()
            for i, dt, o in offsets:
                if i in owned:
                    p = params[i]
                    flats[dt][o : o + p.numel()].copy_(p.detach().reshape(-1))
            marks = flats[marks_dt][sizes[marks_dt] - participants :]
            if stepping and rank is not None:
                marks[rank] = 1
            works = [m.allreduce(f, reduce_op=ReduceOp.SUM) for f in flats.values()]
            for w in works:
                w.wait()
            refuse_incomplete_exchange(m, missing_senders(marks))
            self.stats["param_bytes"] += sum(f.numel() * f.element_size() for f in flats.values())
        committed = m.should_commit()
        if committed and snapshot is not None:
            if self._standby_opt is not None:
                self._shards.sync_hyper(self._standby_opt)
                self._standby_opt.step()
            for i, dt, o in offsets:
                p = params[i]
                p.detach().copy_(flats[dt][o : o + p.numel()].view_as(p))
            self._retire_unheld(m.current_step())
            self.stats["steps"] += 1
        elif committed:
            # Committed without our contribution (cannot happen for a healthy participant:
            # an error would have vetoed). Be safe: force a fresh layout next step.
            self._layout_key = None
        elif snapshot is not None:
            states, datas = snapshot
            for i, d in zip(self._owned, datas):
                p = params[i]
                held[i] = states[i]
                if self._own_opt is not None:
                    self._own_opt.state[p] = states[i]
                p.data = d
            # After an abort the layout is fixed afresh next step (on every group: each one's
            # collectives failed). After an error that did not abort, the exchange ran and the
            # layout holds; fixing it afresh on this group only would issue a migration that
            # the other groups do not.
            self._layout_key = None if m.step_aborted() else self._layout_key

    def _overlap_step(self) -> None:
        """The overlapped step's vote: staging becomes live only if it commits."""
        m = self.manager
        overlap = self.overlap
        assert overlap is not None
        ok = overlap.finish() and m.errored() is None
        committed = m.should_commit()
        if committed and ok:
            overlap.apply_parameters()
            self._shards.held.update(overlap.staged)
            self._retire_unheld(m.current_step())
            self._bind_held()
            self.stats["steps"] += 1
        elif committed:
            self._layout_key = None  # as in _plain_step: committed without our contribution
        elif m.step_aborted():
            self._layout_key = None  # as in _plain_step
        overlap.reset()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_shards", None) is None:
            super().add_param_group(param_group)
            return
        raise NotImplementedError(
            "add_param_group after construction is not supported in fault-tolerant mode"
        )
