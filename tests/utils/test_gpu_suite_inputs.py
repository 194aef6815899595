"""The GPU tests cannot run here, but what they hand ft can be checked here: a GPU test that
passes ft an input ft now refuses (a job secret shorter than ft accepts, say) would otherwise
go stale unseen until the next GPU run."""

from __future__ import annotations

import importlib

import pytest

from ft.utils.auth import JobSecret


@pytest.mark.parametrize("module", ["tests.gpu.test_cuda_checkpoint"])
def test_gpu_tests_use_secrets_ft_accepts(module):
    secret = importlib.import_module(module).SECRET
    JobSecret(secret)  # raises ValueError for a secret ft refuses
