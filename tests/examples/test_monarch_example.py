"""examples/monarch/train_distributed.py end to end: a Monarch controller starts a lighthouse and
two replica groups of two trainer processes on this host, one trainer SIGKILLs itself at step 15,
the controller restarts its group on a new proc mesh, the new group heals from the live one, and
every rank of both groups ends with the same state.

Needs Monarch (``pip install torchmonarch``; tried with torchmonarch 0.7.0 and torch 2.13 CPU).
CI does not install it: there the test is skipped (``pytest.importorskip("monarch")``). To run it,
put Monarch on the path, for example::

    PYTHONPATH=/path/to/monarch/site python -m pytest -q tests/examples/test_monarch_example.py

The example runs as a child process with a deadline of its own (``--deadline``) and a bounded wait
here; it leads a process group of its own, killed after the test whatever happened. Every process
it started carries a marker in its environment, and the test checks that none is left after it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from typing import List

import pytest

from tests.procs import REPO, Proc

pytest.importorskip("monarch")

EXAMPLE = os.path.join(REPO, "examples", "monarch", "train_distributed.py")
TIMEOUT_S = 240
STEPS = 60
KILL_AT = 15


def _pids_with(marker: str) -> List[int]:
    """Processes of this user whose environment holds ``marker``."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def test_monarch_example_restarts_and_heals(tmp_path):
    marker = f"FT_MONARCH_TEST_RUN={uuid.uuid4().hex}"
    key, value = marker.split("=")
    summary_path = tmp_path / "summary.json"
    argv = [
        sys.executable,
        EXAMPLE,
        "--replica-count", "2",
        "--ranks-per-group", "2",
        "--steps", STEPS,
        "--kill-at-step", KILL_AT,
        "--deadline", TIMEOUT_S - 30,
        "--summary-json", summary_path,
    ]  # fmt: skip
    t0 = time.monotonic()
    with Proc(
        argv, env=dict(os.environ, **{key: value}), cwd=tmp_path, name="monarch-example",
        process_group=True,
    ) as proc:  # fmt: skip
        rc = proc.wait(timeout=TIMEOUT_S)
        out = proc.output()
    elapsed = time.monotonic() - t0

    # Every process the run started is gone (the example stops every proc mesh it spawned).
    deadline = time.monotonic() + 15
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _pids_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"processes left after the run: {left}\n{out[-4000:]}"

    assert rc == 0, f"exit {rc} after {elapsed:.0f}s:\n{out[-8000:]}"
    summary = json.loads(summary_path.read_text())
    assert summary["ok"], summary["problems"]

    # One failure was injected, into the last rank of the last group, and that group (and only
    # that one) was restarted once.
    assert out.count("INJECTING FAILURE") == 1, out[-8000:]
    assert [(f["replica"], f["attempt"]) for f in summary["failures"]] == [(1, 0)]

    reports = summary["reports"]
    assert sorted((r["replica"], r["rank"]) for r in reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in reports:
        assert r["attempt"] == (1 if r["replica"] == 1 else 0), r
    # The restarted group healed from the live one, past the step the failure happened at.
    for r in reports:
        if r["replica"] == 1:
            assert any(h["to_step"] >= KILL_AT for h in r["heals"]), r
    # Identical state at the same final step, everywhere.
    assert len({r["hash"] for r in reports}) == 1, reports
    assert len({r["final_step"] for r in reports}) == 1, reports
    assert reports[0]["final_step"] >= STEPS
