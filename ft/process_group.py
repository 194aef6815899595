"""torchft's import path ``torchft.process_group``: every name it offers, from where ft keeps it.

* The backend's face, :mod:`ft.backend.process_group`: the reconfigurable process groups
  (``ProcessGroupGloo``, ``ProcessGroupNCCL``, ...), wrappers, lanes, store helpers. Importing
  either module registers the torch backend ``"ft"``.
* Above the Manager: ``ManagedProcessGroup`` (:mod:`ft.managed_process_group`) and the
  device-mesh names (:mod:`ft.device_mesh`).

ft's own modules import from where a name lives, never from here: this module stands above
them all, so that the backend's face imports nothing above it (docs/design.md, "Layers").
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ft.backend import process_group as _backend_face
from ft.backend.process_group import (  # noqa: F401
    DEFAULT_NUM_LANES,
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ProcessGroup,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupDummy,
    ProcessGroupErrored,
    ProcessGroupFt,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupTimeout,
    ProcessGroupWrapper,
    ProcessGroupXCCL,
    ReconfigureOptions,
    connect_store_client,
    create_store_client,
    current_lane,
    lane,
    parse_store_addr,
    trigger_nccl_fr_trace_through_pipe,
)
from ft.device_mesh import ManagedDeviceMesh, extend_device_mesh, ft_init_device_mesh  # noqa: F401
from ft.managed_process_group import ManagedProcessGroup  # noqa: F401

# The backend face's names, and those that stand above the Manager.
__all__ = [
    *_backend_face.__all__,
    "ManagedProcessGroup",
    "ManagedDeviceMesh",
    "extend_device_mesh",
    "ft_init_device_mesh",
]


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = _backend_face.RECONFIGURE_TIMEOUT,
) -> None:
    """:func:`ft.backend.process_group.reconfigure_with_store`, reaching the store through
    this module's ``create_store_client`` (torchft's module held both, and code written for
    it patches the store client here)."""
    _backend_face.reconfigure_with_store(
        pg, store_addr, rank, world_size, timeout, store_client=create_store_client
    )


def __getattr__(name: str) -> Any:
    # Every other name of the backend's face (its constants, ``TCPStore`` as torchft's tests
    # reach it): torchft's module held them all.
    return getattr(_backend_face, name)
