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

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

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

_P = inspect.Parameter


def _arguments(spec: str) -> Dict[str, Any]:
    """A signature's arguments written on one line, as ``collections.namedtuple`` takes its
    fields: ``"lr eps=1e-8 betas=(0.9,0.999)"`` is ``lr`` (required), then ``eps`` and
    ``betas`` with those defaults (Python literals, without spaces). Name -> default
    (``inspect.Parameter.empty`` for a required one), in order.

    The eight optimizers differ only in these lists; declaring them as data keeps one
    implementation of the checks and the calls for all of them."""
    out: Dict[str, Any] = {}
    for item in spec.split():
        name, has_default, default = item.partition("=")
        out[name] = ast.literal_eval(default) if has_default else _P.empty
    return out


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


# What torch's functional forms are told about the tensors, beside the options.
_TENSOR_FLAGS: Dict[str, Callable[[Sequence[Tensor], Sequence[Tensor]], bool]] = {
    "has_complex": lambda params, grads: any(torch.is_complex(p) for p in params),
    "has_sparse_grad": lambda params, grads: any(g.is_sparse for g in grads),
}


def _check_nesterov(fn: str, options: Mapping[str, Any]) -> None:
    if options["nesterov"] and (options["momentum"] <= 0 or options["dampening"] != 0):
        raise ValueError(f"{fn}: nesterov needs momentum > 0 and dampening == 0")


# ------------------------------------------------------------------ stateless updates


@dataclass(frozen=True)
class _Update:
    """How one ``functional_*`` update calls torch's functional form.

    ``lists``: the state lists after ``params`` and ``grads``, in torch's order;
    ``keywords``: the keyword options (:func:`_arguments`); ``needed_when``: a list that must
    have one entry per parameter only when this option is set (otherwise torch ignores it and
    it may be empty); ``flags``: what torch is told about the tensors (``_TENSOR_FLAGS``);
    ``check``: a further check of the options.
    """

    name: str
    torch_fn: Callable[..., None]
    lists: Tuple[str, ...]
    keywords: Dict[str, Any]
    needed_when: Mapping[str, str] = field(default_factory=dict)
    flags: Tuple[str, ...] = ("has_complex",)
    check: Optional[Callable[[str, Mapping[str, Any]], None]] = None

    def apply(
        self,
        params: List[Tensor],
        grads: List[Tensor],
        lists: Sequence[List[Any]],
        options: Mapping[str, Any],
    ) -> None:
        """One step in place, under ``torch.no_grad()``, once the lists are checked."""
        needed = {
            name: values
            for name, values in zip(self.lists, lists)
            if name not in self.needed_when or options[self.needed_when[name]]
        }
        _check_lists(self.name, params, grads=grads, **needed)
        if self.check is not None:
            self.check(self.name, options)
        if not params:
            return
        flags = {flag: _TENSOR_FLAGS[flag](params, grads) for flag in self.flags}
        with torch.no_grad():
            self.torch_fn(params, grads, *lists, **options, **flags)

    def signature(self) -> inspect.Signature:
        positional = [_P(n, _P.POSITIONAL_OR_KEYWORD) for n in ("params", "grads", *self.lists)]
        keywords = [_P(n, _P.KEYWORD_ONLY, default=d) for n, d in self.keywords.items()]
        return inspect.Signature(positional + keywords, return_annotation=None)


