"""One rank of a multi-process ZeroRedundancyOptimizer test, run as
``python -m tests.optim._zero_worker`` by tests/optim/conftest.py (run_ranks).

Writes its results to ``<out>/rank<r>.pt``; any exception exits non-zero with a traceback.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from ft.optim import ZeroRedundancyOptimizer as FtZero

STEPS = 10


class Net(nn.Module):
    """Awkward sizes: one parameter above the 256 KiB packing threshold, ties (17, 17, 17 and
    5, 5), and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(13, 300)
        self.l2 = nn.Linear(300, 256)  # 76800 elements: broadcast in place
        self.l3 = nn.Linear(256, 17)
        self.norm = nn.LayerNorm(17)
        self.head = nn.Linear(17, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5), requires_grad=False)

    def forward(self, x):
        h = torch.relu(self.l1(x))
        h = torch.tanh(self.l2(h))
        return self.head(self.norm(self.l3(h))) * self.scale


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def groups_of(model: nn.Module, wd: float):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 13, generator=g), torch.randn(8, 5, generator=g)


def backward(model: nn.Module, step: int, rank: int, world: int) -> None:
    x, y = batch(step, rank)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce per step
    dist.all_reduce(flat)
    flat.div_(world)
    off = 0
    for g in grads:
        g.copy_(flat[off : off + g.numel()].view_as(g))
        off += g.numel()


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


OPTIMS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}


def scenario_equiv(rank: int, world: int, out: Path) -> dict:
    res = {}
    for name, (cls, kw) in OPTIMS.items():
        for bucket in (False, True):
            m_ft, m_t = make_model(), make_model()
            z_ft = FtZero(groups_of(m_ft, 0.01), cls, parameters_as_bucket_view=bucket, **kw)
            z_t = TorchZero(groups_of(m_t, 0.01), cls, parameters_as_bucket_view=bucket, **kw)
            idx_ft = {id(p): i for i, p in enumerate(m_ft.parameters())}
            idx_t = {id(p): i for i, p in enumerate(m_t.parameters())}
            same_partition = [
                [idx_ft[id(p)] for p in g["params"]] for g in z_ft.optim.param_groups
            ] == [[idx_t[id(p)] for p in g["params"]] for g in z_t.optim.param_groups]
            for step in range(STEPS):
                if step == 5:  # as an LR scheduler would
                    for z in (z_ft, z_t):
                        for g in z.param_groups:
                            g["lr"] *= 0.5
                for m, z in ((m_ft, z_ft), (m_t, z_t)):
                    backward(m, step, rank, world)
                    z.step()
                    z.zero_grad()
            pairs = list(zip(m_ft.parameters(), m_t.parameters()))
            res[f"{name}-bucket{int(bucket)}"] = {
                "equal": all(torch.equal(a, b) for a, b in pairs),
                "max_abs_diff": max(float((a - b).abs().max()) for a, b in pairs),
                "same_partition": same_partition,
                "ft_state_bytes": state_bytes(z_ft.optim),
                "torch_state_bytes": state_bytes(z_t.optim),
                "digest": params_digest(m_ft),
                "lr_exposed": [g["lr"] for g in z_ft.param_groups],
                "lr_local": [g["lr"] for g in z_ft.optim.param_groups],
                "lr_expected": [kw["lr"] * 0.5] * 2,
            }

    # Memory on a model the greedy rule balances exactly: 12 equal matrices, 4 per rank.
    torch.manual_seed(1)
    mlp = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(12)])
    plain_model = copy.deepcopy(mlp)
    z = FtZero(mlp.parameters(), torch.optim.Adam, lr=1e-3)
    mlp(torch.randn(4, 64)).sum().backward()
    z.step()
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-3)
    plain_model(torch.randn(4, 64)).sum().backward()
    plain.step()
    res["memory"] = {"zero": state_bytes(z.optim), "plain": state_bytes(plain)}
    return res


def run_steps(model, opt, steps, rank, world):
    for step in steps:
        backward(model, step, rank, world)
        opt.step()
        opt.zero_grad()


