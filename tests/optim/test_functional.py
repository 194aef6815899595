"""ft.optim.functional against torch.optim: same steps, bit for bit.

Every comparison is bitwise (torch.equal): the functional forms call torch's own kernels with
the same hyperparameters, state and foreach/fused choice, so there is no rounding to allow for.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch

from ft.optim import functional as F

STEPS = 4
SHAPES = [(5, 3), (7,)]

# (torch class, ft functional class, constructor kwargs shared by both). Each optimizer's
# usual options: weight decay, momentum, nesterov, amsgrad, centered, maximize, ...
CLASS_CASES = [
    (torch.optim.Adam, F.FunctionalAdam, dict(lr=0.1)),
    (torch.optim.Adam, F.FunctionalAdam, dict(lr=0.1, weight_decay=0.1, amsgrad=True)),
    (torch.optim.Adam, F.FunctionalAdam, dict(lr=0.05, betas=(0.8, 0.9), maximize=True)),
    (torch.optim.AdamW, F.FunctionalAdamW, dict(lr=0.1)),
    (
        torch.optim.AdamW,
        F.FunctionalAdamW,
        dict(lr=0.1, weight_decay=0.5, amsgrad=True, maximize=True),
    ),
    (torch.optim.SGD, F.FunctionalSGD, dict(lr=0.1)),
    (torch.optim.SGD, F.FunctionalSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
    (torch.optim.SGD, F.FunctionalSGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    (torch.optim.SGD, F.FunctionalSGD, dict(lr=0.1, momentum=0.9, dampening=0.5)),
    (torch.optim.RMSprop, F.FunctionalRMSprop, dict(lr=0.01)),
    (
        torch.optim.RMSprop,
        F.FunctionalRMSprop,
        dict(lr=0.01, momentum=0.9, centered=True, weight_decay=0.1),
    ),
    (torch.optim.RMSprop, F.FunctionalRMSprop, dict(lr=0.01, alpha=0.9, maximize=True)),
    (torch.optim.Adagrad, F.FunctionalAdagrad, dict(lr=0.1)),
    (
        torch.optim.Adagrad,
        F.FunctionalAdagrad,
        dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.5, maximize=True),
    ),
    (torch.optim.Adadelta, F.FunctionalAdadelta, dict(lr=1.0)),
    (
        torch.optim.Adadelta,
        F.FunctionalAdadelta,
        dict(lr=0.5, rho=0.8, weight_decay=0.1, maximize=True),
    ),
    (torch.optim.Adamax, F.FunctionalAdamax, dict(lr=0.01)),
    (torch.optim.Adamax, F.FunctionalAdamax, dict(lr=0.01, weight_decay=0.1, maximize=True)),
    (torch.optim.Rprop, F.FunctionalRprop, dict(lr=0.01)),
    (
        torch.optim.Rprop,
        F.FunctionalRprop,
        dict(lr=0.01, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0), maximize=True),
    ),
]

# The optimizers with a fused CPU kernel: (torch class, ft class, kwargs).
FUSED_CASES = [
    (torch.optim.Adam, F.FunctionalAdam, dict(lr=0.1, weight_decay=0.1, amsgrad=True)),
    (torch.optim.AdamW, F.FunctionalAdamW, dict(lr=0.1, maximize=True)),
    (torch.optim.SGD, F.FunctionalSGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (torch.optim.Adagrad, F.FunctionalAdagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1)),
]


def _case_id(case: Any) -> str:
    cls, _, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def _params(seed: int = 0) -> List[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int, with_gaps: bool) -> List[Optional[torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    grads: List[Optional[torch.Tensor]] = [torch.randn(s, generator=g) for s in SHAPES]
    if with_gaps and step == 2:
        grads[1] = None  # a parameter without a gradient is skipped by both
    return grads


def _assert_same(
    ref_params: List[torch.Tensor],
    params: List[torch.Tensor],
    ref_state: Any,
    state: Dict[torch.Tensor, Dict[str, torch.Tensor]],
) -> None:
    for i, (rp, p) in enumerate(zip(ref_params, params)):
        assert torch.equal(rp, p), f"param {i} differs"
        want = dict(ref_state.get(rp, {}))
        got = state.get(p, {})
        assert sorted(want) == sorted(got), f"param {i} state keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert want[k].dtype == got[k].dtype and want[k].device == got[k].device, (i, k)
            assert torch.equal(want[k], got[k]), f"param {i} state {k!r} differs"


def _run_torch(cls: type, kw: Dict[str, Any], with_gaps: bool) -> Any:
    params = _params()
    opt = cls(params, **kw)
    for s in range(STEPS):
        for p, g in zip(params, _grads(s, with_gaps)):
            p.grad = None if g is None else g.clone()
        opt.step()
    return params, opt.state


@pytest.mark.parametrize("mode", ["step", "step_param", "as_functional_optim"])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", CLASS_CASES, ids=_case_id)
def test_object_matches_torch(case: Any, foreach: bool, mode: str) -> None:
    torch_cls, ft_cls, kw = case
    kw = dict(kw, foreach=foreach)
    ref_params, ref_state = _run_torch(torch_cls, kw, with_gaps=True)

    params = _params()
    if mode == "step":
        opt = ft_cls(params, **kw)
    elif mode == "step_param":
        opt = ft_cls([], **kw, _allow_empty_param_list=True)
    else:
        opt = F.as_functional_optim(torch_cls, **kw)
        assert type(opt) is ft_cls
    for s in range(STEPS):
        grads = [None if g is None else g.clone() for g in _grads(s, with_gaps=True)]
        if mode == "step":
            opt.step(grads)
        else:
            for p, g in zip(params, grads):
                opt.step_param(p, g)
        assert all(p.grad is None for p in params)  # gradients are explicit, never .grad
    _assert_same(ref_params, params, ref_state, opt.state)


@pytest.mark.parametrize("case", FUSED_CASES, ids=_case_id)
def test_fused_object_matches_torch(case: Any) -> None:
    torch_cls, ft_cls, kw = case
    kw = dict(kw, fused=True)
    ref_params, ref_state = _run_torch(torch_cls, kw, with_gaps=False)
    params = _params()
    opt = ft_cls(params, **kw)
    for s in range(STEPS):
        opt.step(_grads(s, with_gaps=False))
    _assert_same(ref_params, params, ref_state, opt.state)


# ------------------------------------------------------------- the stateless functions


def _zeros(ps: List[torch.Tensor]) -> List[torch.Tensor]:
    return [torch.zeros_like(p) for p in ps]


def _steps(ps: List[torch.Tensor]) -> List[torch.Tensor]:
    return [torch.tensor(0.0) for _ in ps]


def _full(ps: List[torch.Tensor], v: float) -> List[torch.Tensor]:
    return [torch.full_like(p, v) for p in ps]


def _nones(ps: List[torch.Tensor]) -> List[Any]:
    return [None] * len(ps)


def _empty(ps: List[torch.Tensor]) -> List[Any]:
    return []


def _accumulators(v: float) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    return lambda ps: _full(ps, v)


def _torch_key(state_list: str) -> str:
    """The torch state key a function's state list holds (exp_avgs: exp_avg)."""
    other = dict(state_steps="step", state_sums="sum", momentum_buffer_list="momentum_buffer")
    return other.get(state_list, state_list[:-1])


