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
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import ReduceOp

from ft.optim.partition import Partition, buddy_rank, partition_params
from ft.optim.zero_local import check_optimizer_class
from ft.protocols import ManagerLike
from ft.utils.tensors import clone_state

__all__ = ["FaultTolerantZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

_NOT_HYPER = ("params", "param_names")


class _Bucket:
    """One DDP bucket as the overlapped step sees it: which of this optimizer's parameters it
    holds (global index, position in the bucket, offset in ``xbuf``) and the exchange buffer
    (the bucket's parameters, flat, in the order of ``entries``, then one sent-mark per
    participant: see :func:`_missing_senders`)."""

    __slots__ = ("index", "ids", "entries", "xbuf", "participants")

    def __init__(
        self,
        index: int,
        ids: Tuple[int, ...],
        entries: List[Tuple[int, int, int]],
        xbuf: Any,
        participants: int,
    ) -> None:
        self.index = index
        self.ids = ids
        self.entries = entries
        self.xbuf = xbuf
        self.participants = participants

    def marks(self) -> torch.Tensor:
        return self.xbuf[self.xbuf.numel() - self.participants :]


def _missing_senders(marks: torch.Tensor) -> List[int]:
    """The participants whose stepped shards an exchange lacks. Each participant that stepped
    its shards sets its own slot of the exchange's marks to 1 (SUM-allreduced with the
    parameters; every other contribution there is 0). A participant whose step failed where
    the group stays usable (``report_error``: a NaN loss it alone saw) still takes part in the
    exchange, so that no group waits for it, but sends zeros, its mark among them: a group
    that committed that exchange would take zeros for the failed participant's shards."""
    return [r for r, v in enumerate(marks.tolist()) if v != 1]


def _refuse_incomplete_exchange(manager: ManagerLike, missing: List[int]) -> None:
    if missing and manager.errored() is None:
        manager.report_error(
            RuntimeError(
                f"ZeRO parameter exchange: participant(s) {missing} sent no stepped shards "
                "(their step failed there); the step commits on no replica group"
            )
        )


class _BucketOpts:
    """The staging optimizers of one bucket for one layout: the owned parameters stepped on
    views into the bucket's exchange buffer, the standby ones on scratch tensors."""

    __slots__ = ("own", "own_t", "own_opt", "sb", "sb_t", "sb_opt")

    def __init__(
        self,
        own: List[Tuple[int, int]],
        own_t: List[torch.Tensor],
        own_opt: Optional[torch.optim.Optimizer],
        sb: List[Tuple[int, int]],
        sb_t: List[torch.Tensor],
        sb_opt: Optional[torch.optim.Optimizer],
    ) -> None:
        self.own, self.own_t, self.own_opt = own, own_t, own_opt  # (global index, position)
        self.sb, self.sb_t, self.sb_opt = sb, sb_t, sb_opt


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
        self._optimizer_class = optimizer_class
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._gi = {id(p): i for i, p in enumerate(self._params)}
        self._gof = [g for g, group in enumerate(self.param_groups) for _ in group["params"]]
        # Held shard entries: global index -> state dict, and the step each is current for.
        v0 = manager.current_step()
        self._held: Dict[int, Dict[str, Any]] = {i: {} for i in range(len(self._params))}
        self._version: Dict[int, int] = {i: v0 for i in range(len(self._params))}
        self._layout_key: Optional[Tuple[Any, ...]] = None
        self._partition: Optional[Partition] = None
        self._owned: List[int] = []
        self._standby: List[int] = []
        self._own_opt: Optional[torch.optim.Optimizer] = None
        self._standby_opt: Optional[torch.optim.Optimizer] = None
        self._templates: Dict[Tuple[int, Tuple[int, ...], torch.dtype], Dict[str, Any]] = {}
        self.stats = {"migrated_bytes": 0, "param_bytes": 0, "steps": 0}
        self._overlap = bool(overlap_with_ddp)
        self._ov_ddp: Any = None  # the FaultTolerantZeroDDP that feeds this optimizer
        self._ov_buckets: Dict[int, _Bucket] = {}  # by DDP bucket index; fixed by ft's DDP
        self._ov_opts: Dict[int, _BucketOpts] = {}  # per bucket, for the current layout
        self._ov_reset()
        manager.register_state_dict_fn(state_key, self._load_shards, self._save_shards)

    # ------------------------------------------------------------------ state exposure
    @property
    def state(self):  # type: ignore[override]
        """The owned shard's state, keyed by parameter."""
        return {self._params[i]: self._held[i] for i in self._owned if i in self._held}

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
        idx = {"owned": self._owned, "standby": self._standby, "all": sorted(self._held)}[which]
        return {i: clone_state(self._held[i]) for i in idx}

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this replica holds (own + standby shards)."""
        return sum(
            v.numel() * v.element_size()
            for st in self._held.values()
            for v in st.values()
            if torch.is_tensor(v)
        )

    def _save_shards(self) -> Dict[str, Any]:
        return {
            "state": {i: dict(st) for i, st in self._held.items()},
            "version": dict(self._version),
        }

    def _load_shards(self, sd: Dict[str, Any]) -> None:
        state, version = sd["state"], sd["version"]
        for i, st in state.items():
            i = int(i)
            if not 0 <= i < len(self._params):
                raise ValueError(
                    f"healed optimizer state names parameter {i} of {len(self._params)}"
                )
            self._held[i] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            self._version[i] = int(version[i])
        self._layout_key = None  # rebuild local optimizers over the new dicts

    # ------------------------------------------------------------------ layout
    def _hyper(self, g: int) -> Dict[str, Any]:
        return {k: v for k, v in self.param_groups[g].items() if k not in _NOT_HYPER}

    def _build_opt(
        self, idx: List[int], tensors: Optional[List[torch.Tensor]] = None
    ) -> Optional[torch.optim.Optimizer]:
        """A local optimizer over parameters ``idx`` (param-group hyperparameters kept), on the
        parameters themselves with their held state bound, or on ``tensors`` (staging: the
        state is set per step)."""
        if not idx:
            return None
        bind = tensors is None
        ts = [self._params[i] for i in idx] if tensors is None else tensors
        groups = []
        for g in range(len(self.param_groups)):
            ps = [t for i, t in zip(idx, ts) if self._gof[i] == g]
            if ps:
                groups.append(dict(self._hyper(g), params=ps, _g=g))
        opt = self._optimizer_class([{k: v for k, v in gr.items() if k != "_g"} for gr in groups])
        for gr, og in zip(groups, opt.param_groups):
            og["_g"] = gr["_g"]
        if bind:
            for i, t in zip(idx, ts):
                opt.state[t] = self._held.setdefault(i, {})
        return opt

    def _bind_held(self) -> None:
        """Point the local optimizers at the held state dicts (after the overlapped step
        replaced them with the staged ones)."""
        for opt, idx in ((self._own_opt, self._owned), (self._standby_opt, self._standby)):
            if opt is not None:
                for i in idx:
                    opt.state[self._params[i]] = self._held.setdefault(i, {})

    def _retire_unheld(self, step: int) -> None:
        """After a committed step: the owned and standby entries are current for ``step``;
        every other held entry (a shard this replica no longer owns or backs up) is dropped."""
        keep = set(self._owned) | set(self._standby)
        for i in list(self._held):
            if i in keep:
                self._version[i] = step
            else:
                del self._held[i]
                self._version.pop(i, None)

    def _sync_hyper(self, opt: Optional[torch.optim.Optimizer]) -> None:
        if opt is None:
            return
        for og in opt.param_groups:
            for k, v in self._hyper(og["_g"]).items():
                og[k] = v

    def _template(self, i: int) -> Dict[str, Any]:
        """Structure of parameter ``i``'s state (keys, shapes, dtypes) after one step."""
        p = self._params[i]
        g = self._gof[i]
        key = (g, tuple(p.shape), p.dtype)
        if key not in self._templates:
            dummy = torch.zeros_like(p, requires_grad=True)
            dummy.grad = torch.zeros_like(p)
            opt = self._optimizer_class([dummy], **self._hyper(g))
            opt.step()
            self._templates[key] = {k: v for k, v in opt.state[dummy].items()}
        return self._templates[key]

    def _migrate(
        self, n: int, rank: Optional[int], part: Partition, targets: Dict[int, Set[int]]
    ) -> bool:
        """Moves every needed entry to its targets; False if the transfer failed."""
        m = self.manager
        P = len(self._params)
        cur = m.current_step()
        table = torch.zeros(n, P, dtype=torch.int64)
        if rank is not None:
            for i in range(P):
                if i in self._held:
                    table[rank, i] = 2 * (self._version[i] + 1) + (1 if self._held[i] else 0)
        m.allreduce(table, reduce_op=ReduceOp.SUM).wait()
        if m.step_aborted():
            return False
        ver = table // 2 - 1  # -1: not held
        nonempty = (table % 2) == 1
        moves: List[Tuple[int, int, Set[int]]] = []  # (param, source, receivers)
        for i in range(P):
            best = int(ver[:, i].max())
            if best != cur:
                raise RuntimeError(
                    f"optimizer state of parameter {i} is lost: newest copy is for step {best}, "
                    f"current step is {cur} (owner and buddy both died?)"
                )
            holders = [r for r in range(n) if int(ver[r, i]) == best]
            need = {t for t in targets[i] if int(ver[t, i]) != best}
            if need:
                moves.append((i, holders[0], need))
        if not moves:
            return True
        # Byte layout of every moved non-empty entry (from the template), then one SUM allreduce.
        layout: List[Tuple[int, str, int, int]] = []  # (param, key, offset, nbytes)
        off = 0
        for i, src, _ in moves:
            if not bool(nonempty[src, i]):
                continue
            for k, v in sorted(self._template(i).items()):
                if torch.is_tensor(v):
                    nb = v.numel() * v.element_size()
                    layout.append((i, k, off, nb))
                    off += nb
        buf = torch.zeros(off, dtype=torch.uint8)
        src_of = {i: s for i, s, _ in moves}
        for i, k, o, nb in layout:
            if src_of[i] == rank:
                t = self._held[i][k].detach().contiguous().view(-1).view(torch.uint8)
                if t.numel() != nb:
                    raise RuntimeError(f"state {k!r} of parameter {i} does not match its template")
                buf[o : o + nb].copy_(t)
        if off:
            m.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
            if m.step_aborted():
                return False
        self.stats["migrated_bytes"] += off
        for i, src, need in moves:
            if rank not in need:
                continue
            st: Dict[str, Any] = {}
            if bool(nonempty[src, i]):
                for k, v in self._template(i).items():
                    st[k] = v.clone() if torch.is_tensor(v) else v
                for j, k, o, nb in layout:
                    if j == i:
                        t = st[k]
                        t.view(-1).view(torch.uint8).copy_(buf[o : o + nb])
            self._held[i] = st
            self._version[i] = cur
        return True

    def _ensure_layout(self) -> bool:
        m = self.manager
        n = m.num_participants()
        rank = m.participating_rank() if m.is_participating() else None
        quorum_id = getattr(m, "quorum_id", None)  # stand-in managers in tests may lack it
        key = (quorum_id() if callable(quorum_id) else None, n, rank)
        if key == self._layout_key:
            return True
        P = len(self._params)
        numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
        part = partition_params(numels, max(n, 1))
        flat_owner: List[int] = [o for g in part.owner for o in g]
        # global index order = group order, then position in group
        targets: Dict[int, Set[int]] = {}
        for i in range(P):
            o = flat_owner[i]
            targets[i] = {o, buddy_rank(o, n)} if n > 1 else {o}
        if not self._migrate(n, rank, part, targets):
            return False
        if rank is None:
            self._owned, self._standby = [], []
        else:
            gidx = [[self._gi[id(p)] for p in g["params"]] for g in self.param_groups]
            self._owned = [gidx[g][j] for g, j in part.owned(rank)]
            prev = (rank - 1) % n
            self._standby = [gidx[g][j] for g, j in part.owned(prev)] if n > 1 else []
        self._partition = part
        self._own_opt = self._build_opt(self._owned)
        self._standby_opt = self._build_opt(self._standby)
        self._ov_opts = {}
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
        if self._overlap:
            self._ov_begin()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("FaultTolerantZeroRedundancyOptimizer does not support closures")
        if self._overlap and self._ov_active and (self._ov_done or self._ov_pending):
            self._overlap_step()
        else:
            # No bucket went through the DDP hook this step (no FaultTolerantZeroDDP, or no
            # backward through it): the step after backward gives the same result.
            self._ov_reset()
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
                old_states = {i: self._held[i] for i in self._owned}
                old_data = [self._params[i].data for i in self._owned]
                for i in self._owned:
                    p = self._params[i]
                    new = clone_state(self._held[i])
                    self._held[i] = new
                    if self._own_opt is not None:
                        self._own_opt.state[p] = new
                    p.data = p.data.clone()
                snapshot = (old_states, old_data)
                if self._own_opt is not None:
                    self._sync_hyper(self._own_opt)
                    self._own_opt.step()
            sizes: Dict[torch.dtype, int] = {}
            for i, p in enumerate(self._params):
                offsets.append((i, p.dtype, sizes.get(p.dtype, 0)))
                sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
            # The participants' sent-marks follow the first dtype's parameters.
            marks_dt = next(iter(sizes), torch.float32)
            sizes[marks_dt] = sizes.get(marks_dt, 0) + participants
            flats = {dt: torch.zeros(s, dtype=dt) for dt, s in sizes.items()}
            owned = set(self._owned) if stepping else set()
            for i, dt, o in offsets:
                if i in owned:
                    p = self._params[i]
                    flats[dt][o : o + p.numel()].copy_(p.detach().reshape(-1))
            marks = flats[marks_dt][sizes[marks_dt] - participants :]
            if stepping and rank is not None:
                marks[rank] = 1
            works = [m.allreduce(f, reduce_op=ReduceOp.SUM) for f in flats.values()]
            for w in works:
                w.wait()
            _refuse_incomplete_exchange(m, _missing_senders(marks))
            self.stats["param_bytes"] += sum(f.numel() * f.element_size() for f in flats.values())
        committed = m.should_commit()
        if committed and snapshot is not None:
            if self._standby_opt is not None:
                self._sync_hyper(self._standby_opt)
                self._standby_opt.step()
            for i, dt, o in offsets:
                p = self._params[i]
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
                p = self._params[i]
                self._held[i] = states[i]
                if self._own_opt is not None:
                    self._own_opt.state[p] = states[i]
                p.data = d
            # After an abort the layout is fixed afresh next step (on every group: each one's
            # collectives failed). After an error that did not abort, the exchange ran and the
            # layout holds; fixing it afresh on this group only would issue a migration that
            # the other groups do not.
            self._layout_key = None if m.step_aborted() else self._layout_key

    # ------------------------------------------------------------------ overlap
    def _ov_reset(self) -> None:
        """Forget the step's staging (nothing live refers to it)."""
        self._ov_active = False  # zero_grad() began an overlapped step
        self._ov_exchanging = False  # its layout is fixed and the group not aborted
        self._ov_ok = False  # ... and nothing has failed so far: it may commit
        self._ov_pending: Dict[int, Tuple[_Bucket, Any, Any]] = {}  # ready, not yet staged
        self._ov_done: List[int] = []  # staged bucket indices, in order
        self._ov_staged: Dict[int, Dict[str, Any]] = {}  # global index -> stepped state copy
        self._ov_works: List[Any] = []  # the exchanges in flight
        for bo in getattr(self, "_ov_opts", {}).values():
            for opt in (bo.own_opt, bo.sb_opt):
                if opt is not None:
                    opt.state.clear()

    def _ov_begin(self) -> None:
        self._ov_reset()
        self._ov_active = True
        self._ov_exchanging = self._layout_for_step()
        self._ov_ok = self._ov_exchanging and self.manager.errored() is None

    def _ov_attach(self, ddp: Any) -> None:
        if not self._overlap:
            raise ValueError(
                "FaultTolerantZeroRedundancyOptimizer must be constructed with "
                "overlap_with_ddp=True to be stepped by FaultTolerantZeroDDP"
            )
        if self._ov_ddp is not None and self._ov_ddp() is not None:
            raise ValueError("this optimizer is already attached to a FaultTolerantZeroDDP")
        self._ov_ddp = weakref.ref(ddp)

    def _ov_bucket(self, bucket: Any) -> _Bucket:
        """This optimizer's view of DDP bucket ``bucket`` (built once; ft's DDP fixes its
        bucket layout at construction, and a changed layout is rebuilt)."""
        index = bucket.index()
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        participants = self._layout_key[1] if self._layout_key is not None else 0
        b = self._ov_buckets.get(index)
        if b is not None and b.ids == ids and b.participants == participants:
            return b
        entries: List[Tuple[int, int, int]] = []
        off, dtype = 0, None
        for pos, p in enumerate(params):
            i = self._gi.get(id(p))
            if i is None:
                continue  # a module parameter this optimizer does not step
            entries.append((i, pos, off))
            off += p.numel()
            dtype = p.dtype
        xbuf = torch.zeros(
            off + participants, dtype=dtype or torch.float32, device=bucket.buffer().device
        )
        b = _Bucket(index, ids, entries, xbuf, participants)
        self._ov_buckets[index] = b
        self._ov_opts.pop(index, None)
        return b

    def _ov_bucket_opts(self, b: _Bucket) -> _BucketOpts:
        bo = self._ov_opts.get(b.index)
        if bo is not None:
            return bo
        owned, standby = set(self._owned), set(self._standby)
        own = [(i, pos) for i, pos, _ in b.entries if i in owned]
        own_t = [
            b.xbuf[o : o + self._params[i].numel()].view_as(self._params[i])
            for i, _, o in b.entries
            if i in owned
        ]
        sb = [(i, pos) for i, pos, _ in b.entries if i in standby]
        sb_t = [torch.empty_like(self._params[i]) for i, _ in sb]
        bo = _BucketOpts(
            own,
            own_t,
            self._build_opt([i for i, _ in own], own_t),
            sb,
            sb_t,
            self._build_opt([i for i, _ in sb], sb_t),
        )
        self._ov_opts[b.index] = bo
        return bo

    def _overlap_bucket_ready(self, bucket: Any, fut: Any, interleaved: bool = True) -> None:
        """Called by :class:`ft.optim.zero_hooks.FaultTolerantZeroDDP`'s comm hook on the
        backward thread, after it started bucket ``bucket``'s gradient allreduce (``fut``)."""
        if not self._ov_active:
            return  # no zero_grad() began this step: step() steps after backward
        index = bucket.index()
        if index in self._ov_pending or index in self._ov_done:
            raise RuntimeError(
                f"DDP bucket {index} is ready twice in one step: with overlap_with_ddp=True "
                "each step runs one backward pass through the DDP (accumulate gradients "
                "under ddp.no_sync())"
            )
        self._ov_pending[index] = (self._ov_bucket(bucket), bucket, fut)
        if interleaved and index - 1 in self._ov_pending:
            self._ov_stage(index - 1)
        if bucket.is_last():
            for k in sorted(self._ov_pending):
                self._ov_stage(k)

    @torch.no_grad()
    def _ov_stage(self, index: int) -> None:
        """Step the owned and standby parameters of bucket ``index`` into staging (waiting for
        its averaged gradient), then start the exchange of its owned parameters."""
        from ft.optim.zero_overlap import bucket_gradients as _bucket_gradients

        b, bucket, fut = self._ov_pending.pop(index)
        self._ov_done.append(index)
        fut.wait()  # the Manager's futures complete (with the tensor) even when they fail
        m = self.manager
        if not self._ov_exchanging or m.step_aborted():
            # Aborted: the peers' exchanges fail with it; nothing to stage or send.
            self._ov_exchanging = self._ov_ok = False
            return
        if not b.entries:
            return  # none of this optimizer's parameters: nothing to step or exchange
        if not self._ov_ok or m.errored() is not None:
            # The step will not commit: stage nothing, but exchange (zeros) as the other
            # groups do, which may know nothing of this error (docs/optim.md, "Errors
            # within a step").
            self._ov_ok = False
            b.xbuf.zero_()
            self._ov_works.append(m.allreduce(b.xbuf, reduce_op=ReduceOp.SUM))
            return
        grads = _bucket_gradients(bucket, fut.value())
        bo = self._ov_bucket_opts(b)
        b.xbuf.zero_()  # the slots of parameters this replica does not own stay zero
        for (i, _), t in zip(bo.own, bo.own_t):
            t.copy_(self._params[i].detach())
        for (i, _), t in zip(bo.sb, bo.sb_t):
            t.copy_(self._params[i].detach())
        for ents, ts, opt in ((bo.own, bo.own_t, bo.own_opt), (bo.sb, bo.sb_t, bo.sb_opt)):
            if opt is None:
                continue
            for (i, pos), t in zip(ents, ts):
                t.grad = grads[pos]
                st = clone_state(self._held[i])
                self._ov_staged[i] = st
                opt.state[t] = st
            self._sync_hyper(opt)
            opt.step()
            for t in ts:
                t.grad = None  # the gradients are views of DDP's bucket
        rank = self._layout_key[2] if self._layout_key is not None else None
        if rank is not None:
            b.marks()[rank] = 1
        self._ov_works.append(m.allreduce(b.xbuf, reduce_op=ReduceOp.SUM))
        self.stats["param_bytes"] += b.xbuf.numel() * b.xbuf.element_size()

    def _overlap_step(self) -> None:
        """The overlapped step's vote: staging becomes live only if it commits."""
        m = self.manager
        for k in sorted(self._ov_pending):  # buckets whose successor never came (defensive)
            self._ov_stage(k)
        covered = {i for k in self._ov_done for i, _, _ in self._ov_buckets[k].entries}
        stray = [i for i, p in enumerate(self._params) if p.grad is not None and i not in covered]
        if stray:
            self._ov_reset()
            raise ValueError(
                f"parameters {stray} of FaultTolerantZeroRedundancyOptimizer have gradients "
                "but are not in the FaultTolerantZeroDDP's buckets: with overlap_with_ddp=True "
                "the optimizer's parameters must be the DDP module's"
            )
        for w in self._ov_works:
            w.wait()
        if self._ov_ok:
            missing = set()
            for k in self._ov_done:
                b = self._ov_buckets[k]
                if b.entries:
                    missing.update(_missing_senders(b.marks()))
            _refuse_incomplete_exchange(m, sorted(missing))
        ok = self._ov_ok and m.errored() is None
        committed = m.should_commit()
        if committed and ok:
            for k in self._ov_done:
                b = self._ov_buckets[k]
                for i, _, o in b.entries:
                    p = self._params[i]
                    p.detach().copy_(b.xbuf[o : o + p.numel()].view_as(p))
            self._held.update(self._ov_staged)
            self._retire_unheld(m.current_step())
            self._bind_held()
            self.stats["steps"] += 1
        elif committed:
            self._layout_key = None  # as in _plain_step: committed without our contribution
        elif m.step_aborted():
            self._layout_key = None  # as in _plain_step
        self._ov_reset()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_params", None) is None:
            super().add_param_group(param_group)
            return
        raise NotImplementedError(
            "add_param_group after construction is not supported in fault-tolerant mode"
        )
