"""Child processes for the multi-process Manager tests (run through tests.procs.Workers).

Child ``rank`` i is group ``i // ranks_per_group``, group rank ``i % ranks_per_group``. Each
group rank trains its own small model shard (like an FSDP shard), synchronized across the
groups through ft.DistributedDataParallel + ft.Optimizer. Progress goes to the test's store:
``step/{g}/{r}`` after each iteration. The loop stops when the committed step reaches the
``stop_at`` key of the test's store (or the ``stop_at`` kwarg).
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from urllib.parse import urlsplit
from typing import Any, Dict, List, Optional

import torch

from tests.corrupting_proxy import CorruptingProxy

from tests.procs import connect_store


def _hash(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def train(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    ports: List[int],
    ranks_per_group: int = 1,
    async_quorum: bool = False,
    transport: str = "http",
    stop_at: int = 1000,
    step_sleep: float = 0.0,
    pg_timeout: float = 10.0,
    timeout: float = 10.0,
    quorum_timeout: float = 15.0,
    init_sync: bool = True,
    seed_per_group: bool = True,
    wait_ready: int = 0,
    inject_abort: Optional[List[int]] = None,
    corrupt_sends: int = 0,
    quorum_retries: Optional[int] = None,
    min_replica_size: int = 1,
    max_steps_total: int = 1000,
    same_host: Optional[bool] = None,
    pace_s: float = 0.0,
    ballast_mib: int = 0,
    start_after: Optional[str] = None,
) -> Dict[str, Any]:
    import ft
    from ft.checkpointing import HTTPTransport, PGTransport

    class PacedHTTPTransport(HTTPTransport):
        # a source that serves each 1 MiB slice no faster than pace_s: every donor of a
        # striped heal is still serving when the others come
        def _pace(self) -> None:
            time.sleep(pace_s)

    from tests.manager.inproc import make_manager

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("ft.coordination").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    g, r = divmod(rank, ranks_per_group)
    test_store = connect_store(store_port)

    torch.manual_seed(1000 + (g * 10 if seed_per_group else 0) + r)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=pg_timeout))
    to = timedelta(seconds=timeout)
    proxy: Optional[CorruptingProxy] = None
    if transport == "pg":
        ckpt: Any = PGTransport(pg, timeout=to, device=torch.device("cpu"))
    else:
        ckpt = (PacedHTTPTransport if pace_s else HTTPTransport)(
            timeout=to, num_chunks=2, advertise_host="127.0.0.1", same_host=same_host
        )
        if corrupt_sends:
            port = urlsplit(ckpt.metadata()).port
            proxy = CorruptingProxy(port, "data", count=corrupt_sends)
            url = f"http://127.0.0.1:{proxy.port}"
            ckpt.metadata = lambda: url  # type: ignore[method-assign]

    loads: List[int] = []
    # ballast_mib MiB more state, so that a heal has several ranges to stripe: it counts the
    # committed steps (a group that starts late holds zeros until it heals)
    ballast = torch.zeros(ballast_mib << 18)

    def state_dict() -> Dict[str, Any]:
        sd = {"model": model.state_dict(), "optim": optim.state_dict()}
        if ballast_mib:
            sd["ballast"] = ballast
        return sd

    def load_state_dict(sd: Dict[str, Any]) -> None:
        loads.append(1)
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
        if ballast_mib:
            ballast.copy_(sd["ballast"])

    if start_after:
        # a group that joins late, its imports already done: no Manager (no heartbeat) until
        # the test sets this key
        test_store.wait([start_after], timedelta(seconds=120))
    manager = make_manager(
        lh_addr,
        f"g{g}",
        rank=r,
        world_size=ranks_per_group,
        store_port=ports[g],
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=min_replica_size,
        use_async_quorum=async_quorum,
        timeout=to,
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=to,
        checkpoint_transport=ckpt,
        init_sync=init_sync,
        quorum_retries=quorum_retries,
    )
    ddp = ft.DistributedDataParallel(manager, model)
    opt = ft.Optimizer(manager, optim)
    init_hash = _hash(model)

    test_store.set(f"ready/{rank}", "1")
    if wait_ready:
        test_store.wait([f"ready/{i}" for i in range(wait_ready)], timedelta(seconds=60))

    history: List[Dict[str, Any]] = []
    inject = set(inject_abort or [])
    for _ in range(max_steps_total):
        if test_store.check(["stop_at"]):
            stop_at = int(test_store.get("stop_at"))
        if manager.current_step() >= stop_at:
            break
        t0 = time.monotonic()
        opt.zero_grad()
        step = manager.current_step()  # after a sync heal: the healed step
        pre_hash = _hash(model)
        gen = torch.Generator().manual_seed(step * 1000 + g * 10 + r)
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if step_sleep:
            time.sleep(step_sleep)
        injected = False
        if step in inject and g == 0:
            inject.discard(step)
            injected = True
            pg.abort()  # chaos: the process group fails under this replica
        loss.backward()
        opt.step()
        # the ballast holds the committed step: one more on a commit, also the commit of a
        # step whose heal (async mode) was applied at should_commit
        if ballast_mib and manager.current_step() == int(ballast[0].item()) + 1:
            ballast.add_(1)
        err = manager.errored()
        history.append(
            {
                "step": step,
                "committed": manager.current_step() == step + 1,
                "participants": manager.num_participants(),
                "errored": None if err is None else f"{type(err).__name__}: {err}",
                "pre_hash": pre_hash,
                "injected": injected,
                "t0": t0,
                "t1": time.monotonic(),
                "wall": time.time(),
            }
        )
        test_store.set(f"step/{g}/{r}", str(manager.current_step()))

    result = {
        "group": g,
        "rank": r,
        "step": manager.current_step(),
        "batches_committed": manager.batches_committed(),
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": optim.state_dict(),
        "history": history,
        "init_hash": init_hash,
        "loads": len(loads),
        "proxy_flipped": proxy.flipped if proxy is not None else 0,
        # HTTPTransport: "same-host", "http" or "http-striped" for the last heal; None if it
        # never healed
        "recv_path": getattr(ckpt, "last_recv_path", None),
        # HTTPTransport: data bytes this group's checkpoint server sent, every heal together
        "served_bytes": getattr(ckpt, "served_bytes", None),
        "ballast": ballast.clone(),
    }
    manager.shutdown(wait=False)
    return result


def default_config_combos(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    combos: List[Dict[str, Any]],
    target_step: int = 3,
    attempts_without_quorum_size: int = 3,
    combo_timeout: float = 30.0,
) -> Dict[str, Any]:
    """One replica group (rank == group) runs torchft's plain loop under each configuration.

    For combo i the test sets ``lh/{i}`` to a fresh lighthouse's address; this group builds a
    Manager with the combo's ``use_async_quorum``, ``init_sync`` and ``min_replica_size`` and
    runs ``start_quorum`` → ``allreduce(grad).wait()`` → ``should_commit`` until it has
    committed ``target_step`` steps (or, when ``min_replica_size`` exceeds the number of
    groups, for ``attempts_without_quorum_size`` attempts). It reports the final step, each
    attempt's wall time, and its model and optimizer state, then sets ``done/{i}/{rank}``.
    """
    from tests.manager.inproc import make_manager

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    test_store = connect_store(store_port)
    out: Dict[str, Any] = {}
    for i, combo in enumerate(combos):
        test_store.wait([f"lh/{i}"], timedelta(seconds=60))
        lh_addr = test_store.get(f"lh/{i}").decode()
        # Without init_sync, torchft expects identical initial weights from the user's seed;
        # with it, every group starts different and the heal must make them equal.
        torch.manual_seed(7 + (rank if combo["init_sync"] else 0))
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        manager = make_manager(
            lh_addr,
            f"c{i}g{rank}",
            load_state_dict=lambda sd: (
                model.load_state_dict(sd["model"]),
                optim.load_state_dict(sd["optim"]),
            ),
            state_dict=lambda: {"model": model.state_dict(), "optim": optim.state_dict()},
            min_replica_size=combo["min_replica_size"],
            use_async_quorum=combo["use_async_quorum"],
            init_sync=combo["init_sync"],
        )
        # Every group heartbeats before any asks for a quorum, so the first quorum holds all.
        test_store.set(f"ready/{i}/{rank}", "1")
        test_store.wait([f"ready/{i}/{g}" for g in range(world_size)], timedelta(seconds=60))
        reachable = combo["min_replica_size"] <= world_size
        attempts: List[float] = []
        trace: List[Any] = []
        deadline = time.monotonic() + combo_timeout
        while time.monotonic() < deadline:
            if reachable and manager.current_step() >= target_step:
                break
            if not reachable and len(attempts) >= attempts_without_quorum_size:
                break
            t0 = time.monotonic()
            manager.start_quorum()
            optim.zero_grad()
            gen = torch.Generator().manual_seed(1000 * manager.current_step() + rank)
            loss = model(torch.randn(4, 8, generator=gen)).square().mean()
            loss.backward()
            works = [manager.allreduce(p.grad) for p in model.parameters()]
            for w in works:
                w.wait()
            committed = manager.should_commit()
            if committed:
                optim.step()
            attempts.append(time.monotonic() - t0)
            trace.append(
                (
                    manager.quorum_id(),
                    manager.num_participants(),
                    manager.is_participating(),
                    committed,
                )
            )
        out[combo["name"]] = {
            "step": manager.current_step(),
            "attempts": attempts,
            "trace": trace,
            "model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": optim.state_dict(),
        }
        manager.shutdown(wait=False)
        test_store.set(f"done/{i}/{rank}", "1")
    return out


def step_faults(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    ports: List[int],
    fault: str,
    stop_at: int = 6,
    inject_at: Optional[List[int]] = None,
    max_consecutive_failures: Optional[int] = None,
    use_async_quorum: bool = True,
    max_attempts: int = 60,
    run_timeout: float = 60.0,
) -> Dict[str, Any]:
    """One replica group (rank == group) runs torchft's plain loop (start_quorum, allreduce,
    should_commit) under a fault, until it has committed ``stop_at`` steps, should_commit
    raises, or ``max_attempts`` attempts or ``run_timeout`` seconds have passed:

    * ``"non_contiguous"``: group 1 allreduces a non-contiguous tensor at every step, which
      the backend refuses; the Manager then aborts the process group, so group 0's allreduce
      fails too. A persistent fault, in every group.
    * ``"abort"``: group 0 aborts its process group before the allreduce of each step in
      ``inject_at`` (once each), as ft-launch's chaos does: transient faults.

    Every attempt prints ft-launch's step record (``ft.launch.worker.emit_step``). Returns
    each attempt's quorum id and commit, and what should_commit raised, if it did.
    """
    import ft
    from ft.launch import worker
    from tests.manager.inproc import make_manager

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("ft.coordination").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    test_store = connect_store(store_port)
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=10))
    manager = make_manager(
        lh_addr,
        f"g{rank}",
        store_port=ports[rank],
        pg=pg,
        use_async_quorum=use_async_quorum,
        max_consecutive_failures=max_consecutive_failures,
    )
    # Every group heartbeats before any asks for a quorum, so the first quorum holds all.
    test_store.set(f"ready/{rank}", "1")
    test_store.wait([f"ready/{g}" for g in range(world_size)], timedelta(seconds=60))

    attempts: List[Dict[str, Any]] = []
    raised: Optional[Dict[str, Any]] = None
    inject = set(inject_at or [])
    deadline = time.monotonic() + run_timeout
    while len(attempts) < max_attempts and time.monotonic() < deadline:
        if manager.current_step() >= stop_at:
            break
        step = manager.current_step()
        manager.start_quorum()
        if fault == "non_contiguous" and rank == 1:
            t = torch.ones(8)[::2]
        else:
            t = torch.ones(4)
        injected = fault == "abort" and rank == 0 and step in inject
        if injected:
            inject.discard(step)
            pg.abort()
        manager.allreduce(t).wait()
        try:
            committed = manager.should_commit()
        except ft.PersistentStepFailure as e:
            committed = False
            raised = {
                "type": type(e).__name__,
                "message": str(e),
                "phase": e.phase,
                "error": e.error,
                "count": e.count,
                "bound": e.bound,
                "is_runtime_error": isinstance(e, RuntimeError),
            }
        worker.emit_step(manager, loss=0.0, committed=committed, injected=injected)
        attempts.append({"step": step, "quorum_id": manager.quorum_id(), "committed": committed})
        if raised is not None:
            break
    result = {"group": rank, "step": manager.current_step(), "attempts": attempts, "raised": raised}
    manager.shutdown(wait=False)
    return result
