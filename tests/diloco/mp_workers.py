"""Child processes for the multi-process DiLoCo/LocalSGD tests: real
lighthouse (in the test process), real ManagerServers, ft.Manager and
ft.ProcessGroupGloo. Run through tests.procs.Workers; child `rank` is replica
group `rank` (one rank per group)."""

from __future__ import annotations

import hashlib
import time
from datetime import timedelta
from typing import Any, Dict, List

import torch
from torch import nn

from ft.utils.tensors import clone_state
from tests.procs import worker_store


def digest(obj: Any) -> str:
    h = hashlib.sha1()

    def walk(o: Any) -> None:
        if torch.is_tensor(o):
            h.update(o.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()[:16]


def make_manager(
    rank: int, lh_addr: str, pg_lanes: int, load, save, tag: str, pg_timeout: float = 10.0
):
    """Replica group ``rank``'s Manager (one rank, replica id ``{tag}{rank}``, sync quorum)
    through ``tests.manager.inproc.make_manager``: a Gloo group of ``pg_lanes`` lanes, and
    ``pg_timeout`` seconds for its ops, the Manager's collectives and connects and the
    checkpoint transport (the quorum: 30 s)."""
    from ft.checkpointing import HTTPTransport
    from tests.manager import inproc

    to = timedelta(seconds=pg_timeout)
    return inproc.make_manager(
        lh_addr,
        f"{tag}{rank}",
        pg_timeout=to,
        pg_lanes=pg_lanes,
        load_state_dict=load,
        state_dict=save,
        use_async_quorum=False,
        timeout=to,
        quorum_timeout=timedelta(seconds=30),
        connect_timeout=to,
        checkpoint_transport=HTTPTransport(timeout=to, num_chunks=0, advertise_host="127.0.0.1"),
    )


def _task(step: int, local: int, rank: int, n: int = 16):
    g = torch.Generator().manual_seed(100_000 * rank + 1000 * step + local)
    x = torch.randn(n, 8, generator=g)
    w = torch.linspace(-1, 1, 32).view(8, 4)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 4, generator=g)
    return x, y


def make_algo(manager, model: nn.Sequential, inner, cfg: Dict[str, Any]):
    """The run's algorithm over the 3-layer ``model`` and its fragments: LocalSGD with a
    backup when ``cfg["algo"]`` is "localsgd" (``warmup`` steps), else DiLoCo with a Nesterov
    SGD outer optimizer over ``n_frag`` fragments (1: the model; 2: its two linear layers),
    ``tau`` (fragment_sync_delay), ``alpha``, ``bucket`` and ``bucket_cap_mb``."""
    from ft.local_sgd import DiLoCo, LocalSGD

    if cfg["algo"] == "localsgd":
        algo = LocalSGD(
            manager,
            model,
            inner,
            sync_every=cfg["sync_every"],
            warmup_steps=cfg.get("warmup", 0),
            keep_backup=True,
        )
        return algo, [model]
    frags = [model[0], model[2]] if cfg.get("n_frag", 1) == 2 else [model]
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    algo = DiLoCo(
        manager,
        frags,
        inner,
        outer,
        sync_every=cfg["sync_every"],
        fragment_sync_delay=cfg.get("tau", 0),
        fragment_update_alpha=cfg.get("alpha", 0.0),
        use_bucketization=cfg.get("bucket", False),
        bucket_cap_mb=cfg.get("bucket_cap_mb"),
    )
    return algo, frags


