"""The Manager's collectives as Works that never fail: a failure is reported to the Manager
(the step will not commit) and the Work completes with the tensor as it is (docs/design.md,
"Errors")."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ft.collectives import allreduce_quantized
from ft.utils.deadline import Deadline, to_seconds
from ft.work import _DummyWork  # torchft's name for a Work that already succeeded

__all__ = [
    "ManagedWork",
    "caller_cuda_device",
    "future_within",
    "managed_allreduce",
    "reporting_future",
]

# report(error, abort, phase): the Manager's way to fail the step (StepErrors.report).
Report = Callable[[Exception, bool, str], None]


def caller_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device, or None without CUDA (never initializes CUDA)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


def future_within(fut: torch.futures.Future, timeout: timedelta) -> torch.futures.Future:
    """A future with ``fut``'s outcome, or a :class:`TimeoutError` if ``fut`` has not completed
    ``timeout`` from now (``fut`` itself is left alone)."""
    if fut.done():
        return fut
    devices = (
        [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else None
    )
    out: torch.futures.Future = torch.futures.Future(devices=devices)
    lock = threading.Lock()
    settled = [False]

    def settle(set_outcome: Callable[[], None]) -> None:
        with lock:
            if settled[0]:
                return
            settled[0] = True
        set_outcome()

    def expire() -> None:
        settle(
            lambda: out.set_exception(
                TimeoutError(f"future did not complete within {timeout.total_seconds():g}s")
            )
        )

    timer = threading.Timer(max(0.0, to_seconds(timeout) or 0.0), expire)
    timer.daemon = True
    timer.start()

    def done(f: torch.futures.Future) -> None:
        timer.cancel()
        try:
            value = f.value()
        except Exception as e:  # noqa: BLE001 - passed on
            settle(lambda err=e: out.set_exception(err))
            return
        settle(lambda: out.set_result(value))

    fut.add_done_callback(done)
    return out


class ManagedWork(dist.Work):
    """Wraps a backend Work: failures are reported to the Manager, never raised.

    ``get_future()`` returns a future whose value is the reduced tensor (divided for AVG); it
    never completes with an error, so DDP's reducer and user callbacks never see one.
    ``wait(timeout)`` with a timeout that passes first reports a TimeoutError to the Manager
    (through ``on_timeout``: the step fails and nobody commits it) and returns False, as
    torchft's does.
    """

    def __init__(
        self,
        fut: torch.futures.Future,
        on_timeout: Optional[Callable[[Exception], None]] = None,
    ) -> None:
        super().__init__()
        self._fut = fut
        self._on_timeout = on_timeout

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        # Never raises: the callback chain turns failures into a reported error. For CUDA
        # values this makes the current stream wait (no CPU block).
        # torch's C++ callers pass 0 for "no timeout" (c10d's kNoTimeout).
        if timeout is not None and to_seconds(timeout) > 0 and not self._fut.done():
            finished = threading.Event()
            self._fut.add_done_callback(lambda _f: finished.set())
            if not Deadline.after(timeout).wait_event(finished):
                error = TimeoutError(
                    f"allreduce did not complete within {to_seconds(timeout):g}s "
                    "(the timeout given to wait())"
                )
                if self._on_timeout is not None:
                    self._on_timeout(error)
                return False
        self._fut.wait()
        return True

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        return self._fut.done()

    def get_future(self) -> torch.futures.Future:
        return self._fut


def managed_allreduce(
    pg: Any,
    tensor: torch.Tensor,
    participants: int,
    should_quantize: Union[bool, torch.dtype],
    reduce_op: Any,
    report: Report,
) -> dist.Work:
    """Allreduces ``tensor`` in place on ``pg`` (Manager.allreduce: AVG as SUM divided by
    ``participants``, quantized on request); failures go to ``report``, never raised."""
    pg_op = reduce_op
    divide = reduce_op == ReduceOp.AVG
    if divide:
        if not torch.is_floating_point(tensor):
            raise ValueError("ReduceOp.AVG needs a floating point tensor")
        pg_op = ReduceOp.SUM
    try:
        opts = dist.AllreduceOptions()
        opts.reduceOp = pg_op
        if should_quantize and torch.is_floating_point(tensor):
            wire = torch.int8 if should_quantize is True else should_quantize
            work = allreduce_quantized([tensor], opts, pg, wire_dtype=wire)
        else:
            work = pg.allreduce([tensor], opts)
        fut = work.get_future()
    except Exception as e:  # noqa: BLE001
        report(e, True, "allreduce")
        return _DummyWork(tensor)

    stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

    def callback(f: torch.futures.Future) -> torch.Tensor:
        try:
            f.value()
        except Exception as e:  # noqa: BLE001
            report(e, False, "allreduce")
            return tensor
        if divide and participants > 0:
            if stream is None:
                tensor.div_(participants)
            else:
                # Run on the issuing stream, ordered after the op and before later waiters.
                cur = torch.cuda.current_stream(tensor.device)
                stream.wait_stream(cur)
                with torch.cuda.stream(stream):
                    tensor.div_(participants)
                cur.wait_stream(stream)
        return tensor

    return ManagedWork(fut.then(callback), on_timeout=lambda e: report(e, True, "allreduce"))


def reporting_future(
    fut: torch.futures.Future, default: Any, timeout: timedelta, report: Report
) -> torch.futures.Future:
    """A future that never fails (Manager.wrap_future): ``fut``'s value, or ``default`` once
    ``fut`` fails or has not completed within ``timeout``, the error then going to
    ``report``."""

    def callback(f: torch.futures.Future) -> Any:
        try:
            return f.value()
        except Exception as e:  # noqa: BLE001
            report(e, False, "allreduce")
            return default

    return future_within(fut, timeout).then(callback)
