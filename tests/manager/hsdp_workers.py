"""Child processes for tests/manager/test_hsdp.py: HSDP with ft, on CPU Gloo.

Process ``proc`` is rank ``g`` of replica group ``r`` (``r, g = divmod(proc, 2)``). Inside a
group the two ranks form torch's default process group (Gloo, over the test's store under a
prefix of their own, fresh for every incarnation of the group, as torchrun gives a restarted
group a fresh rendezvous). Each rank runs an ``ft.Manager`` (rank ``g`` of world size 2 in its
group) and builds the mesh with ``ft_init_device_mesh``: ``dp_replicate`` is the Manager's
group, ``dp_shard`` the default group. The model is sharded with FSDP2's ``fully_shard`` over
that mesh (HSDP: ``Replicate()`` x ``Shard(0)``), and its state (model and optimizer, as
DTensors) is what a restarted group heals from.

The batch of a step depends only on (committed step, group, group rank), and every group starts
from the same weights, so a run is deterministic: a step commits only with both groups
(``min_replica_size=2``), so after a failure and a heal the committed steps are those of a run
without the failure.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

from tests.procs import connect_store

GROUP_SIZE = 2
TO = timedelta(seconds=10)


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # The last layer has 5 outputs: its weight rows split 3 + 2 (uneven shards).
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5)
    )


def batch(step: int, group: int, group_rank: int):
    g = torch.Generator().manual_seed(10_000 * step + 100 * group + group_rank)
    x = torch.randn(8, 8, generator=g)
    w = torch.linspace(-1, 1, 40).view(8, 5)
    return x, torch.tanh(x @ w) + 0.05 * torch.randn(8, 5, generator=g)


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, Any]:
    """This rank's pieces of the model and optimizer state, as plain tensors (for comparing)."""
    from torch.distributed.tensor import DTensor

    def local(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v.to_local().detach().clone()
        if torch.is_tensor(v):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: local(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [local(x) for x in v]
        return v

    return {"model": local(model.state_dict()), "optim": local(opt.state_dict())}


def _mesh_facts(mesh: Any, manager: Any) -> Dict[str, Any]:
    from ft.process_group import ManagedProcessGroup

    return {
        "type": type(mesh).__name__,
        "shape": tuple(mesh.shape),
        "coord": tuple(mesh.get_coordinate()),
        "replicate_group": type(mesh.get_group("dp_replicate")).__name__,
        "replicate_manager_is_ours": mesh.get_group("dp_replicate")._manager is manager,
        "shard_group_is_default": mesh.get_group("dp_shard") is dist.group.WORLD,
        "sliced_replicate_is_managed": isinstance(
            mesh["dp_replicate"].get_group(), ManagedProcessGroup
        ),
        "sliced_shard_coord": tuple(mesh["dp_shard"].get_coordinate()),
    }


def train(
    proc: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    run: str,
    stop_at: int,
    incarnation: int = 0,
    park_at: int = -1,
    async_quorum: bool = False,
) -> Dict[str, Any]:
    """Trains to step ``stop_at``. With ``park_at``, once step ``park_at`` is committed this rank
    says so in the store and waits there to be killed (so that the test kills it mid-training
    whatever the machine's speed); its group's other rank is then inside the next step. With
    ``async_quorum`` the Manager runs torchtitan's default (``use_async_quorum=True``)."""
    import threading

    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from ft.checkpointing import HTTPTransport
    from tests.manager.inproc import group_manager
    from ft.device_mesh import ft_init_device_mesh

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    group, g = divmod(proc, GROUP_SIZE)
    store = connect_store(store_port)
    prefix = f"{run}/group{group}/inc{incarnation}"
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=g,
        world_size=GROUP_SIZE,
        timeout=timedelta(seconds=60),
    )
    healed: List[Dict[str, Any]] = []
    model = build_model(seed=7 + 1000 * incarnation)  # a restarted group starts elsewhere
    opt_box: List[torch.optim.Optimizer] = []
    # For every read of the registered state: whether it ran on the training (main) thread.
    state_reads: List[bool] = []

    def state_dict() -> Dict[str, Any]:
        state_reads.append(threading.current_thread() is threading.main_thread())
        return {"model": model.state_dict(), "optim": opt_box[0].state_dict()}

    def load_state_dict(sd: Dict[str, Any]) -> None:
        kinds = sorted({type(v).__name__ for v in sd["model"].values()})
        optim_kinds = sorted(
            {
                type(v).__name__
                for s in sd["optim"]["state"].values()
                for k, v in s.items()
                if k != "step"
            }
        )
        healed.append({"kinds": kinds, "optim_kinds": optim_kinds})
        model.load_state_dict(sd["model"])
        opt_box[0].load_state_dict(sd["optim"])

    manager = group_manager(
        store,
        f"{prefix}/port",
        lh_addr,
        f"{run}-group{group}",
        g,
        GROUP_SIZE,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=2,
        use_async_quorum=async_quorum,
        quorum_timeout=timedelta(seconds=60),
        checkpoint_transport=HTTPTransport(timeout=TO, num_chunks=2, advertise_host="127.0.0.1"),
    )
    try:
        mesh = ft_init_device_mesh(
            device_type="cpu",
            mesh_shape=(2, GROUP_SIZE),
            mesh_dim_names=("dp_replicate", "dp_shard"),
            replicate_dim=0,
            manager=manager,
        )
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt_box.append(torch.optim.Adam(model.parameters(), lr=1e-2))
        opt = opt_box[0]

        losses: Dict[int, float] = {}
        attempts = 0
        while manager.current_step() < stop_at:
            attempts += 1
            assert attempts < 2000, f"no progress: step {manager.current_step()}"
            manager.start_quorum()
            step = manager.current_step()
            x, y = batch(step, group, g)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if manager.should_commit():
                opt.step()
                losses[step] = loss.item()
                store.set(f"{run}/progress/{proc}", str(manager.current_step()))
                if manager.current_step() == park_at:
                    store.set(f"{run}/parked/{proc}", "1")
                    time.sleep(120)  # bounded: the test kills this process long before
            else:
                time.sleep(0.1)  # the other group is away: wait for it to come back
        kinds = sorted({type(p).__name__ for p in model.parameters()})
        return {
            "group": group,
            "rank": g,
            "incarnation": incarnation,
            "losses": losses,
            "healed": healed,
            "state_reads_on_training_thread": state_reads,
            "param_kinds": kinds,
            "mesh": _mesh_facts(mesh, manager),
            "placements": [str(tuple(p.placements)) for p in model.parameters()],
            "local": local_state(model, opt),
            "full": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
            "is_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        }
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()


def mesh_checks(proc: int, world_size: int, store_port: int, *, lh_addr: str) -> Dict[str, Any]:
    """One replica group of one rank (``proc`` is its group): what ``ft_init_device_mesh``
    gives, and DTensor's own collectives over the replicate dimension."""
    import io

    from torch.distributed.tensor import DTensor, Partial, Replicate

    from tests.manager.inproc import make_manager
    from ft.device_mesh import extend_device_mesh, ft_init_device_mesh
    from ft.process_group import ManagedProcessGroup

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    store = connect_store(store_port)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"checks/group{proc}", store), rank=0, world_size=1
    )
    manager = make_manager(
        lh_addr,
        f"checks{proc}",
        min_replica_size=2,
        use_async_quorum=False,
        quorum_timeout=timedelta(seconds=60),
    )
    out: Dict[str, Any] = {}
    try:
        # torchtitan registers its own replicate group under the dimension's name first
        ManagedProcessGroup(manager).register("dp_replicate")
        # 3 is a nominal size: two groups run
        kw = dict(
            device_type="cpu",
            mesh_shape=(3, 1),
            mesh_dim_names=("dp_replicate", "tp"),
            replicate_dim=0,
            manager=manager,
        )
        mesh = ft_init_device_mesh(**kw)
        again = ft_init_device_mesh(**kw)
        out["nominal"] = (mesh.size(0), tuple(mesh.shape))
        out["same_group_again"] = again.get_group(0) is mesh.get_group(0) and again == mesh
        manager.start_quorum()
        out["live"] = mesh.get_group("dp_replicate").size()
        # DTensor's functional collectives (C++, by group name) reach the Manager's allreduce
        value = torch.full((2,), float(proc + 1))
        summed = DTensor.from_local(value, mesh, [Partial("sum"), Replicate()], run_check=False)
        out["sum"] = summed.redistribute(mesh, [Replicate(), Replicate()]).to_local().tolist()
        averaged = DTensor.from_local(value, mesh, [Partial("avg"), Replicate()], run_check=False)
        out["avg"] = averaged.full_tensor().tolist()  # divided by the 2 live groups, not 3
        out["commit"] = manager.should_commit()
        buf = io.BytesIO()
        torch.save(mesh, buf)
        buf.seek(0)
        back = torch.load(buf, weights_only=False)  # a mesh of this test's own making
        out["pickled"] = (
            type(back).__name__,
            back == mesh,
            back.get_group(0) is mesh.get_group(0),
            back.replicate_dim,
        )
        try:
            mesh._flatten("dp")
            out["flatten"] = "flattened"
        except RuntimeError as e:
            out["flatten"] = str(e)
        ext = extend_device_mesh(mesh["tp"], ManagedProcessGroup(manager), name="ext")
        out["extended"] = (
            tuple(ext.shape),
            ext.mesh_dim_names,
            type(ext.get_group("ext")).__name__,
            tuple(ext.get_coordinate()),
        )
        alone = ft_init_device_mesh(
            device_type="cpu",
            mesh_shape=(2,),
            mesh_dim_names=("rep",),
            replicate_dim=0,
            manager=manager,
        )
        out["one_dim"] = (
            tuple(alone.shape),
            tuple(alone.get_coordinate()),
            type(alone.get_group()).__name__,
        )
        return out
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
