"""ft.optim.in_backward: optimizer steps in post-accumulate-grad hooks, provisional under an
ft.Manager until commit_in_backward.

Every comparison is bitwise (torch.equal): an in-backward step runs the same optimizer code on
the same gradient as a normal step (the single-replica allreduce divides by 1).
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import pytest
import torch

from ft.optim.in_backward import (
    _apply_optimizer_in_backward,
    _get_in_backward_optimizers,
    apply_optimizer_in_backward,
    commit_in_backward,
    get_in_backward_optimizers,
    rollback_in_backward,
    step_in_backward,
)
from tests.manager.inproc import in_threads, lighthouse, make_manager, replica_managers, on_each

OPTIMS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01, amsgrad=True, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=0.01, foreach=True, maximize=True)),
    (torch.optim.AdamW, dict(lr=0.01)),
    (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, centered=True)),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01)),
]


def _id(case: Any) -> str:
    cls, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(step: int, replica: int = 0) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1000 * replica + step))


def _loss(model: torch.nn.Module, step: int, replica: int = 0) -> torch.Tensor:
    return model(_batch(step, replica)).pow(2).sum()


def _reference(
    cls: type, kw: Dict[str, Any], steps: List[int], replica: int = 0
) -> torch.nn.Module:
    """A normal optimizer's result after stepping on the batches ``steps``."""
    ref = _model()
    opt = cls(ref.parameters(), **kw)
    for s in steps:
        opt.zero_grad()
        _loss(ref, s, replica).backward()
        opt.step()
    return ref


def _capture(model: torch.nn.Module) -> List[Tuple[torch.Tensor, List[Dict[str, Any]]]]:
    """Every parameter and its in-backward optimizers' state, copied."""
    out = []
    for p in model.parameters():
        states = [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
            if p in opt.state
            else None
            for opt in p._in_backward_optimizers
        ]
        out.append((p.detach().clone(), states))
    return out


def _assert_same_capture(want: Any, got: Any) -> None:
    for i, ((wp, ws), (gp, gs)) in enumerate(zip(want, got)):
        assert torch.equal(wp, gp), f"param {i} differs"
        assert len(ws) == len(gs)
        for w, g in zip(ws, gs):
            assert (w is None) == (g is None), f"param {i}: state presence differs"
            if w is None:
                continue
            assert sorted(w) == sorted(g), f"param {i}: state keys differ"
            for k in w:
                if isinstance(w[k], torch.Tensor):
                    assert torch.equal(w[k], g[k]), f"param {i}: state {k!r} differs"
                else:
                    assert w[k] == g[k], f"param {i}: state {k!r} differs"


def _assert_params_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for i, (pa, pb) in enumerate(zip(a.parameters(), b.parameters())):
        assert torch.equal(pa, pb), f"param {i} differs"


# ------------------------------------------------------------- without a manager (torch's API)


@pytest.mark.parametrize("case", OPTIMS, ids=_id)
def test_matches_normal_step(case: Any) -> None:
    cls, kw = case
    model = _model()
    apply_optimizer_in_backward(cls, model.parameters(), kw)
    for s in range(3):
        _loss(model, s).backward()
        assert all(p.grad is None for p in model.parameters())  # consumed by the hooks
    _assert_params_equal(_reference(cls, kw, [0, 1, 2]), model)


def test_torch_names_and_attributes() -> None:
    with warnings.catch_warnings():  # torch.distributed.optim's TorchScript deprecations
        warnings.simplefilter("ignore")
        from torch.distributed.optim import _get_in_backward_optimizers as torch_get

    model = _model()
    params = list(model.parameters())
    _apply_optimizer_in_backward(torch.optim.SGD, params[:1], {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adam, params[1:], {"lr": 0.01})
    apply_optimizer_in_backward(torch.optim.SGD, params[3:], {"lr": 0.2})  # a second optimizer
    optims = get_in_backward_optimizers(model)
    assert _get_in_backward_optimizers is get_in_backward_optimizers
    # torch's helper reads the same attributes, so it sees the same optimizers
    assert optims == torch_get(model)
    assert [type(o).__name__ for o in optims] == ["SGD", "Adam", "Adam", "Adam", "SGD"]
    assert params[3]._optimizer_classes == [torch.optim.Adam, torch.optim.SGD]
    assert params[3]._optimizer_kwargs == [{"lr": 0.01}, {"lr": 0.2}]

    before = params[3].detach().clone()
    _loss(model, 0).backward()
    # both optimizers of params[3] ran, on the same gradient
    g = before.clone().requires_grad_(True)
    ref_model = _model()
    _loss(ref_model, 0).backward()
    grad = list(ref_model.parameters())[3].grad
    adam = torch.optim.Adam([g], lr=0.01)
    g.grad = grad.clone()
    adam.step()
    sgd = torch.optim.SGD([g], lr=0.2)
    sgd.step()
    assert torch.equal(g.detach(), params[3].detach())


def test_register_hook_false_leaves_the_step_to_the_caller() -> None:
    model = _model()
    apply_optimizer_in_backward(
        torch.optim.SGD, model.parameters(), {"lr": 0.1}, register_hook=False
    )
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is not None for p in model.parameters())
    for p in model.parameters():
        step_in_backward(p)
    assert all(p.grad is None for p in model.parameters())
    _assert_params_equal(_reference(torch.optim.SGD, {"lr": 0.1}, [0]), model)


