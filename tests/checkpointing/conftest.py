import pytest
import torch


from tests.checkpointing import ckpt_testlib


@pytest.fixture(scope="session")
def payload_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """build_state() saved once for the sender children (a trusted local file written by the
    test itself), so that each child need not rebuild the model and optimizer."""
    path = str(tmp_path_factory.mktemp("ckpt") / "payload.pt")
    torch.save(ckpt_testlib.build_state(), path)
    return path
