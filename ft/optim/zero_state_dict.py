"""The full state dict of a sharded ZeRO optimizer: gathering the shards on one rank, assembling
a plain optimizer's state dict from them, and checking and splitting one for loading."""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ft.checkpointing import serialization as ser
from ft.optim.zero_local import hyper

__all__ = ["ShardedStateDict"]


class ShardedStateDict:
    """The state-dict side of one ``ZeroRedundancyOptimizer`` on one rank.

    Owns the shards gathered by the last :meth:`consolidate` (on the target rank only) and
    the count of steps taken since, which :meth:`full` warns about. Knows nothing of how the
    shards were made: the ZeRO optimizer passes its local state dict, its exposed
    ``param_groups`` and the map from each rank's local indices to global ones. Kept apart
    because consolidation is a protocol of its own (sizes, point-to-point transfer, a safe
    encoding) that the step never needs.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, group: Any) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.group = group
        self.shards: Optional[List[Dict[str, Any]]] = None
        self.groups: Optional[List[Dict[str, Any]]] = None
        self.steps_since_consolidate = 0

    def note_step(self) -> None:
        self.steps_since_consolidate += 1

    def consolidate(
        self, to: int, local_state_dict: Dict[str, Any], param_groups: List[Dict[str, Any]]
    ) -> None:
        """Gathers every rank's ``local_state_dict`` on rank ``to`` (collective)."""
        group = self.group
        # The checkpoint transports' encoding (ft.checkpointing.serialization): nothing is
        # unpickled, and the receiver validates the header before it trusts any size in it.
        tree, specs, tensors = ser.flatten(local_state_dict)
        meta = ser.encode_header(tree, specs)
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        payload = [meta_t.to(self.device)] + [ser.byte_view(t).to(self.device) for t in tensors]
        size = torch.tensor(
            [len(meta), sum(t.numel() for t in payload)], dtype=torch.int64, device=self.device
        )
        sizes = [size]
        if self.world_size > 1:
            sizes = [torch.empty_like(size) for _ in range(self.world_size)]
            dist.all_gather(sizes, size, group=group)
        sizes_l = [s.tolist() for s in sizes]

        if self.rank != to:
            self.shards = None
            self.groups = None
            dist.send(torch.cat(payload), group=group, group_dst=to)
            return

        shards: List[Dict[str, Any]] = []
        for r in range(self.world_size):
            meta_len, total = sizes_l[r]
            if r == self.rank:
                buf = torch.cat(payload).cpu()
            else:
                buf = torch.empty(total, dtype=torch.uint8, device=self.device)
                dist.recv(buf, group=group, group_src=r)
                buf = buf.cpu()
            shards.append(self._decode_shard(buf, meta_len))
        self.shards = shards
        self.groups = [copy.deepcopy(hyper(g)) for g in param_groups]
        self.steps_since_consolidate = 0

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

    def full(
        self, param_groups: List[Dict[str, Any]], local_to_global: Callable[[int], List[int]]
    ) -> Dict[str, Any]:
        """The consolidated state as a plain optimizer over every parameter would give it."""
        if self.shards is None or self.groups is None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer.state_dict(): the optimizer state has not been "
                f"consolidated on this rank (rank {self.rank}). Call "
                f"consolidate_state_dict(to={self.rank}) on all ranks first; the full state "
                "dict is then available on that rank only."
            )
        if self.steps_since_consolidate:
            warnings.warn(
                f"ZeroRedundancyOptimizer.state_dict() returns the state consolidated "
                f"{self.steps_since_consolidate} step(s) ago; call consolidate_state_dict() "
                "again for the current state",
                stacklevel=3,
            )
        state: Dict[int, Any] = {}
        for r, shard in enumerate(self.shards):
            glob = local_to_global(r)
            local_order = [i for g in shard["param_groups"] for i in g["params"]]
            if len(local_order) != len(glob):
                raise AssertionError("consolidated shard does not match the partition")
            for pos, li in enumerate(local_order):
                if li in shard["state"]:
                    state[glob[pos]] = shard["state"][li]
        groups, off = [], 0
        for g, saved in zip(param_groups, self.groups):
            out = copy.deepcopy(saved)
            out["params"] = list(range(off, off + len(g["params"])))
            if "param_names" in g:
                out["param_names"] = list(g["param_names"])
            off += len(g["params"])
            groups.append(out)
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @staticmethod
    def validate(state_dict: Any, param_groups: List[Dict[str, Any]], optimizer_class: Any) -> None:
        """Checks a full state dict against ``param_groups``, the same way on every rank, so
        that all ranks refuse it together."""

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
        if len(groups) != len(param_groups):
            raise bad(
                f"the dict has {len(groups)} parameter group(s), this optimizer has "
                f"{len(param_groups)}"
            )
        index_to_param: Dict[Any, torch.Tensor] = {}
        for g, (saved, mine) in enumerate(zip(groups, param_groups)):
            if not isinstance(saved, dict) or "params" not in saved:
                raise bad(f"parameter group {g} has no 'params'")
            if len(saved["params"]) != len(mine["params"]):
                raise bad(
                    f"parameter group {g} has {len(saved['params'])} parameter(s) in the "
                    f"dict but {len(mine['params'])} here"
                )
            missing = set(hyper(mine)) - set(hyper(saved))
            extra = set(hyper(saved)) - set(hyper(mine)) - {"initial_lr"}
            if missing and extra:
                raise bad(
                    f"parameter group {g} looks like another optimizer's: it lacks "
                    f"{sorted(missing)} and has {sorted(extra)} (this one is "
                    f"{getattr(optimizer_class, '__name__', optimizer_class)})"
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

    @staticmethod
    def local_part(
        state_dict: Dict[str, Any],
        param_groups: List[Dict[str, Any]],
        owned_global: List[int],
        owned_per_group: List[int],
    ) -> Dict[str, Any]:
        """The part of a (validated) full state dict that this rank's local optimizer loads:
        the state of the parameters it owns (global indices ``owned_global``, in local order;
        ``owned_per_group[g]`` of them in group ``g``), with local indices, and the exposed
        groups' hyperparameters. The input is not modified."""
        saved_state = state_dict["state"]
        glob_ids: List[Any] = [i for g in state_dict["param_groups"] for i in g["params"]]
        local_state = {}
        for li, gi in enumerate(owned_global):
            key = glob_ids[gi]
            if key in saved_state:
                # Copy: the local optimizer updates its state in place ('step' included).
                local_state[li] = copy.deepcopy(saved_state[key])
        local_groups, li = [], 0
        for group, n in zip(param_groups, owned_per_group):
            lg = dict(hyper(group))
            lg["params"] = list(range(li, li + n))
            li += n
            local_groups.append(lg)
        return {"state": local_state, "param_groups": local_groups}
