"""What the training examples share: the three-spiral task and its model, the state hash every
rank prints at the end, the group's own gloo process group, the stop rule, and (for
``train_ddp.py`` and ``train_hsdp.py``) the fault-tolerant training loop and its report.

The examples import it as ``common``: a script's own folder comes first on ``sys.path``
(``python examples/train_ddp.py``, ``torchrun``, ``ft-launch``), and
``examples/monarch/train_distributed.py`` puts this folder there for itself and for the trainer
processes it spawns.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import os
import time
from datetime import timedelta
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

NUM_CLASSES = 3

# ---------------------------------------------------------------------------------------------
# the task, the model and the state hash


def spiral_points(y: torch.Tensor, g: torch.Generator, noise: float) -> torch.Tensor:
    """A point of the spiral of class ``y[i]`` for every label, in [-1, 1]^2 (plus Gaussian
    ``noise``); draws from ``g`` only, so the points are deterministic for a given seed."""
    t = torch.rand(y.shape[0], generator=g) * 0.95 + 0.05  # radius in (0.05, 1]
    angle = 2 * math.pi * y / NUM_CLASSES + 2.0 * math.pi * t
    x = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    return x + noise * torch.randn(x.shape, generator=g)


def make_spirals(n_per_class: int, seed: int, noise: float = 0.06):
    """Three interleaved spirals in [-1, 1]^2, ``n_per_class`` points each; deterministic for a
    given seed."""
    g = torch.Generator().manual_seed(seed)
    ys = [torch.full((n_per_class,), c, dtype=torch.long) for c in range(NUM_CLASSES)]
    xs = [spiral_points(y, g, noise) for y in ys]
    return torch.cat(xs), torch.cat(ys)


def make_model(width: int = 128) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(2, width),
        nn.SiLU(),
        nn.Linear(width, width),
        nn.SiLU(),
        nn.Linear(width, NUM_CLASSES),
    )


def state_hash(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """sha256 over every model tensor and the full optimizer state (tensors as raw bytes, other
    values by their repr). A DTensor counts as its full tensor: then it is a collective inside
    the group, and the same on every rank of every group that holds the same state."""
    h = hashlib.sha256()

    def feed(name: str, value: Any) -> None:
        h.update(name.encode())
        if isinstance(value, DTensor):  # this rank's shard: gather the full tensor
            value = value.full_tensor()
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
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, float]:
    """Test loss and accuracy (with FSDP2 every rank gathers the shards: the same logits)."""
    logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


# ---------------------------------------------------------------------------------------------
# the process: where it stands, its options, its group's own process group


class Place(NamedTuple):
    """Where this process stands, from the environment the launcher sets."""

    group_id: int
    num_groups: int
    rank: int
    world_size: int


def place() -> Place:
    return Place(
        int(os.environ.get("REPLICA_GROUP_ID", "0")),
        int(os.environ.get("NUM_REPLICA_GROUPS", "1")),
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def training_args(description: str) -> argparse.ArgumentParser:
    """The options of train_ddp.py and train_hsdp.py alike; each adds its own."""
    p = argparse.ArgumentParser(description=description)
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
        type=_non_negative,
        default=1.0,
        help="seconds to stay connected after the last step, for peers still finishing it",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="pad every step (demo pacing)")
    p.add_argument("--seed", type=int, default=0)
    return p


def setup_logging(level: Any = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("FT_LOG_LEVEL", "WARNING"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def init_group_pg(host: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """The replica group's own gloo process group (torch's default group), on its own store at
    ``host:port``: the group's ranks average (or shard) over it. Returns ``dist.group.WORLD``."""
    store = dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    return dist.group.WORLD


def init_group_pg_from_env(me: Place, timeout_s: float) -> Any:
    """``init_group_pg`` on ``MASTER_ADDR`` and ``MASTER_PORT + 1`` (``MASTER_PORT`` is the
    Manager's store)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500")) + 1
    return init_group_pg(host, port, me.rank, me.world_size, max(60.0, timeout_s * 6))


def average_in_group(tensors: Any, world_size: int, group: Any = None) -> None:
    """Averages every tensor over the group's own process group, in place."""
    for t in tensors:
        dist.all_reduce(t, group=group)
        t.div_(world_size)


def sharded_loader(dataset: Any, me: Place, batch_size: int, seed: int):
    """This rank's shard of ``dataset`` (over replica groups, then the group's ranks), as an
    endless stream of batches (a new shuffle every epoch)."""
    import ft
    from torch.utils.data import DataLoader

    sampler = ft.DistributedSampler(
        dataset, me.group_id, me.num_groups, me.rank, me.world_size, shuffle=True, seed=seed
    )
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ---------------------------------------------------------------------------------------------
# the training loop


class StopRule:
    """When a run ends: once ``steps`` steps are done and every one of ``num_groups`` replica
    groups participates, or ``final_wait`` seconds after the end was reached whoever is there,
    or at once when asked. Every participant averages its decision with the others before
    acting on it, so all take the same one."""

    def __init__(self, steps: int, num_groups: int, final_wait: float) -> None:
        self.steps = steps
        self.num_groups = num_groups
        self.final_wait = final_wait
        self.final_since: Optional[float] = None

    def __call__(self, step: int, participants: int, asked: bool = False) -> Tuple[bool, bool]:
        """(at_end, want_stop) for this step."""
        at_end = step >= self.steps
        if at_end and self.final_since is None:
            self.final_since = time.monotonic()
        waited_out = (
            self.final_since is not None and time.monotonic() - self.final_since > self.final_wait
        )
        return at_end, asked or (at_end and (participants >= self.num_groups or waited_out))