def test_errors() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"params\[0\] is not a leaf tensor that requires grad"):
        apply_optimizer_in_backward(torch.optim.SGD, [torch.ones(2)], {"lr": 0.1})
    with pytest.raises(ValueError, match="none of the parameters"):
        commit_in_backward(model, manager=object())  # type: ignore[arg-type]
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    with pytest.raises(ValueError, match="without manager=, so its hook already updated it"):
        rollback_in_backward(model)
    with pytest.raises(ValueError, match="must share one manager"):
        apply_optimizer_in_backward(
            torch.optim.SGD, model.parameters(), {"lr": 0.1}, manager=object()
        )  # type: ignore[arg-type]


class _Done:
    def wait(self) -> bool:
        return True


class _StandInManager:
    """Stand-in for ft.Manager, used only where a real one cannot be made to act so cheaply:
    should_commit raising. The real-Manager tests below cover commit and rollback."""

    def wait_quorum(self) -> None:
        pass

    def allreduce(self, t: torch.Tensor) -> _Done:
        return _Done()

    def is_participating(self) -> bool:
        return True

    def should_commit(self, timeout: Any = None) -> bool:
        raise RuntimeError("should_commit failed 3 times in a row, exceeding max_retries=2")


def test_should_commit_raising_rolls_back() -> None:
    m = _StandInManager()
    model = _model()
    apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), {"lr": 0.01}, manager=m)  # type: ignore[arg-type]
    before = _capture(model)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="max_retries"):
        commit_in_backward(model, m)  # type: ignore[arg-type]
    _assert_same_capture(before, _capture(model))
    with pytest.raises(ValueError, match="not to the manager given"):
        commit_in_backward(model, _StandInManager())  # type: ignore[arg-type]


# ------------------------------------------------------------- with a real ft.Manager


@pytest.fixture(scope="module")
def manager():
    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "inbw", use_async_quorum=False)
    yield m
    m.shutdown()
    lh.shutdown()


@pytest.mark.parametrize("case", OPTIMS, ids=_id)
def test_committed_steps_match_normal_steps(manager: Any, case: Any) -> None:
    cls, kw = case
    model = _model()
    apply_optimizer_in_backward(cls, model.parameters(), kw, manager=manager)
    for s in range(3):
        step0 = manager.current_step()
        before = _capture(model)
        manager.start_quorum()
        _loss(model, s).backward()
        assert all(p.grad is None for p in model.parameters())
        # provisional: nothing live is written before the commit (a heal may be reading it)
        _assert_same_capture(before, _capture(model))
        assert commit_in_backward(model, manager) is True
        assert manager.current_step() == step0 + 1
    _assert_params_equal(_reference(cls, kw, [0, 1, 2]), model)


def test_two_backwards_in_one_step(manager: Any) -> None:
    # Each backward steps the step's copy further; both gradients are taken at the parameters
    # as they were before the step (they change at the commit).
    kw = dict(lr=0.1, momentum=0.9)
    model = _model()
    apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), kw, manager=manager)
    manager.start_quorum()
    _loss(model, 0).backward()
    _loss(model, 1).backward()
    assert commit_in_backward(model, manager) is True

    ref = _model()
    grads = []
    for s in (0, 1):
        ref.zero_grad()
        _loss(ref, s).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    opt = torch.optim.SGD(ref.parameters(), **kw)
    for g in grads:
        for p, gi in zip(ref.parameters(), g):
            p.grad = gi
        opt.step()
    _assert_params_equal(ref, model)


@pytest.mark.parametrize("case", OPTIMS, ids=_id)
def test_failed_commit_leaves_params_and_state_as_before(manager: Any, case: Any) -> None:
    cls, kw = case
    model = _model()
    apply_optimizer_in_backward(cls, model.parameters(), kw, manager=manager)

    def failed_step(s: int) -> None:
        before = _capture(model)
        manager.start_quorum()
        _loss(model, s).backward()
        _loss(model, s + 100).backward()  # two backwards in one step: all of it is dropped
        manager.report_error(RuntimeError("bad batch"))  # should_commit -> False
        assert commit_in_backward(model, manager) is False
        _assert_same_capture(before, _capture(model))

    failed_step(0)  # first step: the optimizers had no state; they have none after it
    if cls is not torch.optim.Adagrad:  # (Adagrad makes its state in its constructor)
        assert all(len(o.state) == 0 for o in get_in_backward_optimizers(model))
    manager.start_quorum()
    _loss(model, 1).backward()
    assert commit_in_backward(model, manager) is True
    failed_step(2)  # with state
    manager.start_quorum()
    _loss(model, 3).backward()
    assert commit_in_backward(model, manager) is True
    _assert_params_equal(_reference(cls, kw, [1, 3]), model)  # the failed steps left no trace


