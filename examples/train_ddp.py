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

import argparse
import hashlib
import logging
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ft
from ft.launch import worker

NUM_CLASSES = 3


# ---------------------------------------------------------------------------------------------
# data and model


def make_spirals(n_per_class: int, seed: int, noise: float = 0.06):
    """Three interleaved spirals in [-1, 1]^2; deterministic for a given seed."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(NUM_CLASSES):
        t = torch.rand(n_per_class, generator=g) * 0.95 + 0.05  # radius in (0.05, 1]
        angle = 2 * math.pi * c / NUM_CLASSES + 2.0 * math.pi * t
        x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
        x = x + noise * torch.randn(x.shape, generator=g)
        xs.append(x)
        ys.append(torch.full((n_per_class,), c, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 128),
        nn.SiLU(),
        nn.Linear(128, 128),
        nn.SiLU(),
        nn.Linear(128, NUM_CLASSES),
    )


def state_hash(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every model tensor and the full optimizer state (tensors as raw bytes)."""
    h = hashlib.sha256()

    def feed(name: str, value) -> None:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
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
    if optimizer is not None:
        feed("optim", optimizer.state_dict())
    return h.hexdigest()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


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


# ---------------------------------------------------------------------------------------------
# training


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("FT_MAX_STEPS", "200")))
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--min-replica-size", type=int, default=1)
    p.add_argument("--async-quorum", action="store_true", help="overlap the quorum with compute")
    p.add_argument(
        "--transport",
        choices=("http", "pg"),
        default="http",
        help="how a recovering group receives the live state",
    )
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
        type=_non_negative,
        default=1.0,
        help="seconds to stay connected after the last step, for peers still finishing it",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="pad every step (demo pacing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--debug-hash",
        action="store_true",
        help="add the state hash to every step record (to find a divergence)",
    )
    args = p.parse_args()

    logging.basicConfig(
        level=os.environ.get("FT_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    worker.install_chaos_handlers()

    group_id = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
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
    x_train, y_train = make_spirals(2000, seed=1234)
    x_test, y_test = make_spirals(500, seed=4321)
    x_test, y_test = x_test.to(device), y_test.to(device)
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

    net = make_model().to(device)
    inner_opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)

    # Inside a group of several ranks: a plain gloo group for the group's own averaging.
    group_pg = None
    if world_size > 1:
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MASTER_PORT"]) + 1,
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
        group_pg = dist.group.WORLD

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
        replica_id=f"train_ddp_{group_id}",
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        checkpoint_transport=transport,
    )
    model = ft.DistributedDataParallel(manager, net)
    optimizer = ft.Optimizer(manager, inner_opt)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                yield xb.to(device), yb.to(device)
            epoch += 1

    data = batches()

    def report_heal() -> None:
        # load_state_dict ran: with a sync quorum inside zero_grad(), with an async one inside
        # should_commit().
        if "from" in healed:
            worker.emit("heal", from_step=healed.pop("from"), to_step=manager.current_step())

    final_since = None
    announced_final = False
    try:
        while True:
            healed["before"] = manager.current_step()
            optimizer.zero_grad()  # starts the quorum (and, with a sync quorum, heals)
            if args.async_quorum:
                manager.wait_quorum()
            step = manager.current_step()
            report_heal()
            if args.debug_hash:
                worker.emit(
                    "debug",
                    step=step,
                    pre_hash=state_hash(net, inner_opt)[:12],
                    model_hash=state_hash(net, None)[:12],
                )

            # Stop when this step count is reached and every group is back, or when asked to
            # (the flag is averaged below, so everyone in the quorum takes the same decision).
            at_end = step >= args.steps
            if at_end and final_since is None:
                final_since = time.monotonic()
            everyone_back = manager.num_participants() >= num_groups
            waited_out = (
                final_since is not None and time.monotonic() - final_since > args.final_wait
            )
            want_stop = worker.stop_requested() or (at_end and (everyone_back or waited_out))
            if (at_end or want_stop) and not announced_final:
                announced_final = True
                worker.emit("final", step=step)

            injected = worker.take_injected_allreduce_failure()
            if injected:
                # Chaos: fail this step's allreduce for real. Aborting the process group fails
                # our collectives at once and, through the severed connections, the peers' too;
                # the Manager reports the error and nobody commits this step.
                pg.abort()

            xb, yb = next(data)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()  # gradients averaged over the participating groups
            if args.debug_hash:
                grads = b"".join(q.grad.detach().cpu().numpy().tobytes() for q in net.parameters())
                worker.emit("debug", step=step, grad_hash=hashlib.sha256(grads).hexdigest()[:12])

            ctrl = torch.tensor(
                [float(want_stop), float(at_end), loss.detach().item()], device=device
            )
            manager.allreduce(ctrl).wait()
            if group_pg is not None:  # the ranks of this group average too
                flat = [ctrl] + [q.grad for q in net.parameters() if q.grad is not None]
                for t in flat:
                    dist.all_reduce(t, group=group_pg)
                    t.div_(world_size)
            stop_now, end_now, mean_loss = (float(v) for v in ctrl.tolist())

            if stop_now > 0 or end_now > 0:
                # No update: a barrier step that shows every participant holds the state.
                committed = manager.should_commit()
                report_heal()
                worker.emit_step(
                    manager, loss=mean_loss, committed=committed, injected=injected, barrier=True
                )
                if committed and stop_now > 0:
                    trained = min(step, args.steps)  # no update happens at or after args.steps
                    break
                time.sleep(0.05)
                continue

            optimizer.step()  # commits only if every participant succeeded
            committed = manager.current_step() > step
            report_heal()
            extra = {"hash": state_hash(net, inner_opt)[:12]} if args.debug_hash else {}
            worker.emit_step(
                manager, loss=mean_loss, committed=committed, injected=injected, **extra
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except ft.PersistentStepFailure as e:
        # Every retry met the same fault (the message names it): a restart would too.
        worker.exit_for_persistent_failure(f"train_ddp: group {group_id} rank {rank}", e)
    except BaseException as e:  # noqa: BLE001 - the launcher restarts the whole group
        worker.exit_for_restart(f"train_ddp: group {group_id} rank {rank}", e)

    test_loss, acc = evaluate(net, x_test, y_test)
    digest = state_hash(net, inner_opt)
    worker.emit(
        "done",
        step=trained,
        manager_step=manager.current_step(),
        hash=digest,
        accuracy=round(acc, 4),
        test_loss=round(test_loss, 5),
    )
    print(
        f"train_ddp: group {group_id} rank {rank} done after {trained} steps: "
        f"test loss {test_loss:.4f}, accuracy {acc:.1%}, state sha256 {digest}",
        flush=True,
    )
    _write_hash(group_id, rank, digest)
    # The other groups may still be reading the last allreduce from us: exiting now would reset
    # those connections, discard what they have not read yet and fail their final step (they
    # would then wait --final-wait for a group that is gone). Stay connected a moment.
    time.sleep(args.exit_linger)
    manager.shutdown()
    if group_pg is not None:
        dist.destroy_process_group()
    return 0


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _write_hash(group_id: int, rank: int, digest: str) -> None:
    out_dir = os.environ.get("FT_LAUNCH_LOG_DIR")
    if out_dir:
        with open(os.path.join(out_dir, f"hash_group{group_id}_rank{rank}.txt"), "w") as f:
            f.write(digest + "\n")


if __name__ == "__main__":
    sys.exit(main())
