"""torchft's process-group family in ft: store client, wrappers, dummy, Baby*, XCCL, register,
and the quantized reduce-scatter (2 real processes). Real process groups throughout: ft's
Gloo group (world size 1 in this process, or 2 processes) and torch's Gloo."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

import ft
from ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    FakeProcessGroupWrapper,
    ManagedProcessGroup,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupBabyXCCL,
    ProcessGroupDummy,
    ProcessGroupFt,
    ProcessGroupWrapper,
    ProcessGroupXCCL,
    _ErrorSwallowingWork,
    create_store_client,
    trigger_nccl_fr_trace_through_pipe,
)
from ft.work import _DummyWork
from tests.backend.torchft_workers import SHAPES, rs_inputs
from tests.procs import Workers, free_port, make_store

TO = timedelta(seconds=10)


@pytest.fixture
def store():
    return make_store()


def _addr(store: Any, prefix: str) -> str:
    return f"127.0.0.1:{store.port}/{prefix}"


def _ft_group(store: Any, prefix: str) -> ft.ProcessGroupGloo:
    pg = ft.ProcessGroupGloo(timeout=TO)
    pg.configure(_addr(store, prefix), "test", 0, 1)
    return pg


def _sum_opts() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


# ------------------------------------------------------------------ create_store_client


def test_create_store_client_prefixes_keys(store: Any) -> None:
    client = create_store_client(_addr(store, "a/b"), timeout=TO)
    client.set("k", b"v")
    assert store.get("a/b/k") == b"v"


def test_create_store_client_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="host:port/prefix"):
        create_store_client("no-port-here", timeout=TO)
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=f"127.0.0.1:{port}"):
        create_store_client(f"127.0.0.1:{port}/x", timeout=timedelta(seconds=0.5))
    assert time.monotonic() - t0 < 3.0


# ------------------------------------------------------------------ ProcessGroupDummy


def test_dummy_group_moves_nothing() -> None:
    pg = ProcessGroupDummy(0, 1)
    assert (pg.rank(), pg.size(), pg.getBackendName()) == (0, 1, "ft-dummy")
    t = torch.arange(4.0)
    dist.all_reduce(t, group=pg)  # torch's front end calls the Python override
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    out = [[torch.zeros(2)]]
    work = pg.allgather(out, [torch.ones(2)], AllgatherOptions())
    assert isinstance(work, _DummyWork) and work.wait()
    assert out[0][0].tolist() == [1.0, 1.0]
    pg.configure("ignored:1/x", "r", 0, 1, quorum_id=3)
    assert pg.configure_count == 1
    assert ProcessGroupDummy(2, 4).rank() == 2
    with pytest.raises(ValueError, match="out of range"):
        ProcessGroupDummy(1, 1)


# ------------------------------------------------------------------ ProcessGroupWrapper


class _FourArgDummy(ProcessGroupDummy):
    """A torchft-style group: configure takes exactly torchft's four arguments."""

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int) -> None:
        self.configure_count += 1


def test_wrapper_configures_its_group_with_the_arguments_it_takes() -> None:
    inner = _FourArgDummy(0, 1)
    wrapper = ProcessGroupWrapper(pg=inner)
    assert wrapper.parent is inner
    # The Manager's extra keywords are dropped for a group that does not take them.
    wrapper.configure("addr:1/x", "r", 0, 1, quorum_id=5, group_rank=0, group_world_size=1)
    assert inner.configure_count == 1
    assert repr(wrapper) == "ProcessGroupWrapper(pg=_FourArgDummy())"
    wrapper.abort()
    assert wrapper.parent is inner  # a wrapped group survives abort (torchft drops it)


