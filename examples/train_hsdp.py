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

import os
import sys
import time
from datetime import timedelta
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
import common
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset

import ft
from ft.device_mesh import ft_init_device_mesh
from ft.launch import worker


def main() -> int:
    args = common.training_args(__doc__.split("\n\n")[0]).parse_args()

    common.setup_logging()
    worker.install_chaos_handlers()
    torch.set_num_threads(1)

    me = common.place()
    worker.emit("start", attempt=int(os.environ.get("FT_LAUNCH_ATTEMPT", "1")), device="cpu")

    # The group's own process group: FSDP2 shards over it. MASTER_PORT is the Manager's store.
    common.init_group_pg_from_env(me, args.timeout)

    data = common.sharded_loader(
        TensorDataset(*common.make_spirals(2000, seed=1234)), me, args.batch_size, args.seed
    )
    test_set = common.make_spirals(500, seed=4321)

    torch.manual_seed(args.seed)  # same initial weights everywhere (init_sync also heals them)
    net = common.make_model()
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
        replica_id=f"train_hsdp_{me.group_id}",
        rank=me.rank,
        world_size=me.world_size,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
    )
    # Dimension dp_replicate: the Manager's replica groups; dp_shard: this group's own ranks.
    mesh = ft_init_device_mesh(
        device_type="cpu",
        mesh_shape=(me.num_groups, me.world_size),
        mesh_dim_names=("dp_replicate", "dp_shard"),
        replicate_dim=0,
        manager=manager,
    )
    for layer in (net[0], net[2], net[4], net):
        fully_shard(layer, mesh=mesh)  # every Linear, then the rest of the model
    inner = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    box["optim"] = inner
    optimizer = ft.Optimizer(manager, inner)

    def step_loss() -> torch.Tensor:
        xb, yb = next(data)
        loss = F.cross_entropy(net(xb), yb)
        loss.backward()  # FSDP2: reduce-scatter in the group, allreduce across groups
        return loss

    def average(ctrl: torch.Tensor) -> None:
        common.average_in_group([ctrl], me.world_size)

    trained = common.train(
        "train_hsdp", manager, optimizer, pg, args, step_loss, average, healed, net, inner
    )
    # The hash covers the full (gathered) state: a collective inside the group.
    common.report_done("train_hsdp", trained, manager, net, inner, test_set)
    time.sleep(args.exit_linger)  # peers may still be reading the last allreduce from us
    manager.shutdown()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
