"""Child processes for tests/optim/test_post_localsgd.py (run through tests.procs.Workers).

``equivalence``: rank r of a 2-rank "ft"-backend group runs ft's and torch's post-local SGD side
by side and reports whether they stay bitwise equal.

``ft_train``: replica group ``rank`` (one rank per group) trains with PostLocalSGDOptimizer +
FaultTolerantModelAverager over a real ft.Manager (tests.diloco.mp_workers.make_manager), and
reports every averaging round. Progress goes to the test's store: ``step/{g}`` (manager step)
and ``count/{g}`` (the averager's counter) after each iteration.
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests.procs import connect_store, worker_store

# --------------------------------------------------------------------------- equivalence


class _Net(nn.Module):
    """An fp64 parameter (torch.cat promotes the flat buffer) and one never used in forward
    (no .grad: torch's averager leaves it alone; its values differ per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 12)
        self.l2 = nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3, dtype=torch.float64))
        self.unused = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x))) * self.scale.float()


def _net(rank: int) -> _Net:
    torch.manual_seed(0)
    m = _Net()
    with torch.no_grad():
        m.unused.fill_(float(rank + 1))
    return m


def _groups(m: _Net, lr: float):
    return [
        {"params": [m.l1.weight, m.l2.weight], "lr": lr},
        {"params": [m.l1.bias, m.l2.bias, m.scale, m.unused], "lr": lr / 2},
    ]


