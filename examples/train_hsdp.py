"""HSDP with ft: FSDP2 shards the model inside each replica group, ft averages across groups.

The task: classify points of three interleaved 2-D spirals (generated here from a fixed seed;
nothing is downloaded) with a small MLP, as ``examples/train_ddp.py`` does.

Inside a replica group the ranks form torch's default process group (Gloo, on
``MASTER_PORT + 1``) and every layer is sharded with FSDP2's ``fully_shard`` over the mesh of
``ft.device_mesh.ft_init_device_mesh``: dimension ``dp_shard`` is the group's own ranks,
dimension ``dp_replicate`` is the Manager's replica group. So FSDP2 reduce-scatters gradients
inside the group and allreduces them across groups through the Manager: a group that dies fails
the step for the others instead of hanging it, the others carry on, and a restarted group heals
its DTensor shards (model and optimizer state) from a live group's ranks of the same shard.

Run it with the local launcher (two groups of two ranks, one kill every 8 seconds)::

    ft-launch --replicas 2 --ranks-per-group 2 --chaos kill --every 8 --max-steps 150 \\
        -- examples/train_hsdp.py

Every rank of every group holds a different shard, so what each rank prints at the end is a
sha256 over the *full* model and optimizer state (gathered in its group): every rank of every
group prints the same hash. The stop protocol is train_ddp.py's: a stop flag is averaged every
step, and the groups wait (bounded by ``--final-wait``) for every group to be back before the
last, update-free step.

CPU only as written (Gloo inside the group, ``ft.ProcessGroupGloo`` across groups).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import ft
from ft.device_mesh import ft_init_device_mesh
from ft.launch import worker

NUM_CLASSES = 3


def make_spirals(n_per_class: int, seed: int, noise: float = 0.06):
    """Three interleaved spirals in [-1, 1]^2; deterministic for a given seed."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(NUM_CLASSES):
        t = torch.rand(n_per_class, generator=g) * 0.95 + 0.05
        angle = 2 * math.pi * c / NUM_CLASSES + 2.0 * math.pi * t
        x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
        xs.append(x + noise * torch.randn(x.shape, generator=g))
        ys.append(torch.full((n_per_class,), c, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


def make_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(2, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, NUM_CLASSES)
    )


def full_state_hash(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the full (gathered) model and optimizer state: the same on every rank of
    every group when they hold the same state. A collective inside the group."""
    h = hashlib.sha256()

    def feed(name: str, value: Any) -> None:
        h.update(name.encode())
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(f"{name}.{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                feed(f"{name}[{i}]", v)
        else:
            h.update(repr(value).encode())

    feed("model", model.state_dict())
    feed("optim", optimizer.state_dict())
    return h.hexdigest()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)  # FSDP2 gathers the shards: every rank gets the same logits
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("FT_MAX_STEPS", "200")))
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--min-replica-size", type=int, default=1)
    p.add_argument("--timeout", type=float, default=10.0, help="collective timeout, seconds")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument(
        "--final-wait",
        type=float,
        default=60.0,
        help="seconds to wait at the end for every replica group to rejoin",
    )
    p.add_argument(
        "--exit-linger",
        type=float,
        default=1.0,
        help="seconds to stay connected after the last step, for peers still in it",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="pad every step (demo pacing)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    logging.basicConfig(
        level=os.environ.get("FT_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    worker.install_chaos_handlers()
    torch.set_num_threads(1)

    group_id = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    worker.emit("start", attempt=int(os.environ.get("FT_LAUNCH_ATTEMPT", "1")), device="cpu")

    # The group's own process group: FSDP2 shards over it. MASTER_PORT is the Manager's store.
    store = dist.TCPStore(
        os.environ.get("MASTER_ADDR", "127.0.0.1"),
        int(os.environ.get("MASTER_PORT", "29500")) + 1,
        world_size,
        is_master=rank == 0,
        timeout=timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=max(60.0, args.timeout * 6)),
    )

    x_train, y_train = make_spirals(2000, seed=1234)
    x_test, y_test = make_spirals(500, seed=4321)
    dataset = TensorDataset(x_train, y_train)
    sampler = ft.DistributedSampler(
        dataset,
        replica_rank=group_id,
        num_replica_groups=num_groups,
        group_rank=rank,
        num_replicas=world_size,
        shuffle=True,
        seed=args.seed,
    )
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed)  # same initial weights everywhere (init_sync also heals them)
    net = make_model()
    box: Dict[str, Any] = {}
    healed: Dict[str, int] = {}

    def state_dict() -> Dict[str, Any]:
        # DTensors (this rank's shards), sent as they are: a healing rank of the same shard
        # gets them back as DTensors on its own mesh.
        return {"model": net.state_dict(), "optim": box["optim"].state_dict()}

    def load_state_dict(sd: Dict[str, Any]) -> None:
        healed["from"] = healed.get("before", 0)
        net.load_state_dict(sd["model"])
        box["optim"].load_state_dict(sd["optim"])

    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        use_async_quorum=False,
        replica_id=f"train_hsdp_{group_id}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    mesh = ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(num_groups, world_size),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    for layer in (net[0], net[2], net[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    inner = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    box["optim"] = inner
    optimizer = ft.Optimizer(manager, inner)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    data = batches()

    def report_heal() -> None:
        if "from" in healed:
            worker.emit("heal", from_step=healed.pop("from"), to_step=manager.current_step())

    final_since = None
    trained = 0
    try:
        while True:
            healed["before"] = manager.current_step()
            optimizer.zero_grad()  # starts the quorum; a restarted group heals here
            step = manager.current_step()
            report_heal()

            at_end = step >= args.steps
            if at_end and final_since is None:
                final_since = time.monotonic()
                worker.emit("final", step=step)
            everyone_back = manager.num_participants() >= num_groups
            waited_out = (
                final_since is not None and time.monotonic() - final_since > args.final_wait
            )
            want_stop = worker.stop_requested() or (at_end and (everyone_back or waited_out))

            injected = worker.take_injected_allreduce_failure()
            if injected:
                pg.abort()  # chaos: this step's cross-group allreduce fails for real

            xb, yb = next(data)
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()  # FSDP2: reduce-scatter in the group, allreduce across groups

            # One decision for everyone: averaged across groups, then inside the group.
            ctrl = torch.tensor([float(want_stop), float(at_end), loss.detach().item()])
            manager.allreduce(ctrl).wait()
            dist.all_reduce(ctrl)
            ctrl.div_(world_size)
            stop_now, end_now, mean_loss = (float(v) for v in ctrl.tolist())

            if stop_now > 0 or end_now > 0:
                committed = manager.should_commit()  # an update-free step: everyone agrees
                report_heal()
                worker.emit_step(
                    manager, loss=mean_loss, committed=committed, injected=injected, barrier=True
                )
                if committed and stop_now > 0:
                    trained = min(step, args.steps)
                    break
                time.sleep(0.05)
                continue

            optimizer.step()  # commits only if every participant succeeded
            committed = manager.current_step() > step
            report_heal()
            worker.emit_step(manager, loss=mean_loss, committed=committed, injected=injected)
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except BaseException as e:  # noqa: BLE001 - the launcher restarts the whole group
        worker.exit_for_restart(f"train_hsdp: group {group_id} rank {rank}", e)

    test_loss, acc = evaluate(net, x_test, y_test)
    digest = full_state_hash(net, inner)
    worker.emit(
        "done",
        step=trained,
        manager_step=manager.current_step(),
        hash=digest,
        accuracy=round(acc, 4),
        test_loss=round(test_loss, 5),
    )
    print(
        f"train_hsdp: group {group_id} rank {rank} done after {trained} steps: test loss "
        f"{test_loss:.4f}, accuracy {acc:.1%}, full state sha256 {digest}",
        flush=True,
    )
    time.sleep(args.exit_linger)  # peers may still be reading the last allreduce from us
    manager.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
