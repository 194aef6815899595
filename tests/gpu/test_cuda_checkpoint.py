"""A replica's CUDA state healed from another process, over both checkpoint paths.

The source is a real second process (tests/checkpointing/ckpt_peer.py) holding the state on
the GPU; the receiver places it on the GPU. Both share the one GPU (no NCCL is involved).
"""

from datetime import timedelta

import pytest
import torch

from ft.checkpointing import HTTPTransport

from tests.checkpointing.ckpt_testlib import Peer, assert_same

TO = timedelta(seconds=30)


def cuda_state():
    """Deterministic: built on the CPU from a fixed seed, then moved to the GPU."""
    g = torch.Generator().manual_seed(99)
    big = torch.randn(1 << 20, generator=g)  # 4 MiB: the receiver's large-tensor path
    weight = torch.randn(64, 48, generator=g)
    return {
        "model": {
            "big": big.cuda(),
            "weight": weight.cuda(),
            "weight_t": weight.cuda().t(),  # a non-contiguous view
            "half": torch.randn(333, generator=g).to(torch.bfloat16).cuda(),
            "ids": torch.randint(-(2**40), 2**40, (77,), generator=g).cuda(),
            "scalar": torch.tensor(3.25).cuda(),
            "empty": torch.empty(0, 5).cuda(),
        },
        "optim": {"momentum": (big * 0.5).cuda(), "cpu_step": torch.tensor(17)},
        "torchft": {"step": 5, "batches_committed": 40},
    }


def on_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: on_cpu(v) for k, v in tree.items()}
    return tree


@pytest.fixture(scope="module")
def payload_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cuda_ckpt") / "state.pt")
    torch.save(cuda_state(), path)  # loads back onto the GPU in the source process
    return path


# A job secret as ft requires one (16 bytes at least): the heal is signed as in production.
SECRET = "gpu-test-secret-0123456789"


@pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "http"])
def test_cuda_state_heals_bitwise_from_another_process(payload_path, same_host):
    peer = Peer("http", "--step", "5", "--token", SECRET, "--payload", payload_path)
    try:
        url = peer.expect("ready")["url"]
        expected = cuda_state()
        with HTTPTransport(
            TO,
            4,
            token=SECRET,
            advertise_host="127.0.0.1",
            device=torch.device("cuda"),
            same_host=same_host,
        ) as rx:
            got = rx.recv_checkpoint(0, url, 5, TO)
            assert rx.last_recv_path == ("same-host" if same_host else "http")
        for name, t in got["model"].items():
            assert t.is_cuda, f"model.{name} arrived on {t.device}"
        assert_same(on_cpu(expected), on_cpu(got))
    finally:
        peer.close()