def _stateless(update: _Update, doc: str) -> Callable[..., None]:
    """The public function for ``update``: ``name(params, grads, *lists, **keywords)``, with
    that signature (``inspect.signature``, ``help``) and a TypeError for a missing or unknown
    argument, as a ``def`` gives."""
    signature = update.signature()

    def step(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        lists = [values[name] for name in update.lists]
        options = {name: values[name] for name in update.keywords}
        update.apply(values["params"], values["grads"], lists, options)

    step.__signature__ = signature  # type: ignore[attr-defined]
    step.__name__ = step.__qualname__ = update.name
    step.__doc__ = doc
    return step


_ADAM_LISTS = ("exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")
_ADAM_KEYWORDS = (
    "lr beta1 beta2 eps weight_decay amsgrad=False maximize=False foreach=None fused=None"
)
_ADAM = _Update(
    "functional_adam",
    _adam,
    _ADAM_LISTS,
    _arguments(_ADAM_KEYWORDS),
    {"max_exp_avg_sqs": "amsgrad"},
)
functional_adam = _stateless(
    _ADAM,
    """One Adam step in place (``torch.optim.Adam``); ``state_steps`` are scalar tensors.

    ``max_exp_avg_sqs`` has one tensor per parameter with ``amsgrad``, else is empty.""",
)

_ADAMW = _Update("functional_adamw", _adamw, _ADAM_LISTS, _ADAM.keywords, _ADAM.needed_when)
functional_adamw = _stateless(
    _ADAMW, "One AdamW step (decoupled weight decay) in place; lists as :func:`functional_adam`."
)

_SGD = _Update(
    "functional_sgd",
    _sgd,
    ("momentum_buffer_list",),
    _arguments(
        "lr momentum=0.0 dampening=0.0 weight_decay=0.0 nesterov=False maximize=False "
        "foreach=None fused=None"
    ),
    needed_when={"momentum_buffer_list": "momentum"},
    flags=("has_sparse_grad",),
    check=_check_nesterov,
)
functional_sgd = _stateless(
    _SGD,
    """One SGD step in place (``torch.optim.SGD``).

    With ``momentum != 0``, ``momentum_buffer_list`` has one entry per parameter; a None entry
    is replaced, in the list, by the new buffer (keep it for the next step). Otherwise it is
    ignored (pass an empty list, as torch.optim.SGD does).""",
)

_RMSPROP_OPTIONS = "alpha=0.99 eps=1e-8 weight_decay=0.0 momentum=0.0 centered=False"
_RMSPROP = _Update(
    "functional_rmsprop",
    _rmsprop,
    ("square_avgs", "grad_avgs", "momentum_buffer_list", "state_steps"),
    _arguments(f"lr {_RMSPROP_OPTIONS} maximize=False foreach=None"),
    {"grad_avgs": "centered", "momentum_buffer_list": "momentum"},
)
functional_rmsprop = _stateless(
    _RMSPROP,
    """One RMSprop step in place. ``grad_avgs`` is used only with ``centered`` and
    ``momentum_buffer_list`` only with ``momentum > 0`` (pass empty lists otherwise).""",
)

_ADAGRAD = _Update(
    "functional_adagrad",
    _adagrad,
    ("state_sums", "state_steps"),
    _arguments("lr lr_decay=0.0 weight_decay=0.0 eps=1e-10 maximize=False foreach=None fused=None"),
    flags=("has_sparse_grad", "has_complex"),
)
functional_adagrad = _stateless(
    _ADAGRAD, "One Adagrad step in place; ``state_sums`` start at ``initial_accumulator_value``."
)

_ADADELTA_OPTIONS = "lr=1.0 rho=0.9 eps=1e-6 weight_decay=0.0"
_ADADELTA = _Update(
    "functional_adadelta",
    _adadelta,
    ("square_avgs", "acc_deltas", "state_steps"),
    _arguments(f"{_ADADELTA_OPTIONS} maximize=False foreach=None"),
)
functional_adadelta = _stateless(_ADADELTA, "One Adadelta step in place.")

_ADAMAX = _Update(
    "functional_adamax",
    _adamax,
    ("exp_avgs", "exp_infs", "state_steps"),
    _arguments("lr beta1=0.9 beta2=0.999 eps=1e-8 weight_decay=0.0 maximize=False foreach=None"),
)
functional_adamax = _stateless(_ADAMAX, "One Adamax step in place.")

_RPROP = _Update(
    "functional_rprop",
    _rprop,
    ("prevs", "step_sizes", "state_steps"),
    _arguments(
        "step_size_min=1e-6 step_size_max=50.0 etaminus=0.5 etaplus=1.2 maximize=False foreach=None"
    ),
)
functional_rprop = _stateless(
    _RPROP, "One Rprop step in place; ``step_sizes`` start filled with the learning rate."
)


# ------------------------------------------------------------------ stateful objects

# torch.optim's checks of the constructor arguments, by name (any class that takes the argument
# checks it), with torch's messages: "Invalid learning rate: -1.0".
_ARGUMENT_CHECKS: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "lr": ("learning rate", lambda v: 0.0 <= v),
    "lr_decay": ("lr_decay value", lambda v: 0.0 <= v),
    "eps": ("epsilon value", lambda v: 0.0 <= v),
    "alpha": ("alpha value", lambda v: 0.0 <= v),
    "rho": ("rho value", lambda v: 0.0 <= v <= 1.0),
    "momentum": ("momentum value", lambda v: 0.0 <= v),
    "weight_decay": ("weight_decay value", lambda v: 0.0 <= v),
    "initial_accumulator_value": ("initial_accumulator_value value", lambda v: 0.0 <= v),
    "etas": ("eta values", lambda v: 0.0 < v[0] < 1.0 < v[1]),
}


