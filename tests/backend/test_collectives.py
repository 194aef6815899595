"""Every collective on the ft backend against torch's own Gloo, bit for bit."""

import pytest
import torch

from tests.procs import Workers, free_port


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_match_torch_gloo(world_size):
    dtypes = ["float32", "float64", "int32", "int64", "bfloat16"]
    with Workers("tests.backend.workers:collectives_vs_gloo", world_size, dtypes=dtypes) as w:
        reports = w.join(timeout=90)
    for rank, report in enumerate(reports):
        assert report.pop("host_staged_ops") == 0
        bad = [case for case, ok in report.items() if not ok]
        assert not bad, f"rank {rank}: differs from torch Gloo: {bad}"
        assert len(report) > 40


def test_host_staged_collectives_match_torch_gloo():
    # The path a lane takes when its ranks share a GPU (no GPU here: CPU tensors are staged
    # into fresh CPU copies; tests/gpu/test_shared_gpu.py runs it on CUDA tensors).
    dtypes = ["float32", "int64", "bfloat16"]
    with Workers(
        "tests.backend.workers:collectives_vs_gloo", 3, dtypes=dtypes, host_staged=True
    ) as w:
        reports = w.join(timeout=90)
    for rank, report in enumerate(reports):
        staged = report.pop("host_staged_ops")
        bad = [case for case, ok in report.items() if not ok]
        assert not bad, f"rank {rank}: host-staged differs from torch Gloo: {bad}"
        assert staged >= len(report), (staged, len(report))  # every op went through staging


@pytest.mark.parametrize(
    "ids, expected",
    [
        ([], []),
        (["GPU-a"], []),
        (["GPU-a", "GPU-b", "GPU-c"], []),
        (["GPU-a", "GPU-a"], [[0, 1]]),
        (["GPU-a", "GPU-b", "GPU-a"], [[0, 2]]),
        (["GPU-a", "GPU-b", "GPU-a", "GPU-b", "GPU-c"], [[0, 2], [1, 3]]),
        (["GPU-x"] * 3, [[0, 1, 2]]),
    ],
)
def test_shared_gpu_decision(ids, expected):
    from ft import _C

    assert _C._shared_devices(ids) == expected


@pytest.mark.parametrize("init_method", ["store", "tcp"])
def test_init_process_group_ft_reaches_every_collective(init_method):
    ws = 3
    method = None if init_method == "store" else f"tcp://127.0.0.1:{free_port()}"
    with Workers("tests.backend.workers:torch_api_on_ft", ws, init_method=method) as w:
        results = w.join(timeout=60)
    total = sum(range(1, ws + 1))
    for rank, r in enumerate(results):
        assert r["backend"] == "ft" and r["size"] == ws and r["rank"] == rank
        assert torch.equal(r["all_reduce"], torch.full((3,), float(total)))
        assert torch.equal(r["avg"], torch.full((3,), total / ws))
        assert torch.equal(
            r["all_gather"], torch.arange(float(ws)).repeat_interleave(2).view(ws, 2)
        )
        assert torch.equal(
            r["all_gather_into_tensor"], torch.arange(float(ws)).repeat_interleave(2)
        )
        assert torch.equal(
            r["reduce_scatter_tensor"], (torch.arange(2.0 * ws) * ws)[2 * rank : 2 * rank + 2]
        )
        assert torch.equal(r["reduce_scatter"], torch.full((2,), float(rank * ws)))
        assert torch.equal(r["broadcast"], torch.full((2,), float(ws - 1)))
        assert torch.equal(
            r["all_to_all_single"], torch.tensor([float(rank + 10 * s) for s in range(ws)])
        )
        if rank == 0:
            assert torch.equal(r["reduce"], torch.full((2,), float(total)))
            assert torch.equal(r["gather"], torch.arange(float(ws)))
        assert torch.equal(r["scatter"], torch.full((1,), float(rank)))
        if rank == 1:
            assert torch.equal(r["recv"], torch.full((2,), 7.0))
        assert torch.equal(r["future"], torch.full((1,), float(ws)))
        assert r["completed"]


def test_ddp_on_ft_is_bit_identical_to_gloo():
    with Workers("tests.backend.workers:ddp_ft_vs_gloo", 2) as w:
        results = w.join(timeout=90)
    for r in results:
        for kind in ("ft_facade", "ft_init"):
            assert r[kind]["losses"] == r["gloo"]["losses"], kind
            for a, b in zip(r[kind]["params"], r["gloo"]["params"]):
                assert torch.equal(a, b), kind
    # and the replicas agree with each other
    for a, b in zip(results[0]["gloo"]["params"], results[1]["gloo"]["params"]):
        assert torch.equal(a, b)
