"""Optimizer in backward: each parameter's optimizer runs as soon as its gradient is ready.

``apply_optimizer_in_backward(optimizer_class, params, optimizer_kwargs, register_hook=True)``
is torch's ``torch.distributed.optim._apply_optimizer_in_backward``: every parameter gets its
own ``optimizer_class([param], **optimizer_kwargs)``, stepped from a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``), after which ``param.grad`` is None. The
optimizers are listed, as in torch, on ``param._in_backward_optimizers`` (with
``_optimizer_classes``/``_optimizer_kwargs``) and by :func:`get_in_backward_optimizers` (torch:
``_get_in_backward_optimizers``), e.g. for checkpointing.

What ft adds is ``manager=``: an in-backward step that takes part in the Manager's commit::

    apply_optimizer_in_backward(torch.optim.AdamW, model.parameters(), {"lr": 1e-3},
                                manager=manager)
    for batch in data:
        manager.start_quorum()
        loss_fn(model(batch)).backward()    # per parameter: average its gradient, compute
                                            # the updated parameter and state on the side
        commit_in_backward(model, manager)  # manager.should_commit(): install them, or drop

Contract:
    - Without ``manager`` the behaviour is torch's: each parameter is updated in place in its
      hook, bitwise as one ``optimizer_class`` step on the same gradient.
    - With ``manager``, call ``manager.start_quorum()`` before the forward pass. Each hook
      waits for the quorum, then averages the gradient across the replicas
      (``manager.allreduce(grad).wait()``), so every replica computes the same update; do not
      also wrap the model in ``ft.DistributedDataParallel``. Every replica must produce
      gradients for the same parameters, in the same order (as with DDP).
    - With ``manager``, the hook computes the step out of place: the optimizer runs on a copy
      of the parameter and of its state. The live parameter and state are not written until
      :func:`commit_in_backward`, which calls ``manager.should_commit()``: on True the copies
      are installed (the parameter with an in-place ``copy_``, so views of it stay valid),
      bitwise equal to a normal optimizer step; on False, or if it raises, they are dropped,
      and the parameters and optimizer state are exactly as before the step. Why out of place: a
      replica may be the source of a heal during the step, and the Manager serves its
      registered state (``model.state_dict()``, ``optimizer.state_dict()``) while backward
      runs, relying on it not changing until ``should_commit``.
    - Several ``backward()`` calls before one commit form one step: each continues from the
      step's copy; the gradients are those of the parameters as they were before the step.
    - A replica that does not take part in the step (it heals with ``use_async_quorum=True``,
      so its parameters are replaced inside ``should_commit``, or it is a spare) keeps the
      averaged gradient instead and steps with it at a successful commit, after the heal. For a
      heal to carry the optimizer state, register it with the Manager
      (``get_in_backward_optimizers(model)``'s state dicts).
    - Limitation: while a hook steps the copy, ``param.data`` is the copy. A registered
      state-dict function that returns the live ``Parameter`` objects themselves (instead of
      ``model.state_dict()``'s detached tensors) could be served mid-update.
    - ``register_hook=False`` registers the optimizers without a hook (torch's option for
      wrappers that run them); :func:`step_in_backward` is what the hook does.

Memory cost of ``manager=``: from a parameter's hook until the commit, one extra copy of the
parameter and of its optimizer state; at the end of backward, one extra copy of every parameter
and its optimizer state for the step (Adam: three parameter-sized tensors per parameter, where
a normal step holds one gradient). A non-participating replica holds its averaged gradients
instead. When that is too much, use ``ft.Optimizer``, which holds only the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Tuple, Type, Union

import torch
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakTensorKeyDictionary

from ft.utils.tensors import clone_state

if TYPE_CHECKING:
    from ft.manager import Manager

__all__ = [
    "apply_optimizer_in_backward",
    "get_in_backward_optimizers",
    "commit_in_backward",
    "rollback_in_backward",
    "step_in_backward",
]

# One optimizer's state for one parameter; None: the optimizer has no state for it.
_State = Optional[Dict[str, Any]]


@dataclass
class _Pending:
    """The step's result for one parameter, not yet installed."""

    data: torch.Tensor
    states: List[_State]


@dataclass
class _Record:
    """ft's per-parameter bookkeeping; never references the parameter (weakly keyed by it)."""

    manager: Optional["Manager"]
    handle: Optional[RemovableHandle] = None
    pending: Optional[_Pending] = None
    staged_grads: List[torch.Tensor] = field(default_factory=list)


# Weakly keyed, not attributes of the parameter: a Parameter pickles and deep-copies its
# __dict__, and a Manager can be neither.
_RECORDS: "WeakTensorKeyDictionary" = WeakTensorKeyDictionary()


