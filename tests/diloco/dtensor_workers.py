"""Child processes for the DTensor DiLoCo/LocalSGD test (tests/diloco/test_dtensor_mp.py).

Each child is one replica group of world size 1. Besides the ft process group
(the Manager's, across replica groups) it starts a local gloo default process
group of world size 1 and a 1-D CPU DeviceMesh over it; with
``placement="replicate"`` (or ``"shard"``) the model's parameters are DTensors on
that mesh, built with ``distribute_module``. With ``placement=None`` the model is
the same model with plain tensors, so the two runs can be compared bitwise.
Everything else (real lighthouse, ManagerServer, ft.Manager, ft.ProcessGroupGloo)
is as in tests/diloco/mp_workers.py.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests.diloco.mp_workers import _task, digest, make_algo, make_manager
from tests.procs import worker_store


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def to_local(o: Any) -> Any:
    """The same tree with every DTensor replaced by (a clone of) its local tensor."""
    if torch.is_tensor(o):
        return (o.to_local() if is_dtensor(o) else o).detach().clone()
    if isinstance(o, dict):
        return (
            type(o)((k, to_local(v)) for k, v in o.items())
            if not hasattr(o, "_metadata")
            else _od(o)
        )
    if isinstance(o, (list, tuple)):
        return type(o)(to_local(v) for v in o)
    return o


def _od(o):
    out = type(o)((k, to_local(v)) for k, v in o.items())
    out._metadata = o._metadata  # type: ignore[attr-defined]
    return out


_MESH = None


def local_mesh():
    """A 1-D CPU DeviceMesh over this replica group (world size 1, local gloo)."""
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        _MESH = init_device_mesh("cpu", (1,), mesh_dim_names=("replicate",))
    return _MESH


def build_model(placement: Optional[str], mesh: Any = None) -> nn.Module:
    """The test model; with a placement, its parameters are DTensors on ``mesh`` (default: the
    1-rank local mesh), inputs are replicated and the output is gathered."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if placement is None:
        return model
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )

    mesh = mesh if mesh is not None else local_mesh()
    pl = [Replicate()] if placement == "replicate" else [Shard(0)]

    def partition(_name, mod, mesh):
        for n, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(n, nn.Parameter(distribute_tensor(p.data, mesh, pl)))

    def inputs(_mod, args, mesh):
        return tuple(DTensor.from_local(a, mesh, [Replicate()], run_check=False) for a in args)

    def outputs(_mod, out, mesh):
        return out.full_tensor()

    distribute_module(model, mesh, partition, input_fn=inputs, output_fn=outputs)
    return model


def healing_fns(model: nn.Module, inner: torch.optim.Optimizer):
    """(save, load) of the user's state for healing: plain local tensors (ft's checkpoint
    transport moves plain tensors only), copied back into the DTensors' local tensors."""
    from ft.local_sgd import _load_optimizer_state

    def save():
        return {"model": to_local(model.state_dict()), "inner": to_local(inner.state_dict())}

    def load(sd):
        with torch.no_grad():
            for n, v in model.state_dict().items():
                (v.to_local() if is_dtensor(v) else v).copy_(sd["model"][n])
        _load_optimizer_state(inner, sd["inner"])

    return save, load


def run_config(rank: int, lh_addr: str, cfg: Dict[str, Any], store=None) -> Dict[str, Any]:
    torch.manual_seed(7 + 31 * rank)  # different initial weights: init_sync must fix them
    model = build_model(cfg.get("placement"))
    dparams = [p for p in model.parameters() if is_dtensor(p)]
    assert len(dparams) == (4 if cfg.get("placement") else 0), [type(p) for p in model.parameters()]
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)

    save, load = healing_fns(model, inner)

    if cfg.get("late") and rank == 1:
        store.wait(["r0-at-late"])  # join only once replica 0 has outer momentum
    manager = make_manager(rank, lh_addr, 2, load, save, cfg["tag"])
    if cfg.get("late") and rank == 1:
        store.set("r1-ready", "1")
    algo, _ = make_algo(manager, model, inner, cfg)
    if cfg["algo"] == "localsgd":
        state_fn = lambda: {"params": dict(model.named_parameters()), **algo._state_dict()}  # noqa: E731
    else:
        n_frag = cfg.get("n_frag", 1)

        # with one fragment the parameters equal the global state after a sync;
        # with two, the other fragment's parameters carry local progress.
        def state_fn():
            if n_frag == 1:
                return {"global": algo.global_state(), "params": dict(model.named_parameters())}
            return {"global": algo.global_state()}

    def full_fn():
        return {
            "s": state_fn(),
            "all_params": dict(model.named_parameters()),
            "inner": inner.state_dict(),
        }

    commits: Dict[int, str] = {}
    full: Dict[int, str] = {}
    kinds: Dict[str, str] = {}
    local = 0

    def record(now: int) -> None:
        nonlocal kinds
        kinds = {k: type(v).__name__ for k, v in _leaves(full_fn())}
        commits[now] = digest(to_local(state_fn()))
        full[now] = digest(to_local(full_fn()))

    with algo:
        for _ in range(200):
            if manager.current_step() >= cfg["stop_at"]:
                break
            if cfg.get("late") and rank == 0 and manager.current_step() >= cfg["late"]:
                store.set("r0-at-late", "1")
                store.wait(["r1-ready"])  # replica 1 joins late, once 0 has outer momentum
            if cfg.get("step_sleep"):
                time.sleep(cfg["step_sleep"])
            step_before = manager.current_step()
            x, y = _task(manager.current_step(), local, rank)
            inner.zero_grad()
            # The first forward runs the join round, which commits there (or with tau > 0 at
            # the first inner step).
            nn.functional.mse_loss(model(x), y).backward()
            if manager.current_step() != step_before:
                record(manager.current_step())
                step_before = manager.current_step()
            inner.step()  # the hook may sync here
            local += 1
            now = manager.current_step()
            if now != step_before:
                record(now)
    out = {
        "step": manager.current_step(),
        "commits": commits,
        "final": digest(to_local(state_fn())),
        "kinds": kinds,
        "full": full,
        "failed": getattr(algo, "failed_commits", 0),
    }
    manager.shutdown(wait=False)
    return out


