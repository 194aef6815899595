"""Functional optimizers: one optimizer step from explicit parameters, gradients and state.

Two layers, both matching ``torch.distributed.optim``:

- ``functional_adam``, ``functional_adamw``, ``functional_sgd``, ``functional_rmsprop``,
  ``functional_adagrad``, ``functional_adadelta``, ``functional_adamax``, ``functional_rprop``:
  stateless updates. Each takes lists of parameters, gradients and state tensors, checks that
  the lists line up, and applies one step in place through torch's public functional entry
  point (``torch.optim.adam.adam``, ...), so the arithmetic is torch's own and a step equals
  the matching ``torch.optim`` class's step bit for bit.
- :func:`as_functional_optim` (``torch.distributed.optim.as_functional_optim``): a functional
  optimizer *object* for a ``torch.optim`` class, which keeps its own per-parameter state and
  is stepped with explicit gradients: ``step_param(param, grad)`` or ``step(gradients)``.
  The objects (:class:`FunctionalAdam`, ...) take the constructor arguments, in the same
  order, of torch's private ``_FunctionalAdam``, ... and expose the same ``defaults``,
  ``param_group`` and ``state``.

Contract:
    - ``as_functional_optim(cls, *args, **kwargs)`` builds the functional counterpart of ``cls``
      (Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, Adamax, Rprop, or a class added with
      :func:`register_functional_optim`) with an empty parameter list; an unknown class raises
      :class:`ValueError` (an unhashable argument :class:`TypeError`), as torch does.
    - ``step_param(param, grad)`` updates one parameter (state created on first use, for any
      parameter); ``grad=None`` is a no-op. ``step(gradients)`` updates
      ``param_group["params"]`` with one gradient (or None) each; a length mismatch raises
      :class:`ValueError`.
    - For the same hyperparameters, state and ``foreach``/``fused`` choice, one step equals one
      ``torch.optim`` step bitwise (tests/optim/test_functional.py).
    - All updates run under ``torch.no_grad()`` and never read or write ``param.grad``.

What ft adds over torch's versions: the objects are plain Python (torch's are TorchScript
classes that warn about the deprecation on every construction), every one has
``step_param`` (torch has it only for Adam, AdamW and SGD), a ``fused`` ``step`` tensor is
created on the parameter's device as the ``torch.optim`` classes do, and mismatched lists raise
an error naming the list instead of being silently truncated by ``zip``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

# torch's public functional forms of the optimizers: the arithmetic below is torch's own.
from torch.optim.adadelta import adadelta as _adadelta
from torch.optim.adagrad import adagrad as _adagrad
from torch.optim.adam import adam as _adam
from torch.optim.adamax import adamax as _adamax
from torch.optim.adamw import adamw as _adamw
from torch.optim.rmsprop import rmsprop as _rmsprop
from torch.optim.rprop import rprop as _rprop
from torch.optim.sgd import sgd as _sgd

__all__ = [
    "as_functional_optim",
    "register_functional_optim",
    "registered_functional_optim",
    "registered_functional_classes",
    "FunctionalOptimizer",
    "functional_adam",
    "functional_adamw",
    "functional_sgd",
    "functional_rmsprop",
    "functional_adagrad",
    "functional_adadelta",
    "functional_adamax",
    "functional_rprop",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalSGD",
    "FunctionalRMSprop",
    "FunctionalAdagrad",
    "FunctionalAdadelta",
    "FunctionalAdamax",
    "FunctionalRprop",
]


# ------------------------------------------------------------------ checks shared by all


def _check_lists(fn: str, params: Sequence[Tensor], **lists: Sequence[Any]) -> None:
    """Every state list must have one entry per parameter: zip() would silently drop extras."""
    n = len(params)
    for name, values in lists.items():
        if len(values) != n:
            raise ValueError(
                f"{fn}: {name} has {len(values)} entries but there are {n} params; "
                f"pass one per parameter"
            )
    for i, g in enumerate(lists.get("grads", ())):
        if g is None:
            raise ValueError(
                f"{fn}: grads[{i}] is None; pass only the parameters that have a gradient"
            )


def _has_complex(params: Sequence[Tensor]) -> bool:
    return any(torch.is_complex(p) for p in params)


def _has_sparse(grads: Sequence[Tensor]) -> bool:
    return any(g.is_sparse for g in grads)


# ------------------------------------------------------------------ stateless updates


def functional_adam(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> None:
    """One Adam step in place (``torch.optim.Adam``); ``state_steps`` are scalar tensors.

    ``max_exp_avg_sqs`` has one tensor per parameter with ``amsgrad``, else is empty.
    """
    _check_lists(
        "functional_adam",
        params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        state_steps=state_steps,
    )
    if amsgrad:
        _check_lists("functional_adam", params, max_exp_avg_sqs=max_exp_avg_sqs)
    if not params:
        return
    with torch.no_grad():
        _adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            foreach=foreach,
            fused=fused,
            has_complex=_has_complex(params),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
        )


def functional_adamw(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_avg_sqs: List[Tensor],
    max_exp_avg_sqs: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> None:
    """One AdamW step (decoupled weight decay) in place; lists as :func:`functional_adam`."""
    _check_lists(
        "functional_adamw",
        params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        state_steps=state_steps,
    )
    if amsgrad:
        _check_lists("functional_adamw", params, max_exp_avg_sqs=max_exp_avg_sqs)
    if not params:
        return
    with torch.no_grad():
        _adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            foreach=foreach,
            fused=fused,
            has_complex=_has_complex(params),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
        )


def functional_sgd(
    params: List[Tensor],
    grads: List[Tensor],
    momentum_buffer_list: List[Optional[Tensor]],
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> None:
    """One SGD step in place (``torch.optim.SGD``).

    With ``momentum != 0``, ``momentum_buffer_list`` has one entry per parameter; a None entry
    is replaced, in the list, by the new buffer (keep it for the next step). Otherwise it is
    ignored (pass an empty list, as torch.optim.SGD does).
    """
    _check_lists("functional_sgd", params, grads=grads)
    if momentum != 0:
        _check_lists("functional_sgd", params, momentum_buffer_list=momentum_buffer_list)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("functional_sgd: nesterov needs momentum > 0 and dampening == 0")
    if not params:
        return
    with torch.no_grad():
        _sgd(
            params,
            grads,
            momentum_buffer_list,
            has_sparse_grad=_has_sparse(grads),
            foreach=foreach,
            fused=fused,
            weight_decay=weight_decay,
            momentum=momentum,
            lr=lr,
            dampening=dampening,
            nesterov=nesterov,
            maximize=maximize,
        )


def functional_rmsprop(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    grad_avgs: List[Tensor],
    momentum_buffer_list: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
    maximize: bool = False,
    foreach: Optional[bool] = None,
) -> None:
    """One RMSprop step in place. ``grad_avgs`` is used only with ``centered`` and
    ``momentum_buffer_list`` only with ``momentum > 0`` (pass empty lists otherwise)."""
    fn = "functional_rmsprop"
    _check_lists(fn, params, grads=grads, square_avgs=square_avgs, state_steps=state_steps)
    if centered:
        _check_lists(fn, params, grad_avgs=grad_avgs)
    if momentum > 0:
        _check_lists(fn, params, momentum_buffer_list=momentum_buffer_list)
    if not params:
        return
    with torch.no_grad():
        _rmsprop(
            params,
            grads,
            square_avgs,
            grad_avgs,
            momentum_buffer_list,
            state_steps,
            foreach=foreach,
            maximize=maximize,
            has_complex=_has_complex(params),
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
        )


def functional_adagrad(
    params: List[Tensor],
    grads: List[Tensor],
    state_sums: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    eps: float = 1e-10,
    maximize: bool = False,
    foreach: Optional[bool] = None,
    fused: Optional[bool] = None,
) -> None:
    """One Adagrad step in place; ``state_sums`` start at ``initial_accumulator_value``."""
    _check_lists(
        "functional_adagrad", params, grads=grads, state_sums=state_sums, state_steps=state_steps
    )
    if not params:
        return
    with torch.no_grad():
        _adagrad(
            params,
            grads,
            state_sums,
            state_steps,
            fused=fused,
            has_sparse_grad=_has_sparse(grads),
            foreach=foreach,
            has_complex=_has_complex(params),
            lr=lr,
            weight_decay=weight_decay,
            lr_decay=lr_decay,
            eps=eps,
            maximize=maximize,
        )


def functional_adadelta(
    params: List[Tensor],
    grads: List[Tensor],
    square_avgs: List[Tensor],
    acc_deltas: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float = 1.0,
    rho: float = 0.9,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    maximize: bool = False,
    foreach: Optional[bool] = None,
) -> None:
    """One Adadelta step in place."""
    _check_lists(
        "functional_adadelta",
        params,
        grads=grads,
        square_avgs=square_avgs,
        acc_deltas=acc_deltas,
        state_steps=state_steps,
    )
    if not params:
        return
    with torch.no_grad():
        _adadelta(
            params,
            grads,
            square_avgs,
            acc_deltas,
            state_steps,
            foreach=foreach,
            has_complex=_has_complex(params),
            lr=lr,
            rho=rho,
            eps=eps,
            weight_decay=weight_decay,
            maximize=maximize,
        )


def functional_adamax(
    params: List[Tensor],
    grads: List[Tensor],
    exp_avgs: List[Tensor],
    exp_infs: List[Tensor],
    state_steps: List[Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    maximize: bool = False,
    foreach: Optional[bool] = None,
) -> None:
    """One Adamax step in place."""
    _check_lists(
        "functional_adamax",
        params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_infs=exp_infs,
        state_steps=state_steps,
    )
    if not params:
        return
    with torch.no_grad():
        _adamax(
            params,
            grads,
            exp_avgs,
            exp_infs,
            state_steps,
            foreach=foreach,
            maximize=maximize,
            has_complex=_has_complex(params),
            eps=eps,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
        )


def functional_rprop(
    params: List[Tensor],
    grads: List[Tensor],
    prevs: List[Tensor],
    step_sizes: List[Tensor],
    state_steps: List[Tensor],
    *,
    step_size_min: float = 1e-6,
    step_size_max: float = 50.0,
    etaminus: float = 0.5,
    etaplus: float = 1.2,
    maximize: bool = False,
    foreach: Optional[bool] = None,
) -> None:
    """One Rprop step in place; ``step_sizes`` start filled with the learning rate."""
    _check_lists(
        "functional_rprop",
        params,
        grads=grads,
        prevs=prevs,
        step_sizes=step_sizes,
        state_steps=state_steps,
    )
    if not params:
        return
    with torch.no_grad():
        _rprop(
            params,
            grads,
            prevs,
            step_sizes,
            state_steps,
            foreach=foreach,
            maximize=maximize,
            has_complex=_has_complex(params),
            step_size_min=step_size_min,
            step_size_max=step_size_max,
            etaminus=etaminus,
            etaplus=etaplus,
        )


# ------------------------------------------------------------------ stateful objects


def _check_range(name: str, value: float, ok: bool) -> None:
    if not ok:
        raise ValueError(f"Invalid {name}: {value}")


def _check_adam_like(
    lr: float, betas: Tuple[float, float], eps: float, weight_decay: float
) -> None:
    _check_range("learning rate", lr, 0.0 <= lr)
    _check_range("epsilon value", eps, 0.0 <= eps)
    _check_range("beta parameter at index 0", betas[0], 0.0 <= betas[0] < 1.0)
    _check_range("beta parameter at index 1", betas[1], 0.0 <= betas[1] < 1.0)
    _check_range("weight_decay value", weight_decay, 0.0 <= weight_decay)


def _step_tensor(param: Tensor, on_device: bool) -> Tensor:
    # As torch.optim: a fused kernel reads ``step`` on the parameter's device (float32);
    # otherwise ``step`` stays a CPU scalar so that reading it costs no device sync.
    if on_device:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0)


def _zeros(param: Tensor) -> Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


class FunctionalOptimizer:
    """One param group, state keyed by parameter, stepped with explicit gradients."""

    defaults: Dict[str, Any]

    def __init__(self, params: Iterable[Tensor], allow_empty: bool) -> None:
        params = list(params)
        if not params and not allow_empty:
            raise ValueError("optimizer got an empty parameter list")
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        # One group only, as in torch: functional optimizers serve one parameter set each.
        self.param_group: Dict[str, List[Tensor]] = {"params": params}

    # What a subclass declares, so that one ``_update`` serves them all: its stateless update
    # (``functional_*`` above), the state keys whose per-parameter lists it takes, in its
    # positional order (a key the options leave out of the state, like ``max_exp_avg_sq``
    # without ``amsgrad``, is passed as an empty list, as torch.optim does), and the keyword
    # options it takes from ``defaults`` and from attributes of the same name.
    _functional: Callable[..., None]
    _state_lists: Tuple[str, ...] = ()
    _options_from_defaults: Tuple[str, ...] = ()
    _options_from_attributes: Tuple[str, ...] = ("maximize", "foreach")

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        raise NotImplementedError

    def _options(self) -> Dict[str, Any]:
        options = {k: self.defaults[k] for k in self._options_from_defaults}
        options.update((a, getattr(self, a)) for a in self._options_from_attributes)
        return options

    def _update(
        self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]]
    ) -> None:
        # Every parameter's state has the same keys: the options that decide them are fixed.
        lists = [[s[k] for s in states] if k in states[0] else [] for k in self._state_lists]
        # Through the class: ``_functional`` is a staticmethod declared by each subclass.
        type(self)._functional(params, grads, *lists, **self._options())

    def _states(self, params: List[Tensor], grads: List[Tensor]) -> List[Dict[str, Tensor]]:
        out = []
        for p, g in zip(params, grads):
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = self._init_state(p, g)
            out.append(st)
        return out

    def step_params(self, params: List[Tensor], grads: List[Tensor]) -> None:
        """Updates ``params`` (any of this optimizer's parameters) with ``grads``, creating
        their state on first use. The cost is that of ``params`` alone: ZeRO's overlapped step
        updates one DDP bucket's share at a time with it."""
        self._update(params, grads, self._states(params, grads))

    def step_param(self, param: Tensor, grad: Optional[Tensor]) -> None:
        """Updates ``param`` alone with ``grad`` (no-op for None)."""
        if grad is None:
            return
        self.step_params([param], [grad])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Updates ``param_group["params"]``; ``gradients[i]`` (or None) belongs to params[i]."""
        params = self.param_group["params"]
        gradients = list(gradients)
        if len(params) != len(gradients):
            raise ValueError(
                "the gradients passed in does not equal to the size of the parameters! "
                f"Params length: {len(params)}. Gradients length: {len(gradients)}"
            )
        with_grad = [(p, g) for p, g in zip(params, gradients) if g is not None]
        if not with_grad:
            return
        self.step_params([p for p, _ in with_grad], [g for _, g in with_grad])

    def __repr__(self) -> str:
        return f"ft.optim.{type(self).__name__}({self.defaults})"


class _AdamBase(FunctionalOptimizer):
    _state_lists = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")
    _options_from_defaults = ("lr", "beta1", "beta2", "eps", "weight_decay")
    _options_from_attributes = ("amsgrad", "maximize", "foreach", "fused")

    def __init__(
        self,
        params: List[Tensor],
        lr: float,
        betas: Tuple[float, float],
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        maximize: bool,
        foreach: bool,
        fused: bool,
        _allow_empty_param_list: bool,
    ) -> None:
        _check_adam_like(lr, betas, eps, weight_decay)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {
            "lr": lr,
            "eps": eps,
            "beta1": betas[0],
            "beta2": betas[1],
            "weight_decay": weight_decay,
        }
        self.amsgrad = amsgrad
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        st = {
            "step": _step_tensor(param, self.fused),
            "exp_avg": _zeros(param),
            "exp_avg_sq": _zeros(param),
        }
        if self.amsgrad:
            st["max_exp_avg_sq"] = _zeros(param)
        return st


class FunctionalAdam(_AdamBase):
    """Functional ``torch.optim.Adam`` (torch's ``_FunctionalAdam`` arguments)."""

    _functional = staticmethod(functional_adam)

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            foreach,
            fused,
            _allow_empty_param_list,
        )


class FunctionalAdamW(_AdamBase):
    """Functional ``torch.optim.AdamW`` (torch's ``_FunctionalAdamW`` arguments)."""

    _functional = staticmethod(functional_adamw)

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize,
            foreach,
            fused,
            _allow_empty_param_list,
        )


