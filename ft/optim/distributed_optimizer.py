"""Remote optimizer: torch's ``DistributedOptimizer`` over ``torch.distributed.rpc``, with a
two-phase step so that a failed step is applied on no owner.

    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [loss(model_parallel_forward(x))])
        DistributedOptimizer(torch.optim.Adam, param_rrefs, lr=1e-3).step(ctx)

Contract:
  * ``DistributedOptimizer(optimizer_class, params_rref, *args, **kwargs)`` (torch's signature):
    the parameter RRefs are grouped by owner, and on each owner one local
    ``optimizer_class(local_params, *args, **kwargs)`` is created by RPC (all owners in
    parallel; ``remote_optimizers`` holds their RRefs, as in torch). A failure raises
    :class:`RemoteOptimizerError` naming the owners.
  * ``step(context_id)``: each owner takes its gradients from
    ``dist_autograd.get_gradients(context_id)``; a parameter without a gradient in that context
    is not updated (torch's default TorchScript path does the same). The update is
    ``optimizer_class``'s own ``step()`` (not a TorchScript port), so it is bitwise the update
    a local ``optimizer_class`` makes from the same gradients.
  * Two phases. *Prepare* (every owner, in parallel): the owner runs the local step, keeps the
    result (new parameter values, optimizer state and hyperparameters) aside, and puts the
    parameters and optimizer state back as they were, bitwise. *Commit* (only when every owner
    prepared): each owner installs its result. Hence:
      - ``step()`` returned: every owner applied the step.
      - ``step()`` raised :class:`StepNotApplied` (an owner died, was unreachable, timed out,
        or its optimizer raised during prepare): the step was applied on no owner; every
        surviving owner's parameters and optimizer state are bitwise as before the step. The
        error names the failed owners and their causes. (The prepared results are dropped;
        even if that message is lost, nothing was written to the live parameters.)
      - ``step()`` raised :class:`StepPartiallyApplied`: every owner prepared, then a commit
        failed (the owner died or became unreachable in between). That cannot be undone on
        the owners that committed; ``applied`` lists them and ``unknown`` the failed ones.
  * Bounded: every RPC runs under the RPC agent's timeout (``rpc_timeout`` of ``init_rpc``);
    a killed owner is usually detected at once (closed connection). ``step()`` returns or
    raises within about two such timeouts.
  * A commit checks that the owner's parameters were not written since its prepare (tensor
    version counters): steps are serialized per DistributedOptimizer (a lock) and per owner
    process, but two DistributedOptimizers stepping the same parameters concurrently would
    otherwise lose an update silently; here the second commit fails with an error instead.
  * Cost: per step two RPC rounds instead of torch's one, and on each owner one extra copy of
    its parameters and optimizer state while the step is prepared.

What is and is not fault tolerant here: a step is atomic with respect to owner failures
(applied everywhere or nowhere, except a failure between the two phases), and a dead owner is
reported instead of hanging. But an RPC group is static (``world_size`` fixed at
``init_rpc``): a dead owner cannot be replaced, and its parameters and optimizer state are
lost with it (there is no replica to heal from). Continuing means restarting the RPC job from
a checkpoint. The ``ft.Manager``-based optimizers are the fault-tolerant alternatives for data
parallelism, where every replica group holds the whole model: ``ft.Optimizer`` with
``ft.DistributedDataParallel`` (per step), ``ft.local_sgd.LocalSGD``/``DiLoCo`` and
``ft.optim.post_localsgd.FaultTolerantModelAverager`` (periodic averaging), and
``ft.optim.FaultTolerantZeroRedundancyOptimizer`` (sharded optimizer state with a buddy copy).
There a dead replica group is left out of the next quorum, the others keep training, and a
restarted group heals from a live one.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from ft.utils.tensors import clone_state

__all__ = ["DistributedOptimizer", "RemoteOptimizerError", "StepNotApplied", "StepPartiallyApplied"]


class RemoteOptimizerError(RuntimeError):
    """An RPC to the owners of the parameters failed. ``failed`` maps owner name -> cause."""

    def __init__(self, message: str, failed: Dict[str, str]) -> None:
        super().__init__(message)
        self.failed = failed


class StepNotApplied(RemoteOptimizerError):
    """The step failed before any owner applied it: no owner's parameters changed."""

    def __init__(self, message: str, failed: Dict[str, str], unchanged: List[str]) -> None:
        super().__init__(message, failed)
        self.unchanged = unchanged


class StepPartiallyApplied(RemoteOptimizerError):
    """Every owner prepared the step, then some commits failed: ``applied`` did apply it,
    ``unknown`` (the failed ones) may or may not have."""

    def __init__(self, message: str, failed: Dict[str, str], applied: List[str]) -> None:
        super().__init__(message, failed)
        self.applied = applied
        self.unknown = sorted(failed)


