"""Post-local SGD: torch's ``PostLocalSGDOptimizer`` and ``PeriodicModelAverager``, and a
fault-tolerant averager that averages across the replica groups of an ``ft.Manager``.

    averager = PeriodicModelAverager(period=4, warmup_steps=100)        # plain process group
    averager = FaultTolerantModelAverager(manager, model, period=4)     # across replica groups
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), averager)

Contract:
  * ``PeriodicModelAverager(period, warmup_steps=0, process_group=None)`` is torch's: a counter
    ``step`` (0 at start) moves by one per ``average_parameters(params)`` call; the call averages
    when ``step >= warmup_steps and (step - warmup_steps) % period == 0`` (so the first average
    is at the first call after the warmup; during warmup nothing is averaged). Averaged are the
    given parameters (or the parameters of the given param groups) that have a ``.grad``; the
    arithmetic is torch's (one flat buffer in the promoted dtype, divided by the world size,
    then SUM-allreduced), so results are bitwise torch's. Unlike torch, values are written in
    place (torch rebinds ``p.data``), and an empty selection raises instead of failing in
    ``torch.cat``.
  * ``PostLocalSGDOptimizer(optim, averager)`` is torch's: ``step()`` runs ``optim.step()`` then
    ``averager.average_parameters(param_groups)``; ``state_dict()`` is the local optimizer's plus
    ``"step"`` (the averager's counter); ``load_state_dict`` restores it (warning and 0 when the
    entry is missing). It works with torch's averagers as well as ft's.
  * ``FaultTolerantModelAverager(manager, model, period, warmup_steps=0)`` keeps torch's counter
    and schedule, and on a due call runs one averaging *round* across the replica groups:
    quorum, AVG allreduce of every trainable parameter of ``model`` through
    ``manager.allreduce``, then ``manager.should_commit()``. A committed round sets the
    parameters to the average on every group; a failed one is applied nowhere: each group puts
    its parameters back to the last committed average (the backup), so the groups again hold
    the same parameters (a group that alone failed to commit falls one manager step behind and
    heals from the others in the next round). The counter moves on either way, identically on
    every group. The backup and the counter are registered with the Manager, so a group that
    heals receives them with whatever the Manager's own state_dict fns hold (the model and the
    local optimizer: register them, as for LocalSGD).
  * ``join()`` runs one round outside the schedule (only a heal moves the counter), retried
    until it commits. Call it once before the first forward pass: on a fresh start it is the
    initial sync (with ``init_sync`` every group starts from the primary's state); a group that
    (re)starts while the others train blocks in it until their next round, heals from them and
    takes part in that round, so it never trains from a stale model.

Relation to ``ft.local_sgd.LocalSGD``: the round *is* ``LocalSGD.sync()`` (quorum, averaging,
commit-or-restore, backup registered for healing under ``"LocalSGD"``); this module drives it
with torch's schedule instead of LocalSGD's optimizer hook. The schedules differ: LocalSGD syncs
after every ``sync_every``-th step and averages after *every* step of its warmup, torch's
averager first averages right after its warmup and skips averaging *during* it (there,
DDP keeps the replicas in sync). One Manager holds at most one of the two (both register
``"LocalSGD"``).

Differences from torch on the fault-tolerant path: the averaged set is fixed at construction
(every trainable parameter of ``model``, with or without ``.grad``), because the backup and the
healed state must cover the same tensors on every group; ``average_parameters`` rejects
parameters outside it. That is why the averager takes the model (torch's takes none). The
local optimizer's state (e.g. Adam's moments) is not averaged, as in torch: each group's
follows its own data between heals.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ft.local_sgd import LocalSGD
from ft.protocols import ManagerLike

__all__ = ["PostLocalSGDOptimizer", "PeriodicModelAverager", "FaultTolerantModelAverager"]

STATE_KEY = "FaultTolerantModelAverager"


# --------------------------------------------------------------------------- schedule


class _PeriodicSchedule:
    """torch's counter and rule: average when step >= warmup and (step - warmup) % period == 0."""

    def __init__(self, period: int, warmup_steps: int) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        if period == 1:
            # torch warns too: averaging every step costs at least DDP's gradient allreduce.
            warnings.warn(
                "period=1 averages the parameters after every step; plain data "
                "parallelism (DDP) costs no more and is simpler",
                stacklevel=3,
            )
        self.period = period
        self.warmup_steps = warmup_steps
        self.step = 0

    def _due(self) -> bool:
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0