class FunctionalSGD(FunctionalOptimizer):
    """Functional ``torch.optim.SGD`` (torch's ``_FunctionalSGD`` arguments).

    ``state[p]`` is empty until a step with ``momentum > 0`` creates ``momentum_buffer``.
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        foreach: bool = False,
        fused: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_range("learning rate", lr, 0.0 <= lr)
        _check_range("momentum value", momentum, 0.0 <= momentum)
        _check_range("weight_decay value", weight_decay, 0.0 <= weight_decay)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "weight_decay": weight_decay,
        }
        self.nesterov = nesterov
        self.maximize = maximize
        self.foreach = foreach
        self.fused = fused

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        return {}

    def _update(
        self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]]
    ) -> None:
        d = self.defaults
        bufs: List[Optional[Tensor]] = [s.get("momentum_buffer") for s in states]
        functional_sgd(
            params,
            grads,
            bufs,
            lr=d["lr"],
            momentum=d["momentum"],
            dampening=d["dampening"],
            weight_decay=d["weight_decay"],
            nesterov=self.nesterov,
            maximize=self.maximize,
            foreach=self.foreach,
            fused=self.fused,
        )
        # The first momentum step creates the buffers inside ``bufs``; keep them.
        for s, b in zip(states, bufs):
            if b is not None:
                s["momentum_buffer"] = b


class FunctionalRMSprop(FunctionalOptimizer):
    """Functional ``torch.optim.RMSprop`` (torch's ``_FunctionalRMSprop`` arguments)."""

    _functional = staticmethod(functional_rmsprop)
    _state_lists = ("square_avg", "grad_avg", "momentum_buffer", "step")
    _options_from_defaults = ("lr", "alpha", "eps", "weight_decay", "momentum")
    _options_from_attributes = ("centered", "maximize", "foreach")

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_range("learning rate", lr, 0.0 <= lr)
        _check_range("epsilon value", eps, 0.0 <= eps)
        _check_range("alpha value", alpha, 0.0 <= alpha)
        _check_range("momentum value", momentum, 0.0 <= momentum)
        _check_range("weight_decay value", weight_decay, 0.0 <= weight_decay)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {
            "lr": lr,
            "alpha": alpha,
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum": momentum,
        }
        self.centered = centered
        self.foreach = foreach
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        st = {"step": _step_tensor(param, False), "square_avg": _zeros(param)}
        if self.defaults["momentum"] > 0:
            st["momentum_buffer"] = _zeros(param)
        if self.centered:
            st["grad_avg"] = _zeros(param)
        return st


class FunctionalAdagrad(FunctionalOptimizer):
    """Functional ``torch.optim.Adagrad`` (torch's ``_FunctionalAdagrad`` arguments).

    As in torch, the parameters given to the constructor get their state at once;
    ``warmup_lr_multiplier``, ``warmup_num_iters`` and ``coalesce_grad`` are kept in
    ``defaults``/attributes for compatibility and, as in torch, have no effect.
    """

    _functional = staticmethod(functional_adagrad)
    _state_lists = ("sum", "step")
    _options_from_defaults = ("lr", "lr_decay", "weight_decay", "eps")
    _options_from_attributes = ("maximize", "foreach", "fused")

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        warmup_lr_multiplier: float = 1.0,
        warmup_num_iters: float = 0.0,
        eps: float = 1e-10,
        coalesce_grad: bool = True,
        foreach: bool = False,
        fused: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_range("learning rate", lr, 0.0 <= lr)
        _check_range("lr_decay value", lr_decay, 0.0 <= lr_decay)
        _check_range("weight_decay value", weight_decay, 0.0 <= weight_decay)
        _check_range(
            "initial_accumulator_value value",
            initial_accumulator_value,
            0.0 <= initial_accumulator_value,
        )
        _check_range("epsilon value", eps, 0.0 <= eps)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {
            "lr": lr,
            "lr_decay": lr_decay,
            "eps": eps,
            "weight_decay": weight_decay,
            "initial_accumulator_value": initial_accumulator_value,
            "warmup_lr_multiplier": warmup_lr_multiplier,
            "warmup_num_iters": warmup_num_iters,
        }
        self.coalesce_grad = coalesce_grad
        self.foreach = foreach
        self.fused = fused
        self.maximize = maximize
        for p in self.param_group["params"]:
            self.state[p] = self._init_state(p, p)

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        init = self.defaults["initial_accumulator_value"]
        # A complex parameter is two real ones: both halves start at the accumulator value.
        value = complex(init, init) if torch.is_complex(param) else init
        return {
            "step": _step_tensor(param, self.fused),
            "sum": torch.full_like(param, value, memory_format=torch.preserve_format),
        }


class FunctionalAdadelta(FunctionalOptimizer):
    """Functional ``torch.optim.Adadelta`` (torch's ``_FunctionalAdadelta`` arguments)."""

    _functional = staticmethod(functional_adadelta)
    _state_lists = ("square_avg", "acc_delta", "step")
    _options_from_defaults = ("lr", "rho", "eps", "weight_decay")

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_range("learning rate", lr, 0.0 <= lr)
        _check_range("rho value", rho, 0.0 <= rho <= 1.0)
        _check_range("epsilon value", eps, 0.0 <= eps)
        _check_range("weight_decay value", weight_decay, 0.0 <= weight_decay)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {"lr": lr, "rho": rho, "eps": eps, "weight_decay": weight_decay}
        self.foreach = foreach
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        return {
            "step": _step_tensor(param, False),
            "square_avg": _zeros(param),
            "acc_delta": _zeros(param),
        }


class FunctionalAdamax(FunctionalOptimizer):
    """Functional ``torch.optim.Adamax`` (torch's ``_FunctionalAdamax`` arguments; note its
    default ``lr`` is 1e-3, where ``torch.optim.Adamax``'s is 2e-3)."""

    _functional = staticmethod(functional_adamax)
    _state_lists = ("exp_avg", "exp_inf", "step")
    _options_from_defaults = ("lr", "beta1", "beta2", "eps", "weight_decay")

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_adam_like(lr, betas, eps, weight_decay)
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {
            "lr": lr,
            "eps": eps,
            "beta1": betas[0],
            "beta2": betas[1],
            "weight_decay": weight_decay,
        }
        self.foreach = foreach
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        return {
            "step": _step_tensor(param, False),
            "exp_avg": _zeros(param),
            "exp_inf": _zeros(param),
        }


class FunctionalRprop(FunctionalOptimizer):
    """Functional ``torch.optim.Rprop`` (torch's ``_FunctionalRprop`` arguments)."""

    _functional = staticmethod(functional_rprop)
    _state_lists = ("prev", "step_size", "step")

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        etas: Tuple[float, float] = (0.5, 1.2),
        step_sizes: Tuple[float, float] = (1e-6, 50),
        foreach: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ) -> None:
        _check_range("learning rate", lr, 0.0 <= lr)
        _check_range("eta values", etas, 0.0 < etas[0] < 1.0 < etas[1])
        super().__init__(params, _allow_empty_param_list)
        self.defaults = {"lr": lr}
        self.etas = etas
        self.step_sizes = step_sizes
        self.foreach = foreach
        self.maximize = maximize

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        lr = self.defaults["lr"]
        # A complex parameter is two real ones: the imaginary half needs a step size too.
        value = complex(lr, lr) if torch.is_complex(param) else lr
        return {
            "step": _step_tensor(param, False),
            "prev": _zeros(param),
            "step_size": torch.full_like(grad, value),
        }

    def _options(self) -> Dict[str, Any]:
        return {
            "step_size_min": self.step_sizes[0],
            "step_size_max": self.step_sizes[1],
            "etaminus": self.etas[0],
            "etaplus": self.etas[1],
            "maximize": self.maximize,
            "foreach": self.foreach,
        }


