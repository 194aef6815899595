"""Optimizers for ft.

- :class:`ZeroRedundancyOptimizer` (``ft.optim.zero``): ZeRO stage 1, torch-compatible.
- :class:`FaultTolerantZeroRedundancyOptimizer` (``ft.optim.zero_ft``): ZeRO-1 across the
  replica groups of an ``ft.Manager``, with a buddy copy of every shard.
"""

from ft.optim.wrapper import Optimizer, OptimizerWrapper
from ft.optim.zero import ZeroRedundancyOptimizer
from ft.optim.zero_ft import FaultTolerantZeroRedundancyOptimizer

# ft.Optimizer (OptimizerWrapper, ft/optim/wrapper.py) is exported from here once it exists.

__all__ = ["ZeroRedundancyOptimizer", "FaultTolerantZeroRedundancyOptimizer", "Optimizer", "OptimizerWrapper"]
