"""Helpers for the multi-process optimizer tests.

Ranks are separate ``python -m tests.optim._zero_worker`` processes (tests/procs.py's harness).
Each run gets a fresh TCPStore on a free loopback port, owned by the pytest process; every wait
is bounded and every child is reaped.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import List, Sequence

import pytest

from tests.procs import Procs, make_store, wait_all

WORKER = "tests.optim._zero_worker"


def ft_backend_skip_reason() -> str | None:
    """Why the "ft" torch backend cannot be used here, or None if it can."""
    try:
        import ft  # noqa: F401  (registers the backend)
    except Exception as e:  # pragma: no cover - depends on the build
        return f"import ft failed: {e!r}"
    import torch.distributed as dist

    if "ft" not in dist.Backend.backend_list:
        return "torch backend 'ft' is not registered yet (import ft did not register it)"
    return None


def run_ranks(
    scenario: str,
    world: int,
    out_dir: Path,
    backend: str = "gloo",
    timeout: float = 120.0,
    extra: Sequence[str] = (),
) -> List[Path]:
    """Run ``world`` worker processes of ``scenario``; fail the test if any fails or hangs.

    Returns the per-rank result files (``out_dir/rank{r}.pt``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    store = make_store(timeout)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    with Procs() as group:
        wait_all(
            [
                group.python(
                    WORKER,
                    "--scenario",
                    scenario,
                    "--rank",
                    r,
                    "--world",
                    world,
                    "--port",
                    store.port,
                    "--backend",
                    backend,
                    "--out",
                    out_dir,
                    *extra,
                    env=env,
                    log_path=out_dir / f"rank{r}.log",
                    name=f"{scenario} rank {r}",
                )
                for r in range(world)
            ],
            timeout,
        )
    return [out_dir / f"rank{r}.pt" for r in range(world)]


@pytest.fixture(scope="session")
def ranks():
    """The :func:`run_ranks` helper."""
    return run_ranks


@pytest.fixture(scope="session")
def ft_skip():
    """The :func:`ft_backend_skip_reason` helper."""
    return ft_backend_skip_reason


@pytest.fixture(scope="session")
def backend_ranks(tmp_path_factory):
    """``run(scenario, world, backend, name, timeout)``: :func:`run_ranks` on ``backend`` into
    a new temporary folder ``name``; returns (that folder, the per-rank result files). Skips
    the test on "ft" where that backend cannot be used."""

    def run(scenario: str, world: int, backend: str, name: str, timeout: float):
        if backend == "ft" and (reason := ft_backend_skip_reason()):
            pytest.skip(reason)
        out = tmp_path_factory.mktemp(name)
        return out, run_ranks(scenario, world, out, backend=backend, timeout=timeout)

    return run


@pytest.fixture
def pg1():
    """A one-rank Gloo default group in this process (bad-input checks need no peers)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
