"""``ft.Optimizer`` (torchft's OptimizerWrapper): ties an optimizer to the Manager's step.

``zero_grad()`` starts the quorum for the step; ``step()`` steps the wrapped optimizer only if
the Manager decides to commit::

    optimizer = ft.Optimizer(manager, torch.optim.AdamW(model.parameters()))
    optimizer.zero_grad()   # manager.start_quorum()
    loss.backward()         # gradients allreduced through the manager (ft.DistributedDataParallel)
    optimizer.step()        # optim.step() only if manager.should_commit()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

if TYPE_CHECKING:
    from ft.manager import Manager

__all__ = ["OptimizerWrapper", "Optimizer"]


class OptimizerWrapper(torch.optim.Optimizer):
    """Wraps ``optim`` so that it only steps on committed steps (torchft signature)."""

    def __init__(self, manager: "Manager", optim: torch.optim.Optimizer) -> None:
        # Deliberately no super().__init__(): all state lives in the wrapped optimizer.
        self.optim = optim
        self.manager = manager

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def state_dict(self) -> Dict[str, Any]:
        return self.optim.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        if closure is not None:
            raise ValueError("ft.Optimizer does not support closures")
        if self.manager.should_commit():
            self.optim.step()
        return None

    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.optim.defaults = value

    def __repr__(self) -> str:
        return f"ft.Optimizer({self.optim!r})"


Optimizer = OptimizerWrapper
