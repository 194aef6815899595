"""Replica workers whose process group has only the reconfigure API (as torchft-nightly's
groups and torch 2.14's own, made with ``enable_reconfigure=True``): the Manager must rebuild
it from the handles carried through its ManagerServer and the lighthouse."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List

import torch

from ft.backend.process_group import ProcessGroup, ProcessGroupGloo, _rendezvous
from ft.work import _DummyWork
from tests.procs import connect_store


class ReconfigureOnly(ProcessGroupGloo):
    """ft's Gloo group without ``configure()``: rebuilt only through :meth:`reconfigure`,
    which records what it was given."""

    configure = ProcessGroup.configure  # the base class's: "does not implement configure()"

    def __init__(self) -> None:
        super().__init__(timeout=timedelta(seconds=10))
        self.reconfigures: List[Dict[str, Any]] = []

    def reconfigure(self, opts: Any) -> Any:
        rdv = _rendezvous(opts, self._handle_id())
        ProcessGroupGloo.configure(self, rdv.store_addr, "r", rdv.rank, rdv.world_size)
        self.reconfigures.append(
            {"uuid": opts.uuid, "rank": rdv.rank, "size": rdv.world_size, "n": len(opts.handles)}
        )
        return _DummyWork(None)


def _committed_sums(
    manager: Any, test_store: Any, rank: int, world_size: int, steps: int
) -> List[Any]:
    """Once every replica is ready, steps ``manager`` until it committed ``steps`` steps (at
    most four tries a step): each step allreduces ``rank + 1``; returns the committed sums."""
    test_store.set(f"ready/{rank}", "1")
    test_store.wait([f"ready/{g}" for g in range(world_size)], timedelta(seconds=60))
    sums = []
    for _ in range(steps * 4):
        if manager.current_step() >= steps:
            break
        manager.start_quorum()
        t = torch.full((2,), float(rank + 1))
        manager.allreduce(t, should_quantize=False).wait()
        if manager.should_commit():
            sums.append(t.tolist())
    return sums


def reconfigure_only_replica(
    rank: int, world_size: int, store_port: int, *, lh_addr: str, steps: int = 3
) -> Dict[str, Any]:
    """Replica group ``rank`` (one process) runs ``steps`` committed steps of allreduce with a
    :class:`ReconfigureOnly` group; returns the allreduce results and the reconfigures."""
    from tests.manager.inproc import make_manager

    test_store = connect_store(store_port)
    pg = ReconfigureOnly()
    manager = make_manager(lh_addr, f"g{rank}", pg=pg, use_async_quorum=False, init_sync=False)
    try:
        sums = _committed_sums(manager, test_store, rank, world_size, steps)
        return {"sums": sums, "reconfigures": pg.reconfigures, "size": pg.size()}
    finally:
        manager.shutdown(wait=False)


def torch_group_replica(
    rank: int, world_size: int, store_port: int, *, lh_addr: str, steps: int = 3
) -> Dict[str, Any]:
    """Replica group ``rank`` (one process) with torch's own Gloo group, made with
    ``enable_reconfigure=True`` (torch 2.14 and later): the Manager rebuilds it across the
    replicas from the handles (``get_reconfigure_handle``) that its ManagerServer and the
    lighthouse carry. torch's groups meet on the store they were made with, and a handle
    names the rank a group was made with, so every replica makes its group on one store the
    job shares (here the test's), with its replica index as the rank (the group connects
    nothing until the first reconfigure). Returns the allreduce results and the group's size
    after the last step."""
    import torch.distributed as dist

    from tests.manager.inproc import make_manager

    test_store = connect_store(store_port)
    shared = dist.PrefixStore("torch_groups", connect_store(store_port))
    dist.init_process_group(
        "gloo", store=shared, rank=rank, world_size=world_size, enable_reconfigure=True
    )
    pg = dist.group.WORLD
    manager = make_manager(lh_addr, f"t{rank}", pg=pg, use_async_quorum=False, init_sync=False)
    try:
        sums = _committed_sums(manager, test_store, rank, world_size, steps)
        return {"sums": sums, "size": pg.size(), "errored": repr(manager.errored())}
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()