def _check_arguments(values: Mapping[str, Any]) -> None:
    for name, value in values.items():
        if name == "betas":
            for i, beta in enumerate(value):
                if not 0.0 <= beta < 1.0:
                    raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
        elif name in _ARGUMENT_CHECKS:
            label, ok = _ARGUMENT_CHECKS[name]
            if not ok(value):
                raise ValueError(f"Invalid {label}: {value}")


def _step_tensor(param: Tensor, on_device: bool) -> Tensor:
    # As torch.optim: a fused kernel reads ``step`` on the parameter's device (float32);
    # otherwise ``step`` stays a CPU scalar so that reading it costs no device sync.
    if on_device:
        return torch.zeros((), dtype=torch.float32, device=param.device)
    return torch.tensor(0.0)


def _zeros(param: Tensor) -> Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


class FunctionalOptimizer:
    """One param group, state keyed by parameter, stepped with explicit gradients.

    A subclass declares, as data (so that one implementation serves them all):

    - ``_arguments``: its constructor's arguments after ``params``, with their defaults, in
      the order of torch's ``_FunctionalX`` (:func:`_arguments`'s form); the constructor checks
      them as torch.optim does (``_ARGUMENT_CHECKS``);
    - ``_in_defaults``: those kept in ``defaults`` (``betas`` as ``beta1`` and ``beta2``), in
      that dict's order; the others become attributes of the same name;
    - ``_update``: its stateless update, called with the per-parameter lists of the state keys
      ``_state_lists`` (a key the options leave out of the state, like ``max_exp_avg_sq``
      without ``amsgrad``, is passed as an empty list, as torch.optim does) and its keyword
      options, each read from ``defaults`` or the attribute of its name;
    - ``_zero_state``: the state keys that start as zeros, after ``step``; ``_other_state``
      adds the rest.
    """

    defaults: Dict[str, Any]

    _arguments: str = ""
    _in_defaults: str = ""
    _update: _Update
    _state_lists: Tuple[str, ...] = ()
    _zero_state: Tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _declare_signature(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = type(self).__signature__.bind(*args, **kwargs)  # type: ignore[attr-defined]
        bound.apply_defaults()
        values = dict(bound.arguments)
        params = list(values.pop("params"))
        allow_empty = values.pop("_allow_empty_param_list")
        _check_arguments(values)
        if not params and not allow_empty:
            raise ValueError("optimizer got an empty parameter list")
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        # One group only, as in torch: functional optimizers serve one parameter set each.
        self.param_group: Dict[str, List[Tensor]] = {"params": params}
        self.defaults = {}
        kept = self._in_defaults.split()
        for name in kept:
            if name == "betas":
                self.defaults["beta1"], self.defaults["beta2"] = values[name]
            else:
                self.defaults[name] = values[name]
        for name, value in values.items():
            if name not in kept:
                setattr(self, name, value)

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        state = {"step": _step_tensor(param, getattr(self, "fused", False))}
        state.update((key, _zeros(param)) for key in self._zero_state)
        state.update(self._other_state(param, grad))
        return state

    def _other_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        """The state keys that do not start as zeros (or only with some options)."""
        return {}

    def _options(self) -> Dict[str, Any]:
        """The update's keyword options, each from ``defaults`` or the attribute of its name
        (where the constructor put the argument of that name)."""
        return {
            k: self.defaults[k] if k in self.defaults else getattr(self, k)
            for k in self._update.keywords
        }

    def _apply(
        self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]]
    ) -> None:
        # Every parameter's state has the same keys: the options that decide them are fixed.
        lists = [[s[k] for s in states] if k in states[0] else [] for k in self._state_lists]
        self._update.apply(params, grads, lists, self._options())

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
        self._apply(params, grads, self._states(params, grads))

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


