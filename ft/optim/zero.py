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
      there is one parameter group; ``zero._overlap_info`` holds the bucket assignment;
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
import enum
import inspect
import logging
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from ft.checkpointing import serialization as ser
from ft.optim.functional import _FunctionalOptimizer
from ft.optim.partition import Partition, partition_params

# The module of torch's DDP hooks that step torch's ZeRO (see _overlap_with_ddp).
_TORCH_ZERO_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook"

__all__ = ["ZeroRedundancyOptimizer"]

logger = logging.getLogger(__name__)

# Without parameters_as_bucket_view, parameters smaller than this are packed into one flat
# buffer per owner for the broadcast; larger ones are broadcast in place.
_PACK_BYTES = 256 * 1024

# Group keys that are not hyperparameters.
_NOT_HYPER = ("params", "param_names")


def _hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def _copy_hyper(src: List[Dict[str, Any]], dst: List[Dict[str, Any]]) -> None:
    if len(src) != len(dst):
        raise AssertionError("parameter group count mismatch between exposed and local optimizer")
    for s, d in zip(src, dst):
        for k, v in s.items():
            if k not in _NOT_HYPER:
                d[k] = v


def _class_name(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


def _functional_classes() -> set:
    """Every class this process knows as a functional optimizer: ft's (registered or
    subclassing ft's base) and, if torch's registry is loaded, torch's."""
    from ft.optim import functional as ftf

    known = {c for c in ftf._FUNCTIONAL_OPTIMS.values() if isinstance(c, type)}
    # Not imported here: importing torch.distributed.optim scripts its functional optimizers
    # (TorchScript deprecation warnings). A class of torch's can only exist once it is loaded.
    torch_utils = sys.modules.get("torch.distributed.optim.utils")
    if torch_utils is not None:
        known.update(c for c in torch_utils.functional_optim_map.values() if isinstance(c, type))
    return known


def _is_functional(optimizer_class: Any) -> bool:
    if not isinstance(optimizer_class, type):
        return False
    return (
        issubclass(optimizer_class, _FunctionalOptimizer)
        or optimizer_class in _functional_classes()
    )


def _functional_counterpart(optimizer_class: Any) -> Optional[type]:
    """ft's functional class for ``optimizer_class`` (ft's registry first, then torch's if
    loaded), or None."""
    from ft.optim import functional as ftf

    for registry in (
        ftf._FUNCTIONAL_OPTIMS,
        getattr(sys.modules.get("torch.distributed.optim.utils"), "functional_optim_map", {}),
    ):
        try:
            found = registry.get(optimizer_class)
        except TypeError:  # unhashable: no optimizer class
            return None
        if found is not None:
            return found
    return None


def _optimizer_constructor(optimizer_class: Any, overlap_with_ddp: bool) -> Any:
    """What each rank calls to build its local optimizer; raises with torch's error types.

    Torch's rule (facts, not code): a functional optimizer is stepped with explicit
    gradients, which only the DDP hooks supply, so it is accepted only with overlap; with
    overlap, a ``torch.optim`` class is replaced by its functional counterpart. Both refusals
    are ``ValueError`` in torch; a non-class is a ``TypeError`` there (it is not callable).
    """
    if overlap_with_ddp:
        if _is_functional(optimizer_class):
            return optimizer_class
        counterpart = _functional_counterpart(optimizer_class)
        if counterpart is not None:
            return counterpart
        what = (
            f"an optimizer instance ({type(optimizer_class).__name__}); pass its class"
            if isinstance(optimizer_class, Optimizer)
            else _class_name(optimizer_class)
        )
        raise ValueError(
            "overlap_with_ddp=True steps a functional optimizer inside the DDP hook, but "
            f"optimizer_class is {what}, which has no functional counterpart. Pass a "
            "torch.optim class that has one (Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, "
            "Adamax, Rprop), a functional class (ft.optim.FunctionalAdam, ...), or register "
            "one with ft.optim.functional.register_functional_optim"
        )
    if isinstance(optimizer_class, Optimizer):
        raise TypeError(
            "optimizer_class must be an optimizer class such as torch.optim.Adam, not an "
            f"optimizer instance ({type(optimizer_class).__name__}); pass the class and its "
            "hyperparameters as keyword arguments"
        )
    if _is_functional(optimizer_class):
        raise ValueError(
            f"optimizer_class {_class_name(optimizer_class)} is a functional optimizer, which "
            "is only accepted with overlap_with_ddp=True (it is stepped with explicit "
            "gradients, which only the DDP hooks of ft.optim.zero_hooks supply). Pass the "
            "torch.optim class instead (e.g. torch.optim.Adam for FunctionalAdam)"
        )
    if isinstance(optimizer_class, type):
        if not issubclass(optimizer_class, Optimizer):
            raise TypeError(
                "optimizer_class must be a subclass of torch.optim.Optimizer (e.g. "
                f"torch.optim.Adam); got {_class_name(optimizer_class)}"
            )
    elif not callable(optimizer_class):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    return optimizer_class


def check_optimizer_class(optimizer_class: Any) -> None:
    """The checks for a non-overlapped local optimizer (also used by ``zero_ft``)."""
    _optimizer_constructor(optimizer_class, overlap_with_ddp=False)


def _accepts_empty_flag(ctor: Any) -> bool:
    try:
        return "_allow_empty_param_list" in inspect.signature(ctor).parameters
    except (TypeError, ValueError):  # no signature (a builtin or C++ class)
        return False


def _hyper_to_functional(group: Dict[str, Any], fopt: Any) -> None:
    """Copy the exposed group's hyperparameters into a functional optimizer's ``defaults``
    (which its step reads); Adam-like ones spell ``betas`` as ``beta1``/``beta2``."""
    d = getattr(fopt, "defaults", None)
    if not isinstance(d, dict):
        return
    for k in d:
        if k in group:
            d[k] = group[k]
    betas = group.get("betas")
    if betas is not None and "beta1" in d and "beta2" in d:
        d["beta1"], d["beta2"] = betas[0], betas[1]


def _functional_hyper(fopt: Any) -> Dict[str, Any]:
    """A functional optimizer's hyperparameters in ``torch.optim`` spelling."""
    d = dict(getattr(fopt, "defaults", None) or {})
    if "beta1" in d and "beta2" in d:
        d["betas"] = (d.pop("beta1"), d.pop("beta2"))
    return d


# ---------------------------------------------------------------------------------------------
# Safe encoding of a (local) optimizer state dict: JSON structure + raw tensor bytes.
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Overlap with DDP: what the hooks of ft.optim.zero_hooks need.
# ---------------------------------------------------------------------------------------------


class _OverlapStatus(enum.IntEnum):
    """Where an overlapped ZeRO stands (torch's names): waiting for DDP to fix its buckets,
    recording them, or stepping."""

    UNINITIALIZED = 0
    DDP_HAS_REBUILT_BUCKETS = 1
    INITIALIZED = 2


@dataclass
class _Assignment:
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
class _OverlapInfo:
    """``zero._overlap_info`` (attribute names as torch's, contents ft's own).

    Fixed once initialized: ``params_per_bucket`` (DDP's buckets, in reduction order),
    ``assignments[b]`` (the :class:`_Assignment` s of bucket ``b``, by rank),
    ``assigned_ranks_per_bucket``, ``params_per_rank`` (each rank's local optimizer order:
    bucket order), ``offsets`` (bucket index -> position of that bucket's first parameter in
    this rank's local optimizer; only buckets this rank steps), ``num_bucket_assignments``,
    ``total_size``. Per iteration: the buckets and hook futures waiting for their step, and
    the broadcast handles.
    """

    world_size: int
    status: _OverlapStatus = _OverlapStatus.UNINITIALIZED
    shard_buckets: bool = False
    params_per_bucket: List[List[torch.Tensor]] = field(default_factory=list)
    assignments: List[List[_Assignment]] = field(default_factory=list)
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


def _assign_buckets(
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


def _bucket_gradients(bucket: Any, result: Any) -> List[torch.Tensor]:
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


class _ZeroJoinHook(JoinHook):
    """Shadows a joined rank's ``step()``: it steps its shard with the gradients it holds and
    takes part in the broadcasts (torch's behaviour), without notifying the join context
    again (the context itself matches that all-reduce)."""

    def __init__(self, zero: "ZeroRedundancyOptimizer") -> None:
        self.zero = zero

    def main_hook(self) -> None:
        if self.zero._overlaps_ddp:
            # Nothing to shadow here: with overlap the steps and broadcasts live in the DDP
            # comm hook, which DDP's own join hook runs on the joined rank.
            return
        self.zero._step(None, {}, notify_join=False)


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
        ctor = _optimizer_constructor(optimizer_class, overlap_with_ddp)
        if process_group is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "ZeroRedundancyOptimizer needs a process group: call "
                    "torch.distributed.init_process_group(...) first or pass process_group="
                )
            process_group = dist.group.WORLD

        self._initialized = False
        self._local: Any = None
        self._overlaps_ddp = overlap_with_ddp
        super().__init__(params, defaults)  # fills self.param_groups via add_param_group
        Joinable.__init__(self)

        self._all_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._check_params(self._all_params)

        self.process_group = process_group
        self._optimizer_class = optimizer_class
        self._optim_constructor = ctor
        self._optim_defaults = defaults
        self.rank, self.world_size = self._shard_coords()
        self.global_rank = dist.get_global_rank(process_group, self.rank)
        self._device = self._all_params[0].device
        self._consolidated: Optional[List[Dict[str, Any]]] = None
        self._consolidated_groups: Optional[List[Dict[str, Any]]] = None
        self._steps_since_consolidate = 0
        self._buckets: List[Optional[torch.Tensor]] = []
        self._plan: List[Dict[str, Any]] = []

        self._check_ranks_agree()
        if overlap_with_ddp:
            self._init_overlap_pending(bool(parameters_as_bucket_view))
            self._initialized = True
            return

        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._partition = self._compute_partition()
        self._local = self._build_local_optimizer()
        _copy_hyper(self._local.param_groups, self.param_groups)

        self._trainable_mask = self._get_trainable_mask()
        self._build_comm_plan()
        self._initialized = True

    # torch's ddp_comm_hooks.ddp_zero_hook functions read this attribute first, then reach
    # into torch's own ZeroRedundancyOptimizer internals from inside backward, which ft's
    # does not have: they are refused here, when the hook is made, naming ft's equivalents.
    @property
    def _overlap_with_ddp(self) -> bool:
        if sys._getframe(1).f_globals.get("__name__") == _TORCH_ZERO_HOOKS:
            raise TypeError(
                "torch's ddp_zero_hook functions need torch's ZeroRedundancyOptimizer; with "
                "ft.optim.ZeroRedundancyOptimizer use ft.optim.zero_hooks.hook_with_zero_step "
                "or hook_with_zero_step_interleaved (the same arguments): "
                "ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))"
            )
        return self._overlaps_ddp

    # ----------------------------------------------------------------------------- hooks
    # The sharding dimension and its group, in one place (a subclass may shard elsewhere).

    def _shard_coords(self) -> Tuple[int, int]:
        """(rank, world_size) of the sharding dimension."""
        return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)

    def _comm_group(self) -> Any:
        return self.process_group

    # ----------------------------------------------------------------------------- state

    @property
    def state(self):  # type: ignore[override]
        """The optimizer state of the parameters this rank owns (the local optimizer's)."""
        local = self.__dict__.get("_local")
        return local.state if local is not None else self.__dict__.get("_base_state")

    @state.setter
    def state(self, value) -> None:
        self.__dict__["_base_state"] = value

    @property
    def optim(self) -> Any:
        """The local optimizer over this rank's shard (as torch's ``.optim``); with
        ``overlap_with_ddp=True``, a functional optimizer that exists once the DDP buckets
        have been assigned."""
        if self._local is None:
            self._check_overlap_initialized()
        return self._local

    @property
    def partition(self) -> Partition:
        """The current partition table (see :mod:`ft.optim.partition`). With overlap it
        follows the DDP buckets; a parameter in no bucket (frozen) has owner -1."""
        self._check_overlap_initialized()
        return self._partition

    def owner_of(self, param: torch.Tensor) -> int:
        """Rank that owns (steps and broadcasts) ``param``."""
        part = self.partition
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return part.owner[g][i]
        raise KeyError("tensor is not a parameter of this optimizer")

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
            local = dict(_hyper(group))
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
        return [offsets[g] + i for g, i in self._partition.owned(rank)]

    # ----------------------------------------------------------------------------- broadcast

    def _get_trainable_mask(self) -> List[bool]:
        return [p.requires_grad for p in self._all_params]

    def _owned_trainable(self, rank: int) -> List[torch.Tensor]:
        return [
            self.param_groups[g]["params"][i]
            for g, i in self._partition.owned(rank)
            if self.param_groups[g]["params"][i].requires_grad
        ]

    def _build_comm_plan(self) -> None:
        """Decide, identically on every rank, what is broadcast from whom and how."""
        self._plan = []
        if self.parameters_as_bucket_view:
            self._build_buckets()
            return
        for r in range(self.world_size):
            small, large = [], []
            for p in self._owned_trainable(r):
                if p.numel() * p.element_size() < _PACK_BYTES or not p.data.is_contiguous():
                    small.append(p)
                else:
                    large.append(p)
            flat = None
            if small:
                flat = torch.empty(
                    sum(p.numel() for p in small), dtype=small[0].dtype, device=self._device
                )
            self._plan.append({"small": small, "large": large, "flat": flat})

    def _build_buckets(self) -> None:
        old_members = {id(p) for plan in self._plan for p in plan.get("params", [])}
        self._plan = []
        self._buckets = []
        owned_all = set()
        for r in range(self.world_size):
            params = self._owned_trainable(r)
            owned_all.update(id(p) for p in params)
            if not params:
                self._buckets.append(None)
                self._plan.append({"params": []})
                continue
            bucket = torch.empty(
                sum(p.numel() for p in params), dtype=params[0].dtype, device=self._device
            )
            off = 0
            for p in params:
                n = p.numel()
                bucket[off : off + n].copy_(p.data.reshape(-1))
                p.data = bucket[off : off + n].view_as(p)
                off += n
            self._buckets.append(bucket)
            self._plan.append({"params": params})
        # Parameters that left the buckets (now frozen) get storage of their own again.
        for p in self._all_params:
            if id(p) in old_members and id(p) not in owned_all:
                p.data = p.data.detach().clone()

    def _broadcast_params(self) -> None:
        group = self._comm_group()
        works: List[Tuple[int, Any]] = []
        if self.parameters_as_bucket_view:
            for r, bucket in enumerate(self._buckets):
                if bucket is not None:
                    works.append(
                        (r, dist.broadcast(bucket, group=group, group_src=r, async_op=True))
                    )
            for _, w in works:
                w.wait()
            return
        mine = self._plan[self.rank]
        if mine["flat"] is not None:
            torch.cat([p.detach().reshape(-1) for p in mine["small"]], out=mine["flat"])
        pending: List[Tuple[int, List[Any]]] = []
        for r, plan in enumerate(self._plan):
            ws = []
            if plan["flat"] is not None:
                ws.append(dist.broadcast(plan["flat"], group=group, group_src=r, async_op=True))
            for p in plan["large"]:
                ws.append(dist.broadcast(p.data, group=group, group_src=r, async_op=True))
            pending.append((r, ws))
        for r, ws in pending:
            for w in ws:
                w.wait()
            plan = self._plan[r]
            if r != self.rank and plan["flat"] is not None:
                off = 0
                flat = plan["flat"]
                with torch.no_grad():
                    for p in plan["small"]:
                        n = p.numel()
                        p.data.copy_(flat[off : off + n].view_as(p))
                        off += n

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
        if self._overlaps_ddp:
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
            self._build_comm_plan()
        _copy_hyper(self.param_groups, self.optim.param_groups)
        if closure is None:
            loss = self.optim.step(**kwargs)
        else:
            with torch.enable_grad():
                loss = self.optim.step(closure=closure, **kwargs)
        _copy_hyper(self.optim.param_groups, self.param_groups)
        self._broadcast_params()
        self._steps_since_consolidate += 1
        return loss

    # ----------------------------------------------------------------------------- Joinable

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that shadows ``step()`` on a rank that ran out of inputs (no kwargs)."""
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    # ----------------------------------------------------------------------------- overlap
    # Called by the hooks of ft.optim.zero_hooks, all on the backward (autograd) thread and in
    # bucket order, so every rank issues the same collectives in the same order.

    def _init_overlap_pending(self, bucket_view: bool) -> None:
        if len(self.param_groups) != 1:
            raise ValueError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True supports a single parameter "
                f"group (its functional optimizer has one); got {len(self.param_groups)}"
            )
        if bucket_view:
            # As torch: the DDP buckets decide the flat buffers instead.
            logger.warning(
                "parameters_as_bucket_view=True is ignored with overlap_with_ddp=True: "
                "the parameters are flattened per DDP bucket instead"
            )
        self.parameters_as_bucket_view = False
        self._overlap_info = _OverlapInfo(self.world_size)
        self._partition = None  # type: ignore[assignment]
        # Build the optimizers once, on no real parameter, now: bad hyperparameters fail here
        # and not inside the backward pass. Their hyperparameters fill in param_groups (for LR
        # schedulers, and so that state_dict() has the same groups as without overlap).
        cls = self._optimizer_class
        if isinstance(cls, type) and issubclass(cls, Optimizer):
            ref = self._all_params[0]
            dummy = torch.zeros(1, dtype=ref.dtype, device=ref.device)
            try:
                plain = cls([dummy], **self._optim_defaults)
            except TypeError as e:
                raise TypeError(
                    f"could not build {cls.__name__} with {sorted(self._optim_defaults)}: {e}"
                ) from e
            for k, v in _hyper(plain.param_groups[0]).items():
                self.param_groups[0].setdefault(k, v)
        if _accepts_empty_flag(self._optim_constructor):
            try:
                probe = self._optim_constructor(
                    [], **self._optim_defaults, _allow_empty_param_list=True
                )
            except TypeError as e:
                raise TypeError(
                    f"could not build {_class_name(self._optim_constructor)} with "
                    f"{sorted(self._optim_defaults)}: {e}"
                ) from e
            for k, v in _functional_hyper(probe).items():
                self.param_groups[0].setdefault(k, v)
        self._trainable_mask = self._get_trainable_mask()

    def _check_overlap_initialized(self) -> None:
        if self._overlaps_ddp and self._overlap_info.status != _OverlapStatus.INITIALIZED:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) is not initialized yet: the "
                "shards follow DDP's gradient buckets, which are assigned during the first "
                "iterations of training (see ft.optim.zero_hooks). Call this after them."
            )

    def _overlap_prepare(self, ddp: Any, bucket: Any) -> bool:
        """Per bucket, before anything else: True when this iteration steps, False while the
        buckets are still being learned (as torch: nothing is updated then)."""
        info = self._overlap_info
        index = bucket.index()
        if info.status == _OverlapStatus.INITIALIZED:
            if index == 0:
                self._overlap_begin_iteration()
            return True
        if not ddp._has_rebuilt_buckets:
            # DDP reorders its buckets after the first iteration(s): nothing to learn yet.
            return False
        if info.status == _OverlapStatus.UNINITIALIZED:
            if index != 0:
                return False  # registered mid-iteration: start with the next one
            info.status = _OverlapStatus.DDP_HAS_REBUILT_BUCKETS
            info.params_per_bucket = []
        if index != len(info.params_per_bucket):
            raise AssertionError(
                f"DDP bucket {index} arrived out of order while recording "
                f"(expected {len(info.params_per_bucket)})"
            )
        info.params_per_bucket.append(list(bucket.parameters()))
        if bucket.is_last():
            self._init_zero_for_overlap()
        return False

    def _init_zero_for_overlap(self) -> None:
        """Assign the recorded buckets, flatten each assignment, build the local optimizer."""
        info = self._overlap_info
        buckets = info.params_per_bucket
        params = self.param_groups[0]["params"]
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
                device=self._device,
            )
            everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
            dist.all_gather(everyone, mine, group=self._comm_group())
            if any(not torch.equal(t, everyone[0]) for t in everyone):
                raise RuntimeError(
                    "ZeroRedundancyOptimizer overlap: ranks disagree on DDP's bucket layout "
                    f"[buckets, crc]: {[t.tolist() for t in everyone]}"
                )
        pieces = _assign_buckets(numels, self.world_size, info.shard_buckets)
        info.total_size = sum(sum(n) for n in numels) if info.shard_buckets else None
        info.params_per_rank = [[] for _ in range(self.world_size)]
        info.assignments, info.assigned_ranks_per_bucket, info.offsets = [], [], {}
        for b, bp in enumerate(buckets):
            row = []
            for r, off, n in pieces[b]:
                a = _Assignment(b, r, off, bp[off : off + n])
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
        self._partition = Partition(
            world_size=self.world_size,
            per_rank=tuple(per_rank),
            owner=(tuple(owner),),
            loads=tuple(sum(p.numel() for p in ps) for ps in info.params_per_rank),
        )

        local = list(info.params_per_rank[self.rank])
        try:
            if _accepts_empty_flag(self._optim_constructor):
                self._local = self._optim_constructor(
                    local, **self._optim_defaults, _allow_empty_param_list=True
                )
            else:
                self._local = self._optim_constructor(local, **self._optim_defaults)
        except TypeError as e:
            raise TypeError(
                f"could not build {_class_name(self._optim_constructor)} with "
                f"{sorted(self._optim_defaults)}: {e}"
            ) from e
        if not callable(getattr(self._local, "step", None)):
            raise TypeError(f"{_class_name(self._optim_constructor)} has no step(gradients)")
        self._push_hyper()
        self._trainable_mask = self._get_trainable_mask()
        info.status = _OverlapStatus.INITIALIZED
        logger.info(
            "ZeRO overlap: rank %d steps %d parameter(s) in %d bucket(s); %d bucket(s), "
            "%d assignment(s)",
            self.rank,
            len(local),
            len(info.offsets),
            len(buckets),
            info.num_bucket_assignments,
        )

    def _overlap_begin_iteration(self) -> None:
        info = self._overlap_info
        if info.bucket_index_to_future or info.broadcast_handles:
            raise AssertionError(
                "ZeRO overlap: the previous iteration did not finish (a DDP "
                "backward pass was interrupted?)"
            )
        if self._get_trainable_mask() != self._trainable_mask:
            raise RuntimeError(
                "ZeroRedundancyOptimizer with overlap_with_ddp=True does not support changing "
                "requires_grad at run time: its shards follow DDP's gradient buckets, which "
                "were fixed with the old set of trainable parameters"
            )
        # Once per iteration, on every rank alike: an LR scheduler's changes take effect here.
        self._push_hyper()

    def _overlap_record(self, bucket: Any, fut: Any) -> None:
        """Keep ``bucket`` and its reduction future until its step (owned buckets only)."""
        info = self._overlap_info
        index = bucket.index()
        seen = info.bucket_indices_seen
        if (seen[-1] + 1 if seen else 0) != index:
            raise AssertionError(f"DDP bucket {index} arrived out of order (after {seen})")
        seen.append(index)
        if index in info.offsets:
            info.bucket_index_to_bucket[index] = bucket
            info.bucket_index_to_future[index] = fut

    @torch.no_grad()
    def _overlap_step_bucket(self, index: int) -> None:
        """Step this rank's share of bucket ``index`` (waits for its reduction), then start
        the broadcasts of every share of the bucket, by rank."""
        info = self._overlap_info
        if index in info.offsets:
            bucket = info.bucket_index_to_bucket.pop(index)
            fut = info.bucket_index_to_future.pop(index)
            fut.wait()
            grads = _bucket_gradients(bucket, fut.value())
            mine = next(a for a in info.assignments[index] if a.rank == self.rank)
            start, n = info.offsets[index], len(mine.params)
            mine_grads = grads[mine.offset : mine.offset + n]
            if isinstance(self._local, _FunctionalOptimizer):
                # ft's own functional optimizers update a subset directly: O(bucket), not
                # O(all local parameters) per bucket as a list of None-padded gradients.
                ps = mine.params
                self._local._update(ps, mine_grads, self._local._states(ps, mine_grads))
            else:
                # Any other functional optimizer: torch's protocol, one entry per local
                # parameter, None for "do not update".
                gradients: List[Optional[torch.Tensor]] = [None] * len(self._local_params())
                gradients[start : start + n] = mine_grads
                self._local.step(gradients)
        group = self._comm_group()
        for a in info.assignments[index]:
            info.broadcast_handles.append(
                dist.broadcast(a.flat, group=group, group_src=a.rank, async_op=True)
            )

    def _overlap_finish_iteration(self) -> None:
        """Wait for every broadcast: the parameters are final when backward() returns."""
        info = self._overlap_info
        if len(info.broadcast_handles) != info.num_bucket_assignments:
            raise AssertionError(
                f"ZeRO overlap: {len(info.broadcast_handles)} broadcasts for "
                f"{info.num_bucket_assignments} bucket assignments"
            )
        for w in info.broadcast_handles:
            w.wait()
        info.clear_per_iter_info()
        self._steps_since_consolidate += 1
        # The hook stepped, not step(): tell torch's LR schedulers (they look for this flag,
        # set by their wrapper of step(), and warn "scheduler.step() before optimizer.step()").
        self._opt_called = True

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group; call it on all ranks with the same group.

        Earlier groups keep their owners (the partition is computed group by group with a
        running load), so the local optimizer only gains this rank's share of the new group.
        """
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
        if self._overlaps_ddp:
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
        _copy_hyper(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._trainable_mask = self._get_trainable_mask()
        self._build_comm_plan()

    # ----------------------------------------------------------------------------- state dicts

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on rank ``to`` (collective).

        Afterwards ``state_dict()`` works on rank ``to`` (only there), until the next call.
        """
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is not a rank of a group of size {self.world_size}")
        self._check_overlap_initialized()
        group = self._comm_group()
        self._push_hyper()
        # The checkpoint transports' encoding (ft.checkpointing.serialization): nothing is
        # unpickled, and the receiver validates the header before it trusts any size in it.
        tree, specs, tensors = ser.flatten(self._local_state_dict())
        meta = ser.encode_header(tree, specs)
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        payload = [meta_t.to(self._device)] + [ser.byte_view(t).to(self._device) for t in tensors]
        size = torch.tensor(
            [len(meta), sum(t.numel() for t in payload)], dtype=torch.int64, device=self._device
        )
        sizes = [size]
        if self.world_size > 1:
            sizes = [torch.empty_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=group)
        sizes_l = [s.tolist() for s in sizes]

        if self.rank != to:
            self._consolidated = None
            self._consolidated_groups = None
            dist.send(torch.cat(payload), group=group, group_dst=to)
            return

        shards: List[Dict[str, Any]] = []
        for r in range(self.world_size):
            meta_len, total = sizes_l[r]
            if r == self.rank:
                buf = torch.cat(payload).cpu()
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self._device)
                dist.recv(buf, group=group, group_src=r)
                buf = buf.cpu()
            shards.append(self._decode_shard(buf, meta_len))
        self._consolidated = shards
        self._consolidated_groups = [copy.deepcopy(_hyper(g)) for g in self.param_groups]
        self._steps_since_consolidate = 0

    @staticmethod
    def _decode_shard(buf: torch.Tensor, meta_len: int) -> Dict[str, Any]:
        _, tree, specs = ser.decode_header(bytes(buf[:meta_len].numpy()))
        tensors, off = [], meta_len
        for spec in specs:
            if off + spec.nbytes > buf.numel():
                raise RuntimeError(
                    "consolidate_state_dict: a shard is shorter than its header says"
                )
            t = buf[off : off + spec.nbytes].clone().view(spec.dtype).reshape(spec.shape)
            tensors.append(ser.finalize(t, spec))
            off += spec.nbytes
        if off != buf.numel():
            raise RuntimeError("consolidate_state_dict: shard size mismatch")
        return ser.unflatten(tree, tensors)

    def state_dict(self) -> Dict[str, Any]:
        """The full optimizer state, as a plain ``optimizer_class`` over all parameters would
        return it (global parameter indices).

        Valid only on the rank that ``consolidate_state_dict(to=...)`` targeted, and reflects
        the state at that call.
        """
        if self._consolidated is None or self._consolidated_groups is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.state_dict(): the optimizer state has not been "
                f"consolidated on this rank (rank {self.rank}). Call "
                f"consolidate_state_dict(to={self.rank}) on all ranks first; the full state "
                "dict is then available on that rank only."
            )
        if self._steps_since_consolidate:
            warnings.warn(
                f"ZeroRedundancyOptimizer.state_dict() returns the state consolidated "
                f"{self._steps_since_consolidate} step(s) ago; call consolidate_state_dict() "
                "again for the current state",
                stacklevel=2,
            )
        state: Dict[int, Any] = {}
        for r, shard in enumerate(self._consolidated):
            glob = self._local_to_global(r)
            local_order = [i for g in shard["param_groups"] for i in g["params"]]
            if len(local_order) != len(glob):
                raise AssertionError("consolidated shard does not match the partition")
            for pos, li in enumerate(local_order):
                if li in shard["state"]:
                    state[glob[pos]] = shard["state"][li]
        groups, off = [], 0
        for g, hyper in zip(self.param_groups, self._consolidated_groups):
            out = copy.deepcopy(hyper)
            out["params"] = list(range(off, off + len(g["params"])))
            if "param_names" in g:
                out["param_names"] = list(g["param_names"])
            off += len(g["params"])
            groups.append(out)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _validate_state_dict(self, state_dict: Any) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"ZeroRedundancyOptimizer.load_state_dict: {msg}")

        if (
            not isinstance(state_dict, dict)
            or "state" not in state_dict
            or "param_groups" not in state_dict
        ):
            raise bad("expected a dict with 'state' and 'param_groups' (from state_dict())")
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise bad("'param_groups' must be a list and 'state' a dict")
        if len(groups) != len(self.param_groups):
            raise bad(
                f"the dict has {len(groups)} parameter group(s), this optimizer has "
                f"{len(self.param_groups)}"
            )
        index_to_param: Dict[Any, torch.Tensor] = {}
        for g, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise bad(f"parameter group {g} has no 'params'")
            if len(saved["params"]) != len(mine["params"]):
                raise bad(
                    f"parameter group {g} has {len(saved['params'])} parameter(s) in the "
                    f"dict but {len(mine['params'])} here"
                )
            missing = set(_hyper(mine)) - set(_hyper(saved))
            extra = set(_hyper(saved)) - set(_hyper(mine)) - {"initial_lr"}
            if missing and extra:
                raise bad(
                    f"parameter group {g} looks like another optimizer's: it lacks "
                    f"{sorted(missing)} and has {sorted(extra)} (this one is "
                    f"{getattr(self._optimizer_class, '__name__', self._optimizer_class)})"
                )
            for idx, p in zip(saved["params"], mine["params"]):
                if idx in index_to_param:
                    raise bad(f"parameter index {idx!r} appears twice")
                index_to_param[idx] = p
        for idx, value in state.items():
            if idx not in index_to_param:
                raise bad(f"state for parameter index {idx!r}, which no parameter group lists")
            p = index_to_param[idx]
            if not isinstance(value, dict):
                raise bad(f"state of parameter {idx!r} is a {type(value).__name__}, not a dict")
            for name, v in value.items():
                if (
                    isinstance(v, torch.Tensor)
                    and v.dim() > 0
                    and v.dim() == p.dim()
                    and v.shape != p.shape
                ):
                    raise bad(
                        f"state '{name}' of parameter {idx!r} has shape {tuple(v.shape)} "
                        f"but the parameter has shape {tuple(p.shape)} (a different model?)"
                    )

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()``, or a plain optimizer's) on every
        rank; each rank keeps the state of the parameters it owns.  The input is not modified.
        """
        self._check_overlap_initialized()
        self._validate_state_dict(state_dict)
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        glob_ids: List[Any] = [i for g in saved_groups for i in g["params"]]
        for mine, saved in zip(self.param_groups, saved_groups):
            mine.update(copy.deepcopy(_hyper(saved)))
        local_state = {}
        for li, gi in enumerate(self._local_to_global(self.rank)):
            key = glob_ids[gi]
            if key in saved_state:
                # Copy: the local optimizer updates its state in place ('step' included).
                local_state[li] = copy.deepcopy(saved_state[key])
        local_groups, li = [], 0
        for g, group in enumerate(self.param_groups):
            n = len(self._partition.per_rank[self.rank][g])
            lg = dict(_hyper(group))
            lg["params"] = list(range(li, li + n))
            li += n
            local_groups.append(lg)
        # The local optimizer copies/casts the tensors onto the parameters' device and dtype.
        self._load_local_state({"state": local_state, "param_groups": local_groups})
        self._push_hyper()

    # ----------------------------------------------------------------------------- local optimizer
    # Without overlap it is a torch.optim.Optimizer; with overlap a functional optimizer, which
    # has one parameter group, hyperparameters in ``defaults`` and no state_dict methods.

    def _push_hyper(self) -> None:
        """Exposed ``param_groups`` hyperparameters -> the local optimizer."""
        if self._overlaps_ddp:
            _hyper_to_functional(self.param_groups[0], self.optim)
        else:
            _copy_hyper(self.param_groups, self.optim.param_groups)

    def _local_params(self) -> List[torch.Tensor]:
        if self._overlaps_ddp:
            return list(self._overlap_info.params_per_rank[self.rank])
        return [p for g in self.optim.param_groups for p in g["params"]]

    def _local_state_dict(self) -> Dict[str, Any]:
        """The local optimizer's state dict (local indices, as ``Optimizer.state_dict``)."""
        if not self._overlaps_ddp:
            return self.optim.state_dict()
        params = self._local_params()
        state = {
            i: dict(self.optim.state[p]) for i, p in enumerate(params) if p in self.optim.state
        }
        group = dict(_hyper(self.param_groups[0]), params=list(range(len(params))))
        return {"state": state, "param_groups": [group]}

    def _load_local_state(self, local: Dict[str, Any]) -> None:
        if not self._overlaps_ddp:
            self.optim.load_state_dict(local)
            return
        # As Optimizer.load_state_dict: copies, floating state cast to the parameter's dtype
        # and device; 'step' keeps its own (a CPU scalar unless the optimizer is fused).
        params = self._local_params()
        self.optim.state.clear()
        for i, st in local["state"].items():
            p = params[i]
            new = {}
            for k, v in st.items():
                if not torch.is_tensor(v):
                    new[k] = copy.deepcopy(v)
                elif k == "step":
                    fused = bool(getattr(self.optim, "fused", False))
                    new[k] = v.to(device=p.device, copy=True) if fused else v.clone()
                else:
                    new[k] = v.to(
                        device=p.device,
                        dtype=p.dtype if v.is_floating_point() else v.dtype,
                        copy=True,
                    )
            self.optim.state[p] = new