def apply_optimizer_in_backward(
    optimizer_class: Type[torch.optim.Optimizer],
    params: Iterable[torch.nn.Parameter],
    optimizer_kwargs: Dict[str, Any],
    register_hook: bool = True,
    *,
    manager: Optional["Manager"] = None,
) -> None:
    """Runs ``optimizer_class([p], **optimizer_kwargs)`` as soon as ``p.grad`` is ready.

    Calling it again for a parameter adds another optimizer; one hook runs them all, in
    order. ``manager``: the step only counts once :func:`commit_in_backward` commits it (see
    the module docstring); all of a parameter's optimizers share one manager (or none).
    """
    params = list(params)
    for i, param in enumerate(params):
        if not isinstance(param, torch.Tensor) or not param.requires_grad or not param.is_leaf:
            raise ValueError(
                f"apply_optimizer_in_backward: params[{i}] is not a leaf tensor that requires "
                f"grad, so no gradient is ever accumulated into it"
            )
        rec = _RECORDS.get(param)
        if rec is not None and rec.manager is not manager:
            raise ValueError(
                f"apply_optimizer_in_backward: params[{i}] already has in-backward optimizers "
                f"with manager={rec.manager!r}; all of a parameter's optimizers must share one "
                f"manager (got {manager!r})"
            )
    for param in params:
        optimizer = optimizer_class([param], **optimizer_kwargs)
        # torch's attribute names: torch's own helpers (checkpointing, DDP) look for them.
        if not hasattr(param, "_in_backward_optimizers"):
            param._in_backward_optimizers = []  # type: ignore[attr-defined]
            param._optimizer_classes = []  # type: ignore[attr-defined]
            param._optimizer_kwargs = []  # type: ignore[attr-defined]
        param._in_backward_optimizers.append(optimizer)  # type: ignore[attr-defined]
        param._optimizer_classes.append(optimizer_class)  # type: ignore[attr-defined]
        param._optimizer_kwargs.append(optimizer_kwargs)  # type: ignore[attr-defined]

        rec = _RECORDS.get(param)
        if rec is None:
            rec = _RECORDS[param] = _Record(manager=manager)
        # One hook per parameter runs all its optimizers (torch adds one per call, but every
        # hook after the first finds grad None and does nothing).
        if register_hook and rec.handle is None:
            rec.handle = param.register_post_accumulate_grad_hook(step_in_backward)


# torch's (private) name, for drop-in use.
_apply_optimizer_in_backward = apply_optimizer_in_backward


def get_in_backward_optimizers(module: torch.nn.Module) -> List[torch.optim.Optimizer]:
    """All in-backward optimizers of ``module``'s parameters, in parameter order (for
    checkpointing; do not call their ``step``/``zero_grad``)."""
    optims: List[torch.optim.Optimizer] = []
    for param in module.parameters():
        optims.extend(getattr(param, "_in_backward_optimizers", []))
    return optims


_get_in_backward_optimizers = get_in_backward_optimizers


def _optimizers(param: torch.Tensor) -> List[torch.optim.Optimizer]:
    # torch's attribute name (set above), which torch's own helpers read too.
    return param._in_backward_optimizers  # type: ignore[attr-defined,no-any-return]


def _get_states(param: torch.Tensor) -> List[_State]:
    # ``opt.state`` is a defaultdict: test membership, since indexing would add an entry.
    return [opt.state[param] if param in opt.state else None for opt in _optimizers(param)]


def _set_states(param: torch.Tensor, states: List[_State]) -> None:
    for opt, state in zip(_optimizers(param), states):
        if state is None:
            opt.state.pop(param, None)
        else:
            opt.state[param] = state


def _step_in_place(param: torch.Tensor, grad: torch.Tensor) -> None:
    param.grad = grad
    for opt in _optimizers(param):
        opt.step()
    param.grad = None


def _step_out_of_place(param: torch.Tensor, grad: torch.Tensor, rec: _Record) -> None:
    """Steps the pending copy (made now on the step's first hook); leaves the live tensors and
    state dicts, which a checkpoint transfer may be reading, untouched."""
    with torch.no_grad():
        pending = rec.pending
        if pending is None:
            pending = _Pending(
                data=param.detach().clone(),
                states=[None if s is None else clone_state(s) for s in _get_states(param)],
            )
        live_data, live_states = param.data, _get_states(param)
        try:
            # The optimizer steps ``param``: point it, and its state, at the copies meanwhile.
            param.data = pending.data
            _set_states(param, pending.states)
            _step_in_place(param, grad)
            pending.data = param.data
            pending.states = _get_states(param)
        finally:
            param.grad = None
            param.data = live_data
            _set_states(param, live_states)
    rec.pending = pending


