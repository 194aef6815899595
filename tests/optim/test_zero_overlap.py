"""ZeroRedundancyOptimizer with overlap_with_ddp=True (ft.optim.zero_hooks) and under Join.

Multi-process runs: 2 ranks, torch's DDP, on the "ft" backend and on Gloo (which ft's hooks
accept and torch's refuse). Single-process checks: the hooks' argument checks and the bucket
assignment rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from ft.optim import ZeroRedundancyOptimizer
from ft.optim.zero_overlap import assign_buckets

WORLD = 2

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")


@pytest.fixture(scope="module", params=["ft", "gloo"])
def overlap_results(request, backend_ranks):
    backend = request.param
    _, files = backend_ranks("overlap", WORLD, backend, f"zero-overlap-{backend}", timeout=150)
    return backend, [torch.load(f, weights_only=True) for f in files]


def test_overlap_equals_step_after_backward(overlap_results):
    """Overlapped ZeRO (both hooks, whole and sharded buckets, Adam and SGD with momentum, an
    LR change mid-run) after 2 warm-up iterations + 6 steps has bitwise the parameters and
    the consolidated state dict of the non-overlapped ZeRO after the same 6 steps (tolerance
    0: the functional optimizers are torch's arithmetic per parameter, and the gradients
    are reduced identically)."""
    backend, results = overlap_results
    runs = [k for k in results[0]["overlap"] if "-" in k]
    assert len(runs) == 8, runs
    for run in runs:
        for r, res in enumerate(results):
            c = res["overlap"][run]
            where = f"{backend} {run} rank {r}"
            assert c["equal"], f"{where}: max |diff| {c['max_abs_diff']}"
            assert c["status"] == 2, where  # INITIALIZED
            assert c["buckets"] >= 3, where
            assert c["step_returns"] is None and c["step_warned"], where
            if r == 0:
                assert c["sd_groups_equal"] and c["sd_state_equal"], where
        assert len({res["overlap"][run]["digest"] for res in results}) == 1, run
        # Every trainable element is stepped by exactly one rank.
        assert sum(res["overlap"][run]["local_numel"] for res in results) == sum(
            res["overlap"][run.replace("interleaved", "step")]["local_numel"] for res in results
        )
    sharded = results[0]["overlap"]["adam-step-shard1"]
    whole = results[0]["overlap"]["adam-step-shard0"]
    # shard_buckets=True splits the large bucket between the two ranks.
    assert sharded["assignments"] > whole["assignments"] == whole["buckets"]


def test_overlap_matches_torch_overlap(overlap_results):
    """On the "ft" backend, ft's overlapped ZeRO equals torch's overlapped ZeRO bitwise (same
    warm-up: the first two iterations update nothing in both). On Gloo, torch refuses."""
    backend, results = overlap_results
    for r, res in enumerate(results):
        if backend == "ft":
            c = res["overlap"]["vs_torch"]
            assert c["equal"], f"rank {r}: max |diff| {c['max_abs_diff']}"
        else:
            assert "Gloo" in res["overlap"]["torch_refuses"]


def test_join_uneven_inputs_matches_torch(overlap_results):
    """Rank r has 3 + 2r batches, under Join([ddp, zero]): the run finishes and ft's ZeRO
    gives bitwise torch's parameters (Adam, SGD; with and without bucket view)."""
    backend, results = overlap_results
    for combo in results[0]["join"]:
        for r, res in enumerate(results):
            c = res["join"][combo]
            assert c["equal"], f"{backend} {combo} rank {r}: max |diff| {c['max_abs_diff']}"
        assert len({res["join"][combo]["digest"] for res in results}) == 1, combo


# --------------------------------------------------------------------------- single process


def _ddp(model):
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)


