"""Optimizers for ft.

- :class:`ZeroRedundancyOptimizer` (``ft.optim.zero``): ZeRO stage 1, torch-compatible.
"""

from ft.optim.wrapper import Optimizer, OptimizerWrapper
from ft.optim.zero import ZeroRedundancyOptimizer

# ft.Optimizer (OptimizerWrapper, ft/optim/wrapper.py) is exported from here once it exists.

__all__ = ["ZeroRedundancyOptimizer", "Optimizer", "OptimizerWrapper"]
