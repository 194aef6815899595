"""The launcher's child processes: how one is started, and how they are reaped.

Contract:
* :func:`spawn_child` is the one way ft-launch starts a child (ranks and warm standbys alike):
  its own session, stdout and stderr on one text pipe.
* :func:`reap` waits for children until a deadline and never signals them.
"""

from __future__ import annotations

import subprocess
from typing import Any, Dict, List, Sequence

from ft.utils.deadline import Deadline


def spawn_child(argv: Sequence[str], env: Dict[str, str], stdin: Any) -> subprocess.Popen:
    """Starts one child of the launcher, its stdout and stderr on one text pipe."""
    return subprocess.Popen(
        list(argv),
        env=env,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a terminal's Ctrl-C goes to the launcher only
        bufsize=1,
        text=True,
        errors="replace",
    )


def reap(procs: Sequence[subprocess.Popen], deadline: Deadline) -> List[subprocess.Popen]:
    """Waits for each of ``procs`` to exit until ``deadline``; returns those still running."""
    running = []
    for proc in procs:
        try:
            proc.wait(timeout=deadline.remaining())
        except subprocess.TimeoutExpired:
            running.append(proc)
    return running
