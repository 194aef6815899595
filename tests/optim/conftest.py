"""Helpers for the multi-process optimizer tests.

Ranks are separate ``python tests/optim/_zero_worker.py`` processes (independent of pytest's
import mode).  Each run gets a fresh TCPStore on a free loopback port, owned by the pytest
process; every wait is bounded and every child is reaped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import List, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_zero_worker.py")


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


def run_ranks(scenario: str, world: int, out_dir: Path, backend: str = "gloo",
              timeout: float = 120.0, extra: Sequence[str] = ()) -> List[Path]:
    """Run ``world`` worker processes of ``scenario``; fail the test if any fails or hangs.

    Returns the per-rank result files (``out_dir/rank{r}.pt``).
    """
    import torch.distributed as dist

    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=timeout),
                          wait_for_workers=False)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    procs: List[subprocess.Popen] = []
    logs = []
    try:
        for r in range(world):
            log = open(out_dir / f"rank{r}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--scenario", scenario, "--rank", str(r),
                 "--world", str(world), "--port", str(store.port), "--backend", backend,
                 "--out", str(out_dir), *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO)))
        deadline = time.monotonic() + timeout
        failed = None
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = f"rank {bad[0][0]} exited with {bad[0][1]}"
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        else:
            failed = f"timed out after {timeout:.0f}s"
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait(timeout=10)
            text = "\n".join(f"--- rank {r} ---\n" + (out_dir / f"rank{r}.log").read_text(
                errors="replace")[-4000:] for r in range(world))
            pytest.fail(f"{scenario}: {failed}\n{text}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        for log in logs:
            log.close()
        del store
    return [out_dir / f"rank{r}.pt" for r in range(world)]


@pytest.fixture(scope="session")
def ranks():
    """The :func:`run_ranks` helper."""
    return run_ranks


@pytest.fixture(scope="session")
def ft_skip():
    """The :func:`ft_backend_skip_reason` helper."""
    return ft_backend_skip_reason
