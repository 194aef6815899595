"""ZeRO stage 1: shard the optimizer state across the ranks of a process group.

:class:`ZeroRedundancyOptimizer` has the constructor and behaviour of
``torch.distributed.optim.ZeroRedundancyOptimizer``:

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
* ``overlap_with_ddp=True`` is rejected with ``NotImplementedError``.

Fault-tolerant mode
-------------------
Across replica groups, through a Manager, see :mod:`ft.optim.zero_ft`
(``FaultTolerantZeroRedundancyOptimizer``): shards follow the quorum, each shard's state
also lives on a buddy replica that steps it locally (0 bytes per step, 0 steps stale),
and a step that fails to commit restores every shard.  That module's docstring is the
reference for how it works.
"""

from __future__ import annotations

import copy
import json
import logging
import warnings
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ft.optim.partition import Partition, partition_params

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


def _check_optimizer_class(optimizer_class: Any) -> None:
    if isinstance(optimizer_class, Optimizer):
        raise TypeError(
            "optimizer_class must be an optimizer class such as torch.optim.Adam, not an "
            f"optimizer instance ({type(optimizer_class).__name__}); pass the class and its "
            "hyperparameters as keyword arguments"
        )
    if isinstance(optimizer_class, type):
        if not issubclass(optimizer_class, Optimizer):
            raise TypeError(
                "optimizer_class must be a subclass of torch.optim.Optimizer (e.g. "
                f"torch.optim.Adam); got {optimizer_class.__module__}.{optimizer_class.__qualname__}"
            )
    elif not callable(optimizer_class):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )


# ---------------------------------------------------------------------------------------------
# Safe encoding of a (local) optimizer state dict: JSON structure + raw tensor bytes.
# ---------------------------------------------------------------------------------------------


