"""ZeroRedundancyOptimizer: equivalence with torch's, state dicts, memory, bad input."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ft.optim import ZeroRedundancyOptimizer

WORLD = 3

# Importing torch.distributed.optim scripts its functional optimizers, which warns.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`TorchScript:DeprecationWarning"),
]


# --------------------------------------------------------------------------- single process


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a default group exists in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1)


def test_one_rank_matches_plain_adam(pg1):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    b = copy.deepcopy(a)
    za = ZeroRedundancyOptimizer(a.parameters(), torch.optim.Adam, lr=0.01)
    ob = torch.optim.Adam(b.parameters(), lr=0.01)
    for _ in range(3):
        x = torch.randn(4, 5)
        for m, o in ((a, za), (b, ob)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    # param_groups exposes every hyperparameter of the local optimizer.
    assert set(za.param_groups[0]) == set(ob.param_groups[0])
    assert za.state is za.optim.state and len(za.state) == 4
    # An LR scheduler drives the exposed param_groups; the local optimizer follows at step().
    sched = torch.optim.lr_scheduler.StepLR(za, step_size=1, gamma=0.5)
    a(torch.randn(4, 5)).pow(2).sum().backward()
    za.step()
    sched.step()
    assert za.param_groups[0]["lr"] == 0.005
    a(torch.randn(4, 5)).pow(2).sum().backward()
    za.step()
    assert za.optim.param_groups[0]["lr"] == 0.005


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.optim.Adam([nn.Parameter(torch.ones(1))]), "not an optimizer instance"),
        (nn.Linear, "subclass of torch.optim.Optimizer"),
        ("adam", "torch.optim.Optimizer subclass"),
    ],
)
def test_wrong_optimizer_class(pg1, bad, match):
    with pytest.raises(TypeError, match=match):
        ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], bad, lr=0.1)


def _torch_error(bad, overlap):
    """The exception type torch's ZeroRedundancyOptimizer raises for ``bad`` (None: accepts)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    try:
        with warnings.catch_warnings(record=True):
            TorchZero([nn.Parameter(torch.ones(2))], bad, overlap_with_ddp=overlap, lr=0.1)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e)
    return None


def _optimizer_class_cases():
    from torch.distributed.optim.functional_adam import _FunctionalAdam

    import ft.optim

    return [
        ("ft functional", ft.optim.FunctionalAdam),
        ("torch functional", _FunctionalAdam),
        ("no functional counterpart", torch.optim.LBFGS),
        ("torch.optim class", torch.optim.Adam),
        ("not an optimizer", nn.Linear),
        ("instance", torch.optim.Adam([nn.Parameter(torch.ones(1))])),
        ("string", "adam"),
    ]


@pytest.mark.parametrize("overlap", [False, True])
def test_optimizer_class_errors_match_torch(pg1, overlap):
    """Functional optimizer classes are accepted exactly where torch accepts them (only with
    overlap_with_ddp=True), and each refusal has torch's exception type: ValueError for a
    functional class without overlap (it used to be TypeError here) and for anything without
    a functional counterpart with overlap; TypeError for what is not an optimizer class."""
    cases = _optimizer_class_cases()
    for label, bad in cases:
        # torch knows only its own functional classes: ft's FunctionalAdam must behave as
        # torch's _FunctionalAdam does.
        want = _torch_error(
            dict(cases)["torch functional"] if label == "ft functional" else bad, overlap
        )
        try:
            # torch's functional classes warn about TorchScript with filter "always": record.
            with warnings.catch_warnings(record=True):
                ZeroRedundancyOptimizer(
                    [nn.Parameter(torch.ones(2))], bad, overlap_with_ddp=overlap, lr=0.1
                )
            got = None
        except Exception as e:  # noqa: BLE001
            got = type(e)
            message = str(e)
        assert got is want, f"{label} (overlap={overlap}): ft {got}, torch {want}"
        if got is ValueError:
            assert "functional" in message, message


