"""``ft.DistributedDataParallel``: torch DDP whose gradient allreduce goes through the Manager.

DDP is built on a local, size-1 stand-in process group, so its constructor broadcasts nothing
across replicas (replicas get identical initial state from the Manager's ``init_sync`` heal, or
from a seeded init with ``init_sync=False``). Every gradient bucket is reduced by a comm hook
that calls :meth:`ft.Manager.allreduce` and hands DDP the Manager's future: nothing blocks the
CPU per bucket (on CUDA the future is stream-aware; on CPU the backend runs the op on its own
threads). Every replica uses the same bucket layout from its first step (see below). Failures
never reach DDP: the Manager reports them and the step does not commit.

``ft.ddp.PureDistributedDataParallel`` (torchft's name) is the reducer-free variant: one
:meth:`ft.Manager.allreduce` per gradient, issued as each gradient is accumulated.

Contract (PureDistributedDataParallel):
* every parameter that requires grad has its ``.grad`` averaged over the participating
  replicas by the time ``loss.backward()`` returns (ft waits for the allreduces at the end of
  the backward pass; torchft never waits for them);
* failures are the Manager's business (reported, step not committed), never raised here.
"""

import warnings
from typing import TYPE_CHECKING, Any, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.nn import parallel

if TYPE_CHECKING:
    from ft.manager import Manager

__all__ = ["DistributedDataParallel", "PureDistributedDataParallel"]


def _local_process_group() -> Tuple[ProcessGroup, Any]:
    """A size-1 process group whose ops do nothing (soaks up DDP's constructor collectives)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    # torch has no public way to build a group without a store: its private calls do it
    backend = FakeProcessGroup._create_internal(0, 1)
    pg = ProcessGroup(0, 1)
    for device in ("cpu", "cuda"):
        # torch's private call (see above)
        pg._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)  # torch's private call
    return pg, backend


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``DistributedDataParallel(manager, module, **kwargs)`` (torchft signature).

    ``kwargs`` go to torch's DDP (``bucket_cap_mb``, ``find_unused_parameters``, ...), except
    ``process_group`` and ``broadcast_buffers``, which ft sets. ``gradient_as_bucket_view``
    defaults to True here (gradients are views into the communication buckets: one pass over
    them per step instead of three, and no second copy of the gradients in memory).
    """

    def __init__(self, manager: "Manager", module: torch.nn.Module, **kwargs: Any) -> None:
        kwargs.pop("process_group", None)
        kwargs.pop("broadcast_buffers", None)
        # Gradients live in the buckets, so the hook's division by the participant count is
        # the only pass over them. Without it the reducer copies every gradient into its bucket
        # and the result back (torch's own hookless DDP fuses its division into the first
        # copy, so ft would pay one extra pass per step). Explicit False is honoured.
        kwargs.setdefault("gradient_as_bucket_view", True)
        pg, backend = _local_process_group()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(module, process_group=pg, broadcast_buffers=False, **kwargs)
        # Fix the bucket layout now. Torch rebuilds the buckets once, after the first backward,
        # in gradient-ready order; a replica that (re)starts later would then reduce its first
        # step's buckets in a different layout than its peers, summing mismatched gradients.
        # Rebuilding here, from _build_params_for_reducer's order (see there), gives every
        # replica the same layout from step 0.
        self.reducer._push_all_rebuilt_params()
        self.reducer._rebuild_buckets()  # torch's reducer: the only way to rebuild them now
        self._ft_pg = pg
        self._ft_local_backend = backend
        self._ft_manager = manager
        self.register_comm_hook(manager, self._comm_hook)

    def _build_params_for_reducer(self) -> Any:
        # The buckets are fixed from this list, in its order, and DDP reduces them in index
        # order. In module order bucket 0 would hold the first layer, whose gradients come
        # last in backward, so no bucket's allreduce could start before backward ended.
        # Reversed (the order torch's own first-step buckets and its rebuild find for a model
        # used in definition order), bucket 0 holds the last layer and is ready first, and
        # the allreduces overlap with the rest of backward. The order depends only on the
        # module, so it is the same on every replica.
        params, expect_sparse_gradient = super()._build_params_for_reducer()
        return params[::-1], expect_sparse_gradient[::-1]

    @staticmethod
    def _comm_hook(state: "Manager", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return state.allreduce(bucket.buffer()).get_future()


class PureDistributedDataParallel(torch.nn.Module):
    """``PureDistributedDataParallel(manager, module)`` (torchft signature): averages each
    gradient over the replicas with its own :meth:`ft.Manager.allreduce`, started the moment
    the gradient is accumulated, without DDP's reducer or buckets.

    Simpler than :class:`DistributedDataParallel`, and slower for models with many small
    parameters (one collective per tensor). The allreduces are waited for when the
    backward pass ends, so the gradients are final when ``backward()`` returns.
    """

    def __init__(self, manager: "Manager", module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self._ft_manager = manager
        self._ft_pending: List[dist.Work] = []
        self._ft_wait_queued = False
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._ft_grad_ready)

    def _ft_grad_ready(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        self._ft_pending.append(self._ft_manager.allreduce(param.grad))
        if not self._ft_wait_queued:
            # Runs once the whole backward pass is done: the last gradient's allreduce is
            # issued by then, and nothing reads the gradients before it returns.
            self._ft_wait_queued = True
            # torch's only hook for "after this backward" (torch's own DDP uses it too)
            torch.autograd.Variable._execution_engine.queue_callback(self._ft_wait_all)

    def _ft_wait_all(self) -> None:
        pending, self._ft_pending = self._ft_pending, []
        self._ft_wait_queued = False
        for work in pending:
            work.wait()  # never raises: the Manager reports failures itself

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
