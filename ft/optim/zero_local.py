"""ZeRO's local optimizer: which class each rank builds (torch's rules and error types) and how
its hyperparameters follow the ``param_groups`` that the ZeRO optimizer exposes.

Shared by :mod:`ft.optim.zero` (the local ``torch.optim`` optimizer), :mod:`ft.optim.zero_overlap`
(the local functional optimizer of the overlapped step) and :mod:`ft.optim.zero_ft`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Optional

from torch.optim import Optimizer

from ft.optim import functional as ftf

__all__ = [
    "NOT_HYPER",
    "hyper",
    "copy_hyper",
    "hyper_to_functional",
    "functional_hyper",
    "class_name",
    "accepts_empty_flag",
    "optimizer_constructor",
    "check_optimizer_class",
]

# Group keys that are not hyperparameters.
NOT_HYPER = ("params", "param_names")

# Where torch keeps its functional optimizers' registry; not imported here (see
# _functional_classes).
_TORCH_OPTIM_UTILS = "torch.distributed.optim.utils"


def hyper(group: Dict[str, Any]) -> Dict[str, Any]:
    """The hyperparameters of a parameter group (everything but its parameters)."""
    return {k: v for k, v in group.items() if k not in NOT_HYPER}


def copy_hyper(src: List[Dict[str, Any]], dst: List[Dict[str, Any]]) -> None:
    """Copies each group's hyperparameters from ``src`` into the matching group of ``dst``."""
    if len(src) != len(dst):
        raise AssertionError("parameter group count mismatch between exposed and local optimizer")
    for s, d in zip(src, dst):
        for k, v in s.items():
            if k not in NOT_HYPER:
                d[k] = v


def hyper_to_functional(group: Dict[str, Any], fopt: Any) -> None:
    """Copy the exposed group's hyperparameters into a functional optimizer's ``defaults``
    (which its step reads); Adam-like ones spell ``betas`` as ``beta1``/``beta2``."""
    d = getattr(fopt, "defaults", None)
    if not isinstance(d, dict):
        return
    for k in d:
        if k in group:
            d[k] = group[k]
    betas = group.get("betas")
    if betas is not None and "beta1" in d and "beta2" in d:
        d["beta1"], d["beta2"] = betas[0], betas[1]


def functional_hyper(fopt: Any) -> Dict[str, Any]:
    """A functional optimizer's hyperparameters in ``torch.optim`` spelling."""
    d = dict(getattr(fopt, "defaults", None) or {})
    if "beta1" in d and "beta2" in d:
        d["betas"] = (d.pop("beta1"), d.pop("beta2"))
    return d


def class_name(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return repr(obj)


def accepts_empty_flag(ctor: Any) -> bool:
    """Whether ``ctor`` takes torch's functional-optimizer flag ``_allow_empty_param_list``."""
    try:
        return "_allow_empty_param_list" in inspect.signature(ctor).parameters
    except (TypeError, ValueError):  # no signature (a builtin or C++ class)
        return False


def _functional_classes() -> set:
    """Every class this process knows as a functional optimizer: ft's (registered or
    subclassing ft's base) and, if torch's registry is loaded, torch's."""
    known = ftf.registered_functional_classes()
    # Not imported here: importing torch.distributed.optim scripts its functional optimizers
    # (TorchScript deprecation warnings). A class of torch's can only exist once it is loaded.
    torch_utils = sys.modules.get(_TORCH_OPTIM_UTILS)
    if torch_utils is not None:
        known.update(c for c in torch_utils.functional_optim_map.values() if isinstance(c, type))
    return known


def _is_functional(optimizer_class: Any) -> bool:
    if not isinstance(optimizer_class, type):
        return False
    return (
        issubclass(optimizer_class, ftf.FunctionalOptimizer)
        or optimizer_class in _functional_classes()
    )


def _functional_counterpart(optimizer_class: Any) -> Optional[type]:
    """ft's functional class for ``optimizer_class`` (ft's registry first, then torch's if
    loaded), or None."""
    torch_map = getattr(sys.modules.get(_TORCH_OPTIM_UTILS), "functional_optim_map", {})
    for lookup in (ftf.registered_functional_optim, torch_map.get):
        try:
            found = lookup(optimizer_class)
        except TypeError:  # unhashable: no optimizer class
            return None
        if found is not None:
            return found
    return None


def optimizer_constructor(optimizer_class: Any, overlap_with_ddp: bool) -> Any:
    """What each rank calls to build its local optimizer; raises with torch's error types.

    Torch's rule (facts, not code): a functional optimizer is stepped with explicit
    gradients, which only the DDP hooks supply, so it is accepted only with overlap; with
    overlap, a ``torch.optim`` class is replaced by its functional counterpart. Both refusals
    are ``ValueError`` in torch; a non-class is a ``TypeError`` there (it is not callable).
    """
    if overlap_with_ddp:
        if _is_functional(optimizer_class):
            return optimizer_class
        counterpart = _functional_counterpart(optimizer_class)
        if counterpart is not None:
            return counterpart
        what = (
            f"an optimizer instance ({type(optimizer_class).__name__}); pass its class"
            if isinstance(optimizer_class, Optimizer)
            else class_name(optimizer_class)
        )
        raise ValueError(
            "overlap_with_ddp=True steps a functional optimizer inside the DDP hook, but "
            f"optimizer_class is {what}, which has no functional counterpart. Pass a "
            "torch.optim class that has one (Adam, AdamW, SGD, RMSprop, Adagrad, Adadelta, "
            "Adamax, Rprop), a functional class (ft.optim.FunctionalAdam, ...), or register "
            "one with ft.optim.functional.register_functional_optim"
        )
    if isinstance(optimizer_class, Optimizer):
        raise TypeError(
            "optimizer_class must be an optimizer class such as torch.optim.Adam, not an "
            f"optimizer instance ({type(optimizer_class).__name__}); pass the class and its "
            "hyperparameters as keyword arguments"
        )
    if _is_functional(optimizer_class):
        raise ValueError(
            f"optimizer_class {class_name(optimizer_class)} is a functional optimizer, which "
            "is only accepted with overlap_with_ddp=True (it is stepped with explicit "
            "gradients, which only the DDP hooks of ft.optim.zero_hooks supply). Pass the "
            "torch.optim class instead (e.g. torch.optim.Adam for FunctionalAdam)"
        )
    if isinstance(optimizer_class, type):
        if not issubclass(optimizer_class, Optimizer):
            raise TypeError(
                "optimizer_class must be a subclass of torch.optim.Optimizer (e.g. "
                f"torch.optim.Adam); got {class_name(optimizer_class)}"
            )
    elif not callable(optimizer_class):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    return optimizer_class


def check_optimizer_class(optimizer_class: Any) -> None:
    """The checks for a non-overlapped local optimizer (also used by ``zero_ft``)."""
    optimizer_constructor(optimizer_class, overlap_with_ddp=False)
