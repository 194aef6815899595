"""The optimizer state a fault-tolerant ZeRO replica holds: its shard entries, the step each is
current for, and how entries move between replicas when the quorum changes (:mod:`ft.optim.zero_ft`,
"Quorum change: migration")."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import ReduceOp

from ft.optim.zero_local import hyper
from ft.protocols import ManagerLike

__all__ = ["HeldShards"]


class HeldShards:
    """The held optimizer state of one ``FaultTolerantZeroRedundancyOptimizer``.

    Owns ``held`` (global parameter index -> that parameter's state dict, for the owned and
    standby shards and, until a step commits, entries on their way out), ``version`` (the
    committed step each entry is current for), the per-shape state templates, and the
    migration that brings every entry to its new owner and buddy. Builds the local
    optimizers over held entries, with the hyperparameters of the optimizer's
    ``param_groups``. Kept apart from the step so that what is held, and its versioning,
    has one owner: the step, its overlapped form and healing all go through it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        optimizer_class: Any,
        version: int,
        stats: Dict[str, int],
    ) -> None:
        self.optimizer = optimizer
        self.optimizer_class = optimizer_class
        self.stats = stats
        self.params: List[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.group_of = [
            g for g, group in enumerate(optimizer.param_groups) for _ in group["params"]
        ]
        self.held: Dict[int, Dict[str, Any]] = {i: {} for i in range(len(self.params))}
        self.version: Dict[int, int] = {i: version for i in range(len(self.params))}
        self._templates: Dict[Tuple[int, Tuple[int, ...], torch.dtype], Dict[str, Any]] = {}

    # ------------------------------------------------------------------ healing
    def save(self) -> Dict[str, Any]:
        return {
            "state": {i: dict(st) for i, st in self.held.items()},
            "version": dict(self.version),
        }

    def load(self, sd: Dict[str, Any]) -> None:
        state, version = sd["state"], sd["version"]
        for i, st in state.items():
            i = int(i)
            if not 0 <= i < len(self.params):
                raise ValueError(
                    f"healed optimizer state names parameter {i} of {len(self.params)}"
                )
            self.held[i] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            self.version[i] = int(version[i])

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held (own + standby shards)."""
        return sum(
            v.numel() * v.element_size()
            for st in self.held.values()
            for v in st.values()
            if torch.is_tensor(v)
        )

    # ------------------------------------------------------------------ local optimizers
    def hyper(self, g: int) -> Dict[str, Any]:
        return hyper(self.optimizer.param_groups[g])

    def build_opt(
        self, idx: List[int], tensors: Optional[List[torch.Tensor]] = None
    ) -> Optional[torch.optim.Optimizer]:
        """A local optimizer over parameters ``idx`` (param-group hyperparameters kept), on the
        parameters themselves with their held state bound, or on ``tensors`` (staging: the
        state is set per step)."""
        if not idx:
            return None
        bind = tensors is None
        ts = [self.params[i] for i in idx] if tensors is None else tensors
        groups = []
        for g in range(len(self.optimizer.param_groups)):
            ps = [t for i, t in zip(idx, ts) if self.group_of[i] == g]
            if ps:
                groups.append(dict(self.hyper(g), params=ps, _g=g))
        opt = self.optimizer_class([{k: v for k, v in gr.items() if k != "_g"} for gr in groups])
        for gr, og in zip(groups, opt.param_groups):
            og["_g"] = gr["_g"]
        if bind:
            self.bind(opt, idx)
        return opt

    def bind(self, opt: Optional[torch.optim.Optimizer], idx: List[int]) -> None:
        """Point ``opt`` (over parameters ``idx``) at the held state dicts."""
        if opt is not None:
            for i in idx:
                opt.state[self.params[i]] = self.held.setdefault(i, {})

    def sync_hyper(self, opt: Optional[torch.optim.Optimizer]) -> None:
        if opt is None:
            return
        for og in opt.param_groups:
            for k, v in self.hyper(og["_g"]).items():
                og[k] = v

    # ------------------------------------------------------------------ versions
    def retire_unheld(self, keep: Set[int], step: int) -> None:
        """After a committed step: the entries ``keep`` (owned and standby) are current for
        ``step``; every other held entry (a shard no longer owned or backed up) is dropped."""
        for i in list(self.held):
            if i in keep:
                self.version[i] = step
            else:
                del self.held[i]
                self.version.pop(i, None)

    def template(self, i: int) -> Dict[str, Any]:
        """Structure of parameter ``i``'s state (keys, shapes, dtypes) after one step."""
        p = self.params[i]
        g = self.group_of[i]
        key = (g, tuple(p.shape), p.dtype)
        if key not in self._templates:
            dummy = torch.zeros_like(p, requires_grad=True)
            dummy.grad = torch.zeros_like(p)
            opt = self.optimizer_class([dummy], **self.hyper(g))
            opt.step()
            self._templates[key] = {k: v for k, v in opt.state[dummy].items()}
        return self._templates[key]

    def migrate(
        self, manager: ManagerLike, n: int, rank: Optional[int], targets: Dict[int, Set[int]]
    ) -> bool:
        """Moves every needed entry to its targets (``targets[i]``: the participants that
        must hold parameter ``i``'s entry); False if the transfer failed."""
        m = manager
        P = len(self.params)
        cur = m.current_step()
        table = torch.zeros(n, P, dtype=torch.int64)
        if rank is not None:
            for i in range(P):
                if i in self.held:
                    table[rank, i] = 2 * (self.version[i] + 1) + (1 if self.held[i] else 0)
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
            for k, v in sorted(self.template(i).items()):
                if torch.is_tensor(v):
                    nb = v.numel() * v.element_size()
                    layout.append((i, k, off, nb))
                    off += nb
        buf = torch.zeros(off, dtype=torch.uint8)
        src_of = {i: s for i, s, _ in moves}
        for i, k, o, nb in layout:
            if src_of[i] == rank:
                t = self.held[i][k].detach().contiguous().view(-1).view(torch.uint8)
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
                for k, v in self.template(i).items():
                    st[k] = v.clone() if torch.is_tensor(v) else v
                for j, k, o, nb in layout:
                    if j == i:
                        t = st[k]
                        t.view(-1).view(torch.uint8).copy_(buf[o : o + nb])
            self.held[i] = st
            self.version[i] = cur
        return True
