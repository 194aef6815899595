"""DiLoCo / Streaming DiLoCo / LocalSGD with DTensor parameters, multi-process:
real lighthouse, ManagerServers, ft.Manager (sync quorum), ft.ProcessGroupGloo.

2 replica groups x 1 rank. Each replica builds a 1-D CPU DeviceMesh over its own
group (a local gloo process group of world size 1) and distributes the model
with ``distribute_module`` (Replicate, or Shard(0)). The last test uses 2 ranks
per replica group (4 processes) with Shard(0) over a 2-rank mesh in each group.

Asserted: at every sync both replicas' global state (DiLoCo backups, outer
optimizer state, parameters' local tensors; LocalSGD backups and parameters)
is bitwise identical, and it is bitwise identical to the same run with plain
tensors (on a world-size-1 mesh every DTensor op runs the same local kernel).
Then a DTensor replica's registered DiLoCo state (with DTensor momentum
buffers) goes through ft's checkpoint serialization and loads back.
"""

from __future__ import annotations

from tests.diloco.test_diloco_mp import assert_same_global_state

TARGET = "tests.diloco.dtensor_workers:train"


def test_dtensor_diloco_and_localsgd_identical_and_equal_to_plain(replicas):
    runs = {
        "diloco": dict(algo="diloco", sync_every=3, stop_at=3),
        "streaming": dict(algo="diloco", sync_every=4, n_frag=2, tau=1, stop_at=4),
        "localsgd": dict(algo="localsgd", sync_every=3, stop_at=3),
    }
    configs, names = [], []
    for name, cfg in runs.items():
        for placement in (None, "replicate"):
            configs.append(dict(cfg, placement=placement))
            names.append((name, placement))
    configs.append(dict(runs["diloco"], placement="shard"))
    names.append(("diloco", "shard"))
    w = replicas(
        TARGET,
        2,
        lighthouse=dict(min_replicas=2, join_timeout_ms=200),
        configs=configs,
        check_partial=True,
    )
    r0, r1 = w.join(timeout=120)
    rejected, r0, r1 = r0[0], r0[1:], r1[1:]
    for name in ("diloco", "localsgd"):  # Partial placements are rejected, clearly
        assert "Partial placement" in rejected[name] and "'weight'" in rejected[name], rejected
    res = {}
    for key, cfg, a, b in zip(names, configs, r0, r1):
        assert_same_global_state(a, b, key)
        assert sorted(a["commits"]) == list(range(1, cfg["stop_at"] + 1)), (key, a["commits"])
        assert a["failed"] == b["failed"] == 0, key
        if key[1] is not None:  # the params (and outer momentum) really are DTensors
            assert any(
                k.startswith("/all_params/") and v == "DTensor" for k, v in a["kinds"].items()
            ), a["kinds"]
            if key[0] != "localsgd":
                assert any(
                    "momentum_buffer" in k and v == "DTensor" for k, v in a["kinds"].items()
                ), a["kinds"]
        res[key] = (a, b)
    # DTensor run == plain-tensor run, bitwise, on each replica: global state,
    # every parameter (incl. local progress) and the inner optimizer state.
    for name in runs:
        for i in (0, 1):
            plain, dt = res[(name, None)][i], res[(name, "replicate")][i]
            assert plain["commits"] == dt["commits"], f"{name}: DTensor run differs from plain run"
            assert plain["full"] == dt["full"], f"{name}: replica {i} DTensor differs from plain"
            assert plain["final"] == dt["final"], name
    for i in (0, 1):
        assert res[("diloco", "shard")][i]["full"] == res[("diloco", None)][i]["full"]


def test_dtensor_late_joiner_heals_outer_momentum(replicas):
    """Replica 1 joins after replica 0 has committed with DTensor outer momentum:
    it heals the DiLoCo backups and the outer-optimizer state (DTensor momentum
    buffers travel as local tensors and are wrapped back like the parameters),
    and both replicas are then bitwise identical at every common sync."""
    cfg = dict(
        algo="diloco", sync_every=2, stop_at=8, placement="replicate", late=2, step_sleep=0.02
    )
    w = replicas(
        TARGET, 2, ranks=[0], lighthouse=dict(min_replicas=1, join_timeout_ms=300), configs=[cfg]
    )
    w.spawn(1)
    r0, r1 = w.join(timeout=90)
    a, b = r0[0], r1[0]
    assert min(b["commits"]) > 2, b["commits"]  # it healed a step with outer momentum
    assert a["step"] == b["step"] == cfg["stop_at"]
    assert_same_global_state(a, b, "late")
    assert any("momentum_buffer" in k and v == "DTensor" for k, v in b["kinds"].items()), b["kinds"]


def test_shard_placement_on_a_two_rank_mesh_per_group(replicas):
    """2 replica groups x 2 ranks; each group shards every parameter over its 2-rank mesh
    (Shard(0)). Each rank's DiLoCo global state (its shard's backup and outer momentum) is
    bitwise identical to the same rank's in the other group at every sync, the two ranks of
    a group really hold different halves, and the full parameters agree everywhere."""
    w = replicas(
        "tests.diloco.dtensor_workers:train_sharded_groups",
        4,
        lighthouse=dict(min_replicas=2, join_timeout_ms=200),
        sync_every=2,
        stop_at=3,
    )
    res = w.join(timeout=150)
    by = {(r["replica"], r["group_rank"]): r for r in res}
    for r in res:
        assert r["step"] == 3 and r["failed"] == 0, r
        assert r["kinds"] == ["DTensor"] and r["shard_shape"] == [8, 8], r
        assert sorted(r["commits"]) == [1, 2, 3], r["commits"]
    for g in (0, 1):  # same group rank across replica groups: identical shard state
        assert by[(0, g)]["commits"] == by[(1, g)]["commits"], f"group rank {g} diverged"
        assert by[(0, g)]["shard_digest"] == by[(1, g)]["shard_digest"]
    assert by[(0, 0)]["shard_digest"] != by[(0, 1)]["shard_digest"]  # really two halves
    assert len({r["full_digest"] for r in res}) == 1