def _flatten_params(params: Iterable[Any]) -> List[torch.Tensor]:
    """Parameters, or the parameters of optimizer param groups, in order (torch accepts both)."""
    out: List[torch.Tensor] = []
    for item in params:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, dict) and "params" in item:
            out.extend(item["params"])
        else:
            raise TypeError(
                f"average_parameters takes parameters or optimizer param groups, "
                f"got an item of type {type(item).__name__}"
            )
    return out


# --------------------------------------------------------------------------- plain averager


class PeriodicModelAverager(_PeriodicSchedule):
    """torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager, on a plain
    process group (ft's "ft" backend or any other). See the module docstring."""

    def __init__(
        self, period: int, warmup_steps: int = 0, process_group: Optional[dist.ProcessGroup] = None
    ) -> None:
        super().__init__(period, warmup_steps)
        if process_group is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "PeriodicModelAverager averages over the default process "
                    "group, which does not exist: call "
                    "torch.distributed.init_process_group() first or pass "
                    "process_group="
                )
            process_group = dist.group.WORLD
        self.process_group = process_group

    def average_parameters(self, params: Iterable[Any]) -> None:
        if self._due():
            with_grads = [p for p in _flatten_params(params) if p.grad is not None]
            _average_flat(with_grads, self.process_group)
        self.step += 1


def _average_flat(params: List[torch.Tensor], group: Any) -> None:
    """torch's arithmetic, so the result is bitwise torch's: one flat buffer (torch.cat
    promotes mixed dtypes), divided by the world size *before* the SUM allreduce."""
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return  # this rank is outside the group: nothing to average, as in torch
    if not params:
        raise ValueError(
            "nothing to average: none of the given parameters has a .grad "
            "(the averager averages only parameters with gradients, as torch's)"
        )
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat.div_(dist.get_world_size(group))
    if flat.device.type != "cpu":
        # The parameters may have been written on other streams (e.g. a fused optimizer);
        # torch synchronizes the device here for the same reason.
        torch.accelerator.synchronize()
    dist.all_reduce(flat, group=group)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))  # casts back to p's dtype
            offset += n


# --------------------------------------------------------------------------- fault tolerant