def _local_step(model: nn.Module, opt, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * rank + step)  # different data per rank
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def equivalence(
    rank: int, world_size: int, store_port: int, *, steps: int, period: int, warmup: int
) -> Dict[str, Any]:
    import ft  # noqa: F401  (registers the "ft" backend)
    import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGD

    from ft.optim.post_localsgd import PeriodicModelAverager, PostLocalSGDOptimizer

    torch.set_num_threads(1)
    store = dist.PrefixStore("equivalence", connect_store(store_port))
    dist.init_process_group(
        "ft", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30)
    )
    out: Dict[str, Any] = {"backend": dist.get_backend()}
    try:
        combos = {
            "ft": (PostLocalSGDOptimizer, PeriodicModelAverager),
            "ft_opt+torch_avg": (PostLocalSGDOptimizer, torch_averagers.PeriodicModelAverager),
            "torch_opt+ft_avg": (TorchPostLocalSGD, PeriodicModelAverager),
        }
        ref_m = _net(rank)
        ref = TorchPostLocalSGD(
            torch.optim.SGD(_groups(ref_m, 0.1), momentum=0.9),
            torch_averagers.PeriodicModelAverager(period, warmup),
        )
        runs = {}
        for name, (opt_cls, avg_cls) in combos.items():
            m = _net(rank)
            runs[name] = (
                m,
                opt_cls(torch.optim.SGD(_groups(m, 0.1), momentum=0.9), avg_cls(period, warmup)),
            )
        per_step: Dict[str, List[bool]] = {name: [] for name in runs}
        for step in range(steps):
            _local_step(ref_m, ref, step, rank)
            for name, (m, opt) in runs.items():
                _local_step(m, opt, step, rank)
                per_step[name].append(
                    all(torch.equal(a, b) for a, b in zip(m.parameters(), ref_m.parameters()))
                )
        out["per_step"] = per_step
        out["params"] = {k: v.clone() for k, v in ref_m.state_dict().items()}
        out["unused"] = runs["ft"][0].unused.detach().clone()
        out["steps"] = {name: opt.state_dict()["step"] for name, (_, opt) in runs.items()}
        out["torch_step"] = ref.state_dict()["step"]

        # The averager used directly, with model.parameters() (torch's other usage), and Adam.
        a, b = _net(rank), _net(rank)
        oa = torch.optim.Adam(a.parameters(), lr=0.01)
        ob = torch.optim.Adam(b.parameters(), lr=0.01)
        ava = PeriodicModelAverager(period, warmup)
        avb = torch_averagers.PeriodicModelAverager(period, warmup)
        for step in range(steps):
            _local_step(a, oa, step, rank)
            ava.average_parameters(a.parameters())
            _local_step(b, ob, step, rank)
            avb.average_parameters(b.parameters())
        out["direct_equal"] = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))

        # Resume: ft's optimizer loads torch's state dict (with "step") mid-period and both
        # continue identically, without a new warmup.
        ft_m = _net(rank)
        resumed = PostLocalSGDOptimizer(
            torch.optim.SGD(_groups(ft_m, 0.1), momentum=0.9), PeriodicModelAverager(period, warmup)
        )
        ft_m.load_state_dict(ref_m.state_dict())
        # (a copy: Optimizer.load_state_dict keeps the given state tensors, which torch's
        # optimizer goes on updating in place)
        resumed.load_state_dict(copy.deepcopy(ref.state_dict()))
        out["resumed_step"] = resumed.averager.step
        for step in range(steps, steps + period + 1):
            _local_step(ref_m, ref, step, rank)
            _local_step(ft_m, resumed, step, rank)
        out["resume_equal"] = all(
            torch.equal(p, q) for p, q in zip(ft_m.parameters(), ref_m.parameters())
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return out


# --------------------------------------------------------------------------- fault tolerant


def _task(counter: int, group: int):
    g = torch.Generator().manual_seed(100_000 * group + counter)  # different data per group
    x = torch.randn(16, 8, generator=g)
    noise = 0.05 * torch.randn(16, 4, generator=g)
    y = torch.tanh(x @ torch.linspace(-1, 1, 32).view(8, 4)) + noise
    return x, y


def ft_train(
    rank: int,
    world_size: int,
    store_port: int,
    *,
    lh_addr: str,
    period: int,
    warmup: int,
    step_sleep: float,
    fail_at: Optional[int] = None,
    seed: int = 0,
    wait_ready: int = 0,
    max_iters: int = 3000,
) -> Dict[str, Any]:
    from tests.diloco.mp_workers import digest, make_manager
    from ft.utils.tensors import clone_state

    from ft.optim.post_localsgd import FaultTolerantModelAverager, PostLocalSGDOptimizer

    test_store = worker_store(store_port)
    # Different initial weights per group (and for a restarted group): the join must fix them.
    torch.manual_seed(7 + 31 * rank + 1000 * seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    loads: List[int] = []

    def save():
        return clone_state({"model": model.state_dict(), "inner": inner.state_dict()})

    def load(sd):
        loads.append(1)
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = make_manager(rank, lh_addr, 1, load, save, "g", pg_timeout=4.0)
    averager = FaultTolerantModelAverager(manager, model, period=period, warmup_steps=warmup)
    opt = PostLocalSGDOptimizer(inner, averager)

    # A failed round on every group: at manager step `fail_at`, group 0 reports a communication
    # error right before its first allreduce of the round (its process group is aborted, so the
    # others' allreduces fail too), as tests/diloco/mp_workers.py does.
    injected: List[int] = []
    real_allreduce = manager.allreduce

    def allreduce(t, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        if fail_at == manager.current_step() and rank == 0 and not injected:
            injected.append(manager.current_step())
            manager._report_error(RuntimeError("injected allreduce failure"), abort=True)
        return real_allreduce(t, should_quantize=should_quantize, reduce_op=reduce_op)

    manager.allreduce = allreduce  # type: ignore[method-assign]

    test_store.set(f"ready/{rank}", "1")
    if wait_ready:
        # "go": the test sets it once the lighthouse sees every group's heartbeat, so that the
        # first quorum (the join round) holds all of them (a group whose first heartbeat lands
        # after that quorum formed would join one round later).
        test_store.wait([f"ready/{i}" for i in range(wait_ready)] + ["go"], timedelta(seconds=60))

    averager.join()
    joined = {
        "step": manager.current_step(),
        "counter": averager.step,
        "model": digest(model.state_dict()),
        "inner": digest(inner.state_dict()),
        "loads": len(loads),
        "join_rounds": averager.rounds,  # > 1: a join round failed (the error below says why)
        "join_error": repr(manager.errored()),
    }
    rounds: List[Dict[str, Any]] = []
    pre_step: List[str] = []  # the model each local step starts from (first few)
    stop_at = 10**9
    for _ in range(max_iters):
        if test_store.check(["stop_at"]):
            stop_at = int(test_store.get("stop_at"))
        if len(pre_step) < 3:
            pre_step.append(digest(model.state_dict()))
        x, y = _task(averager.step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if step_sleep:
            time.sleep(step_sleep)
        before = averager.rounds
        opt.step()
        if averager.rounds != before:
            rounds.append(
                {
                    "counter": averager.step,
                    "step": manager.current_step(),
                    "committed": averager.last_committed,
                    "participants": manager.num_participants(),
                    "model": digest(model.state_dict()),
                    "inner": digest(inner.state_dict()),
                }
            )
        test_store.set(f"count/{rank}", str(averager.step))
        test_store.set(f"step/{rank}", str(manager.current_step()))
        if averager.rounds != before and manager.current_step() >= stop_at:
            break
    out = {
        "joined": joined,
        "rounds": rounds,
        "pre_step": pre_step,
        "injected": injected,
        "step": manager.current_step(),
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt_step": opt.state_dict()["step"],
        "param_groups": opt.state_dict()["param_groups"],
        "failed_rounds": averager.failed_rounds,
    }
    manager.shutdown(wait=False)
    return out
