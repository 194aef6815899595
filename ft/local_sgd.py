"""LocalSGD, DiLoCo and Streaming DiLoCo on top of ft.Manager (docs/design.md, "DiLoCo").

Both wrap an existing inner optimizer through its step hooks:

    with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=H):
        for batch in data:
            inner_opt.zero_grad(); loss(model, batch).backward(); inner_opt.step()

The pure schedule -- which inner step prepares and which syncs a fragment --
is `streaming_schedule` / `fragment_for_step` below (tested as a table), and the
pure rule for whose progress counts in a sync is `contributions_after`.

The join round runs before the first inner step (at the first forward of a
wrapped module, once the context is entered): a quorum, which waits for the other groups'
next one and heals this group if it is behind. If another group is at its sync (a late
joiner), the group takes part in that sync and only then trains, contributing nothing to it:
every sync sums the groups' tensors together with a weight per group (1: its progress counts,
0: it sends zeros) and divides by the total weight. If every group of the quorum is joining (a
job whose groups start together), nobody syncs or commits: DiLoCo's syncs then fall on the
same inner steps and manager steps as torchft's (`join_starts`, a table).

DiLoCo, per fragment f (of n):
  * keeps a backup of the fragment's global parameters (on `backup_device`,
    by default the CPU, pinned when CUDA is available, as torchft does: one
    copy of the model in host memory, none on the GPU);
  * every P = sync_every / n inner steps one fragment syncs; at inner step
    P - tau (tau = fragment_sync_delay) the quorum is started and the
    pseudo-gradient (backup - local) of fragment `current_step() % n` is sent
    with its weight on lane f % num_lanes (one sync is in flight at a time; one lane per
    fragment lets a fragment's sync overlap with the next one's start), and
    at step P it is waited for, the backup restored and `should_commit()`
    asked;
  * on commit the outer optimizer steps with the averaged pseudo-gradient as
    gradient, the result becomes the new backup, and the parameters are mixed
    `param.lerp_(local, alpha)` (alpha = fragment_update_alpha, 0 = pure global);
  * on failure the fragment's local progress is dropped (params = backup), and
    since the manager step did not advance the same fragment is retried next.
  * backups and outer-optimizer state are registered with the Manager, so a
    healing replica receives them; it restarts every fragment from them and
    its progress counts again once each fragment has synced with the others.

DiLoCo needs the synchronous quorum: the fragment is chosen from the manager
step, and only a synchronous quorum applies a heal (step, backups) before
that choice. An async-quorum Manager is rejected.
"""

from __future__ import annotations

import os
import time

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.distributed import ReduceOp

from ft.collectives import BucketedAllreduce
from ft.backend.process_group import lane
from ft.protocols import ManagerLike
from ft.observability.spans import span, span_block
from ft.utils.tensors import clone_state

__all__ = [
    "LocalSGD",
    "DiLoCo",
    "StreamingPlan",
    "streaming_plan",
    "streaming_schedule",
    "fragment_for_step",
    "join_starts",
]

# torchft's default: with bucketization on, one bucket holds up to 1 GiB.
DEFAULT_BUCKET_CAP_MB = 1024
# torchft's switch: "True" turns bucketization on whatever the constructor says.
USE_BUCKETIZATION_ENV = "TORCHFT_USE_BUCKETIZATION"


def _bucketization(requested: bool) -> bool:
    return requested or os.environ.get(USE_BUCKETIZATION_ENV, "False") == "True"


# --------------------------------------------------------------------------
# The schedule (pure)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamingPlan:
    n_fragments: int
    period: int  # P: inner steps between two fragment syncs
    prepare_at: int  # P - tau: the inner step (1-based, within a period) that sends


def streaming_plan(
    sync_every: int, n_fragments: int, fragment_sync_delay: int = 0
) -> StreamingPlan:
    """Validates the DiLoCo schedule parameters and returns the plan.

    P = sync_every / n_fragments must be a whole number, and
    0 <= fragment_sync_delay (tau) < P.
    """
    if not isinstance(n_fragments, int) or n_fragments < 1:
        raise ValueError(f"need at least one model fragment, got {n_fragments!r}")
    if not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
    if sync_every % n_fragments:
        raise ValueError(
            f"sync_every ({sync_every}) must be divisible by the number of fragments ({n_fragments})"
        )
    period = sync_every // n_fragments
    if not isinstance(fragment_sync_delay, int) or not 0 <= fragment_sync_delay < period:
        raise ValueError(
            f"fragment_sync_delay must satisfy 0 <= tau < sync_every / n_fragments = {period}, "
            f"got {fragment_sync_delay!r}"
        )
    return StreamingPlan(n_fragments, period, period - fragment_sync_delay)