# (name, ft function, torch class, class kwargs, function kwargs (None: the class kwargs),
#  {state list name: its initial value from the parameters; an empty list: torch keeps none})
FN_CASES: List[Any] = [
    (
        "adam",
        F.functional_adam,
        torch.optim.Adam,
        dict(lr=0.1, weight_decay=0.1, amsgrad=True, maximize=True),
        dict(
            lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, amsgrad=True, maximize=True
        ),
        dict(exp_avgs=_zeros, exp_avg_sqs=_zeros, max_exp_avg_sqs=_zeros, state_steps=_steps),
    ),
    (
        "adamw",
        F.functional_adamw,
        torch.optim.AdamW,
        dict(lr=0.1, weight_decay=0.3),
        dict(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.3),
        dict(exp_avgs=_zeros, exp_avg_sqs=_zeros, max_exp_avg_sqs=_empty, state_steps=_steps),
    ),
    (
        "sgd",
        F.functional_sgd,
        torch.optim.SGD,
        dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
        None,
        dict(momentum_buffer_list=_nones),
    ),
    (
        "sgd-no-momentum",
        F.functional_sgd,
        torch.optim.SGD,
        dict(lr=0.1, maximize=True),
        None,
        dict(momentum_buffer_list=_empty),
    ),
    (
        "rmsprop",
        F.functional_rmsprop,
        torch.optim.RMSprop,
        dict(lr=0.01, momentum=0.5, centered=True, weight_decay=0.1, maximize=True),
        None,
        dict(square_avgs=_zeros, grad_avgs=_zeros, momentum_buffer_list=_zeros, state_steps=_steps),
    ),
    (
        "adagrad",
        F.functional_adagrad,
        torch.optim.Adagrad,
        dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.25),
        dict(lr=0.1, lr_decay=0.01),
        dict(state_sums=_accumulators(0.25), state_steps=_steps),
    ),
    (
        "adadelta",
        F.functional_adadelta,
        torch.optim.Adadelta,
        dict(lr=0.5, weight_decay=0.1),
        None,
        dict(square_avgs=_zeros, acc_deltas=_zeros, state_steps=_steps),
    ),
    (
        "adamax",
        F.functional_adamax,
        torch.optim.Adamax,
        dict(lr=0.01, maximize=True),
        None,
        dict(exp_avgs=_zeros, exp_infs=_zeros, state_steps=_steps),
    ),
    (
        "rprop",
        F.functional_rprop,
        torch.optim.Rprop,
        dict(lr=0.01, etas=(0.4, 1.3)),
        dict(etaminus=0.4, etaplus=1.3),
        dict(prevs=_zeros, step_sizes=_accumulators(0.01), state_steps=_steps),
    ),
]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", FN_CASES, ids=[c[0] for c in FN_CASES])
def test_function_matches_torch(case: Any, foreach: bool) -> None:
    _, fn, torch_cls, cls_kw, fn_kw, initial = case
    ref_params, ref_state = _run_torch(torch_cls, dict(cls_kw, foreach=foreach), False)

    params = _params()
    lists = {name: make(params) for name, make in initial.items()}
    for s in range(STEPS):
        fn(params, _grads(s, with_gaps=False), **lists, **(fn_kw or cls_kw), foreach=foreach)
    state = {
        p: {_torch_key(name): values[i] for name, values in lists.items() if values}
        for i, p in enumerate(params)
    }
    _assert_same(ref_params, params, ref_state, state)