def scenario_save(rank: int, world: int, out: Path) -> dict:
    res = {}
    # Ranks that disagree on the model fail together, with a clear error.
    torch.manual_seed(0)
    odd = [nn.Parameter(torch.zeros(3 + (rank == 1)))]
    try:
        FtZero(odd, torch.optim.Adam, lr=0.1)
        res["mismatch_error"] = None
    except RuntimeError as e:
        res["mismatch_error"] = str(e)

    to = 1
    m_ft, m_t = make_model(), make_model()
    z_ft = FtZero(groups_of(m_ft, 0.01), torch.optim.Adam, lr=1e-2)
    z_t = TorchZero(groups_of(m_t, 0.01), torch.optim.Adam, lr=1e-2)
    try:
        z_ft.state_dict()
        res["before_error"] = None
    except RuntimeError as e:
        res["before_error"] = str(e)
    run_steps(m_ft, z_ft, range(5), rank, world)
    run_steps(m_t, z_t, range(5), rank, world)
    z_ft.consolidate_state_dict(to=to)
    z_t.consolidate_state_dict(to=to)
    if rank == to:
        sd_ft, sd_t = z_ft.state_dict(), z_t.state_dict()
        torch.save({"model": m_ft.state_dict(), "optim": sd_ft}, out / "checkpoint.pt")
        res["groups_equal"] = sd_ft["param_groups"] == sd_t["param_groups"]
        res["state_keys_equal"] = list(sd_ft["state"]) == list(sd_t["state"])
        res["state_equal"] = all(
            sd_ft["state"][i].keys() == sd_t["state"][i].keys()
            and all(
                torch.equal(sd_ft["state"][i][k], sd_t["state"][i][k]) for k in sd_ft["state"][i]
            )
            for i in sd_t["state"]
        )
        torch.save(sd_t, out / "torch_zero_optim.pt")
    else:
        try:
            z_ft.state_dict()
            res["other_rank_error"] = None
        except RuntimeError as e:
            res["other_rank_error"] = str(e)
    # The reference next step.
    run_steps(m_ft, z_ft, [5], rank, world)
    res["next"] = {k: v.clone() for k, v in m_ft.state_dict().items()}
    return res


def scenario_resume(rank: int, world: int, out: Path) -> dict:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    res = {}
    # ft ZeRO from ft's dict; torch ZeRO from ft's dict; ft ZeRO from torch ZeRO's dict.
    sources = {
        "ft<-ft": (FtZero, ckpt["optim"]),
        "torch<-ft": (TorchZero, ckpt["optim"]),
        "ft<-torch": (FtZero, torch.load(out / "torch_zero_optim.pt", weights_only=True)),
    }
    for label, (cls, sd) in sources.items():
        model = make_model(seed=123)  # different init: everything must come from the checkpoint
        model.load_state_dict(ckpt["model"])
        z = cls(groups_of(model, 0.5), torch.optim.Adam, lr=0.5)  # overwritten by the dict
        z.load_state_dict(copy.deepcopy(sd))
        backward(model, 5, rank, world)
        if label == "ft<-ft" and rank == 0:
            # A plain (unsharded) Adam loads the same dict and makes the same step.
            plain_model = copy.deepcopy(model)
            for p, q in zip(model.parameters(), plain_model.parameters()):
                q.grad = None if p.grad is None else p.grad.clone()
            plain = torch.optim.Adam(groups_of(plain_model, 0.5), lr=0.5)
            plain.load_state_dict(copy.deepcopy(ckpt["optim"]))
            plain.step()
            res["plain"] = {k: v.clone() for k, v in plain_model.state_dict().items()}
        z.step()
        res[label] = {k: v.clone() for k, v in model.state_dict().items()}
    return res


# --------------------------------------------------------------------------- overlap / join

OVERLAP_STEPS = 6


def ddp_of(model: nn.Module):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # 10 KB buckets: three buckets (head..l3, l2, l1), one of them far larger than the rest.
    return DDP(model, bucket_cap_mb=0.01)


def ddp_batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g)


