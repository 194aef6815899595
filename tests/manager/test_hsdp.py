"""HSDP with ft, multi-process on CPU Gloo: FSDP2 inside each replica group, ft across groups.

2 replica groups x 2 FSDP ranks (tests/manager/hsdp_workers.py). Each rank runs an ft.Manager
and shards the model with ``fully_shard`` over ``ft_init_device_mesh``'s mesh; the replicate
dimension's allreduce goes through the Manager.

The failure run kills one rank of group 1 with SIGKILL mid-training, then its sibling (as
torchrun's agent does when a worker dies), and starts both again; the new ranks heal their
DTensor shards (model and Adam state) from group 0's ranks of the same shard. Asserted: the
healed ranks got DTensors (not plain tensors), every group ends with bitwise the same state
(shard by shard, and the full parameters), that state is bitwise the fault-free run's, and
every loss either run recorded for a committed step is the fault-free run's loss of that step.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from tests.procs import wait_progress

TARGET = "tests.manager.hsdp_workers:train"
STOP_AT = 8
LIGHTHOUSE = dict(min_replicas=1, join_timeout_ms=500)


def _same(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(
            a.view(-1).view(torch.uint8) if a.numel() else a,
            b.view(-1).view(torch.uint8) if b.numel() else b,
        ), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _by_rank(results: List[Dict[str, Any]]) -> Dict[tuple, Dict[str, Any]]:
    return {(r["group"], r["rank"]): r for r in results}


def _check_run(res: Dict[tuple, Dict[str, Any]], name: str) -> None:
    for (_group, g), r in res.items():
        assert r["is_dtensor"] and r["param_kinds"] == ["DTensor"], (name, r["param_kinds"])
        assert set(r["placements"]) == {"(Replicate(), Shard(dim=0))"}, r["placements"]
        assert r["mesh"] == {
            "type": "ManagedDeviceMesh",
            "shape": (2, 2),
            "coord": (0, g),
            "replicate_group": "ManagedProcessGroup",
            "replicate_manager_is_ours": True,
            "shard_group_is_default": True,
            "sliced_replicate_is_managed": True,
            "sliced_shard_coord": (g,),
        }, (name, r["mesh"])
    for g in (0, 1):  # the same shard in both groups: bitwise the same model and Adam state
        _same(res[(0, g)]["local"], res[(1, g)]["local"], f"{name}: shard {g}")
    assert not torch.equal(
        res[(0, 0)]["local"]["model"]["0.weight"], res[(0, 1)]["local"]["model"]["0.weight"]
    )  # really two halves
    assert res[(0, 0)]["local"]["model"]["4.weight"].shape == (3, 32)  # uneven: 5 rows = 3 + 2
    assert res[(0, 1)]["local"]["model"]["4.weight"].shape == (2, 32)
    for key in res:
        _same(res[(0, 0)]["full"], res[key]["full"], f"{name}: full parameters of {key}")


def _run_with_group_1_killed_and_restarted(replicas, run: str, **kw: Any) -> Dict[tuple, Any]:
    """The failure run: group 1's rank 1 holds still after step 3 and is killed with SIGKILL,
    then its sibling (as torchrun's agent stops a dead worker's group), and both start again.
    Returns every rank's result by (group, rank)."""
    w = replicas(TARGET, 4, lighthouse=LIGHTHOUSE, run=run, stop_at=STOP_AT, ranks=[0, 1, 2], **kw)
    w.spawn(3, park_at=3)
    wait_progress(w.store, [f"{run}/parked/3"], at_least=1, timeout=180, w=w)
    w.by_rank(3).kill()
    w.by_rank(2).kill()
    for proc in (2, 3):
        w.spawn(proc, incarnation=1)
    return _by_rank(w.join(timeout=240, children=[w.by_rank(p) for p in range(4)]))