class FaultTolerantModelAverager(_PeriodicSchedule):
    """torch's periodic schedule; each due call is a LocalSGD round across the replica groups
    of ``manager`` (see the module docstring).

    Args:
        manager: the ``ft.Manager`` of this replica group (its state_dict fns should cover the
            model and the local optimizer, so a healing group receives them).
        model: the module whose trainable parameters are averaged (fixed at construction).
        period, warmup_steps: torch's.
        backup_device, pin_memory, use_bucketization, bucket_cap_mb, should_quantize:
            LocalSGD's (where the backup lives, how the allreduce is packed and quantized).
    """

    def __init__(
        self,
        manager: ManagerLike,
        model: nn.Module,
        period: int,
        warmup_steps: int = 0,
        *,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: Union[bool, torch.dtype] = False,
    ) -> None:
        super().__init__(period, warmup_steps)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"FaultTolerantModelAverager averages an nn.Module's parameters, "
                f"got {type(model).__name__}: the averaged set is fixed at "
                f"construction so that backups and heals cover it on every group"
            )
        self._ids = {id(p) for p in model.parameters() if p.requires_grad}
        if not self._ids:
            raise ValueError("the model has no trainable parameters to average")
        self.manager = manager
        # The round is LocalSGD's. Its optimizer argument only serves its step hook, which is
        # never entered here: this averager is driven by average_parameters() instead.
        self._localsgd = LocalSGD(
            manager,
            model,
            None,  # type: ignore[arg-type]
            sync_every=period,
            backup_device=backup_device,
            pin_memory=pin_memory,
            use_bucketization=use_bucketization,
            bucket_cap_mb=bucket_cap_mb,
            should_quantize=should_quantize,
            keep_backup=True,  # a failed round is applied nowhere (see the module docstring)
        )
        manager.register_state_dict_fn(STATE_KEY, self._load_state, self._state)
        self.rounds = 0  # rounds run (committed or not), join rounds included
        self.failed_rounds = 0
        self.last_committed: Optional[bool] = None

    # -- healing ----------------------------------------------------------------------

    def _state(self) -> Dict[str, Any]:
        # Inside a round the counter has already moved past it (average_parameters), so a
        # group healing from this one during the round gets the value every member holds
        # once the round is over.
        return {"step": self.step}

    def _load_state(self, state: Dict[str, Any]) -> None:
        self.step = int(state["step"])

    # -- rounds -----------------------------------------------------------------------

    def _round(self) -> bool:
        committed = self._localsgd.sync()
        self.rounds += 1
        self.failed_rounds += not committed
        self.last_committed = committed
        return committed

    def average_parameters(self, params: Iterable[Any]) -> None:
        """One call per training step (PostLocalSGDOptimizer makes it). ``params`` must be
        trainable parameters of the model this averager was built with."""
        self._check(params)
        due = self._due()
        self.step += 1  # before the round: see _state
        if due:
            self._round()

    def join(self, max_attempts: int = 3) -> None:
        """Runs averaging rounds (counter unchanged, except by a heal) until one commits.

        Raises:
            RuntimeError: ``max_attempts`` rounds in a row did not commit.
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        for _ in range(max_attempts):
            if self._round():
                return
        err = self.manager.errored()
        raise RuntimeError(
            f"FaultTolerantModelAverager.join(): {max_attempts} averaging rounds in a row did "
            f"not commit (last error: {err!r}); this replica group has not joined the others"
        )

    def _check(self, params: Iterable[Any]) -> None:
        for p in _flatten_params(params):
            if p.requires_grad and id(p) not in self._ids:
                raise ValueError(
                    f"average_parameters got a parameter of shape {tuple(p.shape)} that is not a "
                    f"trainable parameter of the model this FaultTolerantModelAverager was built "
                    f"with; build it with the model the optimizer trains"
                )


# --------------------------------------------------------------------------- optimizer


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """torch.distributed.optim.PostLocalSGDOptimizer: ``optim.step()``, then
    ``averager.average_parameters(param_groups)``. See the module docstring."""

    def __init__(self, optim: torch.optim.Optimizer, averager: Any) -> None:
        # Deliberately no Optimizer.__init__ (as torch): param_groups and state are optim's own.
        if not isinstance(optim, torch.optim.Optimizer):
            raise TypeError(
                f"optim must be a torch.optim.Optimizer instance, got {type(optim).__name__}"
            )
        if not callable(getattr(averager, "average_parameters", None)) or not hasattr(
            averager, "step"
        ):
            raise TypeError(
                f"averager must be a model averager (with average_parameters() and a "
                f"step counter), got {type(averager).__name__}"
            )
        self.optim = optim
        self.param_groups = optim.param_groups
        self.averager = averager

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self):  # type: ignore[override]
        return self.optim.defaults

    def __repr__(self) -> str:
        return repr(self.optim)

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """The local optimizer's state dict plus ``"step"``: the averager's counter, so that a
        resumed run does not warm up again."""
        sd = self.optim.state_dict()
        sd["step"] = self.averager.step
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        self.optim.load_state_dict({k: v for k, v in state_dict.items() if k != "step"})
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn(
                "the loaded state dict has no averager step counter ('step'); the "
                "averager's step is reset to 0",
                stacklevel=2,
            )
            self.averager.step = 0

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(params=self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)
