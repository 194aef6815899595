"""ft: per-step fault tolerance for PyTorch training.

Contract:
* ``import ft`` makes the torch.distributed backend "ft" available: at once when torch is
  already imported, otherwise the moment torch finishes importing (see :mod:`ft.backend.registration`).
  Either way ``torch.distributed.init_process_group("ft")`` works after ``import ft`` and
  ``import torch``, in any order.
* ``import ft`` itself imports neither torch nor the extension ``ft._C``. The names below load
  their module on first use (PEP 562), so a process that needs only the control plane
  (``ft.coordination``, ``ft-lighthouse``) runs without torch installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

from ft._version import __version__

# name -> the module that defines it. Every torch-side public name of the package lives here.
_LAZY: Dict[str, str] = {
    "ProcessGroup": "ft.backend.process_group",
    "ProcessGroupFt": "ft.backend.process_group",
    "ProcessGroupGloo": "ft.backend.process_group",
    "ProcessGroupNCCL": "ft.backend.process_group",
    "ProcessGroupXCCL": "ft.backend.process_group",
    "ProcessGroupBabyNCCL": "ft.backend.process_group",
    "ProcessGroupBabyXCCL": "ft.backend.process_group",
    "lane": "ft.backend.process_group",
    "Manager": "ft.manager",
    "WorldSizeMode": "ft.manager",
    "PersistentStepFailure": "ft.manager_parts.step_failures",  # torch-free
    "Optimizer": "ft.optim.wrapper",
    "OptimizerWrapper": "ft.optim.wrapper",
    "DistributedDataParallel": "ft.ddp",
    "DistributedSampler": "ft.data",
    "DiLoCo": "ft.local_sgd",
    "LocalSGD": "ft.local_sgd",
    "setup_logger": "ft.observability.otel",  # torch-free
}

__all__: List[str] = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ft' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # static checkers and IDEs see the eager imports
    from ft.data import DistributedSampler  # noqa: F401
    from ft.ddp import DistributedDataParallel  # noqa: F401
    from ft.local_sgd import DiLoCo, LocalSGD  # noqa: F401
    from ft.manager import Manager, WorldSizeMode  # noqa: F401
    from ft.optim.wrapper import Optimizer, OptimizerWrapper  # noqa: F401
    from ft.otel import setup_logger  # noqa: F401
    from ft.manager_parts.step_failures import PersistentStepFailure  # noqa: F401
    from ft.backend.process_group import (  # noqa: F401
        ProcessGroup,
        ProcessGroupBabyNCCL,
        ProcessGroupBabyXCCL,
        ProcessGroupFt,
        ProcessGroupGloo,
        ProcessGroupNCCL,
        ProcessGroupXCCL,
        lane,
    )

from ft.backend import registration  # noqa: E402

registration.register_when_torch_loads()


def _export_torchft_records() -> None:
    """As ``import torchft`` does: torchft's three record loggers (ft.observability.records) are exported
    through OpenTelemetry when TORCHFT_USE_OTEL asks for it (a no-op otherwise)."""
    import warnings

    from ft.observability import otel, records

    for name in records.NAMES:
        try:
            otel.setup_logger(name)
        except ImportError as e:  # asked for, but not installed: say so, keep ft importable
            warnings.warn(f"ft: {e}", stacklevel=3)
            return


_export_torchft_records()