def step_in_backward(param: torch.Tensor) -> None:
    """What the hook does once ``param.grad`` is accumulated (call it yourself after
    ``register_hook=False``); ``param.grad`` is None afterwards."""
    grad = param.grad
    if grad is None:
        return
    rec = _RECORDS.get(param)
    if rec is None:
        raise ValueError(
            "step_in_backward: the parameter has no optimizer from apply_optimizer_in_backward"
        )
    manager = rec.manager
    if manager is None:
        _step_in_place(param, grad)
        return
    # The quorum, and the checkpoint this replica serves to a healing one (read now, before
    # any hook of this step changes a parameter), must be over before a hook computes
    # anything (allreduce stops waiting for it once the step has errored). Its failures are
    # raised here, as by should_commit.
    manager.wait_quorum()
    send_pending_heal = getattr(manager, "send_pending_heal", None)  # not on torchft's
    if send_pending_heal is not None:
        send_pending_heal()
    # Replicas must apply the same update: average first. A failed allreduce is reported to
    # the manager (the step will not commit) and leaves the local gradient.
    manager.allreduce(grad).wait()
    if not manager.is_participating():
        # Healing (async quorum) or a spare: should_commit may still replace the parameters
        # and state, so step with the averaged gradient only after it, at the commit.
        rec.staged_grads.append(grad)
        param.grad = None
        return
    _step_out_of_place(param, grad, rec)


_ParamsOrModule = Union[torch.nn.Module, Iterable[torch.Tensor]]


def _records(
    where: str, params_or_module: _ParamsOrModule, manager: Optional["Manager"]
) -> List[Tuple[torch.Tensor, _Record]]:
    if isinstance(params_or_module, torch.nn.Module):
        params: Iterable[torch.Tensor] = params_or_module.parameters()
    else:
        params = params_or_module
    out: List[Tuple[torch.Tensor, _Record]] = []
    seen = set()
    for p in params:
        rec = _RECORDS.get(p)
        if rec is None or id(p) in seen:
            continue
        seen.add(id(p))
        if rec.manager is None:
            raise ValueError(
                f"{where}: a parameter of shape {tuple(p.shape)} has in-backward optimizers "
                f"without manager=, so its hook already updated it for good; pass manager= to "
                f"apply_optimizer_in_backward"
            )
        if manager is not None and rec.manager is not manager:
            raise ValueError(
                f"{where}: a parameter of shape {tuple(p.shape)} is bound to "
                f"{rec.manager!r}, not to the manager given ({manager!r})"
            )
        out.append((p, rec))
    if not out:
        raise ValueError(
            f"{where}: none of the parameters has an optimizer from "
            f"apply_optimizer_in_backward(..., manager=...)"
        )
    return out


def _drop(recs: List[Tuple[torch.Tensor, _Record]]) -> None:
    for _, rec in recs:
        rec.pending = None
        rec.staged_grads = []


def rollback_in_backward(params_or_module: _ParamsOrModule) -> None:
    """Drops the current step's pending updates and staged gradients: the parameters and
    optimizer state stay as they were before the step.

    :func:`commit_in_backward` does this when the step does not commit. Call it directly only
    for a step that will not commit (e.g. ``backward()`` raised: report it with
    ``manager.report_error(e)`` so that every replica skips the step).
    """
    _drop(_records("rollback_in_backward", params_or_module, None))


def commit_in_backward(
    params_or_module: _ParamsOrModule, manager: "Manager", timeout: Optional[timedelta] = None
) -> bool:
    """Ends an in-backward step with ``manager.should_commit(timeout)``: on True installs the
    step's updates (and steps staged gradients); on False, or if it raises (e.g. past
    ``max_retries``), drops them before returning/re-raising. Returns the decision.

    Call it once per step, instead of (not besides) ``manager.should_commit()``.
    """
    recs = _records("commit_in_backward", params_or_module, manager)
    try:
        committed = manager.should_commit(timeout)
    except BaseException:
        _drop(recs)
        raise
    if not committed:
        _drop(recs)
        return False
    # should_commit has ended any checkpoint transfer of this step: writing is safe now.
    with torch.no_grad():
        for p, rec in recs:
            pending, rec.pending = rec.pending, None
            if pending is not None:
                p.copy_(pending.data)
                _set_states(p, pending.states)  # the copies become the state: no second copy
            staged, rec.staged_grads = rec.staged_grads, []
            for grad in staged:
                _step_in_place(p, grad)
    return True