def _encode(obj: Any, tensors: List[torch.Tensor], path: str = "") -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"x": len(tensors) - 1, "dtype": str(obj.dtype).replace("torch.", ""),
                "shape": list(obj.shape)}
    if isinstance(obj, tuple):
        return {"t": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return {"l": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return {"d": [[_encode(k, tensors, path), _encode(v, tensors, f"{path}.{k}")]
                      for k, v in obj.items()]}
    if isinstance(obj, torch.dtype):
        return {"dt": str(obj).replace("torch.", "")}
    raise TypeError(
        f"consolidate_state_dict: cannot encode optimizer state value of type "
        f"{type(obj).__name__} at {path or '<root>'}"
    )


def _decode(obj: Any, tensors: List[torch.Tensor]) -> Any:
    if not isinstance(obj, dict):
        if isinstance(obj, list):
            raise ValueError("malformed state encoding")
        return obj
    if "x" in obj:
        return tensors[obj["x"]]
    if "t" in obj:
        return tuple(_decode(v, tensors) for v in obj["t"])
    if "l" in obj:
        return [_decode(v, tensors) for v in obj["l"]]
    if "d" in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj["d"]}
    if "dt" in obj:
        return getattr(torch, obj["dt"])
    raise ValueError("malformed state encoding")


def _tensor_specs(obj: Any, out: List[Tuple[int, str, List[int]]]) -> None:
    if isinstance(obj, dict):
        if "x" in obj:
            out.append((obj["x"], obj["dtype"], obj["shape"]))
            return
        for v in obj.values():
            _tensor_specs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _tensor_specs(v, out)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class ZeroRedundancyOptimizer(Optimizer):
    r"""Shard optimizer state across the ranks of ``process_group`` (ZeRO stage 1).

    Args:
        params: an iterable of tensors or of parameter-group dicts.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (e.g. ``torch.optim.Adam``);
            each rank builds one over the parameters it owns.
        process_group: the group to shard over (default: the default group).
        parameters_as_bucket_view: keep each rank's parameters in one flat buffer (the
            parameters become views into it) and broadcast one buffer per rank.
        overlap_with_ddp: not supported; ``True`` raises ``NotImplementedError``.
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
        if overlap_with_ddp:
            raise NotImplementedError(
                "ft.optim.ZeroRedundancyOptimizer does not support overlap_with_ddp=True. Use "
                "overlap_with_ddp=False (the default) and call step() after backward(); if you "
                "need the parameter broadcast overlapped with DDP's gradient communication, use "
                "torch.distributed.optim.ZeroRedundancyOptimizer with torch's DDP comm hook."
            )
        _check_optimizer_class(optimizer_class)
        if process_group is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "ZeroRedundancyOptimizer needs a process group: call "
                    "torch.distributed.init_process_group(...) first or pass process_group="
                )
            process_group = dist.group.WORLD

        self._initialized = False
        self._local: Optional[Optimizer] = None
        super().__init__(params, defaults)  # fills self.param_groups via add_param_group

        self._all_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._check_params(self._all_params)

        self.process_group = process_group
        self.parameters_as_bucket_view = bool(parameters_as_bucket_view)
        self._optimizer_class = optimizer_class
        self._optim_defaults = defaults
        self.rank, self.world_size = self._shard_coords()
        self.global_rank = dist.get_global_rank(process_group, self.rank)
        self._device = self._all_params[0].device

        self._check_ranks_agree()
        self._partition = self._compute_partition()
        self._local = self._build_local_optimizer()
        _copy_hyper(self._local.param_groups, self.param_groups)

        self._trainable_mask = self._get_trainable_mask()
        self._buckets: List[Optional[torch.Tensor]] = []
        self._plan: List[Dict[str, Any]] = []
        self._build_comm_plan()

        self._consolidated: Optional[List[Dict[str, Any]]] = None
        self._consolidated_groups: Optional[List[Dict[str, Any]]] = None
        self._steps_since_consolidate = 0
        self._initialized = True

    # ----------------------------------------------------------------------------- hooks
    # The fault-tolerant subclass overrides these two to shard across replica groups.

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
    def optim(self) -> Optimizer:
        """The local optimizer over this rank's shard (as torch's ``.optim``)."""
        assert self._local is not None
        return self._local

    @property
    def partition(self) -> Partition:
        """The current partition table (see :mod:`ft.optim.partition`)."""
        return self._partition

    def owner_of(self, param: torch.Tensor) -> int:
        """Rank that owns (steps and broadcasts) ``param``."""
        for g, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p is param:
                    return self._partition.owner[g][i]
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
        return [len(self.param_groups), len(self._all_params),
                sum(p.numel() for p in self._all_params), zlib.crc32(shapes)]

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
            raise TypeError(f"could not build {name} with {sorted(self._optim_defaults)}: {e}") from e
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
        return [self.param_groups[g]["params"][i] for g, i in self._partition.owned(rank)
                if self.param_groups[g]["params"][i].requires_grad]

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
                flat = torch.empty(sum(p.numel() for p in small), dtype=small[0].dtype,
                                   device=self._device)
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
            bucket = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                 device=self._device)
            off = 0
            for p in params:
                n = p.numel()
                bucket[off:off + n].copy_(p.data.reshape(-1))
                p.data = bucket[off:off + n].view_as(p)
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
                    works.append((r, dist.broadcast(bucket, group=group, group_src=r, async_op=True)))
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
                        p.data.copy_(flat[off:off + n].view_as(p))
                        off += n

    # ----------------------------------------------------------------------------- optimizer API

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Step this rank's shard, then broadcast every shard from its owner.

        Must be called on all ranks.  ``closure`` and ``kwargs`` go to the local optimizer.
        """
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

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a parameter group; call it on all ranks with the same group.

        Earlier groups keep their owners (the partition is computed group by group with a
        running load), so the local optimizer only gains this rank's share of the new group.
        """
        if not getattr(self, "_initialized", False):
            super().add_param_group(param_group)
            return
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
        group = self._comm_group()
        _copy_hyper(self.param_groups, self.optim.param_groups)
        tensors: List[torch.Tensor] = []
        meta = json.dumps(_encode(self.optim.state_dict(), tensors)).encode()
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        payload = [meta_t.to(self._device)] + [_as_bytes(t).to(self._device) for t in tensors]
        size = torch.tensor([len(meta), sum(t.numel() for t in payload)], dtype=torch.int64,
                            device=self._device)
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
        enc = json.loads(bytes(buf[:meta_len].numpy()).decode())
        specs: List[Tuple[int, str, List[int]]] = []
        _tensor_specs(enc, specs)
        specs.sort()
        tensors, off = [], meta_len
        for _, dtype_name, shape in specs:
            dtype = getattr(torch, dtype_name)
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            t = buf[off:off + nbytes].clone().view(dtype).reshape(shape)
            tensors.append(t)
            off += nbytes
        if off != buf.numel():
            raise RuntimeError("consolidate_state_dict: shard size mismatch")
        return _decode(enc, tensors)

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
                "again for the current state", stacklevel=2)
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

        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise bad("expected a dict with 'state' and 'param_groups' (from state_dict())")
        groups, state = state_dict["param_groups"], state_dict["state"]
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise bad("'param_groups' must be a list and 'state' a dict")
        if len(groups) != len(self.param_groups):
            raise bad(f"the dict has {len(groups)} parameter group(s), this optimizer has "
                      f"{len(self.param_groups)}")
        index_to_param: Dict[Any, torch.Tensor] = {}
        for g, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise bad(f"parameter group {g} has no 'params'")
            if len(saved["params"]) != len(mine["params"]):
                raise bad(f"parameter group {g} has {len(saved['params'])} parameter(s) in the "
                          f"dict but {len(mine['params'])} here")
            missing = set(_hyper(mine)) - set(_hyper(saved))
            extra = set(_hyper(saved)) - set(_hyper(mine)) - {"initial_lr"}
            if missing and extra:
                raise bad(f"parameter group {g} looks like another optimizer's: it lacks "
                          f"{sorted(missing)} and has {sorted(extra)} (this one is "
                          f"{getattr(self._optimizer_class, '__name__', self._optimizer_class)})")
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
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.dim() == p.dim() \
                        and v.shape != p.shape:
                    raise bad(f"state '{name}' of parameter {idx!r} has shape {tuple(v.shape)} "
                              f"but the parameter has shape {tuple(p.shape)} (a different model?)")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (from ``state_dict()``, or a plain optimizer's) on every
        rank; each rank keeps the state of the parameters it owns.  The input is not modified.
        """
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
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
        _copy_hyper(self.param_groups, self.optim.param_groups)