def test_functional_optimizer_messages(pg1):
    import ft.optim

    with pytest.raises(ValueError, match="only accepted with overlap_with_ddp=True"):
        ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], ft.optim.FunctionalSGD, lr=0.1)
    with pytest.raises(ValueError, match="LBFGS.*no functional counterpart"):
        ZeroRedundancyOptimizer(
            [nn.Parameter(torch.ones(2))], torch.optim.LBFGS, overlap_with_ddp=True, lr=0.1
        )
    with pytest.raises(TypeError, match="could not build"):
        ZeroRedundancyOptimizer(
            [nn.Parameter(torch.ones(2))],
            torch.optim.SGD,
            overlap_with_ddp=True,
            lr=0.1,
            betas=(0.9, 0.99),
        )
    # Accepted with overlap: param_groups carries the hyperparameters for LR schedulers.
    z = ZeroRedundancyOptimizer(
        [nn.Parameter(torch.ones(2))], torch.optim.Adam, overlap_with_ddp=True, lr=0.1
    )
    assert z.param_groups[0]["lr"] == 0.1 and z.param_groups[0]["betas"] == (0.9, 0.999)
    z = ZeroRedundancyOptimizer(
        [nn.Parameter(torch.ones(2))], ft.optim.FunctionalAdam, overlap_with_ddp=True, lr=0.1
    )
    assert z.param_groups[0]["betas"] == (0.9, 0.999)


def test_unknown_hyperparameter(pg1):
    with pytest.raises(TypeError, match="could not build SGD"):
        ZeroRedundancyOptimizer(
            [nn.Parameter(torch.ones(2))], torch.optim.SGD, lr=0.1, betas=(0.9, 0.99)
        )


def test_mixed_devices(pg1):
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, device="meta"))]
    with pytest.raises(ValueError, match="one device.*cpu and meta"):
        ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.1)


def test_mixed_devices_in_added_group(pg1):
    z = ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], torch.optim.Adam, lr=0.1)
    with pytest.raises(ValueError, match="one device"):
        z.add_param_group({"params": [nn.Parameter(torch.ones(2, device="meta"))]})
    assert len(z.param_groups) == 1 and len(z.optim.param_groups) == 1


def test_mixed_dtypes(pg1):
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="one dtype"):
        ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.1)


def test_joinable(pg1):
    from torch.distributed.algorithms.join import Join, Joinable

    p = nn.Parameter(torch.ones(2))
    z = ZeroRedundancyOptimizer([p], torch.optim.SGD, lr=0.1)
    assert isinstance(z, Joinable)
    assert z.join_device == torch.device("cpu") and z.join_process_group is pg1
    # One rank: the context is entered and left; the join hook's shadow step is a real step.
    with Join([z]):
        p.grad = torch.ones(2)
        z.step()
    z.join_hook().main_hook()
    q = nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    plain = torch.optim.SGD([q], lr=0.1)
    plain.step()
    plain.step()
    assert torch.equal(p.detach(), q.detach())


def test_state_dict_needs_consolidate(pg1):
    z = ZeroRedundancyOptimizer([nn.Parameter(torch.ones(2))], torch.optim.Adam, lr=0.1)
    with pytest.raises(RuntimeError, match=r"consolidate_state_dict\(to=0\)"):
        z.state_dict()
    with pytest.raises(ValueError, match="to=3"):
        z.consolidate_state_dict(to=3)


