"""Optimizers for ft: the torch.distributed.optim surface, fault tolerant where it can be.

- :class:`ZeroRedundancyOptimizer` (``ft.optim.zero``): ZeRO stage 1, torch-compatible, with
  ``overlap_with_ddp`` through :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved`
  (``ft.optim.zero_hooks``) and ``Join`` support.
- :class:`FaultTolerantZeroRedundancyOptimizer` (``ft.optim.zero_ft``): ZeRO-1 across the
  replica groups of an ``ft.Manager``, with a buddy copy of every shard; overlapped with
  backward through :class:`FaultTolerantZeroDDP`.
- Functional optimizers (``ft.optim.functional``): :func:`as_functional_optim`, the
  ``Functional*`` classes and the ``functional_*`` updates.
- Optimizer-in-backward (``ft.optim.in_backward``): :func:`apply_optimizer_in_backward`, with
  an ``ft.Manager`` the step counts only after :func:`commit_in_backward`.
- Post-local SGD (``ft.optim.post_localsgd``): :class:`PostLocalSGDOptimizer`,
  :class:`PeriodicModelAverager`, and :class:`FaultTolerantModelAverager` across the replica
  groups of an ``ft.Manager`` (LocalSGD's round).
- :class:`DistributedOptimizer` (``ft.optim.distributed_optimizer``): remote parameters over
  torch.distributed.rpc, with a two-phase step (applied on every owner or on none).

docs/optim.md has the whole table, with each name's torch counterpart.
"""

from ft.optim import functional

# The functional optimizers: as_functional_optim, the Functional* classes and the functional_*
# updates, as functional.__all__ lists them.
from ft.optim.functional import *  # noqa: F403
from ft.optim.in_backward import (
    apply_optimizer_in_backward,
    commit_in_backward,
    get_in_backward_optimizers,
    rollback_in_backward,
    step_in_backward,
)
from ft.optim.distributed_optimizer import (
    DistributedOptimizer,
    RemoteOptimizerError,
    StepNotApplied,
    StepPartiallyApplied,
)
from ft.optim.post_localsgd import (
    FaultTolerantModelAverager,
    PeriodicModelAverager,
    PostLocalSGDOptimizer,
)
from ft.optim.wrapper import Optimizer, OptimizerWrapper
from ft.optim.zero import ZeroRedundancyOptimizer
from ft.optim.zero_hooks import (
    FaultTolerantZeroDDP,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from ft.optim.zero_ft import FaultTolerantZeroRedundancyOptimizer

__all__ = [
    "ZeroRedundancyOptimizer",
    "FaultTolerantZeroRedundancyOptimizer",
    "FaultTolerantZeroDDP",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "Optimizer",
    "OptimizerWrapper",
    "apply_optimizer_in_backward",
    "get_in_backward_optimizers",
    "commit_in_backward",
    "rollback_in_backward",
    "step_in_backward",
    "PostLocalSGDOptimizer",
    "PeriodicModelAverager",
    "FaultTolerantModelAverager",
    "DistributedOptimizer",
    "RemoteOptimizerError",
    "StepNotApplied",
    "StepPartiallyApplied",
]
__all__ += functional.__all__
