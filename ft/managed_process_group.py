"""The Manager's replica group as a torch process group (torchft's ``ManagedProcessGroup``).

It stands above the Manager (it calls one), so it lives on the Manager's side of the layers:
the backend's face (:mod:`ft.backend.process_group`) imports nothing above it. torchft's path
:mod:`ft.process_group` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft.backend.process_group import ProcessGroupWrapper
from ft.collectives import work_from_future

if TYPE_CHECKING:
    from ft.manager import Manager

__all__ = ["ManagedProcessGroup"]


def _reduce_op(opts: Any) -> Any:
    if isinstance(opts, dist.AllreduceOptions):
        return opts.reduceOp
    if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):
        return opts
    raise TypeError(f"expected AllreduceOptions or a ReduceOp, got {type(opts).__name__}")


class ManagedProcessGroup(ProcessGroupWrapper):
    """The Manager's replica group as a process group: ``allreduce`` goes through
    :meth:`ft.Manager.allreduce` (so failures are reported to the Manager, never raised, and
    AVG divides by the participants), ``size()`` is the number of participants. Other ops go
    straight to the Manager's group, its ``parent``.

    ft addition: ``allreduce`` of several tensors (one Manager allreduce each); torchft takes
    exactly one.
    """

    def __init__(self, manager: "Manager") -> None:
        # ``_pg``: torchft's name for the Manager's group, which ft's Manager keeps (torchft's
        # tests set it on a live Manager); there is no public one in torchft's API.
        super().__init__(pg=manager._pg)
        self._manager = manager

    def allreduce(self, tensors: List[torch.Tensor], opts: Any) -> dist.Work:
        op = _reduce_op(opts)
        works = [self._manager.allreduce(t, reduce_op=op) for t in tensors]
        if len(works) == 1:
            return works[0]
        joined = torch.futures.collect_all([w.get_future() for w in works])
        return work_from_future(joined.then(lambda _f: tensors))

    def size(self) -> int:
        return self._manager.num_participants()

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self.parent.getBackendName()