def _trained(pg, opt=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    z = ZeroRedundancyOptimizer(m.parameters(), opt, **(kw or {"lr": 0.1}))
    m(torch.randn(2, 3)).sum().backward()
    z.step()
    z.consolidate_state_dict()
    return m, z


def test_load_mismatched_state_dicts(pg1):
    m, z = _trained(pg1)
    good = z.state_dict()
    cases = []
    cases.append(("not a dict", [], "expected a dict"))
    cases.append(("no state", {"param_groups": good["param_groups"]}, "expected a dict"))
    two = copy.deepcopy(good)
    two["param_groups"].append(copy.deepcopy(two["param_groups"][0]))
    cases.append(("groups", two, "2 parameter group"))
    short = copy.deepcopy(good)
    short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
    cases.append(("count", short, "3 parameter"))
    shape = copy.deepcopy(good)
    shape["state"][0]["exp_avg"] = torch.zeros(5, 3)
    cases.append(("shape", shape, r"shape \(5, 3\).*\(4, 3\)"))
    stray = copy.deepcopy(good)
    stray["state"][99] = {}
    cases.append(("index", stray, "index 99"))
    _, sgd = _trained(pg1, torch.optim.SGD, lr=0.1, momentum=0.9)
    cases.append(("other optimizer", sgd.state_dict(), "another optimizer"))
    before = {k: {n: t.clone() for n, t in v.items()} for k, v in z.optim.state.items()}
    for _label, sd, match in cases:
        with pytest.raises(ValueError, match=match):
            z.load_state_dict(sd)
    # Nothing was loaded by the failed calls.
    for k, v in z.optim.state.items():
        assert all(torch.equal(v[n], before[k][n]) for n in v)
    # A good dict loads, and the caller's dict is not modified by later steps.
    snapshot = copy.deepcopy(good)
    z.load_state_dict(good)
    m(torch.randn(2, 3)).sum().backward()
    z.step()
    assert all(
        torch.equal(good["state"][i][k], snapshot["state"][i][k])
        for i in good["state"]
        for k in good["state"][i]
    )


def test_add_param_group(pg1):
    m, z = _trained(pg1)
    extra = nn.Parameter(torch.ones(3))
    z.add_param_group({"params": [extra], "lr": 0.5})
    assert len(z.param_groups) == 2 and len(z.optim.param_groups) == 2
    assert z.param_groups[1]["lr"] == 0.5 and "betas" in z.param_groups[1]
    extra.grad = torch.ones(3)
    z.step()
    assert not torch.equal(extra, torch.ones(3))


def test_stale_state_dict_warns(pg1):
    m, z = _trained(pg1)
    m(torch.randn(2, 3)).sum().backward()
    z.step()
    with pytest.warns(UserWarning, match="1 step"):
        z.state_dict()


# --------------------------------------------------------------------------- multi process


@pytest.fixture(scope="module", params=["gloo", "ft"])
def trained(request, backend_ranks):
    """One 3-rank run per backend: the equivalence runs, then the consolidate/save run."""
    backend = request.param
    out, files = backend_ranks("train", WORLD, backend, f"zero-{backend}", timeout=180)
    results = [torch.load(f, weights_only=True) for f in files]
    for f in files:
        f.unlink()
    return backend, out, results


def test_equivalence_with_torch(trained):
    """ft's and torch's ZeroRedundancyOptimizer, 3 ranks, same seed and data, 10 steps, Adam
    and SGD with momentum, with and without parameters_as_bucket_view: bitwise-identical
    parameters (tolerance 0: both run the same local optimizer kernels on the same shards)."""
    _, _, results = trained
    results = [res["equiv"] for res in results]
    combos = [k for k in results[0] if k != "memory"]
    assert len(combos) == 4
    for combo in combos:
        for r, res in enumerate(results):
            c = res[combo]
            assert c["same_partition"], f"{combo} rank {r}: partition differs from torch's"
            assert c["equal"], f"{combo} rank {r}: max |diff| {c['max_abs_diff']}"
            assert c["ft_state_bytes"] == c["torch_state_bytes"], combo
            assert c["lr_exposed"] == c["lr_local"] == c["lr_expected"]
        assert len({res[combo]["digest"] for res in results}) == 1, f"{combo}: ranks differ"
    # Optimizer state per rank vs plain Adam on a model the partition balances exactly.
    mem = [res["memory"] for res in results]
    total = sum(m["zero"] for m in mem)
    assert total == mem[0]["plain"]
    for m in mem:
        assert m["zero"] <= m["plain"] * (1 / WORLD + 0.05)


def test_consolidate_and_resume(trained, ranks):
    """consolidate(to=1)/state_dict equals torch's; resuming from it in fresh processes gives
    a bitwise-identical next step (ft and torch ZeRO, either dict, and a plain Adam)."""
    backend, out, results = trained
    saved = [res["save"] for res in results]
    for r, res in enumerate(saved):
        assert res["mismatch_error"] and "disagree on the parameters" in res["mismatch_error"], r
        assert "consolidate_state_dict(to=" in res["before_error"]
        if r == 1:
            assert res["groups_equal"] and res["state_keys_equal"] and res["state_equal"]
        else:
            assert "not been consolidated on this rank" in res["other_rank_error"]
    resumed = [
        torch.load(f, weights_only=True) for f in ranks("resume", WORLD, out, backend=backend)
    ]
    reference = saved[0]["next"]
    for r, res in enumerate(resumed):
        for label in ("ft<-ft", "torch<-ft", "ft<-torch") + (("plain",) if r == 0 else ()):
            got = res[label]
            for k in reference:
                assert torch.equal(got[k], reference[k]), f"rank {r} {label} {k}"


@pytest.mark.parametrize("bucket", [False, True])
def test_trainability_change_rebuilds_plan(pg1, bucket):
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    za = ZeroRedundancyOptimizer(
        a.parameters(), torch.optim.SGD, parameters_as_bucket_view=bucket, lr=0.1, momentum=0.9
    )
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        for m in (a, b):
            m[0].weight.requires_grad_(i % 2 == 0)  # freeze, then unfreeze
        x = torch.randn(3, 4)
        for m, o in ((a, za), (b, ob)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