# ------------------------------------------------------------------ as_functional_optim

# Keyed by the exact class, as in torch: a subclass may change the update, so it does not
# silently inherit its parent's functional form.
_FUNCTIONAL_OPTIMS: Dict[Any, type] = {
    torch.optim.Adagrad: FunctionalAdagrad,
    torch.optim.Adam: FunctionalAdam,
    torch.optim.AdamW: FunctionalAdamW,
    torch.optim.SGD: FunctionalSGD,
    torch.optim.Adadelta: FunctionalAdadelta,
    torch.optim.RMSprop: FunctionalRMSprop,
    torch.optim.Rprop: FunctionalRprop,
    torch.optim.Adamax: FunctionalAdamax,
}


def register_functional_optim(key: Any, optim: type) -> None:
    """Maps ``key`` (usually an optimizer class) to a functional optimizer class for
    :func:`as_functional_optim`; an existing mapping is kept, as in torch."""
    _FUNCTIONAL_OPTIMS.setdefault(key, optim)


def registered_functional_optim(key: Any) -> Optional[type]:
    """The functional optimizer class registered for ``key`` (see
    :func:`register_functional_optim`), or None; ``TypeError`` for an unhashable ``key``."""
    return _FUNCTIONAL_OPTIMS.get(key)


def registered_functional_classes() -> Set[type]:
    """Every functional optimizer class registered here."""
    return {c for c in _FUNCTIONAL_OPTIMS.values() if isinstance(c, type)}


def as_functional_optim(optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    """The functional counterpart of ``optim_cls``, built with ``args``/``kwargs`` and an empty
    parameter list (step it with ``step_param``). Raises ValueError for an unknown class and
    TypeError for an unhashable argument, as torch does."""
    try:
        functional_cls = _FUNCTIONAL_OPTIMS[optim_cls]
    except TypeError as e:
        # torch raises TypeError here too (an unhashable key); keep the type, name the problem.
        raise TypeError(f"as_functional_optim expects an optimizer class, got {optim_cls!r}") from e
    except KeyError as e:
        raise ValueError(
            f"Optimizer {optim_cls} does not have a functional counterpart! Known: "
            f"{sorted(getattr(k, '__name__', str(k)) for k in _FUNCTIONAL_OPTIMS)}; "
            f"add one with ft.optim.functional.register_functional_optim"
        ) from e
    return functional_cls([], *args, **kwargs, _allow_empty_param_list=True)