def _declare_signature(cls: type) -> None:
    """``cls(params, <_arguments>, _allow_empty_param_list=False)``: what the constructor binds
    its arguments to, and what ``inspect.signature`` shows."""
    arguments = [
        _P(name, _P.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in _arguments(cls._arguments).items()
    ]
    cls.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [_P("params", _P.POSITIONAL_OR_KEYWORD), *arguments]
        + [_P("_allow_empty_param_list", _P.POSITIONAL_OR_KEYWORD, default=False)]
    )


_declare_signature(FunctionalOptimizer)


class FunctionalAdam(FunctionalOptimizer):
    """Functional ``torch.optim.Adam`` (torch's ``_FunctionalAdam`` arguments)."""

    _arguments = "lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0.0 amsgrad=False " + (
        "maximize=False foreach=False fused=False"
    )
    _in_defaults = "lr eps betas weight_decay"
    _update = _ADAM
    _state_lists = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step")

    _zero_state = ("exp_avg", "exp_avg_sq")

    def _other_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        amsgrad = self.amsgrad  # type: ignore[attr-defined]
        return {"max_exp_avg_sq": _zeros(param)} if amsgrad else {}


class FunctionalAdamW(FunctionalAdam):
    """Functional ``torch.optim.AdamW`` (torch's ``_FunctionalAdamW`` arguments: Adam's, with
    ``weight_decay`` 1e-2)."""

    _arguments = "lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=1e-2 amsgrad=False " + (
        "maximize=False foreach=False fused=False"
    )
    _update = _ADAMW


class FunctionalSGD(FunctionalOptimizer):
    """Functional ``torch.optim.SGD`` (torch's ``_FunctionalSGD`` arguments).

    ``state[p]`` is empty until a step with ``momentum > 0`` creates ``momentum_buffer``.
    """

    _arguments = "lr=1e-2 momentum=0.0 dampening=0.0 weight_decay=0.0 nesterov=False " + (
        "maximize=False foreach=False fused=False"
    )
    _in_defaults = "lr momentum dampening weight_decay"
    _update = _SGD

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        return {}

    def _apply(
        self, params: List[Tensor], grads: List[Tensor], states: List[Dict[str, Tensor]]
    ) -> None:
        buffers: List[Optional[Tensor]] = [s.get("momentum_buffer") for s in states]
        self._update.apply(params, grads, [buffers], self._options())
        # The first momentum step creates the buffers inside ``buffers``; keep them.
        for s, b in zip(states, buffers):
            if b is not None:
                s["momentum_buffer"] = b


class FunctionalRMSprop(FunctionalOptimizer):
    """Functional ``torch.optim.RMSprop`` (torch's ``_FunctionalRMSprop`` arguments)."""

    _arguments = f"lr=1e-2 {_RMSPROP_OPTIONS} foreach=False maximize=False"
    _in_defaults = "lr alpha eps weight_decay momentum"
    _update = _RMSPROP
    _state_lists = ("square_avg", "grad_avg", "momentum_buffer", "step")

    def _init_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        state = {"step": _step_tensor(param, False), "square_avg": _zeros(param)}
        if self.defaults["momentum"] > 0:
            state["momentum_buffer"] = _zeros(param)
        if self.centered:  # type: ignore[attr-defined]
            state["grad_avg"] = _zeros(param)
        return state