def streaming_schedule(local_step: int, plan: StreamingPlan) -> Tuple[bool, bool]:
    """(prepare, sync) for the inner step `local_step` (1-based, counted since
    the last sync). With tau = 0 both happen at step P, prepare first."""
    if not 1 <= local_step <= plan.period:
        raise ValueError(f"local_step {local_step} outside 1..{plan.period}")
    return local_step == plan.prepare_at, local_step == plan.period


def fragment_for_step(manager_step: int, n_fragments: int) -> int:
    """The fragment every replica syncs at this manager step."""
    return manager_step % n_fragments


def join_starts(quorum_changed: bool, groups_syncing: Optional[float]) -> bool:
    """Whether a DiLoCo join round ends at its quorum (True: every group of the quorum is
    joining, so nobody syncs or commits and training starts) or takes part in the sync the
    other groups are at (False: a late joiner, which contributes nothing to it).

    ``quorum_changed``: the quorum's id differs from this group's previous quorum's (always
    true for a group's first quorum). Quorum ids change with membership (every start of a
    group is a new replica id), so an unchanged id means the same groups took part in this
    group's previous round, and running the same code they are all joining too (a loop that
    ran quorums of its own before its first inner step). A changed quorum may hold groups at
    their sync: then every member (joining or syncing) exchanges one number first, the count
    of groups at their sync, ``groups_syncing`` (None: that exchange failed, so the step
    fails too; the joiner takes the sync path, as the others do).
    """
    if not quorum_changed:
        return True
    if groups_syncing is None:
        return False
    return groups_syncing == 0


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (replicated dims hold full copies), or t."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _like_param(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Wraps `local` like parameter `p` (a DTensor with the same mesh and
    placements), so it can be p's grad."""
    if hasattr(p, "device_mesh") and hasattr(p, "placements"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False)
    return local


def _local_state(sd: Any) -> Any:
    """`sd` with every DTensor replaced by its local tensor: ft's checkpoint
    transport moves plain tensors only (an optimizer over DTensor parameters
    keeps DTensor state, e.g. momentum buffers)."""
    if torch.is_tensor(sd):
        return _local(sd)
    if isinstance(sd, dict):
        return type(sd)((k, _local_state(v)) for k, v in sd.items())
    if isinstance(sd, (list, tuple)):
        return type(sd)(_local_state(v) for v in sd)
    return sd


def _load_optimizer_state(opt: torch.optim.Optimizer, sd: Dict[str, Any]) -> None:
    """`opt.load_state_dict(sd)` for a state dict made by `_local_state`: the
    per-parameter tensors of a DTensor parameter (all but "step", with the
    parameter's local shape) are wrapped back like the parameter."""
    opt.load_state_dict(sd)
    for p, st in opt.state.items():
        if not (hasattr(p, "device_mesh") and hasattr(p, "placements")):
            continue
        shape = _local(p.detach()).shape
        for k, v in list(st.items()):
            if (
                k != "step"
                and torch.is_tensor(v)
                and not hasattr(v, "device_mesh")
                and v.shape == shape
            ):
                st[k] = _like_param(p, v)


