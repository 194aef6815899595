"""The Manager's quorum thread uses the caller's CUDA device when it reconfigures the process
group (NCCL communicators belong to the thread's current device). GPU only: on one GPU the
test checks that configure() sees the caller's device; with two or more, the caller uses
cuda:1, the case where a thread left on cuda:0 went wrong."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import ft
from tests.manager.inproc import lighthouse, make_manager

pytestmark = pytest.mark.gpu


class _RecordingGroup(ft.ProcessGroupGloo):
    """The CPU group (the device under test is the thread's, not the group's), recording the
    current CUDA device of every configure() call."""

    def __init__(self) -> None:
        super().__init__(timeout=timedelta(seconds=10))
        self.devices = []

    def configure(self, *args, **kwargs):
        self.devices.append(torch.cuda.current_device())
        return super().configure(*args, **kwargs)


@pytest.mark.parametrize("async_quorum", [False, True])
def test_configure_runs_on_the_callers_cuda_device(async_quorum):
    device = 1 if torch.cuda.device_count() > 1 else 0
    torch.cuda.set_device(device)
    torch.zeros(1, device="cuda")  # initializes CUDA in this thread, as training would
    lh = lighthouse(min_replicas=1)
    pg = _RecordingGroup()
    m = make_manager(lh.address(), "gpu-dev", use_async_quorum=async_quorum)
    m._pg = pg
    try:
        m.start_quorum()
        m.wait_quorum()
        assert pg.devices and all(d == device for d in pg.devices), pg.devices
    finally:
        m.shutdown()
        lh.shutdown()


def test_should_commit_waits_for_the_work_queued_on_the_current_stream():
    """should_commit() decides only after the work queued on the caller's current stream has
    run, so that a collective still in flight there (FSDP issues its own, straight on the
    process group) has had its chance to fail and veto the step. Here the stream holds a
    sleep kernel (about 0.2 s at 1.5 GHz, longer than the vote takes): it must be done when
    should_commit() returns."""
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    lh = lighthouse(min_replicas=1)
    m = make_manager(lh.address(), "gpu-commit", use_async_quorum=False)
    try:
        m.start_quorum()
        stream = torch.cuda.current_stream()
        torch.cuda._sleep(300_000_000)
        assert not stream.query(), "the sleep kernel ended before the vote: make it longer"
        assert m.should_commit()
        assert stream.query(), "should_commit() returned with work still queued on the stream"
    finally:
        m.shutdown()
        lh.shutdown()