def test_hsdp_group_killed_and_restarted_heals_its_dtensor_shards(replicas) -> None:
    # The fault-free run of the same seed: the reference for the state and the loss curve.
    clean_w = replicas(TARGET, 4, lighthouse=LIGHTHOUSE, run="clean", stop_at=STOP_AT)
    clean = _by_rank(clean_w.join(timeout=240))
    _check_run(clean, "clean")
    for r in clean.values():
        assert sorted(r["losses"]) == list(range(STOP_AT)), r["losses"]
    assert clean[(0, 0)]["losses"] != clean[(0, 1)]["losses"]  # each rank has its own data

    res = _run_with_group_1_killed_and_restarted(replicas, "fault")
    _check_run(res, "fault")

    for g in (0, 1):
        survivor, restarted = res[(0, g)], res[(1, g)]
        assert survivor["incarnation"] == 0 and restarted["incarnation"] == 1
        # The restarted rank healed mid-training, from DTensor state (model and Adam)
        first = min(restarted["losses"])
        assert 3 <= first < STOP_AT, restarted["losses"]
        assert restarted["healed"], "the restarted rank never healed"
        assert restarted["healed"][-1] == {"kinds": ["DTensor"], "optim_kinds": ["DTensor"]}
        assert sorted(restarted["losses"]) == list(range(first, STOP_AT))
        assert sorted(survivor["losses"]) == list(range(STOP_AT))

    # Bitwise the fault-free run: final state, and the loss of every committed step
    for key in res:
        _same(clean[key]["local"], res[key]["local"], f"state of {key} vs the fault-free run")
        for step, loss in res[key]["losses"].items():
            assert loss == clean[key]["losses"][step], (key, step, loss, clean[key]["losses"][step])


def test_hsdp_with_async_quorum_heals_from_state_read_on_the_training_thread(replicas) -> None:
    """torchtitan's default, ``use_async_quorum=True``: the heal source reads its FSDP2 state
    on its training thread at should_commit, after backward (never on the quorum thread while
    a forward pass runs, where FSDP2's state-dict hooks would swap the parameters it uses), and
    keeps it readable until the healing rank has it. The same kill and restart as above: the
    restarted ranks heal their DTensor shards, and every group ends bitwise identical (the
    healing step counts the source group's data only, so the losses are not the sync run's)."""
    res = _run_with_group_1_killed_and_restarted(replicas, "async", async_quorum=True)
    _check_run(res, "async")
    for g in (0, 1):
        survivor, restarted = res[(0, g)], res[(1, g)]
        assert restarted["incarnation"] == 1 and restarted["healed"], restarted["healed"]
        assert restarted["healed"][-1] == {"kinds": ["DTensor"], "optim_kinds": ["DTensor"]}
        reads = survivor["state_reads_on_training_thread"]
        assert reads and all(reads), reads  # sent at least once, always from training
        assert sorted(survivor["losses"]) == list(range(STOP_AT))


def test_ft_mesh_is_a_torch_mesh_whose_replicate_dim_is_the_manager(replicas) -> None:
    """``ft_init_device_mesh``'s mesh, seen by torch: slicing, pickling, DTensor's functional
    collectives over the replicate dimension (through the Manager: an average divides by the
    groups taking part, not by the mesh's nominal size), and torchft's other constructors."""
    w = replicas(
        "tests.manager.hsdp_workers:mesh_checks",
        2,
        lighthouse=dict(min_replicas=2, join_timeout_ms=200),
    )
    for r in w.join(timeout=120):
        assert r["nominal"] == (3, (3, 1)) and r["live"] == 2, r
        assert r["same_group_again"], r
        assert r["sum"] == [3.0, 3.0] and r["avg"] == [1.5, 1.5] and r["commit"], r
        assert r["pickled"] == ("ManagedDeviceMesh", True, True, 0), r
        # the stacked ranks of the other groups do not exist here: torch refuses to flatten
        assert "bigger than default world size" in r["flatten"], r
        assert r["extended"] == ((1, 1), ("ext", "tp"), "ManagedProcessGroup", (0, 0)), r
        assert r["one_dim"] == ((2,), (0,), "ManagedProcessGroup"), r