def _two_ddp_copies():
    """Two DDP models (tiny buckets) of the same seeded small network."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return _ddp(copy.deepcopy(base)), _ddp(copy.deepcopy(base))


def _iteration(i, a, za, b, zb):
    """Iteration ``i`` on one random batch: ``a`` overlapped (``za`` steps inside backward,
    nothing in the first two iterations) and, from the third, ``b`` with ``zb`` stepped after
    backward."""
    x = torch.randn(3, 4)
    za.zero_grad()
    a(x).pow(2).sum().backward()
    if i >= 2:
        zb.zero_grad()
        b(x).pow(2).sum().backward()
        zb.step()


def test_hook_argument_checks(pg1):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import ft
    from ft.optim.zero_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

    model = nn.Linear(3, 2)
    ddp = _ddp(model)
    plain = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    for hook in (hook_with_zero_step, hook_with_zero_step_interleaved):
        with pytest.raises(ValueError, match="overlap_with_ddp=True"):
            hook(allreduce_hook, ddp, plain)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1
    )
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        hook_with_zero_step(allreduce_hook, model, zero)
    # ft's DDP averages through a Manager; its constructor only registers the Manager's hook.
    ft_ddp = ft.DistributedDataParallel(object(), nn.Linear(3, 2))
    with pytest.raises(TypeError, match="should_commit"):
        hook_with_zero_step(allreduce_hook, ft_ddp, zero)
    # Before the buckets are assigned there is no state to consolidate or load.
    with pytest.raises(RuntimeError, match="not initialized yet"):
        zero.consolidate_state_dict()
    with pytest.raises(RuntimeError, match="single parameter group"):
        zero.add_param_group({"params": [nn.Parameter(torch.ones(1))]})
    with pytest.raises(ValueError, match="single parameter group"):
        ZeroRedundancyOptimizer(
            [{"params": [model.weight]}, {"params": [model.bias]}],
            torch.optim.SGD,
            overlap_with_ddp=True,
            lr=0.1,
        )
    with pytest.warns(UserWarning, match="does nothing"):
        assert zero.step() is None


@pytest.mark.parametrize("interleaved", [False, True])
def test_one_rank_overlap_follows_lr_and_trainability(pg1, interleaved):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from ft.optim.zero_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

    a, b = _two_ddp_copies()
    za = ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, overlap_with_ddp=True, lr=0.01)
    zb = ZeroRedundancyOptimizer(b.parameters(), torch.optim.Adam, lr=0.01)
    hook = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    a.register_comm_hook(None, hook(allreduce_hook, a, za))
    sched_a = None
    for i in range(7):
        if i == 2:  # the first update: from here on both must agree
            sched_a = torch.optim.lr_scheduler.StepLR(za, step_size=1, gamma=0.5)
            sched_b = torch.optim.lr_scheduler.StepLR(zb, step_size=1, gamma=0.5)
        _iteration(i, a, za, b, zb)
        if i >= 2:
            sched_a.step()
            sched_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # The scheduler's last change reaches both local optimizers at their next step.
    assert za.param_groups[0]["lr"] == zb.param_groups[0]["lr"] == 0.01 * 0.5**5
    assert za.optim.defaults["lr"] == zb.optim.param_groups[0]["lr"] == 0.01 * 0.5**4
    a.module[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="requires_grad"):
        a(torch.randn(3, 4)).pow(2).sum().backward()


@pytest.mark.parametrize(
    "numels,world,shard,want",
    [
        # Whole buckets, in order, each to the least-loaded rank (round robin for equal sizes).
        ([[1], [5], [5], [5]], 2, False, [[(0, 0, 1)], [(1, 0, 1)], [(0, 0, 1)], [(1, 0, 1)]]),
        ([[10], [1], [1], [1]], 2, False, [[(0, 0, 1)], [(1, 0, 1)], [(1, 0, 1)], [(1, 0, 1)]]),
        ([[1, 1], [1]], 3, False, [[(0, 0, 2)], [(1, 0, 1)]]),
        # Sharded: contiguous ranges of ~total/world, cut at parameter midpoints.
        ([[2, 2], [2, 2]], 2, True, [[(0, 0, 2)], [(1, 0, 2)]]),
        ([[4, 2, 2]], 2, True, [[(0, 0, 1), (1, 1, 2)]]),
        ([[1, 1, 1], [1, 1, 1]], 3, True, [[(0, 0, 2), (1, 2, 1)], [(1, 0, 1), (2, 1, 2)]]),
        ([[100], [1]], 2, True, [[(0, 0, 1)], [(1, 0, 1)]]),
        ([[100], [1], [1]], 3, True, [[(1, 0, 1)], [(2, 0, 1)], [(2, 0, 1)]]),  # rank 0 idle
    ],
)
def test_assign_buckets(numels, world, shard, want):
    assert assign_buckets(numels, world, shard) == want


@pytest.mark.parametrize("which", ["ft", "torch"])
def test_one_rank_functional_class_given(pg1, which):
    """A functional class passed as optimizer_class (ft's, or torch's private one, stepped
    through torch's step(gradients) protocol) gives the torch.optim class's parameters."""
    import warnings

    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import ft.optim
    from ft.optim.zero_hooks import hook_with_zero_step_interleaved

    with warnings.catch_warnings(record=True):  # torch's warns about TorchScript, "always"
        from torch.distributed.optim.functional_sgd import _FunctionalSGD

        cls = ft.optim.FunctionalSGD if which == "ft" else _FunctionalSGD
        a, b = _two_ddp_copies()
        za = ZeroRedundancyOptimizer(
            a.parameters(), cls, overlap_with_ddp=True, lr=0.1, momentum=0.9
        )
        zb = ZeroRedundancyOptimizer(b.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        a.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, a, za))
        for i in range(6):
            _iteration(i, a, za, b, zb)
    assert isinstance(za.optim, cls)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_torch_overlap_hooks_given_ft_zero_are_refused_when_made(ft_skip):
    """torch's documented way (``hook_with_zero_step(allreduce_hook, ddp, zero)`` from
    ``torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook``) with ft's ZeRO: refused
    when the hook is made, naming ft.optim.zero_hooks, never inside backward; ft's own hook
    then trains the same model."""
    if reason := ft_skip():
        pytest.skip(reason)
    from tests.procs import Workers

    with Workers("tests.optim._torch_hook_worker:torch_hooks_refused", WORLD) as w:
        results = w.join(timeout=120)
    for r in results:
        for name in ("step", "interleaved"):
            assert "ft.optim.zero_hooks.hook_with_zero_step" in r[name], r
        assert r["trained"], r
