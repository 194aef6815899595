"""ZeRO stage 1: shard the optimizer state across the ranks of a process group.

:class:`ZeroRedundancyOptimizer` has the constructor and behaviour of
``torch.distributed.optim.ZeroRedundancyOptimizer``.

Contract:
    * Every whole parameter is owned by one rank (:mod:`ft.optim.partition`: largest first,
      each to the least-loaded rank, the same assignment as torch's, so the two shard a
      model identically and give bitwise-identical parameters).
    * Each rank builds a local ``optimizer_class`` over the parameters it owns and steps only
      those; the updated parameters are then broadcast from their owners.
    * ``param_groups`` holds every parameter, with every hyperparameter of the local
      optimizer; changes to it (an LR scheduler) reach the local optimizer at the next step.
    * ``state`` is the local optimizer's state: the shard this rank owns.
    * ``consolidate_state_dict(to)`` gathers the shards on rank ``to``; ``state_dict()`` is then
      valid on that rank only and has the layout of a plain optimizer over all parameters
      (global indices), so it loads into a plain ``optimizer_class``, into torch's
      ZeroRedundancyOptimizer, or into this one on any world size.
    * ``load_state_dict`` takes such a full state dict on every rank and keeps the owned part.
    * It is a ``torch.distributed.algorithms.Joinable``: under
      ``Join([ddp_model, zero])`` ranks may run out of batches at different steps; a joined
      rank's ``step()`` is shadowed (it steps its shard with the gradients it holds and
      takes part in the broadcasts), exactly as torch's does, so the results are bitwise
      torch's.
    * ``optimizer_class`` errors have torch's types: a functional optimizer class with
      ``overlap_with_ddp=False``, or a class without a functional counterpart with
      ``overlap_with_ddp=True``, raise ``ValueError``; something that is not an optimizer
      class at all raises ``TypeError``.

Overlap with DDP (``overlap_with_ddp=True``)
    Used with a DDP comm hook from :mod:`ft.optim.zero_hooks` (``hook_with_zero_step`` or
    ``hook_with_zero_step_interleaved``, torch's names and signatures), registered on
    torch's ``DistributedDataParallel`` over the same ranks (any backend: "ft", Gloo, NCCL).
    Each rank's shard is updated inside the backward pass, as its DDP gradient buckets are
    reduced, and the updated parameters are broadcast while the backward pass still runs;
    they are final when ``backward()`` returns. As in torch:

    * the shards follow DDP's buckets, which DDP only fixes after its first iterations: the
      first iteration in which DDP reports rebuilt buckets records them, and the parameters
      are first updated in the next one (with ``static_graph=False``: no update in the first
      two iterations, as torch documents). The hook must be registered before that;
    * ``step()`` does nothing (it warns): the hooks step;
    * the local optimizer is functional (``ft.optim.functional``; a ``torch.optim`` class is
      translated with its functional counterpart, a functional class is used as given), and
      there is one parameter group; ``zero.overlap`` (:mod:`ft.optim.zero_overlap`) holds the
      bucket assignment;
    * ``consolidate_state_dict``/``state_dict``/``load_state_dict`` raise ``RuntimeError``
      until the assignment exists; afterwards they work as without overlap (same layout).

    ft's ZeRO with overlap gives the same parameters as without it (bitwise on CPU: the
    functional optimizers are torch's arithmetic, and per-parameter updates do not depend
    on the order in which the buckets are stepped).

Communication uses only public ``torch.distributed`` calls with ``group=process_group``,
so any backend works (Gloo, NCCL, the "ft" backend).  Differences from torch, all
deliberate:

* Broadcasts are issued asynchronously, all of them before the first wait.  Without
  ``parameters_as_bucket_view``, parameters under 256 KiB are packed into one flat
  buffer per owner (one broadcast instead of one per tiny tensor); larger parameters
  are broadcast in place.  With it, each rank's parameters live in one flat buffer
  (the parameters are views into it) and each buffer is one broadcast.
* ``consolidate_state_dict`` ships each shard to ``to`` point to point (not a broadcast
  to every rank), and encodes the structure as JSON plus raw tensor bytes: nothing is
  unpickled.
* Construction checks (with one tiny all-gather) that all ranks passed the same
  parameter shapes, instead of hanging or corrupting later.
* ``load_state_dict`` validates the dict against the parameters on every rank alike (so
  all ranks fail together) and does not modify the caller's dict.
* A joined rank's shadow step does not call ``Join.notify_join_context`` again (torch's
  does, which would add an all-reduce when the optimizer is the first joinable).
* Overlap: the hooks issue every collective from the backward thread in bucket order, so
  they are safe on Gloo too (torch refuses Gloo because its interleaved hook issues
  broadcasts from completion callbacks); each bucket goes to the least-loaded rank (torch:
  round robin), and ``shard_buckets=True`` cuts the buckets, in order, into one contiguous
  range per rank; an LR scheduler's changes to ``param_groups`` reach the functional
  optimizer (torch's functional optimizer keeps its constructor values); the state dict
  methods work after the assignment exists.

Fault-tolerant mode
-------------------
Across replica groups, through a Manager, see :mod:`ft.optim.zero_ft`
(``FaultTolerantZeroRedundancyOptimizer``): shards follow the quorum, each shard's state
also lives on a buddy replica that steps it locally (0 bytes per step, 0 steps stale),
and a step that fails to commit restores every shard.  That module's docstring is the
reference for how it works, including its overlap with DDP (staged per bucket during
backward, applied after the Manager's vote; ``ft.optim.zero_hooks.FaultTolerantZeroDDP``).
"""