# --------------------------------------------------------------------------- owner side


@dataclass
class _Prepared:
    """A step prepared on an owner and not yet committed: the new parameter values and
    optimizer state, and the versions of the parameters it was computed from."""

    token: str
    values: List[torch.Tensor]
    state: Dict[Any, Any]
    hyper: List[Dict[str, Any]]
    versions: List[int]


class _LocalOptimizer:
    """One owner's optimizer over its local parameters, stepped in two phases."""

    # One local step at a time per process, as in torch (a step swaps shared .grad fields).
    _lock = threading.Lock()

    def __init__(
        self, optimizer_class: Any, params: List[torch.Tensor], *args: Any, **kwargs: Any
    ) -> None:
        self.params = params
        self.optim = optimizer_class(params, *args, **kwargs)
        self._pending: Optional[_Prepared] = None

    def _hyper(self) -> List[Dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optim.param_groups]

    def _set_hyper(self, hyper: List[Dict[str, Any]]) -> None:
        for g, h in zip(self.optim.param_groups, hyper):
            g.update(h)

    def prepare(self, token: str, grads: Dict[torch.Tensor, torch.Tensor]) -> None:
        with self._lock:
            self._pending = None  # a stale prepare (its driver died before committing)
            state = self.optim.state
            old_values = [p.detach().clone() for p in self.params]
            old_state = {p: clone_state(state[p]) for p in self.params if p in state}
            old_hyper = clone_state(self._hyper())
            old_grads = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)  # None: not in this context, so not updated
                self.optim.step()
                new_values = [p.detach().clone() for p in self.params]
                new_state = {p: state[p] for p in self.params if p in state}
                new_hyper = self._hyper()
            finally:
                # Back to exactly the state before the step, whether it succeeded or not.
                with torch.no_grad():
                    for p, old, g in zip(self.params, old_values, old_grads):
                        p.copy_(old)
                        p.grad = g
                for p in self.params:
                    if p in old_state:
                        state[p] = old_state[p]
                    else:
                        state.pop(p, None)
                self._set_hyper(old_hyper)
            # torch's in-place version counter (no public equivalent): commit() uses it to
            # see whether a parameter was written after this prepare.
            versions = [p._version for p in self.params]  # torch's counter, as said above
            self._pending = _Prepared(token, new_values, new_state, new_hyper, versions)

    def commit(self, token: str) -> None:
        with self._lock:
            pending = self._pending
            if pending is None or pending.token != token:
                raise RuntimeError(
                    f"no prepared step {token} on this owner (it was replaced by "
                    f"another prepare, or never arrived)"
                )
            self._pending = None
            # torch's version counter, as in prepare()
            now = [p._version for p in self.params]
            moved = [i for i, (v, w) in enumerate(zip(now, pending.versions)) if v != w]
            if moved:
                raise RuntimeError(
                    f"parameters {moved} of this owner were written between prepare and commit "
                    f"(a concurrent step from another DistributedOptimizer?); the step was not "
                    f"applied here"
                )
            with torch.no_grad():
                for p, new in zip(self.params, pending.values):
                    p.copy_(new)
            for p, st in pending.state.items():
                self.optim.state[p] = st
            self._set_hyper(pending.hyper)

    def abort(self, token: str) -> None:
        with self._lock:
            if self._pending is not None and self._pending.token == token:
                self._pending = None


# RPC targets: module-level so that they pickle by name.


