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

__all__ = ["ProcessGroup", "ProcessGroupFt", "ProcessGroupGloo", "ProcessGroupNCCL", "lane"]