# ------------------------------------------------------------- errors


def _torch_as_functional_optim() -> Callable[..., Any]:
    # torch's functional optimizers are TorchScript classes that warn on import/construction.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.optim import as_functional_optim

    return as_functional_optim


@pytest.mark.parametrize(
    "bad",
    [torch.optim.NAdam, torch.optim.LBFGS, "Adam", []],
    ids=["NAdam", "LBFGS", "str", "unhashable"],
)
def test_unsupported_class_error_type_matches_torch(bad: Any) -> None:
    torch_fn = _torch_as_functional_optim()
    with pytest.raises(Exception) as want:
        torch_fn(bad)
    with pytest.raises(Exception) as got:
        F.as_functional_optim(bad)
    assert type(got.value) is type(want.value)


def test_register_functional_optim() -> None:
    class MySGD(torch.optim.SGD):
        pass

    with pytest.raises(ValueError, match="does not have a functional counterpart"):
        F.as_functional_optim(MySGD)  # a subclass is not its parent
    F.register_functional_optim(MySGD, F.FunctionalSGD)
    try:
        opt = F.as_functional_optim(MySGD, 0.5, momentum=0.1)  # positional args as torch's
        assert isinstance(opt, F.FunctionalSGD)
        assert opt.defaults["lr"] == 0.5 and opt.defaults["momentum"] == 0.1
        assert opt.param_group == {"params": []} and opt.state == {}
    finally:
        F._FUNCTIONAL_OPTIMS.pop(MySGD)


def test_contract_errors() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="empty parameter list"):
        F.FunctionalAdam([])
    with pytest.raises(ValueError, match="Invalid learning rate"):
        F.FunctionalAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="Params length: 1. Gradients length: 2"):
        F.FunctionalSGD([p]).step([torch.ones(3), torch.ones(3)])
    with pytest.raises(ValueError, match="exp_avg_sqs has 0 entries but there are 1 params"):
        F.functional_adam(
            [p],
            [torch.ones(3)],
            [torch.zeros(3)],
            [],
            [],
            [torch.tensor(0.0)],
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
        )
    with pytest.raises(ValueError, match=r"grads\[0\] is None"):
        F.functional_sgd([p], [None], [None], lr=0.1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="nesterov needs momentum > 0"):
        F.functional_sgd([p], [torch.ones(3)], [None], lr=0.1, nesterov=True)
    before = p.detach().clone()
    opt = F.as_functional_optim(torch.optim.Adam, lr=0.1)
    opt.step_param(p, None)  # no gradient: nothing happens, no state
    assert torch.equal(p, before) and opt.state == {}