def run_config(rank: int, lh_addr: str, cfg: Dict[str, Any], test_store) -> Dict[str, Any]:
    # different initial weights (and for a restarted group): init_sync or the heal must fix them
    torch.manual_seed(7 + 31 * rank + 1000 * cfg.get("seed", 0))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    n_frag = cfg.get("n_frag", 1)

    def save():
        return clone_state({"model": model.state_dict(), "inner": inner.state_dict()})

    def load(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    manager = make_manager(
        rank, lh_addr, max(2, n_frag), load, save, cfg.get("tag", "r"), cfg.get("pg_timeout", 10.0)
    )
    algo, frags = make_algo(manager, model, inner, cfg)
    if cfg["algo"] == "localsgd":
        state_fn = lambda: {"params": dict(model.named_parameters()), **algo._state_dict()}  # noqa: E731
    else:
        state_fn = algo.global_state

    # Fault injection: at manager step `fail_at`, replica `fail_rank` reports an
    # error right before its first allreduce of that sync (aborting its pg, so
    # the peer's op fails too).
    from ft import _C

    injected: List[int] = []
    lanes: set = set()
    real_allreduce = manager.allreduce

    def allreduce(t, should_quantize=False, reduce_op=torch.distributed.ReduceOp.AVG):
        if (
            cfg.get("fail_at") == manager.current_step()
            and rank == cfg.get("fail_rank", 0)
            and not injected
        ):
            injected.append(manager.current_step())
            # a communication failure (the Manager aborts the group), not a user-reported one
            manager._report_error(RuntimeError("injected allreduce failure"), abort=True)
        lanes.add(_C.get_current_lane())
        return real_allreduce(t, should_quantize=should_quantize, reduce_op=reduce_op)

    manager.allreduce = allreduce  # type: ignore[method-assign]

    # How many inner steps this group took before its first quorum (0: it healed first).
    local = 0
    inner_before_quorum: List[int] = []
    real_start_quorum = manager.start_quorum

    def start_quorum(*args, **kwargs):
        if not inner_before_quorum:
            inner_before_quorum.append(local)
        return real_start_quorum(*args, **kwargs)

    manager.start_quorum = start_quorum  # type: ignore[method-assign]

    def params_by_fragment() -> Dict[int, Any]:
        return {i: {n: p.detach() for n, p in f.named_parameters()} for i, f in enumerate(frags)}

    def backups_by_fragment() -> Dict[int, Any]:
        g = algo.global_state()
        return {i: g[f"backup/{i}"] for i in range(len(frags))}

    commits: Dict[int, str] = {}
    backups: Dict[int, str] = {}  # the global parameters (DiLoCo's backups) at each step
    contributors: Dict[int, Any] = {}
    inner_at: Dict[int, int] = {}  # inner steps taken when each step committed
    first_inner: Dict[str, Any] = {}
    failures = 0
    stop_at = cfg["stop_at"]
    last = manager.current_step()
    key = f"{cfg.get('tag', 'r')}step/{rank}"
    test_store.set(f"{cfg.get('tag', 'r')}ready/{rank}", "1")
    if cfg.get("wait_ready"):
        # "go": the test sets it once the lighthouse sees every group's heartbeat, so that the
        # first quorum (the join round: all groups joining, so no sync) holds all of them.
        test_store.wait(
            [f"{cfg.get('tag', 'r')}ready/{i}" for i in range(cfg["wait_ready"])] + ["go"],
            timedelta(seconds=60),
        )

    def record_commit(now: int) -> None:
        commits[now] = digest(state_fn())
        contributors[now] = getattr(algo, "contributors", None)
        inner_at[now] = local
        if cfg["algo"] == "diloco":
            backups[now] = digest(backups_by_fragment())

    with algo:
        # The join round runs at the first forward (below). A late joiner's commits there
        # (LocalSGD's always), or with tau > 0 at the first inner step; DiLoCo's, when every
        # group of its quorum is joining, syncs nothing.
        last = manager.current_step()
        test_store.set(key, str(last))
        for _ in range(cfg.get("max_inner", 400)):
            if test_store.check(["stop_at"]):
                stop_at = int(test_store.get("stop_at"))
            if manager.current_step() >= stop_at:
                break
            step_before = manager.current_step()
            syncs_before = getattr(algo, "syncs", None)
            x, y = _task(manager.current_step(), local, rank)
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # the first forward joins
            # A join round that synced committed in that forward (LocalSGD; DiLoCo with
            # tau = 0). With tau > 0 only its heal may have moved the step: it commits at the
            # inner step.
            sync_done = syncs_before is None or algo.syncs != syncs_before
            if sync_done and manager.current_step() != step_before:
                record_commit(manager.current_step())
                step_before = manager.current_step()
            if not first_inner:
                # What the first inner step starts from: after the join (and its heal).
                first_inner = {
                    "step": manager.current_step(),
                    "params": digest(params_by_fragment()),
                }
            if cfg.get("step_sleep"):
                time.sleep(cfg["step_sleep"])
            syncs_before = getattr(algo, "syncs", None)
            inner.step()  # the hook may sync here
            local += 1
            now = manager.current_step()
            if now != step_before:
                record_commit(now)
            elif syncs_before is not None and algo.syncs != syncs_before:
                failures += 1
            last = now
            test_store.set(f"{cfg.get('tag', 'r')}local/{rank}", str(algo._local_step))
            test_store.set(key, str(now))
    out = {
        "step": manager.current_step(),
        "commits": commits,
        "final": digest(state_fn()),
        "failures": failures,
        "algo_failed": getattr(algo, "failed_commits", None),
        "injected": injected,
        "last": last,
        "lanes": sorted(lanes),
        "backups": backups,
        "contributors": contributors,
        "inner_at": inner_at,
        "first_inner": first_inner,
        "inner_before_quorum": inner_before_quorum[0] if inner_before_quorum else None,
        "model": digest({n: p.detach() for n, p in model.named_parameters()}),
    }
    manager.shutdown(wait=False)
    return out


def train(
    rank: int, world_size: int, store_port: int, *, lh_addr: str, configs: List[Dict[str, Any]]
) -> List[Dict[str, Any]]:
    test_store = worker_store(store_port)
    results = []
    for i, cfg in enumerate(configs):
        cfg = dict(cfg, tag=f"c{i}-")
        results.append(run_config(rank, lh_addr, cfg, test_store))
    return results
