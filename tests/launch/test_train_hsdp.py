"""examples/train_hsdp.py under ft-launch: 2 replica groups x 2 FSDP2 ranks, ranks killed with
SIGKILL; each killed group restarts, heals its DTensor shards from the other group, and every
rank of every group ends with the same full state.

Runs through tests/launch/test_launch.py's ``run_launch`` (a real ``python -m ft.launch`` with a
hard ``--timeout``, a bounded wait, and a check that every process it started is gone).
"""

from __future__ import annotations

import os

from tests.launch.test_launch import ROOT, _check_real_run, run_launch

EXAMPLE = os.path.join(ROOT, "examples", "train_hsdp.py")


def test_train_hsdp_survives_kills():
    rc, out, s = run_launch(
        "--replicas 2 --ranks-per-group 2 --chaos kill --every 6 --seed 1 --max-steps 150",
        [EXAMPLE, '--step-sleep', '0.05', '--final-wait', '60'],
        200,
    )
    _check_real_run(rc, out, s, ranks=4)
