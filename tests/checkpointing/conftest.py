import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ckpt_testlib  # noqa: E402


@pytest.fixture(scope="session")
def payload_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """build_state() saved once for the sender children (a trusted local file written by the
    test itself), so that each child need not rebuild the model and optimizer."""
    path = str(tmp_path_factory.mktemp("ckpt") / "payload.pt")
    torch.save(ckpt_testlib.build_state(), path)
    return path