def test_rollback_after_backward_raised(manager: Any) -> None:
    model = _model()
    apply_optimizer_in_backward(
        torch.optim.AdamW, model.parameters(), {"lr": 0.01}, manager=manager
    )
    before = _capture(model)
    manager.start_quorum()
    _loss(model, 0).backward()  # say a later backward of the step raised here
    manager.report_error(RuntimeError("backward failed"))
    rollback_in_backward(model)
    assert commit_in_backward(model, manager) is False  # the group skips the step too
    _assert_same_capture(before, _capture(model))
    manager.start_quorum()
    _loss(model, 1).backward()
    assert commit_in_backward(model, manager) is True
    _assert_params_equal(_reference(torch.optim.AdamW, {"lr": 0.01}, [1]), model)


def _run_replicas(
    ms: List[Any], models: List[torch.nn.Module], kw: Dict[str, Any], steps: int
) -> List[Any]:
    def run(i: int, m: Any) -> Any:
        model = models[i]
        apply_optimizer_in_backward(torch.optim.Adam, model.parameters(), kw, manager=m)
        participating = []
        for s in range(steps):
            m.start_quorum()
            _loss(model, s, replica=i).backward()
            participating.append(m.is_participating())
            assert commit_in_backward(model, m) is True
        return participating

    return on_each(ms, run)


def _averaged_reference(kw: Dict[str, Any], plan: List[List[int]]) -> torch.nn.Module:
    """Adam on the average of the replicas' gradients; plan[s]: the replicas of step s."""
    ref = _model()
    opt = torch.optim.Adam(ref.parameters(), **kw)
    for s, replicas in enumerate(plan):
        grads = []
        for r in replicas:
            ref.zero_grad()
            _loss(ref, s, replica=r).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            # the Manager's AVG: the participants' sum, divided by their number
            total = grads[0][i]
            for g in grads[1:]:
                total = total + g[i]
            p.grad = total / len(grads)
        opt.step()
    return ref


def test_spare_replica_stages_and_applies_at_commit() -> None:
    # Two replica groups, one replica per step (min_replica_size=1) plus a spare: g1 is the
    # spare, so it steps with g0's averaged gradient at the commit, not in its hooks.
    import ft

    lh = lighthouse(min_replicas=2)
    ms = replica_managers(
        lh.address(),
        2,
        min_replica_size=1,
        use_async_quorum=False,
        world_size_mode=ft.WorldSizeMode.FIXED_WITH_SPARES,
    )
    kw = dict(lr=0.01)
    models = [_model(), _model()]
    try:
        parts = _run_replicas(ms, models, kw, steps=2)
        assert parts == [[True, True], [False, False]]
        ref = _averaged_reference(kw, [[0], [0]])
        _assert_params_equal(ref, models[0])
        _assert_params_equal(ref, models[1])
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()


def test_async_heal_with_in_backward_steps() -> None:
    # g1 starts from other weights and heals from g0 at step 0 (async quorum): g0's hooks run
    # while g1 may be reading g0's state, and g1 steps only after the heal, at the commit.
    models = [_model(seed=0), _model(seed=1)]

    def fns(model: torch.nn.Module) -> Dict[str, Any]:
        def state_dict() -> Dict[str, Any]:
            return {
                "model": model.state_dict(),
                "optim": [o.state_dict() for o in get_in_backward_optimizers(model)],
            }

        def load_state_dict(sd: Dict[str, Any]) -> None:
            model.load_state_dict(sd["model"])
            for o, osd in zip(get_in_backward_optimizers(model), sd["optim"]):
                o.load_state_dict(osd)

        return dict(state_dict=state_dict, load_state_dict=load_state_dict)

    lh = lighthouse(min_replicas=2)
    ms = replica_managers(lh.address(), 2, lambda i: fns(models[i]), use_async_quorum=True)
    kw = dict(lr=0.01, weight_decay=0.1)
    try:
        parts = _run_replicas(ms, models, kw, steps=3)
        assert parts == [[True, True, True], [False, True, True]]  # g1 healed at step 0
        ref = _averaged_reference(kw, [[0], [0, 1], [0, 1]])
        _assert_params_equal(ref, models[0])
        _assert_params_equal(ref, models[1])
        for o0, o1 in zip(*(get_in_backward_optimizers(m) for m in models)):
            for p0, p1 in zip(o0.state.values(), o1.state.values()):
                assert all(torch.equal(p0[k], p1[k]) for k in p0)
    finally:
        in_threads([lambda m=m: m.shutdown() for m in ms])
        lh.shutdown()