def _new_local_optimizer(
    optimizer_class: Any, param_rrefs: List[Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
) -> Any:
    params = [r.local_value() for r in param_rrefs]
    return rpc.RRef(_LocalOptimizer(optimizer_class, params, *args, **kwargs))


def _prepare(opt_rref: Any, context_id: int, token: str) -> None:
    opt_rref.local_value().prepare(token, dist_autograd.get_gradients(context_id))


def _commit(opt_rref: Any, token: str) -> None:
    opt_rref.local_value().commit(token)


def _abort(opt_rref: Any, token: str) -> None:
    opt_rref.local_value().abort(token)


# --------------------------------------------------------------------------- driver side


def _describe(e: BaseException) -> str:
    """One line per failed owner: the remote exception, a lost connection, or the RPC error."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__
    if "On WorkerInfo" in lines[0] and len(lines) > 1:
        return f"raised {lines[1]}"  # RPC puts the remote exception's repr on the 2nd line
    if lines[0].startswith("eof"):
        # TensorPipe's word for a connection closed by the peer, e.g. a killed process
        return f"connection lost ({lines[0]}): the owner died or exited"
    return f"{type(e).__name__}: {lines[0]}"


def _call_all(
    targets: Sequence[Tuple[str, Any]], fn: Any, args: Tuple[Any, ...]
) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """Calls fn(rref, *args) on each (owner, rref)'s owner in parallel; waits for every reply
    (each bounded by the RPC timeout). Returns ({owner: result}, {owner: failure})."""
    futs = []
    failed: Dict[str, str] = {}
    for owner, rref in targets:
        try:
            futs.append((owner, rpc.rpc_async(owner, fn, args=(rref,) + args)))
        except Exception as e:  # noqa: BLE001 - an owner we cannot even send to
            failed[owner] = _describe(e)
    results: Dict[str, Any] = {}
    for owner, fut in futs:
        try:
            results[owner] = fut.wait()
        except Exception as e:  # noqa: BLE001 - reported with the owner's name
            failed[owner] = _describe(e)
    return results, failed


def _names(owners: Sequence[str]) -> str:
    return ", ".join(repr(o) for o in owners) if owners else "none"


def _causes(failed: Dict[str, str]) -> str:
    """``owner: cause`` for each failed owner, in order."""
    return "; ".join(f"{o}: {c}" for o, c in sorted(failed.items()))


class DistributedOptimizer:
    """torch.distributed.optim.DistributedOptimizer with a two-phase step (module docstring).

    Args:
        optimizer_class: the ``torch.optim.Optimizer`` subclass to create on each owner.
        params_rref: RRefs to the (local or remote) parameters to optimize.
        args, kwargs: passed to ``optimizer_class`` on each owner.
    """

    def __init__(
        self, optimizer_class: Any, params_rref: Sequence[Any], *args: Any, **kwargs: Any
    ) -> None:
        if not rpc.is_available():
            raise RuntimeError(
                "DistributedOptimizer needs torch.distributed.rpc, which this "
                "torch build does not include"
            )
        per_owner: Dict[str, List[Any]] = {}
        for r in params_rref:
            per_owner.setdefault(r.owner().name, []).append(r)
        if not per_owner:
            raise ValueError("DistributedOptimizer got no parameter RRefs")
        self._owners = list(per_owner)
        futs = [
            (
                o,
                rpc.rpc_async(
                    o,
                    _new_local_optimizer,
                    args=(optimizer_class, rrefs, tuple(args), dict(kwargs)),
                ),
            )
            for o, rrefs in per_owner.items()
        ]
        remote, failed = [], {}
        for o, fut in futs:
            try:
                remote.append(fut.wait())
            except Exception as e:  # noqa: BLE001
                failed[o] = _describe(e)
        if failed:
            raise RemoteOptimizerError(
                f"could not create {getattr(optimizer_class, '__name__', optimizer_class)} on "
                f"owner(s) {_names(sorted(failed))}: {_causes(failed)}",
                failed,
            )
        self.remote_optimizers = remote
        self._lock = threading.Lock()

    def step(self, context_id: int) -> None:
        """Applies one step on every owner, or on none (see the module docstring).

        Raises:
            StepNotApplied: some owner failed to prepare; no owner applied the step.
            StepPartiallyApplied: some owner failed to commit after all prepared.
        """
        check = getattr(dist_autograd, "_is_valid_context", None)
        if check is not None:
            check(context_id)  # raises for an unknown context, as torch's step does
        targets = list(zip(self._owners, self.remote_optimizers))
        token = uuid.uuid4().hex
        with self._lock:
            _, failed = _call_all(targets, _prepare, (context_id, token))
            if failed:
                ok = [o for o in self._owners if o not in failed]
                # Only frees the prepared copies: the live parameters were never written.
                _call_all([(o, r) for o, r in targets if o in ok], _abort, (token,))
                raise StepNotApplied(
                    f"DistributedOptimizer.step(context_id={context_id}) failed on owner(s) "
                    f"{_names(sorted(failed))} ({_causes(failed)}); the step was applied on no "
                    f"owner: the parameters and optimizer state of {_names(ok)} are as before "
                    f"the step",
                    failed,
                    ok,
                )
            _, failed = _call_all(targets, _commit, (token,))
            if failed:
                applied = [o for o in self._owners if o not in failed]
                raise StepPartiallyApplied(
                    f"DistributedOptimizer.step(context_id={context_id}): every owner prepared "
                    f"the step, then the commit failed on {_names(sorted(failed))} "
                    f"({_causes(failed)}); it was applied on {_names(applied)} and may or may "
                    f"not have been applied on the failed owner(s)",
                    failed,
                    applied,
                )