class _TorchGlooWrapper(ProcessGroupWrapper):
    """Creates torch's own Gloo group at every configure."""

    def _create_pg(self, store: Any, rank: int, world_size: int) -> dist.ProcessGroup:
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        backend = dist.ProcessGroupGloo(store, rank, world_size, TO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg


def test_wrapper_creates_and_replaces_its_group(store: Any) -> None:
    wrapper = _TorchGlooWrapper(timeout=TO)
    with pytest.raises(RuntimeError, match="configure"):
        wrapper.parent  # noqa: B018 (the access itself must raise)
    wrapper.configure(_addr(store, "w0"), "r", 0, 1)
    t = torch.full((3,), 2.0)
    wrapper.allreduce([t], _sum_opts()).wait()
    assert t.tolist() == [2.0, 2.0, 2.0]
    out = torch.zeros(3)
    dist.all_gather_single(out, t, group=wrapper)  # torch's front end, via the wrapper
    assert out.tolist() == [2.0, 2.0, 2.0]
    wrapper._allgather_base(out, t).wait()  # what ft.collectives calls
    assert out.tolist() == [2.0, 2.0, 2.0]
    assert (wrapper.size(), wrapper.rank()) == (1, 0)
    first = wrapper.parent
    wrapper.abort(errored=False)
    with pytest.raises(RuntimeError, match="configure"):
        wrapper.parent  # noqa: B018 (a created group is dropped at abort: the access raises)
    wrapper.configure(_addr(store, "w1"), "r", 0, 1)
    assert wrapper.parent is not first
    wrapper.barrier().wait()


# ------------------------------------------------------------------ ErrorSwallowing / Fake


def test_error_swallowing_wrapper_swallows_records_and_skips(store: Any) -> None:
    pg = _ft_group(store, "es0")
    fake = FakeProcessGroupWrapper(pg)
    wrapper = ErrorSwallowingProcessGroupWrapper(fake)

    t = torch.ones(2)
    work = wrapper.allreduce([t], _sum_opts())
    assert isinstance(work, _ErrorSwallowingWork) and work.wait()
    assert wrapper.error() is None

    fake.report_future_error(RuntimeError("injected"))
    work = wrapper.allreduce([t], _sum_opts())
    assert work.wait() is True  # swallowed
    assert isinstance(wrapper.error(), RuntimeError) and "injected" in str(wrapper.error())

    # Every op after the error is skipped: a completed dummy holding the untouched outputs.
    u = torch.full((2,), 7.0)
    work = wrapper.allreduce([u], _sum_opts())
    assert isinstance(work, _DummyWork)
    assert work.get_future().wait()[0] is u
    assert isinstance(wrapper.broadcast([u], dist.BroadcastOptions()), _DummyWork)
    # A second error is a consequence: the first one stays recorded.
    wrapper.report_error(ValueError("later"))
    assert "injected" in str(wrapper.error())

    # configure starts over.
    wrapper.configure(_addr(store, "es1"), "test", 0, 1)
    assert wrapper.error() is None
    assert isinstance(wrapper.allreduce([u], _sum_opts()), _ErrorSwallowingWork)
    pg.shutdown()


def test_error_swallowing_wrapper_swallows_a_real_failure(store: Any) -> None:
    pg = _ft_group(store, "es-real")
    wrapper = ErrorSwallowingProcessGroupWrapper(pg)
    pg.abort()  # the generation is gone: its ops fail
    t = torch.ones(2)
    work = wrapper.allreduce([t], _sum_opts())
    assert work.get_future().wait()[0] is t  # the default result, no exception
    work.wait()
    assert wrapper.error() is not None
    assert isinstance(wrapper.allreduce([t], _sum_opts()), _DummyWork)
    pg.shutdown()


def test_fake_wrapper_fails_the_next_op_once(store: Any) -> None:
    pg = _ft_group(store, "fk")
    fake = FakeProcessGroupWrapper(pg)
    fake.report_future_error(TimeoutError("injected"))
    t = torch.ones(2)
    work = fake.allreduce([t], _sum_opts())
    with pytest.raises(TimeoutError, match="injected"):
        work.get_future().wait()  # the exception as given, not wrapped
    with pytest.raises(TimeoutError, match="injected"):
        work.wait()
    assert fake.allreduce([t], _sum_opts()).wait()  # once only
    fake.report_future_error(RuntimeError("cleared"))
    fake.configure(_addr(store, "fk2"), "test", 0, 1)  # configure drops the pending one
    assert fake.allreduce([t], _sum_opts()).wait()
    pg.shutdown()


# ------------------------------------------------------------------ ManagedProcessGroup


class _RecordingManager:
    """Stands in for ft.Manager: records allreduce calls, answers like the Manager."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg
        self.calls: List[Any] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = dist.ReduceOp.AVG) -> dist.Work:
        self.calls.append((tensor, reduce_op))
        tensor.mul_(2)
        return _DummyWork(tensor)

    def num_participants(self) -> int:
        return 3


def test_managed_group_goes_through_the_manager() -> None:
    manager = _RecordingManager(ProcessGroupDummy(0, 1))
    pg = ManagedProcessGroup(manager)  # type: ignore[arg-type]
    assert pg.size() == 3 and pg.getBackendName() == "ft-dummy"
    a, b = torch.ones(2), torch.ones(1)
    pg.allreduce([a], _sum_opts()).wait()
    assert manager.calls[0][1] == dist.ReduceOp.SUM and a.tolist() == [2.0, 2.0]
    work = pg.allreduce([a, b], dist.ReduceOp.AVG)
    assert work.get_future().wait() == [a, b]
    assert len(manager.calls) == 3 and b.tolist() == [2.0]


# ------------------------------------------------------------------ Baby, XCCL, abort flag


def test_baby_groups_are_ft_groups_with_torchfts_constructor(store: Any) -> None:
    pg = ProcessGroupBabyGloo(timeout=5.0)  # seconds, as torchft takes them
    assert isinstance(pg, ProcessGroupBaby) and isinstance(pg, ProcessGroupFt)
    pg.configure(_addr(store, "baby"), "test", 0, 1)
    t = torch.ones(2)
    pg.allreduce([t], _sum_opts()).wait()
    assert t.tolist() == [1.0, 1.0]
    pg.abort(errored=False)
    pg.shutdown()
    nccl = ProcessGroupBabyNCCL(timeout=timedelta(seconds=3))
    assert isinstance(nccl, ft.ProcessGroupNCCL) and isinstance(nccl, ProcessGroupBaby)
    assert ft.ProcessGroupBabyNCCL is ProcessGroupBabyNCCL


@pytest.mark.skipif(hasattr(torch, "xpu") and torch.xpu.is_available(), reason="has an XPU")
@pytest.mark.parametrize("cls", [ProcessGroupXCCL, ProcessGroupBabyXCCL])
def test_xccl_groups_name_the_missing_xpu(cls: type) -> None:
    pg = cls(timeout=timedelta(seconds=1))
    with pytest.raises(RuntimeError, match=r"Intel XPU device.*torch\.xpu\.is_available"):
        pg.configure("127.0.0.1:1/never-dialled", "r", 0, 1)


def test_abort_takes_torchfts_errored_flag(store: Any) -> None:
    pg = _ft_group(store, "ab")
    pg.abort(errored=False)
    assert pg.errored() is not None  # aborted: the generation's error is sticky
    pg.configure(_addr(store, "ab2"), "test", 0, 1)
    assert pg.errored() is None
    pg.shutdown()


# ------------------------------------------------------------------ register / unregister


def test_register_makes_the_group_usable_by_functional_collectives(store: Any) -> None:
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    import torch.distributed._functional_collectives as funcol

    pg = _ft_group(store, "reg")
    with pytest.raises(RuntimeError, match="init_process_group"):
        pg.register("too-early")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = pg.register(f"surface-{os.getpid()}")
        assert group is pg
        y = funcol.all_reduce(torch.full((2,), 3.0), "sum", group)
        assert torch.as_tensor(y).tolist() == [3.0, 3.0]
        pg.unregister()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ flight recorder pipe


def test_trigger_nccl_fr_trace_through_pipe_never_blocks(tmp_path: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", raising=False)
    assert trigger_nccl_fr_trace_through_pipe(0) is False
    prefix = str(tmp_path / "fr_")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", prefix)
    assert trigger_nccl_fr_trace_through_pipe(0) is False  # no pipe
    os.mkfifo(prefix + "1.pipe")
    assert trigger_nccl_fr_trace_through_pipe(1) is False  # a pipe nobody reads: no hang
    reader = os.open(prefix + "1.pipe", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert trigger_nccl_fr_trace_through_pipe(1) is True
        assert os.read(reader, 16) == b"1\n"
    finally:
        os.close(reader)


# ------------------------------------------------------------------ quantized reduce-scatter


def _expected_shares(world_size: int) -> List[torch.Tensor]:
    """Rank r's share of the fp32 SUM, computed here from every rank's inputs."""
    per_rank = [rs_inputs(r) for r in range(world_size)]
    shares = []
    for r in range(world_size):
        parts = []
        for i, shape in enumerate(SHAPES):
            total = sum(inputs[i] for inputs in per_rank).reshape(shape[0], -1)
            rows = -(-shape[0] // world_size) * world_size
            padded = torch.zeros(rows, total.shape[1])
            padded[: shape[0]] = total
            step = rows // world_size
            parts.append(padded[r * step : (r + 1) * step].reshape(-1))
        shares.append(torch.cat(parts))
    return shares


def test_reduce_scatter_quantized_matches_plain_reduce_scatter_on_two_processes() -> None:
    world = 2
    with Workers("tests.backend.torchft_workers:reduce_scatter_quantized_vs_plain", world) as w:
        results = w.join(timeout=90)
    expected = _expected_shares(world)
    # int8 with one scale per block: each rank's value is off by at most absmax(block)/254;
    # bounded here by the largest input magnitude over all ranks.
    absmax = max(t.abs().max().item() for r in range(world) for t in rs_inputs(r))
    tol_sum = world * absmax / 254 * 1.001
    for rank, res in enumerate(results):
        assert res["padded"] == [(6, 1), (4, 4), (8, 2)]
        plain = res["plain_sum"]
        torch.testing.assert_close(plain, expected[rank])  # the layout is torchft's
        assert (res["sum"] - plain).abs().max().item() <= tol_sum
        assert (res["avg"] - plain / world).abs().max().item() <= tol_sum / world
        assert (res["sum"] - plain).abs().max().item() > 0  # it really was quantized
    assert not torch.equal(results[0]["plain_sum"], results[1]["plain_sum"])
