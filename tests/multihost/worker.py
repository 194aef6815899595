"""One rank of a replica group training on a simulated host, for tests/multihost.

Run as ``python -m tests.multihost.worker '<json config>'`` inside a host's namespace, alone
(one rank per group) or under torchrun (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` /
``MASTER_PORT`` from torchrun; each group rank trains its own shard, as under FSDP). It talks
to the test only through files, since the test's own namespace is not on the test subnet: it
appends ``"{step} {pid} {time} {participants}"`` to ``{progress}.{rank}`` after every iteration, stops once
its committed step reaches the number in ``stop_file``, and saves its final model and
optimizer state to ``{result}.{rank}``. It sets no address at all: everything it advertises
comes from the route to the lighthouse.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch


def main(cfg: dict) -> None:
    import ft

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    rank = int(os.environ["RANK"]) if torchrun else 0
    torch.manual_seed(cfg["seed"] * 100 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    to = timedelta(seconds=cfg["timeout"])
    manager = ft.Manager(
        pg=ft.ProcessGroupGloo(timeout=to),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            optim.load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
        min_replica_size=1,
        timeout=to,
        quorum_timeout=timedelta(seconds=cfg["quorum_timeout"]),
        connect_timeout=timedelta(seconds=cfg["quorum_timeout"]),
        lighthouse_addr=cfg["lighthouse"],
        replica_id=cfg["name"],
        rank=None if torchrun else 0,
        world_size=None if torchrun else 1,
    )
    ddp = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, optim)
    with open(f"{cfg['progress']}.{rank}", "a") as progress:
        while True:
            stop_at = None
            if os.path.exists(cfg["stop_file"]):
                with open(cfg["stop_file"]) as f:
                    stop_at = int(f.read().strip() or "0")
            step = manager.current_step()
            if stop_at is not None and step >= stop_at:
                break
            opt.zero_grad()
            gen = torch.Generator().manual_seed(step * 1000 + cfg["seed"] * 10 + rank)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            progress.write(
                f"{manager.current_step()} {os.getpid()} {time.time():.3f} "
                f"{manager.num_participants()}\n"
            )
            progress.flush()
            time.sleep(cfg["step_sleep"])
    torch.save(
        {"step": manager.current_step(), "model": model.state_dict(), "optim": optim.state_dict()},
        f"{cfg['result']}.{rank}",
    )
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