def train(
    name: str,
    manager: Any,
    optimizer: Any,
    pg: Any,
    args: argparse.Namespace,
    step_loss: Callable[[], torch.Tensor],
    average: Callable[[torch.Tensor], None],
    healed: Dict[str, Any],
    net: nn.Module,
    inner_opt: torch.optim.Optimizer,
) -> int:
    """The loop of train_ddp.py and train_hsdp.py until the stop rule ends it; returns the
    number of steps trained. ``step_loss`` runs one forward and backward and returns the loss;
    ``average`` averages the step's control tensor (and what else the example needs) inside
    the group; ``healed`` is what the example's ``load_state_dict`` fills in. A chaos request
    fails the step's allreduce for real (``pg.abort``); any failure ends the process for the
    launcher to restart the group."""
    import ft
    from ft.launch import worker

    me = place()
    async_quorum = getattr(args, "async_quorum", False)
    debug_hash = getattr(args, "debug_hash", False)
    stop = StopRule(args.steps, me.num_groups, args.final_wait)

    def report_heal() -> None:
        # load_state_dict ran: with a sync quorum inside zero_grad(), with an async one inside
        # should_commit().
        if "from" in healed:
            worker.emit("heal", from_step=healed.pop("from"), to_step=manager.current_step())

    who = f"{name}: group {me.group_id} rank {me.rank}"
    announced_final = False
    try:
        while True:
            healed["before"] = manager.current_step()
            optimizer.zero_grad()  # starts the quorum (and, with a sync quorum, heals)
            if async_quorum:
                manager.wait_quorum()
            step = manager.current_step()
            report_heal()
            if debug_hash:
                pre, model_only = state_hash(net, inner_opt), state_hash(net)
                worker.emit("debug", step=step, pre_hash=pre[:12], model_hash=model_only[:12])

            at_end, want_stop = stop(step, manager.num_participants(), worker.stop_requested())
            if (at_end or want_stop) and not announced_final:
                announced_final = True
                worker.emit("final", step=step)

            injected = worker.take_injected_allreduce_failure()
            if injected:
                # Chaos: fail this step's allreduce for real. Aborting the process group fails
                # our collectives at once and, through the severed connections, the peers' too;
                # the Manager reports the error and nobody commits this step.
                pg.abort()

            loss = step_loss()  # gradients averaged over the participating groups
            if debug_hash:
                grads = b"".join(q.grad.detach().cpu().numpy().tobytes() for q in net.parameters())
                worker.emit("debug", step=step, grad_hash=hashlib.sha256(grads).hexdigest()[:12])

            # One decision for everyone: averaged across groups, then inside the group.
            flags = [float(want_stop), float(at_end), loss.detach().item()]
            ctrl = torch.tensor(flags, device=loss.device)
            manager.allreduce(ctrl).wait()
            average(ctrl)
            stop_now, end_now, mean_loss = (float(v) for v in ctrl.tolist())

            if stop_now > 0 or end_now > 0:
                # No update: a barrier step that shows every participant holds the state.
                committed = manager.should_commit()
                report_heal()
                worker.emit_step(
                    manager, loss=mean_loss, committed=committed, injected=injected, barrier=True
                )
                if committed and stop_now > 0:
                    return min(step, args.steps)  # no update happens at or after args.steps
                time.sleep(0.05)
                continue

            optimizer.step()  # commits only if every participant succeeded
            committed = manager.current_step() > step
            report_heal()
            extra = {"hash": state_hash(net, inner_opt)[:12]} if debug_hash else {}
            worker.emit_step(
                manager, loss=mean_loss, committed=committed, injected=injected, **extra
            )
            if args.step_sleep:
                time.sleep(args.step_sleep)
    except ft.PersistentStepFailure as e:
        # Every retry met the same fault (the message names it): a restart would too.
        worker.exit_for_persistent_failure(who, e)
    except BaseException as e:  # noqa: BLE001 - the launcher restarts the whole group
        worker.exit_for_restart(who, e)


def report_done(
    name: str,
    trained: int,
    manager: Any,
    net: nn.Module,
    inner_opt: torch.optim.Optimizer,
    test_set: Tuple[torch.Tensor, torch.Tensor],
) -> str:
    """Evaluates on the test set, reports the end to the launcher (``done``: steps, hash,
    accuracy) and on stdout, and writes the state hash into the launcher's log folder; returns
    the hash."""
    from ft.launch import worker

    me = place()
    test_loss, acc = evaluate(net, *test_set)
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
        f"{name}: group {me.group_id} rank {me.rank} done after {trained} steps: "
        f"test loss {test_loss:.4f}, accuracy {acc:.1%}, state sha256 {digest}",
        flush=True,
    )
    out_dir = os.environ.get("FT_LAUNCH_LOG_DIR")
    if out_dir:
        path = os.path.join(out_dir, f"hash_group{me.group_id}_rank{me.rank}.txt")
        with open(path, "w") as f:
            f.write(digest + "\n")
    return digest
