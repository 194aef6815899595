"""Fault-tolerant data-parallel training of a small classifier with ft.

The task: classify points of three interleaved 2-D spirals (generated here from a fixed seed;
nothing is downloaded) with a small MLP. Chance is 33% accuracy and a loss of ln 3 = 1.10; a
healthy run reaches well over 90% on held-out points.

Every replica group trains on its own shard of the data (``ft.DistributedSampler``) and averages
gradients with the other groups through ``ft.DistributedDataParallel`` and the ``ft.Manager``.
Groups may die, hang or fail a step at any time: the others carry on, and a restarted group heals
from a live peer. Inside a group of several ranks, the ranks also average gradients over a plain
gloo group (on ``MASTER_PORT + 1``), so every rank of every group holds the same model.

Run it with the local launcher::

    ft-launch --replicas 3 --chaos kill --every 5 --max-steps 200 -- examples/train_ddp.py

or by hand, one command per replica group (with a lighthouse at ``TORCHFT_LIGHTHOUSE``)::

    ft-lighthouse --bind 127.0.0.1:29510 --min_replicas 1 &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 \\
        torchrun --nproc_per_node 1 --master_port 29600 examples/train_ddp.py

The device is chosen automatically (CUDA when available and ft was built with NCCL, else CPU);
the code is the same on both.

Stopping: the run ends at ``--steps`` (default: env ``FT_MAX_STEPS`` or 200) committed steps, or
when the launcher asks it to stop. The decision is taken together: every step allreduces a stop
flag, so all groups stop after the same step, and they wait (bounded by ``--final-wait``) until
every replica group is back in the quorum, so a group restarted near the end still heals before
the others leave. At the end each rank prints a sha256 over its model and optimizer state: every
rank of every group prints the same hash.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
import common
from torch.utils.data import TensorDataset

import ft
from ft.launch import worker


def pick_device() -> torch.device:
    """The GPU this rank was given, as torchrun and ft-launch give them: ``LOCAL_RANK`` within
    the GPUs this process sees (ft-launch gives each replica group its own slice through
    ``CUDA_VISIBLE_DEVICES``); the CPU without a GPU or without ft's NCCL build."""
    if torch.cuda.is_available() and getattr(ft._C, "has_nccl", False):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def device_identity(device: torch.device) -> str:
    """The physical GPU behind ``device`` (its UUID), for the launcher's record; "cpu"."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def main() -> int:
    p = common.training_args(__doc__.split("\n\n")[0])
    p.add_argument("--async-quorum", action="store_true", help="overlap the quorum with compute")
    p.add_argument(
        "--transport",
        choices=("http", "pg"),
        default="http",
        help="how a recovering group receives the live state",
    )
    p.add_argument(
        "--debug-hash",
        action="store_true",
        help="add the state hash to every step record (to find a divergence)",
    )
    args = p.parse_args()

    common.setup_logging()
    worker.install_chaos_handlers()

    me = common.place()
    device = pick_device()
    torch.manual_seed(args.seed)  # same initial weights everywhere (init_sync also heals them)
    worker.emit(
        "start",
        attempt=int(os.environ.get("FT_LAUNCH_ATTEMPT", "1")),
        device=str(device),
        gpu=device_identity(device),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )

    # Data: one fixed train set, sharded over replica groups and ranks; a held-out test set.
    data = common.sharded_loader(
        TensorDataset(*common.make_spirals(2000, seed=1234)), me, args.batch_size, args.seed
    )
    x_test, y_test = common.make_spirals(500, seed=4321)
    x_test, y_test = x_test.to(device), y_test.to(device)

    net = common.make_model().to(device)
    inner_opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)

    # Inside a group of several ranks: a plain gloo group for the group's own averaging.
    group_pg = common.init_group_pg_from_env(me, args.timeout) if me.world_size > 1 else None

    healed = {}

    def load_state_dict(sd) -> None:
        healed["from"] = healed.get("before")
        net.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    def state_dict():
        return {"model": net.state_dict(), "optim": inner_opt.state_dict()}

    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    transport = None
    if args.transport == "pg":
        from ft.checkpointing import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=args.timeout * 3), device=device)
    manager = ft.Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=args.min_replica_size,
        use_async_quorum=args.async_quorum,
        replica_id=f"train_ddp_{me.group_id}",
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        checkpoint_transport=transport,
    )
    model = ft.DistributedDataParallel(manager, net)
    optimizer = ft.Optimizer(manager, inner_opt)

    def step_loss() -> torch.Tensor:
        xb, yb = next(data)
        loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
        loss.backward()  # gradients averaged over the participating groups
        return loss

    def average(ctrl: torch.Tensor) -> None:
        if group_pg is not None:  # the ranks of this group average too
            grads = [q.grad for q in net.parameters() if q.grad is not None]
            common.average_in_group([ctrl, *grads], me.world_size, group_pg)

    trained = common.train(
        "train_ddp", manager, optimizer, pg, args, step_loss, average, healed, net, inner_opt
    )
    common.report_done("train_ddp", trained, manager, net, inner_opt, (x_test, y_test))
    # The other groups may still be reading the last allreduce from us: exiting now would reset
    # those connections, discard what they have not read yet and fail their final step (they
    # would then wait --final-wait for a group that is gone). Stay connected a moment.
    time.sleep(args.exit_linger)
    manager.shutdown()
    if group_pg is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