def _leaves(o: Any, prefix: str = ""):
    if torch.is_tensor(o):
        yield prefix, o
    elif isinstance(o, dict):
        for k, v in o.items():
            yield from _leaves(v, f"{prefix}/{k}")
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            yield from _leaves(v, f"{prefix}/{i}")


def partial_rejected() -> Dict[str, str]:
    """DiLoCo/LocalSGD reject a Partial parameter (its local tensor is not the value)."""
    from torch.distributed.tensor import DTensor, Partial

    from ft.local_sgd import DiLoCo, LocalSGD

    class _Stub:  # construction only: no sync happens
        use_async_quorum = False
        num_lanes = 1

        def register_state_dict_fn(self, *a: Any) -> None:
            pass

    mesh = local_mesh()
    model = nn.Linear(2, 2)
    model.weight = nn.Parameter(DTensor.from_local(torch.ones(2, 2), mesh, [Partial()]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    for name, make in (
        ("diloco", lambda: DiLoCo(_Stub(), [model], opt, opt, sync_every=2)),
        ("localsgd", lambda: LocalSGD(_Stub(), model, opt, sync_every=2)),
    ):
        try:
            make()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


def train(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    configs: List[Dict[str, Any]],
    check_partial: bool = False,
) -> List[Any]:
    store = worker_store(store_port)
    results: List[Any] = []
    if check_partial:
        results.append(partial_rejected())
    for i, cfg in enumerate(configs):
        try:
            results.append(run_config(rank, lh_addr, dict(cfg, tag=f"d{i}-"), store))
        except Exception as e:  # reported, so the test shows exactly what fails
            import traceback

            results.append({"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()})
            raise
    return results


def train_sharded_groups(
    proc: int, world_size: int, store_port: int, *, lh_addr: str, sync_every: int, stop_at: int
) -> Dict[str, Any]:
    """2 replica groups x 2 ranks (proc = 2 * replica + group_rank). Inside each group the
    two ranks form a 2-rank CPU DeviceMesh (local gloo) and every parameter is Shard(0) on
    it, so each rank holds half of each tensor; DiLoCo on each rank averages its shard with
    the same rank of the other replica group (the ft process group pairs group ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from ft.local_sgd import DiLoCo
    from tests.manager import inproc

    replica, group_rank = divmod(proc, 2)
    store = worker_store(store_port)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"mesh{replica}", store), rank=group_rank, world_size=2
    )
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))

    torch.manual_seed(7 + 31 * replica)  # groups differ; init_sync must make them equal
    model = build_model("shard", mesh)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    save, load = healing_fns(model, inner)

    manager = inproc.group_manager(  # 10 s timeouts
        store,
        f"group{replica}-port",
        lh_addr,
        f"shard{replica}",
        group_rank,
        2,
        load_state_dict=load,
        state_dict=save,
        min_replica_size=2,
        use_async_quorum=False,
        quorum_timeout=timedelta(seconds=30),
    )
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    algo = DiLoCo(manager, [model], inner, outer, sync_every=sync_every)
    commits: Dict[int, str] = {}
    local = 0
    with algo:
        for _ in range(100):
            if manager.current_step() >= stop_at:
                break
            before = manager.current_step()
            x, y = _task(manager.current_step(), local, replica)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # the first forward joins
            if manager.current_step() != before:
                commits[manager.current_step()] = digest(to_local(algo.global_state()))
                before = manager.current_step()
            inner.step()
            local += 1
            if manager.current_step() != before:
                commits[manager.current_step()] = digest(to_local(algo.global_state()))
    shards = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    out = {
        "replica": replica,
        "group_rank": group_rank,
        "step": manager.current_step(),
        "commits": commits,
        "shard_digest": digest(shards),
        "full_digest": digest(full),
        "shard_shape": list(shards["0.weight"].shape),
        "kinds": kinds,
        "failed": algo.failed_commits,
    }
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return out
