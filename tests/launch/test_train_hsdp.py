"""examples/train_hsdp.py under ft-launch: 2 replica groups x 2 FSDP2 ranks, ranks killed with
SIGKILL; each killed group restarts, heals its DTensor shards from the other group, and every
rank of every group ends with the same full state.

Runs through tests/launch/test_launch.py's ``run_launch`` (a real ``python -m ft.launch`` with a
hard ``--timeout``, a bounded wait, and a check that every process it started is gone).
"""

from __future__ import annotations

import os

from tests.launch.test_launch import ROOT, check_example_survives

EXAMPLE = os.path.join(ROOT, "examples", "train_hsdp.py")


def test_train_hsdp_survives_kills():
    check_example_survives(
        EXAMPLE,
        "--replicas 2 --ranks-per-group 2 --chaos kill --every 6 --seed 1 --max-steps 150",
        4,
        200,
        step_sleep=0.05,
    )
