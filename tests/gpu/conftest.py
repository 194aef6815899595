"""GPU tests: skipped cleanly unless ft has its NCCL path and a CUDA device is visible.

Run them on a GPU machine with tests/gpu/run_on_device.sh. NCCL refuses two ranks on one
GPU, so on one GPU these use world size 1, plus world-2 inits whose second rank is a
CPU-only peer that never creates its NCCL communicator.
"""

import pytest
import torch


def gpu_skip_reason():
    try:
        import ft
    except Exception as e:  # pragma: no cover - depends on the build
        return f"ft does not import: {e}"
    if not ft._C.has_nccl:
        return "ft was built without NCCL (CPU-only torch)"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return None


SKIP_REASON = gpu_skip_reason()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device and an NCCL build of ft")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if SKIP_REASON is not None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
