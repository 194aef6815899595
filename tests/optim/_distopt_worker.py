"""Child processes for tests/optim/test_distributed_optimizer.py (run through tests.procs.Workers).

Rank 0 is the driver ("driver"), ranks 1 and 2 own the two layers of a model-parallel MLP
("worker1", "worker2"), over torch.distributed.rpc (TensorPipe, 127.0.0.1). The driver owns
one parameter itself. The test store coordinates the faults: the driver sets ``stop`` (then
``kill``) and waits for ``stopped`` (``killed``); every process leaves once ``done`` is set.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from ft.utils.tensors import clone_state
from tests.procs import connect_store

_MODULES: Dict[str, nn.Module] = {}


# -- RPC targets on the owners -----------------------------------------------------------


def _build(name: str, n_in: int, n_out: int, seed: int) -> List[Any]:
    torch.manual_seed(seed)
    _MODULES[name] = nn.Linear(n_in, n_out)
    return [rpc.RRef(p) for p in _MODULES[name].parameters()]


def _forward(name: str, x: torch.Tensor) -> torch.Tensor:
    return _MODULES[name](x)


def _params(name: str) -> List[torch.Tensor]:
    return [p.detach().clone() for p in _MODULES[name].parameters()]


def _optim_state(opt_rref: Any) -> Dict[str, Any]:
    return clone_state(opt_rref.local_value().optim.state_dict())


class RaisesOnWorker2(torch.optim.SGD):
    """An optimizer whose step fails on worker2 only (an owner-side error during prepare)."""

    def step(self, closure=None):
        if rpc.get_worker_info().name == "worker2":
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


# -- the driver ------------------------------------------------------------------------------


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _remote_forward(scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(rpc.rpc_sync("worker1", _forward, args=("l1", x)))
    return rpc.rpc_sync("worker2", _forward, args=("l2", h)) * scale


def _equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _states_equal(a: Any, b: Any) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_states_equal(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


def _by_owner(dopt: Any) -> Dict[str, Any]:
    return {r.owner().name: r for r in dopt.remote_optimizers}


def _snapshot(dopt: Any, scale: torch.Tensor) -> Dict[str, Any]:
    opts = _by_owner(dopt)
    return {
        "worker1": rpc.rpc_sync("worker1", _params, args=("l1",)),
        "worker1_state": rpc.rpc_sync("worker1", _optim_state, args=(opts["worker1"],)),
        "driver": [scale.detach().clone()],
        "driver_state": _optim_state(opts["driver"]),
    }


def _unchanged(before: Dict[str, Any], after: Dict[str, Any]) -> bool:
    return (
        _equal(before["worker1"], after["worker1"])
        and _equal(before["driver"], after["driver"])
        and _states_equal(before["worker1_state"], after["worker1_state"])
        and _states_equal(before["driver_state"], after["driver_state"])
    )


def _drive(store: Any, steps: int) -> Dict[str, Any]:
    from ft.optim.distributed_optimizer import DistributedOptimizer, StepNotApplied

    out: Dict[str, Any] = {}
    rrefs = rpc.rpc_sync("worker1", _build, args=("l1", 4, 8, 1)) + rpc.rpc_sync(
        "worker2", _build, args=("l2", 8, 2, 2)
    )
    scale = nn.Parameter(torch.linspace(0.5, 1.5, 2))
    rrefs.append(rpc.RRef(scale))

    # The same model, locally, with a local optimizer: the reference.
    torch.manual_seed(1)
    l1 = nn.Linear(4, 8)
    torch.manual_seed(2)
    l2 = nn.Linear(8, 2)
    ref_scale = nn.Parameter(torch.linspace(0.5, 1.5, 2))
    ref_params = list(l1.parameters()) + list(l2.parameters()) + [ref_scale]
    kw = dict(lr=0.05, weight_decay=0.01)
    ref_opt = torch.optim.Adam(ref_params, **kw)
    dopt = DistributedOptimizer(torch.optim.Adam, rrefs, **kw)
    out["owners"] = sorted(_by_owner(dopt))

    equal = []
    for step in range(steps):
        x, y = _data(step)
        with dist_autograd.context() as ctx:
            loss = nn.functional.mse_loss(_remote_forward(scale, x), y)
            dist_autograd.backward(ctx, [loss])
            dopt.step(ctx)
        ref_opt.zero_grad()
        nn.functional.mse_loss(l2(torch.tanh(l1(x))) * ref_scale, y).backward()
        ref_opt.step()
        remote = (
            rpc.rpc_sync("worker1", _params, args=("l1",))
            + rpc.rpc_sync("worker2", _params, args=("l2",))
            + [scale.detach()]
        )
        equal.append(_equal(remote, [p.detach() for p in ref_params]))
    out["equal"] = equal
    out["changed"] = not torch.equal(ref_scale.detach(), torch.linspace(0.5, 1.5, 2))

    # An owner's optimizer raises during prepare: applied nowhere.
    bad = DistributedOptimizer(RaisesOnWorker2, rrefs, lr=0.1)
    with dist_autograd.context() as ctx:
        x, y = _data(100)
        dist_autograd.backward(ctx, [nn.functional.mse_loss(_remote_forward(scale, x), y)])
        before = _snapshot(dopt, scale)
        try:
            bad.step(ctx)
            out["raised"] = None
        except StepNotApplied as e:
            out["raised"] = {"msg": str(e), "failed": sorted(e.failed), "unchanged": e.unchanged}
        out["raised_unchanged"] = _unchanged(before, _snapshot(dopt, scale))

    # worker2 hangs (SIGSTOP: its connections stay open, so only the RPC timeout can tell),
    # then is killed -9, between backward and step.
    with dist_autograd.context() as ctx:
        x, y = _data(101)
        dist_autograd.backward(ctx, [nn.functional.mse_loss(_remote_forward(scale, x), y)])
        before = _snapshot(dopt, scale)
        for event in ("stop", "kill"):
            store.set(event, "1")
            store.wait([f"{event}ped" if event == "stop" else "killed"], timedelta(seconds=30))
            t0 = time.monotonic()
            try:
                dopt.step(ctx)
                out[event] = None
            except StepNotApplied as e:
                out[event] = {"msg": str(e), "failed": sorted(e.failed), "unchanged": e.unchanged}
            out[f"{event}_seconds"] = time.monotonic() - t0
            out[f"{event}_unchanged"] = _unchanged(before, _snapshot(dopt, scale))
    return out


def main(
    rank: int, world_size: int, store_port: int, *, rpc_port: int, rpc_timeout: float, steps: int
) -> Dict[str, Any]:
    torch.set_num_threads(1)
    # Paid before the RPC agent starts: a process's first torch.optim optimizer imports
    # torch._dynamo (2.7 s on this 2-core machine under load), and ft.optim takes 0.5 s more.
    # Inside the first remote call they can outlast the short rpc_timeout that this test
    # needs for its hang case.
    import ft.optim.distributed_optimizer  # noqa: F401

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])

    store = connect_store(store_port, timeout_s=60)
    name = "driver" if rank == 0 else f"worker{rank}"
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=rpc_timeout, num_worker_threads=8
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    if rank != 0:
        try:
            store.wait(["done"], timedelta(seconds=90))
        finally:
            rpc.shutdown(graceful=False)  # a peer may be dead: no shutdown barrier
        return {"name": name}
    try:
        return _drive(store, steps)
    finally:
        store.set("done", "1")
        rpc.shutdown(graceful=False)