from __future__ import annotations

import copy
import logging
import sys
import warnings
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ft.optim.partition import Partition, partition_params
from ft.optim.zero_broadcast import BroadcastPlan
from ft.optim.zero_local import copy_hyper, hyper, optimizer_constructor
from ft.optim.zero_overlap import ZeroOverlap
from ft.optim.zero_state_dict import ShardedStateDict

# The module of torch's DDP hooks that step torch's ZeRO (see _overlap_with_ddp).
_TORCH_ZERO_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)


class _ZeroJoinHook(JoinHook):
    """Shadows a joined rank's ``step()`` with ``shadow_step``: it steps its shard with the
    gradients it holds and takes part in the broadcasts (torch's behaviour), without
    notifying the join context again (the context itself matches that all-reduce)."""

    def __init__(self, shadow_step: Callable[[], None]) -> None:
        self.shadow_step = shadow_step

    def main_hook(self) -> None:
        self.shadow_step()


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    r"""Shard optimizer state across the ranks of ``process_group`` (ZeRO stage 1).

    Args:
        params: an iterable of tensors or of parameter-group dicts.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (e.g. ``torch.optim.Adam``);
            each rank builds one over the parameters it owns.
        process_group: the group to shard over (default: the default group).
        parameters_as_bucket_view: keep each rank's parameters in one flat buffer (the
            parameters become views into it) and broadcast one buffer per rank.
        overlap_with_ddp: update the shards inside DDP's backward pass, through a hook of
            :mod:`ft.optim.zero_hooks` (see the module docstring); ``step()`` then does
            nothing. Needs one parameter group and an ``optimizer_class`` with a functional
            counterpart (or a functional class); ``parameters_as_bucket_view`` is ignored.
        **defaults: hyperparameters for ``optimizer_class`` (``lr=...``, ...).

    All ranks must construct it with the same parameters (same shapes, same order), and
    call ``step``, ``add_param_group`` and ``consolidate_state_dict`` together.

    This class owns the exposed ``param_groups``, the partition and the local optimizer
    (without overlap); its parts own the rest: ``overlap`` (:class:`ZeroOverlap`, None without
    ``overlap_with_ddp``) the overlapped step, a :class:`BroadcastPlan` the broadcasts of a
    step, and a :class:`ShardedStateDict` the consolidated state dict.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: Any,
        process_group: Any = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        overlap_with_ddp = bool(overlap_with_ddp)
        ctor = optimizer_constructor(optimizer_class, overlap_with_ddp)
        if process_group is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "ZeroRedundancyOptimizer needs a process group: call "
                    "torch.distributed.init_process_group(...) first or pass process_group="
                )
            process_group = dist.group.WORLD

        self._initialized = False
        self._local: Any = None
        self.overlap: Optional[ZeroOverlap] = None
        super().__init__(params, defaults)  # fills self.param_groups via add_param_group
        Joinable.__init__(self)

        self._all_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._check_params(self._all_params)

        self.process_group = process_group
        self._optimizer_class = optimizer_class
        self._optim_defaults = defaults
        self.rank, self.world_size = self._shard_coords()
        self.global_rank = dist.get_global_rank(process_group, self.rank)
        self._device = self._all_params[0].device
        self._state_dicts = ShardedStateDict(
            self.rank, self.world_size, self._device, self._comm_group()
        )

        self._check_ranks_agree()
        if overlap_with_ddp:
            if parameters_as_bucket_view:
                # As torch: the DDP buckets decide the flat buffers instead.
                logger.warning(
                    "parameters_as_bucket_view=True is ignored with overlap_with_ddp=True: "
                    "the parameters are flattened per DDP bucket instead"
                )
            self.parameters_as_bucket_view = False
            self.overlap = ZeroOverlap(
                self.param_groups,
                self.rank,
                self.world_size,
                self._comm_group(),
                optimizer_class,
                ctor,
                defaults,
                on_iteration_done=self._overlap_iteration_done,
            )
            self._initialized = True
            return

        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._partition = self._compute_partition()
        self._local = self._build_local_optimizer()
        copy_hyper(self._local.param_groups, self.param_groups)

        self._trainable_mask = self._get_trainable_mask()
        self._broadcasts = BroadcastPlan(
            self.rank, self.world_size, self._device, self.parameters_as_bucket_view
        )
        self._rebuild_broadcasts()
        self._initialized = True

    # torch's ddp_comm_hooks.ddp_zero_hook functions read this attribute first, then reach
    # into torch's own ZeroRedundancyOptimizer internals from inside backward, which ft's
    # does not have: they are refused here, when the hook is made, naming ft's equivalents.
    @property
    def _overlap_with_ddp(self) -> bool:
        # The caller's module is the one way to tell torch's hooks from any other reader.
        if sys._getframe(1).f_globals.get("__name__") == _TORCH_ZERO_HOOKS:
            raise TypeError(
                "torch's ddp_zero_hook functions need torch's ZeroRedundancyOptimizer; with "
                "ft.optim.ZeroRedundancyOptimizer use ft.optim.zero_hooks.hook_with_zero_step "
                "or hook_with_zero_step_interleaved (the same arguments): "
                "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))"
            )
        return self.overlap is not None

    # ----------------------------------------------------------------------------- hooks
    # The sharding dimension and its group, in one place. Both are fixed at construction: the
    # state-dict and overlap parts take the group then.

    def _shard_coords(self) -> Tuple[int, int]:
        """(rank, world_size) of the sharding dimension."""
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _comm_group(self) -> Any:
        return self.process_group

    # ----------------------------------------------------------------------------- state

    @property
    def state(self):  # type: ignore[override]
        """The optimizer state of the parameters this rank owns (the local optimizer's)."""
        overlap = self.__dict__.get("overlap")
        local = overlap.optimizer if overlap is not None else self.__dict__.get("_local")
        return local.state if local is not None else self.__dict__.get("_base_state")

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_base_state"] = value

    @property
    def optim(self) -> Any:
        """The local optimizer over this rank's shard (as torch's ``.optim``); with
        ``overlap_with_ddp=True``, a functional optimizer that exists once the DDP buckets
        have been assigned."""
        if self.overlap is not None:
            self.overlap.check_initialized()
            return self.overlap.optimizer
        return self._local

    @property
    def partition(self) -> Partition:
        """The current partition table (see :mod:`ft.optim.partition`). With overlap it
        follows the DDP buckets; a parameter in no bucket (frozen) has owner -1."""
        if self.overlap is not None:
            self.overlap.check_initialized()
            return self.overlap.partition  # type: ignore[return-value]
        return self._partition

    def owner_of(self, param: torch.Tensor) -> int:
        """Rank that owns (steps and broadcasts) ``param``."""
        part = self.partition
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return part.owner[g][i]
        raise KeyError("tensor is not a parameter of this optimizer")

    def _check_overlap_initialized(self) -> None:
        if self.overlap is not None:
            self.overlap.check_initialized()

    # ----------------------------------------------------------------------------- checks

    def _check_params(self, params: List[torch.Tensor]) -> None:
        ref = self._all_params[0] if getattr(self, "_all_params", None) else params[0]
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters must be tensors, got {type(p).__name__}")
            if p.layout != torch.strided:
                raise ValueError(
                    f"ZeroRedundancyOptimizer only supports dense parameters; got layout {p.layout}"
                )
            if p.device != ref.device:
                raise ValueError(
                    "ZeroRedundancyOptimizer requires all parameters on one device; got "
                    f"{ref.device} and {p.device}. Move the model to a single device first."
                )
            if p.dtype != ref.dtype:
                raise ValueError(
                    "ZeroRedundancyOptimizer requires all parameters to have one dtype (as torch's "
                    f"does); got {ref.dtype} and {p.dtype}"
                )

    def _fingerprint(self) -> List[int]:
        shapes = repr([(tuple(p.shape), str(p.dtype)) for p in self._all_params]).encode()
        return [
            len(self.param_groups),
            len(self._all_params),
            sum(p.numel() for p in self._all_params),
            zlib.crc32(shapes),
        ]

    def _check_ranks_agree(self) -> None:
        mine = torch.tensor(self._fingerprint(), dtype=torch.int64, device=self._device)
        if self.world_size == 1:
            return
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self._comm_group())
        rows = [t.tolist() for t in everyone]
        for r, row in enumerate(rows):
            if row != rows[0]:
                raise RuntimeError(
                    "ZeroRedundancyOptimizer: ranks disagree on the parameters "
                    "[groups, params, numel, shapes-crc]: "
                    f"rank 0 has {rows[0]}, rank {r} has {row}. Every rank must pass the same "
                    "model parameters in the same order."
                )

    # ----------------------------------------------------------------------------- partition

    def _compute_partition(self) -> Partition:
        numels = [[p.numel() for p in g["params"]] for g in self.param_groups]
        return partition_params(numels, self.world_size)

    def _rank_groups(self, rank: int) -> List[Dict[str, Any]]:
        """Parameter groups of ``rank``'s local optimizer (one per global group, maybe empty)."""
        out = []
        for g, group in enumerate(self.param_groups):
            idx = self._partition.per_rank[rank][g]
            local = dict(hyper(group))
            local["params"] = [group["params"][i] for i in idx]
            if "param_names" in group:
                local["param_names"] = [group["param_names"][i] for i in idx]
            out.append(local)
        return out

    def _build_local_optimizer(self) -> Optimizer:
        groups = self._rank_groups(self.rank)
        try:
            local = self._optimizer_class(groups, **self._optim_defaults)
        except TypeError as e:
            name = getattr(self._optimizer_class, "__name__", repr(self._optimizer_class))
            raise TypeError(
                f"could not build {name} with {sorted(self._optim_defaults)}: {e}"
            ) from e
        if not isinstance(local, Optimizer):
            raise TypeError(
                f"optimizer_class returned {type(local).__name__}, not a torch.optim.Optimizer"
            )
        return local

    def _local_to_global(self, rank: int) -> List[int]:
        """Global (flattened over groups) index of each of ``rank``'s local indices."""
        offsets, off = [], 0
        for group in self.param_groups:
            offsets.append(off)
            off += len(group["params"])
        return [offsets[g] + i for g, i in self.partition.owned(rank)]

    # ----------------------------------------------------------------------------- broadcast

    def _get_trainable_mask(self) -> List[bool]:
        return [p.requires_grad for p in self._all_params]

    def _owned_trainable(self, rank: int) -> List[torch.Tensor]:
        return [
            self.param_groups[g]["params"][i]
            for g, i in self._partition.owned(rank)
            if self.param_groups[g]["params"][i].requires_grad
        ]

    def _rebuild_broadcasts(self) -> None:
        self._broadcasts.rebuild(
            [self._owned_trainable(r) for r in range(self.world_size)], self._all_params
        )

    # ----------------------------------------------------------------------------- optimizer API

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Step this rank's shard, then broadcast every shard from its owner.

        Must be called on all ranks.  ``closure`` and ``kwargs`` go to the local optimizer.
        With ``overlap_with_ddp=True`` it does nothing (the DDP hook steps) and warns.
        """
        return self._step(closure, kwargs, notify_join=True)

    @torch.no_grad()
    def _step(
        self, closure: Optional[Callable[[], float]], kwargs: Dict[str, Any], notify_join: bool
    ) -> Optional[float]:
        if self.overlap is not None:
            warnings.warn(
                "ZeroRedundancyOptimizer.step() does nothing with overlap_with_ddp=True: the "
                "DDP hook (ft.optim.zero_hooks) updates the parameters during backward(); "
                "remove step() from the training loop",
                stacklevel=3,
            )
            return None
        if notify_join:
            # Matches the join context's all-reduce on joined ranks, when this optimizer is
            # the first joinable (a no-op otherwise, and outside a join context).
            Join.notify_join_context(self)
        mask = self._get_trainable_mask()
        if mask != self._trainable_mask:
            logger.info("ZeroRedundancyOptimizer: trainable parameters changed; rebuilding plan")
            self._trainable_mask = mask
            self._rebuild_broadcasts()
        copy_hyper(self.param_groups, self.optim.param_groups)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            with torch.enable_grad():
                loss = self.optim.step(closure=closure, **kwargs)
        copy_hyper(self.optim.param_groups, self.param_groups)
        self._broadcasts.broadcast(self._comm_group())
        self._state_dicts.note_step()
        return loss

    def _overlap_iteration_done(self) -> None:
        """The DDP hooks stepped every bucket of an iteration (with overlap)."""
        self._state_dicts.note_step()
        # The hook stepped, not step(): tell torch's LR schedulers (they look for this flag,
        # set by their wrapper of step(), and warn "scheduler.step() before optimizer.step()").
        self._opt_called = True

    # ----------------------------------------------------------------------------- Joinable

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows ``step()`` on a rank that ran out of inputs (no kwargs)."""
        return _ZeroJoinHook(self._shadow_step)

    def _shadow_step(self) -> None:
        if self.overlap is not None:
            # Nothing to shadow here: with overlap the steps and broadcasts live in the DDP
            # comm hook, which DDP's own join hook runs on the joined rank.
            return
        self._step(None, {}, notify_join=False)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group; call it on all ranks with the same group.

        Earlier groups keep their owners (the partition is computed group by group with a
        running load), so the local optimizer only gains this rank's share of the new group.
        """
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        if self.overlap is not None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                "group (its functional optimizer has one, and the DDP buckets fix the shards)"
            )
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError("param_group must be a dict with a 'params' key")
        new = param_group["params"]
        new = [new] if isinstance(new, torch.Tensor) else list(new)
        tensors = [p[1] if isinstance(p, tuple) else p for p in new]
        self._check_params(tensors)
        super().add_param_group(param_group)
        self._all_params.extend(self.param_groups[-1]["params"])
        old = self._partition
        self._partition = self._compute_partition()
        if self._partition.per_rank[self.rank][:-1] != old.per_rank[self.rank]:
            raise AssertionError("add_param_group moved parameters of earlier groups")
        self.optim.add_param_group(self._rank_groups(self.rank)[-1])
        copy_hyper(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._trainable_mask = self._get_trainable_mask()
        self._rebuild_broadcasts()

    # ----------------------------------------------------------------------------- state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on rank ``to`` (collective).

        Afterwards ``state_dict()`` works on rank ``to`` (only there), until the next call.
        """
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is not a rank of a group of size {self.world_size}")
        self._check_overlap_initialized()
        self._push_hyper()
        self._state_dicts.consolidate(to, self._local_state_dict(), self.param_groups)

    def state_dict(self) -> Dict[str, Any]:
        """The full optimizer state, as a plain ``optimizer_class`` over all parameters would
        return it (global parameter indices).

        Valid only on the rank that ``consolidate_state_dict(to=...)`` targeted, and reflects
        the state at that call.
        """
        return self._state_dicts.full(self.param_groups, self._local_to_global)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()``, or a plain optimizer's) on every
        rank; each rank keeps the state of the parameters it owns.  The input is not modified.
        """
        self._check_overlap_initialized()
        ShardedStateDict.validate(state_dict, self.param_groups, self._optimizer_class)
        for mine, saved in zip(self.param_groups, state_dict["param_groups"]):
            mine.update(copy.deepcopy(hyper(saved)))
        local = ShardedStateDict.local_part(
            state_dict,
            self.param_groups,
            self._local_to_global(self.rank),
            [len(idx) for idx in self.partition.per_rank[self.rank]],
        )
        # The local optimizer copies/casts the tensors onto the parameters' device and dtype.
        if self.overlap is not None:
            self.overlap.load_local_state(local)
        else:
            self.optim.load_state_dict(local)
        self._push_hyper()

    def _push_hyper(self) -> None:
        """Exposed ``param_groups`` hyperparameters -> the local optimizer."""
        if self.overlap is not None:
            self.overlap.push_hyper()
        else:
            copy_hyper(self.param_groups, self.optim.param_groups)

    def _local_state_dict(self) -> Dict[str, Any]:
        """The local optimizer's state dict (local indices, as ``Optimizer.state_dict``)."""
        if self.overlap is not None:
            return self.overlap.local_state_dict()
        return self.optim.state_dict()
