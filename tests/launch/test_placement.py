"""ft-launch places replica groups on GPUs as torchrun places ranks on a node: each group its own
slice (``CUDA_VISIBLE_DEVICES``), each rank its ``LOCAL_RANK`` within it.

This machine has no GPU: the end-to-end tests name GPUs with ``--gpus`` and check what every
rank of every attempt was given (the fake worker dumps its environment); that a CUDA process
then sees only its slice is CUDA's own behaviour, checked on a GPU host by
tests/gpu/run_on_device.sh (the demo's ranks report their GPU's UUID).
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from ft.launch import placement
from ft.launch.placement import GroupDevices, parse_gpus, place_groups, sharing_notes
from tests.launch.test_launch import FAKE, run_launch


def slices(placed):
    return [group.devices for group in placed]


@pytest.mark.parametrize(
    "gpus, groups, per, expected",
    [
        ([], 3, None, [(), (), ()]),  # CPU host: nothing exported
        (["0"], 3, None, [("0",), ("0",), ("0",)]),  # one GPU: every group shares it
        (["0", "1"], 3, None, [("0",), ("1",), ("0",)]),  # fewer GPUs than groups: round robin
        (["0", "1", "2"], 3, None, [("0",), ("1",), ("2",)]),
        ([str(i) for i in range(8)], 2, None, [("0", "1", "2", "3"), ("4", "5", "6", "7")]),
        ([str(i) for i in range(8)], 3, None, [("0", "1"), ("2", "3"), ("4", "5")]),
        ([str(i) for i in range(8)], 3, 1, [("0",), ("1",), ("2",)]),
        ([str(i) for i in range(4)], 3, 2, [("0", "1"), ("2", "3"), ("0", "1")]),  # wraps
        (["GPU-a", "GPU-b"], 2, None, [("GPU-a",), ("GPU-b",)]),  # UUIDs pass through
        (["3", "5"], 2, None, [("3",), ("5",)]),  # the launcher's own CUDA_VISIBLE_DEVICES
    ],
)
def test_place_groups(gpus, groups, per, expected):
    placed = place_groups(gpus, groups, per)
    assert slices(placed) == expected
    assert [group.gid for group in placed] == list(range(groups))


@pytest.mark.parametrize(
    "gpus, groups, per, message",
    [
        (["0", "1"], 2, 3, "--gpus-per-group 3 but only 2 GPU(s) visible"),
        ([], 2, 1, "--gpus-per-group 1 but no GPU is visible"),
        (["0"], 2, 0, "--gpus-per-group must be >= 1"),
        (["0"], 0, None, "num_groups must be >= 1"),
    ],
)
def test_place_groups_refuses(gpus, groups, per, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        place_groups(gpus, groups, per)


def test_visible_gpus_honours_cuda_visible_devices_first():
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}, lambda: 8) == ["2", "3"]
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: 8) == []
    assert placement.visible_gpus({}, lambda: 2) == ["0", "1"]


@pytest.mark.parametrize(
    "text, expected",
    [("0,1", ["0", "1"]), ("none", []), (" 2 , 5 ", ["2", "5"]), ("GPU-x", ["GPU-x"])],
)
def test_parse_gpus(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["0,,1", "1,1"])
def test_parse_gpus_refuses(text):
    with pytest.raises(ValueError):
        parse_gpus(text)


def test_sharing_notes_name_who_shares():
    shared = place_groups(["0"], 2)
    (note,) = sharing_notes(shared, ranks_per_group=1)
    assert "GPU 0: groups 0, 1" in note and "host-staged" in note
    assert sharing_notes(place_groups(["0", "1"], 2), ranks_per_group=1) == []
    (note,) = sharing_notes(place_groups(["0", "1"], 2), ranks_per_group=2)
    assert "ranks of a group share GPUs" in note
    assert sharing_notes(place_groups([], 2), ranks_per_group=4) == []
    assert GroupDevices(0, ()).env_value() is None and GroupDevices(0, ("1", "2")).label() == "1,2"


def _envs(log_dir):
    envs = {}
    for path in glob.glob(os.path.join(log_dir, "env_g*_r*_t*.json")):
        with open(path) as f:
            envs[os.path.basename(path)[4:-5]] = json.load(f)  # g0_r1_t2
    return envs


def test_launcher_gives_each_group_its_slice_and_each_rank_its_local_rank():
    rc, out, s = run_launch(
        "--replicas 2 --ranks-per-group 2 --gpus 0,1,2,3 --chaos kill --every 1 --seed 3 "
        "--max-steps 40 --restart-delay 0.1",
        [FAKE, "--dump-env"],
        90,
    )
    assert rc == 0, out
    assert "GPUs g0 [0,1] g1 [2,3]" in out, out
    assert "warning:" not in out, out
    assert [g["devices"] for g in s["groups"]] == [["0", "1"], ["2", "3"]]
    envs = _envs(s["log_dir"])
    restarted = [g["group"] for g in s["groups"] if g["tries"] > 1]
    assert restarted, out  # a restarted attempt (a warm standby) gets the same slice
    for name, env in envs.items():
        gid, rank = int(name[1]), int(name.split("_")[1][1:])
        assert env["CUDA_VISIBLE_DEVICES"] == ("0,1" if gid == 0 else "2,3"), (name, env)
        assert env["LOCAL_RANK"] == str(rank), (name, env)
    assert any(name.endswith("_t2") for name in envs), sorted(envs)


def test_launcher_with_fewer_gpus_than_groups_warns_and_shows_the_sharing():
    rc, out, s = run_launch(
        "--replicas 2 --gpus 0 --max-steps 10", [FAKE, "--dump-env", "--step-s", "0.1"], 60
    )
    assert rc == 0, out
    assert "GPUs g0 [0] g1 [0]" in out, out
    assert "warning: replica groups share GPUs (GPU 0: groups 0, 1)" in out, out
    assert "gpu=0]" in out, out  # the status line shows each group's GPUs
    envs = _envs(s["log_dir"])
    assert {env["CUDA_VISIBLE_DEVICES"] for env in envs.values()} == {"0"}


def test_launcher_on_cpu_exports_no_gpus():
    rc, out, s = run_launch("--replicas 2 --gpus none --max-steps 5", [FAKE, "--dump-env"], 60)
    assert rc == 0, out
    assert "on CPU (no GPU visible)" in out, out
    assert all(env["CUDA_VISIBLE_DEVICES"] is None for env in _envs(s["log_dir"]).values())


def test_launcher_refuses_a_slice_larger_than_the_gpus():
    import subprocess
    import sys

    from tests.launch.test_launch import ROOT

    r = subprocess.run(
        [sys.executable, "-m", "ft.launch", "--gpus", "0,1", "--gpus-per-group", "3", "--", FAKE],
        cwd=ROOT,
        timeout=60,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2, r
    assert "--gpus-per-group 3 but only 2 GPU(s) visible" in r.stderr