class FunctionalAdagrad(FunctionalOptimizer):
    """Functional ``torch.optim.Adagrad`` (torch's ``_FunctionalAdagrad`` arguments).

    As in torch, the parameters given to the constructor get their state at once;
    ``warmup_lr_multiplier``, ``warmup_num_iters`` and ``coalesce_grad`` are kept in
    ``defaults``/attributes for compatibility and, as in torch, have no effect.
    """

    _arguments = (
        "lr=1e-2 lr_decay=0.0 weight_decay=0.0 initial_accumulator_value=0.0 "
        "warmup_lr_multiplier=1.0 warmup_num_iters=0.0 eps=1e-10 coalesce_grad=True "
        "foreach=False fused=False maximize=False"
    )
    _in_defaults = (
        "lr lr_decay eps weight_decay initial_accumulator_value warmup_lr_multiplier "
        "warmup_num_iters"
    )
    _update = _ADAGRAD
    _state_lists = ("sum", "step")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.param_group["params"]:
            self.state[p] = self._init_state(p, p)

    def _other_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        init = self.defaults["initial_accumulator_value"]
        # A complex parameter is two real ones: both halves start at the accumulator value.
        value = complex(init, init) if torch.is_complex(param) else init
        return {"sum": torch.full_like(param, value, memory_format=torch.preserve_format)}


class FunctionalAdadelta(FunctionalOptimizer):
    """Functional ``torch.optim.Adadelta`` (torch's ``_FunctionalAdadelta`` arguments)."""

    _arguments = f"{_ADADELTA_OPTIONS} foreach=False maximize=False"
    _in_defaults = "lr rho eps weight_decay"
    _update = _ADADELTA
    _state_lists = ("square_avg", "acc_delta", "step")
    _zero_state = ("square_avg", "acc_delta")


class FunctionalAdamax(FunctionalOptimizer):
    """Functional ``torch.optim.Adamax`` (torch's ``_FunctionalAdamax`` arguments; note its
    default ``lr`` is 1e-3, where ``torch.optim.Adamax``'s is 2e-3)."""

    _arguments = "lr=1e-3 betas=(0.9,0.999) eps=1e-8 weight_decay=0.0 foreach=False maximize=False"
    _in_defaults = "lr eps betas weight_decay"
    _update = _ADAMAX
    _state_lists = ("exp_avg", "exp_inf", "step")
    _zero_state = ("exp_avg", "exp_inf")


class FunctionalRprop(FunctionalOptimizer):
    """Functional ``torch.optim.Rprop`` (torch's ``_FunctionalRprop`` arguments)."""

    _arguments = "lr=1e-2 etas=(0.5,1.2) step_sizes=(1e-6,50) foreach=False maximize=False"
    _in_defaults = "lr"
    _update = _RPROP
    _state_lists = ("prev", "step_size", "step")
    _zero_state = ("prev",)

    def _other_state(self, param: Tensor, grad: Tensor) -> Dict[str, Tensor]:
        lr = self.defaults["lr"]
        # A complex parameter is two real ones: the imaginary half needs a step size too.
        value = complex(lr, lr) if torch.is_complex(param) else lr
        return {"step_size": torch.full_like(grad, value)}

    def _options(self) -> Dict[str, Any]:
        etas, step_sizes = self.etas, self.step_sizes  # type: ignore[attr-defined]
        return {
            "step_size_min": step_sizes[0],
            "step_size_max": step_sizes[1],
            "etaminus": etas[0],
            "etaplus": etas[1],
            "maximize": self.maximize,  # type: ignore[attr-defined]
            "foreach": self.foreach,  # type: ignore[attr-defined]
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
