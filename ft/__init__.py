"""ft: per-step fault tolerance for PyTorch training.

Importing ft registers the torch.distributed backend "ft".
"""

import torch  # noqa: F401  (must load before the extension: it links libc10)

from ft import _C  # noqa: F401
from ft.process_group import (  # noqa: F401
    ProcessGroup,
    ProcessGroupFt,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    lane,
)
from ft.manager import Manager, WorldSizeMode  # noqa: F401,E402
from ft.optim.wrapper import Optimizer, OptimizerWrapper  # noqa: F401,E402
from ft.ddp import DistributedDataParallel  # noqa: F401,E402
from ft.data import DistributedSampler  # noqa: F401,E402

__all__ = ["ProcessGroup", "ProcessGroupFt", "ProcessGroupGloo", "ProcessGroupNCCL", "lane"]
__all__ += [
    "Manager",
    "WorldSizeMode",
    "Optimizer",
    "OptimizerWrapper",
    "DistributedDataParallel",
    "DistributedSampler",
]
from ft.local_sgd import DiLoCo, LocalSGD  # noqa: F401,E402
__all__ += ["DiLoCo", "LocalSGD"]