def _check_placements(params: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """DTensor parameters are synced through their local tensors: rank r of
    every replica group holds the same slice (the mesh lives inside a replica
    group), so averaging local tensors across replica groups is exact for
    Replicate and Shard placements alike. Partial placements hold unreduced
    values and are rejected."""
    for n, p in params:
        for pl in getattr(p, "placements", ()) or ():
            is_partial = getattr(pl, "is_partial", None)
            if callable(is_partial) and is_partial():
                raise ValueError(
                    f"parameter {n!r} has a Partial placement ({pl}); DiLoCo/LocalSGD sync "
                    "DTensor parameters through their local tensors, which needs Replicate or "
                    "Shard placements"
                )


def _make_backup(p: torch.Tensor, device: Optional[torch.device], pin_memory: bool) -> torch.Tensor:
    src = _local(p.detach())
    # Host memory by default (torchft's choice): a backup on the GPU would cost a model copy there.
    dev = torch.device(device) if device is not None else torch.device("cpu")
    pin = pin_memory and dev.type == "cpu" and torch.cuda.is_available()
    b = torch.empty(src.shape, dtype=src.dtype, device=dev, pin_memory=pin)
    b.copy_(src)
    return b


class _AllWorks:
    def __init__(self, works: List[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for w in self._works:
            w.wait()


def _allreduce_all(
    manager: ManagerLike,
    tensors: Sequence[torch.Tensor],
    should_quantize: Union[bool, torch.dtype],
    bucket_cap_bytes: Optional[int],
    use_bucketization: bool,
    reduce_op: ReduceOp = ReduceOp.AVG,
):
    """Issues the allreduce of `tensors` through the manager on the calling
    thread (so on its current lane); returns something with .wait()."""

    def one(t: torch.Tensor):
        return manager.allreduce(t, should_quantize=should_quantize, reduce_op=reduce_op)

    if use_bucketization:
        return BucketedAllreduce(tensors, one, bucket_cap_bytes)
    return _AllWorks([one(t) for t in tensors])


# --------------------------------------------------------------------------
# Who contributes to a sync (pure)
# --------------------------------------------------------------------------


def contributions_after(
    contributes: Sequence[bool],
    event: str,
    fragment: Optional[int] = None,
) -> Tuple[bool, ...]:
    """Whether each fragment's local progress counts at its next sync, after ``event``.

    A group's pseudo-gradient (DiLoCo) or parameters (LocalSGD) for fragment f count in f's
    next sync only if its fragment-f parameters have trained since the same global state the
    other groups started f's interval from. Otherwise the group sends zeros with weight 0 and
    the average is taken over the groups that sent weight 1 (see ``DiLoCo``).

    * ``"heal"``: the group has just received the global state (backups, outer optimizer,
      step) mid-interval and restarts every fragment from it: nothing it holds counts until
      each fragment has been through one sync with the others.
    * ``"sync"`` of ``fragment``: every group, this one included, starts the fragment's next
      interval from the same global state (the new backup on commit, the old one restored
      otherwise), so the fragment counts from now on.
    * ``"start"``: a join round in which every group was joining (``join_starts``): every
      group starts every fragment from the same state together (healed ones included), so
      every fragment counts.
    """
    flags = tuple(bool(c) for c in contributes)
    if event == "heal":
        return (False,) * len(flags)
    if event == "start":
        return (True,) * len(flags)
    if event != "sync":
        raise ValueError(f"unknown event {event!r} (expected 'heal', 'sync' or 'start')")
    if fragment is None or not 0 <= fragment < len(flags):
        raise ValueError(f"sync of fragment {fragment!r} outside 0..{len(flags) - 1}")
    return flags[:fragment] + (True,) + flags[fragment + 1 :]


class _WeightedSum:
    """The SUM allreduce of a sync's tensors together with this group's weight (1: its tensors
    count, 0: it sends zeros), so that every group divides by the same total weight.

    The weight travels as one extra element of the smallest float32/float64 tensor (no extra
    collective, the count is exact); with quantization, or without such a tensor, it is a
    one-element float32 allreduce of its own, issued first and never quantized (a lane that
    carries a quantized allreduce carries nothing else while it is in flight).
    """

    def __init__(
        self,
        manager: ManagerLike,
        tensors: Sequence[torch.Tensor],
        weight: float,
        should_quantize: Union[bool, torch.dtype],
        bucket_cap_bytes: Optional[int],
        use_bucketization: bool,
    ) -> None:
        self.tensors = list(tensors)
        sent = list(self.tensors)
        works: List[Any] = []
        fold = None if should_quantize else _fold_index(self.tensors)
        if fold is not None:
            t = self.tensors[fold]
            buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
            buf[:-1].copy_(t.reshape(-1))
            buf[-1] = weight
            self.tensors[fold] = buf[:-1].view(t.shape)
            sent[fold] = buf
            self._weight = buf[-1:]
        else:
            device = self.tensors[0].device if self.tensors else torch.device("cpu")
            self._weight = torch.tensor([weight], dtype=torch.float32, device=device)
            works.append(
                manager.allreduce(self._weight, should_quantize=False, reduce_op=ReduceOp.SUM)
            )
        works.append(
            _allreduce_all(
                manager, sent, should_quantize, bucket_cap_bytes, use_bucketization, ReduceOp.SUM
            )
        )
        self._work = _AllWorks(works)

    def wait(self) -> None:
        self._work.wait()

    def total(self) -> float:
        """The sum of every group's weight (read after ``wait``)."""
        return float(self._weight.item())


def _fold_index(tensors: Sequence[torch.Tensor]) -> Optional[int]:
    """The smallest tensor that can carry the weight exactly, or None."""
    best: Optional[int] = None
    for i, t in enumerate(tensors):
        if t.dtype in (torch.float32, torch.float64):
            if best is None or t.numel() < tensors[best].numel():
                best = i
    return best


class _OnOptimizerStep:
    """A context manager that calls ``self._step_post_hook`` after every step of
    ``self._hooked_optimizer`` while it is entered (LocalSGD and DiLoCo share it).

    The join: before the group's first inner step, ``self._join()`` makes it take part in a
    sync (healing first, if it is behind). It runs at the first forward of a wrapped module
    (``self._join_modules()``), ahead of that module's own forward hooks (FSDP's all-gather
    among them), so the first inner step computes from the healed parameters; or, should no
    wrapped module run forward first, before the first optimizer step. Not at ``__enter__``:
    code that binds the context object (``with DiLoCo(...) as self.diloco``) and reads it in
    the state-dict functions a heal calls (torchft's trainers do) has bound it by then. A join
    that raises (a quorum timeout) is tried again at the next forward or step.
    """

    _manager: ManagerLike
    _hooked_optimizer: torch.optim.Optimizer
    _hook: Any = None

    def _set_sum_options(
        self,
        should_quantize: Union[bool, torch.dtype],
        use_bucketization: bool,
        bucket_cap_mb: Optional[float],
    ) -> None:
        """How a sync's allreduce is issued (the constructors' arguments of the same names)."""
        self._should_quantize = should_quantize
        self._use_bucketization = _bucketization(use_bucketization)
        self._bucket_cap = int((bucket_cap_mb or DEFAULT_BUCKET_CAP_MB) * 1024 * 1024)

    def _weighted_sum(self, tensors: Sequence[torch.Tensor], contribute: bool) -> _WeightedSum:
        """Starts a sync's allreduce of ``tensors``: this group's own (weight 1) or zeros
        (weight 0, ``contribute`` False)."""
        return _WeightedSum(
            self._manager,
            tensors,
            1.0 if contribute else 0.0,
            self._should_quantize,
            self._bucket_cap,
            self._use_bucketization,
        )

    _join_hooks: Optional[List[Any]] = None
    _joined = False

    def __enter__(self):
        if self._hook is None:
            self._hook = self._hooked_optimizer.register_step_post_hook(self._step_post_hook)
        if not self._joined and self._join_hooks is None:
            hooks = [
                m.register_forward_pre_hook(self._join_before_use, prepend=True)
                for m in self._join_modules()
            ]
            hooks.append(self._hooked_optimizer.register_step_pre_hook(self._join_before_use))
            self._join_hooks = hooks
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._remove_join_hooks()
        return False

    def _join_before_use(self, *_args: Any) -> None:
        if self._joined:
            return
        self._join()
        self._joined = True
        self._remove_join_hooks()

    def _remove_join_hooks(self) -> None:
        for h in self._join_hooks or ():
            h.remove()
        self._join_hooks = None

    def _join_modules(self) -> List[nn.Module]:
        raise NotImplementedError

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        raise NotImplementedError

    def _join(self) -> None:
        raise NotImplementedError


# --------------------------------------------------------------------------
# LocalSGD
# --------------------------------------------------------------------------


class LocalSGD(_OnOptimizerStep):
    """Averages the model's parameters every `sync_every` optimizer steps.

    The averages are copied into the model only if `manager.should_commit()`.
    What a failed sync leaves depends on `keep_backup`:

    * False (default, torchft's LocalSGD): the parameters keep their local
      values; the groups differ until the next committed sync. Memory: one
      transient copy of the parameters during a sync (the averages).
    * True: the last committed average is kept as a backup (on
      `backup_device`, by default pinned host memory) and a failed sync puts
      it back, so every group again holds the same parameters; the backup is
      registered for healing under "LocalSGD". Memory: one more persistent
      copy of the parameters (on the host by default).

    The first `warmup_steps` optimizer steps sync after every step (plain
    synchronous averaging, as torch's post-local SGD warmup).

    Joining: one sync runs before the first optimizer step, at the first forward of the
    model once the context is entered (the join round). It blocks until the other groups' next sync, heals from them if this group
    is behind, and contributes nothing: the average is taken over the groups that trained
    since the last one (weights, as in ``DiLoCo``). A group that heals during any sync
    contributes nothing to it either (its parameters are another group's copy). A rejoining
    group also skips the warmup steps the job has already taken (one committed step each).
    """

    def __init__(
        self,
        manager: ManagerLike,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        sync_every: int,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        warmup_steps: int = 0,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: Union[bool, torch.dtype] = False,
        *,
        keep_backup: bool = False,
    ) -> None:
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be a positive int, got {sync_every!r}")
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        self._manager = manager
        self._model = model
        self._optimizer = optimizer
        self._hooked_optimizer = optimizer
        self._sync_every = sync_every
        self._warmup_steps = warmup_steps
        self._set_sum_options(should_quantize, use_bucketization, bucket_cap_mb)
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        _check_placements(self._params)
        self._backup: Optional[Dict[str, torch.Tensor]] = None
        if keep_backup:
            self._backup = {n: _make_backup(p, backup_device, pin_memory) for n, p in self._params}
            manager.register_state_dict_fn("LocalSGD", self._load_state_dict, self._state_dict)
        self._local_step = 0
        self._total_steps = 0
        self._healed = False  # set by a heal (the backup's load fn) during a quorum
        # Total weight of the last sync: how many groups' parameters the average holds.
        self.contributors: Optional[float] = None

    # -- state for healing ----------------------------------------------------

    def _state_dict(self) -> Dict[str, Any]:
        return {"backup": dict(self._backup or {})}

    def _load_state_dict(self, state: Dict[str, Any]) -> None:
        self._healed = True
        for n, b in (self._backup or {}).items():
            b.copy_(state["backup"][n])

    # -- hooks ----------------------------------------------------------------

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        self._total_steps += 1
        if self._total_steps <= self._warmup_steps or self._local_step >= self._sync_every:
            self.sync()

    # -- sync -----------------------------------------------------------------

    def _join_modules(self) -> List[nn.Module]:
        return [self._model]

    def _join(self) -> None:
        if self._sync(contribute=False):
            # Every committed warmup step advanced the step by one (and the join round by
            # one), so a job at step s has taken at least min(warmup, s - 1) of them.
            done = min(self._warmup_steps, self._manager.current_step() - 1)
            self._total_steps = max(self._total_steps, done)

    def sync(self) -> bool:
        """Starts the quorum, averages the parameters and commits them; returns
        whether they were committed."""
        return self._sync(contribute=True)

    @span("torchft::local_sgd::sync")
    def _sync(self, contribute: bool) -> bool:
        self._local_step = 0
        self._healed = False
        step = self._manager.current_step()
        self._manager.start_quorum()
        # A heal moves the step (or, at step 0, loads the backup): the parameters are then
        # another group's, which count already.
        if self._healed or self._manager.current_step() != step:
            contribute = False
        averages = [
            _local(p.detach()).clone() if contribute else torch.zeros_like(_local(p.detach()))
            for _, p in self._params
        ]
        try:
            summed = self._weighted_sum(averages, contribute)
            averages = summed.tensors
            summed.wait()
            total = summed.total()
        except Exception as e:  # the Manager reports its own errors; this is belt and braces
            self._manager.report_error(e)
            total = 0.0
        committed = self._manager.should_commit()
        self.contributors = total
        with torch.no_grad():
            for (n, p), avg in zip(self._params, averages):
                dst = _local(p.detach())
                if committed and total > 0:
                    avg.div_(total)
                    dst.copy_(avg)
                    if self._backup is not None:
                        self._backup[n].copy_(avg)
                elif self._backup is not None:
                    # Not committed, or nobody had anything to average: the last average.
                    dst.copy_(self._backup[n])
        return committed


# --------------------------------------------------------------------------
# DiLoCo / Streaming DiLoCo
# --------------------------------------------------------------------------


class _Fragment:
    def __init__(
        self,
        index: int,
        module: nn.Module,
        outer_optimizer: torch.optim.Optimizer,
        backup_device: Optional[torch.device],
        pin_memory: bool,
    ) -> None:
        self.index = index
        self.module = module
        self.outer_optimizer = outer_optimizer
        self.params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"model fragment {index} has no trainable parameters")
        _check_placements(self.params)
        self.backup = {n: _make_backup(p, backup_device, pin_memory) for n, p in self.params}

    def pseudo_gradients(self) -> List[torch.Tensor]:
        # backup - local, on the parameters' device, in the parameters' dtype.
        return [
            self.backup[n].to(_local(p.detach()).device, non_blocking=True) - _local(p.detach())
            for n, p in self.params
        ]

    def zeros(self) -> List[torch.Tensor]:
        # What a group whose progress does not count sends: the pseudo-gradients' shapes.
        return [torch.zeros_like(_local(p.detach())) for _, p in self.params]

    @span("torchft::local_sgd::restore_parameters")
    def restore(self) -> None:
        with torch.no_grad():
            for n, p in self.params:
                _local(p.detach()).copy_(self.backup[n], non_blocking=True)

    @span("torchft::local_sgd::save_parameters")
    def save(self) -> None:
        with torch.no_grad():
            for n, p in self.params:
                self.backup[n].copy_(_local(p.detach()), non_blocking=True)


class DiLoCo(_OnOptimizerStep):
    """DiLoCo (sync_every inner steps, then an outer step on the averaged
    pseudo-gradient) and Streaming DiLoCo (several fragments, staggered, with
    an overlap delay tau and a merge factor alpha). torchft's arguments.

    Joining: the *join round* runs before the first inner step (at the first forward of a
    fragment once the context is entered; see ``_OnOptimizerStep``), as if
    this group had just taken the P - tau inner steps that precede a sync: the quorum (which
    waits for the other groups' next one and heals this group from them if it is behind).
    If every group of that quorum is joining (``join_starts``: a job whose groups start
    together), the round ends there: no allreduce, no commit, and the syncs that follow fall
    on torchft's inner steps and manager steps. Otherwise (a late joiner) it takes part in
    the sync the others are at: its allreduce, with tau = 0 also the commit. A healed group
    restarts every fragment from the healed backups (the global state), not from the healing
    peer's local parameters, so its first inner step starts from the global state, and its
    inner-step count is the others' (the next sync happens at the same step on every group).

    Contributions: each group sends its pseudo-gradient with a weight, 1 or 0, and the
    average divides the sum by the total weight. A fragment's progress counts (weight 1) only
    once the group has been through one sync of that fragment with the others
    (``contributions_after``): the join round, a heal and the first interval after either
    send zeros with weight 0. A joiner therefore contributes nothing to the sync it joins,
    and with n fragments nothing to the first sync of each other fragment (its interval was
    shorter than the others'). Contributing nothing, rather than weighting the average by
    inner steps taken, keeps every outer step the average of full-interval pseudo-gradients
    (what the outer learning rate and momentum are tuned for, and exactly what the healthy
    groups would compute by themselves: a zero adds nothing to a sum), makes no assumption
    that progress is proportional to inner steps, and needs no step counts on the wire; a
    joiner loses at most one partial interval per fragment. A sync that nobody contributes
    to commits without an outer step. On the fault-free path every weight is 1 and the
    result is the plain average (the same sum over the same count).
    """

    def __init__(
        self,
        manager: ManagerLike,
        model_fragments: List[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: Union[torch.optim.Optimizer, List[torch.optim.Optimizer]],
        sync_every: int,
        backup_device: Optional[torch.device] = None,
        pin_memory: bool = True,
        use_bucketization: bool = False,
        bucket_cap_mb: Optional[int] = None,
        should_quantize: Union[bool, torch.dtype] = False,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        if isinstance(model_fragments, nn.Module):
            model_fragments = [model_fragments]
        model_fragments = list(model_fragments)
        self._plan = streaming_plan(sync_every, len(model_fragments), fragment_sync_delay)
        if not 0.0 <= float(fragment_update_alpha) <= 1.0:
            raise ValueError(
                f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha!r}"
            )
        if manager.use_async_quorum:
            raise ValueError(
                "DiLoCo requires a Manager with use_async_quorum=False: the fragment to sync is "
                "chosen from the manager step, and only a synchronous quorum applies a heal "
                "(step, backups, outer-optimizer state) before that choice"
            )
        n = len(model_fragments)
        # Fragments share the lanes there are (fragment f on lane f % num_lanes).
        self._num_lanes = manager.num_lanes
        if isinstance(outer_optimizer, (list, tuple)):
            outer = list(outer_optimizer)
            if len(outer) != n:
                raise ValueError(
                    f"got {len(outer)} outer optimizers for {n} fragments (give one, or one each)"
                )
            self._shared_outer: Optional[torch.optim.Optimizer] = None
        else:
            outer = [outer_optimizer] * n
            self._shared_outer = outer_optimizer
        self._manager = manager
        self._inner_optimizer = inner_optimizer
        self._hooked_optimizer = inner_optimizer
        self._alpha = float(fragment_update_alpha)
        self._set_sum_options(should_quantize, use_bucketization, bucket_cap_mb)
        self._fragments = [
            _Fragment(i, m, outer[i], backup_device, pin_memory)
            for i, m in enumerate(model_fragments)
        ]
        self._local_step = 0
        # (fragment, pseudo-gradients, allreduce)
        self._pending: Optional[Tuple[int, List[torch.Tensor], _WeightedSum]] = None
        self._contributes: Tuple[bool, ...] = (False,) * n
        self._healed = False  # set by a fragment's load fn during a heal
        # Total weight of the last completed sync: how many groups' pseudo-gradients it averaged.
        self.contributors: Optional[float] = None
        # Seconds the training loop spent blocked on fragment allreduces at sync points: the
        # communication the schedule did not hide (tau > 0 overlaps it with inner steps).
        self.comm_wait_seconds = 0.0
        self.syncs = 0  # completed fragment syncs (committed or not)
        self.commits = 0
        self.failed_commits = 0
        for frag in self._fragments:
            manager.register_state_dict_fn(
                f"StreamingDiLoCoFragment_{frag.index}",
                self._fragment_load_fn(frag),
                self._fragment_save_fn(frag),
            )
        if self._shared_outer is not None:
            manager.register_state_dict_fn(
                "DiLoCoOuterOptimizer",
                lambda sd: _load_optimizer_state(self._shared_outer, sd),
                lambda: _local_state(self._shared_outer.state_dict()),
            )

    # -- state for healing ----------------------------------------------------

    def _fragment_save_fn(self, frag: _Fragment) -> Callable[[], Dict[str, Any]]:
        def save() -> Dict[str, Any]:
            sd: Dict[str, Any] = {"original_parameters": dict(frag.backup)}
            if self._shared_outer is None:
                sd["outer_optimizer"] = _local_state(frag.outer_optimizer.state_dict())
            return sd

        return save

    def _fragment_load_fn(self, frag: _Fragment) -> Callable[[Dict[str, Any]], None]:
        def load(sd: Dict[str, Any]) -> None:
            self._healed = True
            for n, b in frag.backup.items():
                b.copy_(sd["original_parameters"][n])
            if self._shared_outer is None:
                _load_optimizer_state(frag.outer_optimizer, sd["outer_optimizer"])

        return load

    # -- hooks ----------------------------------------------------------------

    def _step_post_hook(self, _optim: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._local_step += 1
        prepare, sync = streaming_schedule(self._local_step, self._plan)
        if prepare:
            self._prepare_sync()
        if sync:
            self._local_step = 0
            self._perform_sync()

    def _join_modules(self) -> List[nn.Module]:
        return [frag.module for frag in self._fragments]

    def _join(self) -> None:
        # Where the other groups are when they start a quorum: inner step P - tau of a period.
        self._local_step = self._plan.prepare_at
        if not self._prepare_sync(joining=True):
            self._local_step = 0  # every group was joining: training starts here, together
            return
        if self._local_step == self._plan.period:  # tau = 0: the sync completes here too
            self._local_step = 0
            self._perform_sync()

    # -- the two halves of a fragment sync ----------------------------------------

    def lane_for(self, fragment: int) -> int:
        """The process-group lane fragment ``fragment``'s sync runs on."""
        return fragment % self._num_lanes

    def _quorum_id(self) -> Optional[int]:
        # An ft Manager's; None for a manager without it (every quorum then counts as changed).
        fn = getattr(self._manager, "quorum_id", None)
        return fn() if callable(fn) else None

    def _count_syncing(self, f: int, syncing: bool) -> Optional[float]:
        """The number of groups of this quorum at their sync (this one: ``syncing``), summed
        on fragment ``f``'s lane ahead of its sync; None if the exchange failed."""
        device = _local(self._fragments[f].params[0][1].detach()).device
        count = torch.tensor([1.0 if syncing else 0.0], dtype=torch.float32, device=device)
        with lane(self.lane_for(f)):
            work = self._manager.allreduce(count, should_quantize=False, reduce_op=ReduceOp.SUM)
        work.wait()
        if self._manager.errored() is not None:
            return None
        return float(count.item())

    @span("torchft::local_sgd::prepare_sync")
    def _prepare_sync(self, joining: bool = False) -> bool:
        """Starts the quorum and sends the sync's allreduce; False (only when ``joining``):
        every group of the quorum was joining, so no sync was started (``join_starts``)."""
        self._healed = False
        before = self._quorum_id()
        self._manager.start_quorum()
        after = self._quorum_id()
        changed = before is None or after != before
        if self._healed:
            # The healing peer's parameters hold its own local progress, which it contributes
            # itself: restart every fragment from the healed global state instead.
            for frag in self._fragments:
                frag.restore()
            self._contributes = contributions_after(self._contributes, "heal")
        step = self._manager.current_step()
        f = fragment_for_step(step, self._plan.n_fragments)
        # A changed quorum may mix joining groups with groups at their sync: all of them
        # exchange the count of the latter, so that all decide alike (``join_starts``).
        syncing = self._count_syncing(f, not joining) if changed else None
        if joining and join_starts(changed, syncing):
            self._contributes = contributions_after(self._contributes, "start")
            return False
        frag = self._fragments[f]
        contribute = self._contributes[f]
        pseudo = frag.pseudo_gradients() if contribute else frag.zeros()
        with lane(self.lane_for(f)):
            handle = self._weighted_sum(pseudo, contribute)
        self._pending = (f, handle.tensors, handle)
        return True

    @span("torchft::local_sgd::perform_sync")
    def _perform_sync(self) -> None:
        assert self._pending is not None, "perform_sync without prepare_sync"
        f, pseudo, handle = self._pending
        self._pending = None
        frag = self._fragments[f]
        t0 = time.perf_counter()
        total = 0.0
        try:
            with span_block("torchft::local_sgd::wait"):
                handle.wait()
            total = handle.total()
        except Exception as e:  # the Manager reports its own errors; this is belt and braces
            self._manager.report_error(e)
        self.comm_wait_seconds += time.perf_counter() - t0
        local = [_local(p.detach()).clone() for _, p in frag.params] if self._alpha > 0 else None
        frag.restore()
        self.syncs += 1
        committed = self._manager.should_commit()
        self.contributors = total
        # Whether it commits or not, every group starts this fragment's next interval from
        # the same global state.
        self._contributes = contributions_after(self._contributes, "sync", f)
        if not committed:
            # Drop this fragment's local progress: params stay = backup.
            self.failed_commits += 1
            return
        if total > 0:
            for t in pseudo:
                t.div_(total)
            self._outer_step(frag, pseudo)
            frag.save()
        if local is not None:
            with torch.no_grad():
                for (_, p), loc in zip(frag.params, local):
                    _local(p.detach()).lerp_(loc, self._alpha)
        self.commits += 1

    def _outer_step(self, frag: _Fragment, pseudo: List[torch.Tensor]) -> None:
        opt = frag.outer_optimizer
        # Only this fragment's params get a gradient; every other param the
        # outer optimizer holds is skipped (grad None). Inner grads are put back.
        saved: Dict[int, Optional[torch.Tensor]] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                saved[id(p)] = p.grad
                p.grad = None
        mine = {id(p) for _, p in frag.params}
        missing = mine - set(saved)
        if missing:
            raise ValueError(
                f"the outer optimizer of fragment {frag.index} does not hold all its parameters"
            )
        try:
            for (_, p), g in zip(frag.params, pseudo):
                p.grad = _like_param(p, g)
            opt.step()
        finally:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = saved[id(p)]

    # -- introspection --------------------------------------------------------

    @property
    def plan(self) -> StreamingPlan:
        return self._plan

    def global_state(self) -> Dict[str, Any]:
        """Copies of every fragment's backup and outer-optimizer state (for tests)."""
        out: Dict[str, Any] = {}
        for frag in self._fragments:
            out[f"backup/{frag.index}"] = {n: b.clone() for n, b in frag.backup.items()}
            if self._shared_outer is None:
                out[f"outer/{frag.index}"] = clone_state(frag.outer_optimizer.state_dict())
        if self._shared_outer is not None:
            out["outer"] = clone_state(self._shared_outer.state_dict())
        return out


def extract_local_tensor(t: torch.Tensor) -> torch.Tensor:
    """torchft's helper: a copy of ``t`` (of its local tensor, for a DTensor) that shares no
    memory with it and has no ``.grad``."""
    copy = _local(t).clone()
    copy.grad = None  # explicit, as in torchft (a clone never carries a .grad)
    return copy