def overlap_run(rank: int, make_zero, hook_fn, steps: int, warmup: int, lr_change_at=None):
    """DDP over ``make_model()``; ``warmup`` batches first (the overlapped ZeRO learns the
    buckets on them and updates nothing), then ``steps`` batches; the batches after the
    warm-up are the same for every run. Returns the model, its ZeRO and its DDP."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = make_model()
    ddp = ddp_of(model)
    zero = make_zero(ddp)
    if hook_fn is not None:
        ddp.register_comm_hook(None, hook_fn(allreduce_hook, ddp, zero))
    for i in range(warmup + steps):
        step = i - warmup  # warm-up batches get negative numbers
        if lr_change_at is not None and step == lr_change_at:
            for g in zero.param_groups:  # as an LR scheduler would
                g["lr"] *= 0.5
        zero.zero_grad()
        x, y = ddp_batch(step, rank)
        nn.functional.mse_loss(ddp(x), y).backward()
        if hook_fn is None:
            zero.step()
    return model, zero, ddp


def compare(a: nn.Module, b: nn.Module) -> dict:
    pairs = list(zip(a.parameters(), b.parameters()))
    return {
        "equal": all(torch.equal(p, q) for p, q in pairs),
        "max_abs_diff": max(float((p - q).abs().max()) for p, q in pairs),
        "digest": params_digest(a),
    }


def scenario_overlap(rank: int, world: int, out: Path, backend: str) -> dict:
    import warnings

    from ft.optim.zero_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

    res = {}
    hooks = {"step": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
    for oname, (cls, kw) in OPTIMS.items():
        ref, ref_zero, _ = overlap_run(
            rank,
            lambda d: FtZero(d.parameters(), cls, **kw),
            None,
            OVERLAP_STEPS,
            0,
            lr_change_at=3,
        )
        ref_zero.consolidate_state_dict(to=0)
        ref_sd = ref_zero.state_dict() if rank == 0 else None
        for hname, hook in hooks.items():
            for shard in (False, True):
                h = (lambda hk, sb: lambda f, d, z: hk(f, d, z, shard_buckets=sb))(hook, shard)
                m, z, _ = overlap_run(
                    rank,
                    lambda d: FtZero(d.parameters(), cls, overlap_with_ddp=True, **kw),
                    h,
                    OVERLAP_STEPS,
                    2,
                    lr_change_at=3,
                )
                r = compare(m, ref)
                r["status"] = int(z.overlap.info.status)
                r["assignments"] = z.overlap.info.num_bucket_assignments
                r["buckets"] = len(z.overlap.info.params_per_bucket)
                r["local_numel"] = sum(p.numel() for p in z.overlap.info.params_per_rank[rank])
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    r["step_returns"] = z.step()
                r["step_warned"] = any("does nothing" in str(w.message) for w in caught)
                z.consolidate_state_dict(to=0)
                if rank == 0:
                    sd = z.state_dict()
                    r["sd_groups_equal"] = sd["param_groups"] == ref_sd["param_groups"]
                    r["sd_state_equal"] = list(sd["state"]) == list(ref_sd["state"]) and all(
                        sd["state"][i].keys() == ref_sd["state"][i].keys()
                        and all(
                            torch.equal(sd["state"][i][k], ref_sd["state"][i][k])
                            for k in sd["state"][i]
                        )
                        for i in ref_sd["state"]
                    )
                res[f"{oname}-{hname}-shard{int(shard)}"] = r
    # Torch's own overlapped ZeRO (torch refuses Gloo: only on the "ft" backend), no LR change
    # (torch's functional optimizer does not follow param_groups).
    from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import (
        hook_with_zero_step as torch_hook,
    )

    cls, kw = OPTIMS["adam"]
    m_ft, _, _ = overlap_run(
        rank,
        lambda d: FtZero(d.parameters(), cls, overlap_with_ddp=True, **kw),
        hook_with_zero_step,
        OVERLAP_STEPS,
        2,
    )
    if backend == "ft":
        m_t, _, _ = overlap_run(
            rank,
            lambda d: TorchZero(d.parameters(), cls, overlap_with_ddp=True, **kw),
            torch_hook,
            OVERLAP_STEPS,
            2,
        )
        res["vs_torch"] = compare(m_ft, m_t)
    else:
        try:
            overlap_run(
                rank,
                lambda d: TorchZero(d.parameters(), cls, overlap_with_ddp=True, **kw),
                torch_hook,
                0,
                0,
            )
            res["torch_refuses"] = None
        except RuntimeError as e:
            res["torch_refuses"] = str(e)
    return res


def scenario_join(rank: int, world: int, out: Path) -> dict:
    """Uneven inputs (rank r has 3 + 2r batches) under Join([ddp, zero]), ft's ZeRO and
    torch's, Adam and SGD with momentum, with and without parameters_as_bucket_view."""
    from torch.distributed.algorithms.join import Join

    res = {}
    n_batches = 3 + 2 * rank
    for oname, (cls, kw) in OPTIMS.items():
        for bucket in (False, True):
            models = {}
            for name, Z in (("ft", FtZero), ("torch", TorchZero)):
                model = make_model()
                ddp = ddp_of(model)
                zero = Z(groups_of(model, 0.01), cls, parameters_as_bucket_view=bucket, **kw)
                with Join([ddp, zero]):
                    for step in range(n_batches):
                        zero.zero_grad()
                        x, y = ddp_batch(step, rank)
                        nn.functional.mse_loss(ddp(x), y).backward()
                        zero.step()
                models[name] = model
            res[f"{oname}-bucket{int(bucket)}"] = compare(models["ft"], models["torch"])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.backend == "ft":
        import ft  # noqa: F401  (registers the backend)
    store = dist.TCPStore("127.0.0.1", a.port, None, False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        a.backend, store=store, rank=a.rank, world_size=a.world, timeout=timedelta(seconds=60)
    )
    try:
        if a.scenario == "train":  # one set of processes for both (process start-up is slow)
            res = {
                "equiv": scenario_equiv(a.rank, a.world, a.out),
                "save": scenario_save(a.rank, a.world, a.out),
            }
        elif a.scenario == "overlap":  # one set of processes for both
            res = {
                "overlap": scenario_overlap(a.rank, a.world, a.out, a.backend),
                "join": scenario_join(a.rank, a.world, a.out),
            }
        else:
            res = {"resume": scenario_resume}[a.scenario](a.rank, a.world, a.out)
        torch.save(res, a.out / f"rank{a.rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
