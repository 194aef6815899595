"""Multi-process LocalSGD / DiLoCo / Streaming DiLoCo: real lighthouse,
ManagerServers, ft.Manager (sync quorum) and ft.ProcessGroupGloo with lanes.
Every child is a real process (kill -9 by pid, always reaped)."""

from __future__ import annotations

import signal
import time
from typing import Any, Dict

import pytest

from tests.procs import Workers, kill_at_counter, max_step, wait_progress

TARGET = "tests.diloco.mp_workers:train"


def assert_same_global_state(a: Dict[str, Any], b: Dict[str, Any], cfg) -> None:
    common = sorted(set(a["commits"]) & set(b["commits"]))
    assert common, (cfg, a["commits"], b["commits"])
    for s in common:
        assert a["commits"][s] == b["commits"][s], f"{cfg}: global state differs at step {s}"
    assert a["step"] == b["step"], cfg
    assert a["final"] == b["final"], cfg


def test_healthy_localsgd_and_diloco_identical_at_every_sync(replicas):
    configs = [
        dict(algo="localsgd", sync_every=3, warmup=2, stop_at=5),
        dict(algo="diloco", sync_every=3, stop_at=4),
        dict(
            algo="diloco",
            sync_every=4,
            n_frag=2,
            tau=1,
            stop_at=4,
            bucket=True,
            bucket_cap_mb=0.0002,
        ),  # ~52 fp32 per bucket: tensors split across buckets
    ]
    w = replicas(TARGET, 2, lighthouse=dict(min_replicas=2, join_timeout_ms=200), configs=configs)
    r0, r1 = w.join(timeout=120)
    for cfg, a, b in zip(configs, r0, r1):
        assert_same_global_state(a, b, cfg)
        assert sorted(a["commits"]) == list(range(1, cfg["stop_at"] + 1)), (cfg, a["commits"])
        assert a["failures"] == b["failures"] == 0
        # the Manager issues on the calling thread, so each fragment used its own lane
        assert a["lanes"] == ([0, 1] if cfg.get("n_frag") == 2 else [0]), (cfg, a["lanes"])


def test_streaming_matrix_with_injected_failure(replicas):
    """2 fragments, tau in {0, 1}, alpha in {0, 0.5, 1}; one injected allreduce
    failure per run (at manager step 2, on replica 0). Each failure is counted
    exactly once on each replica, the same fragment is retried, and all
    replicas' global state is identical at every commit."""
    configs = [
        dict(
            algo="diloco",
            sync_every=4,
            n_frag=2,
            tau=tau,
            alpha=alpha,
            stop_at=4,
            fail_at=2,
            fail_rank=0,
        )
        for tau in (0, 1)
        for alpha in (0.0, 0.5, 1.0)
    ]
    w = replicas(TARGET, 2, lighthouse=dict(min_replicas=2, join_timeout_ms=200), configs=configs)
    r0, r1 = w.join(timeout=150)
    for cfg, a, b in zip(configs, r0, r1):
        assert_same_global_state(a, b, cfg)
        assert a["injected"] == [2] and b["injected"] == []
        assert a["failures"] == b["failures"] == 1, cfg
        assert a["algo_failed"] == b["algo_failed"] == 1, cfg


def _wait_key(store, key: str, at_least: int, timeout: float, w: Workers) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = int(store.get(key)) if store.check([key]) else -1
        if v >= at_least:
            return v
        for c in w.children:
            if c.proc.poll() not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"child {c.rank} died:\n{c.log()}")
        time.sleep(0.02)
    raise AssertionError(
        f"{key} < {at_least} after {timeout}s\n" + "\n".join(c.log()[-3000:] for c in w.children)
    )


@pytest.mark.parametrize("scenario", ["kill", "late_joiner"])
def test_kill_restart_and_late_joiner_heal_global_state(scenario, replicas):
    """kill -9 of replica 1 mid-interval, then a restart; or replica 1 starting
    late ("upscale"). It heals backups and outer-optimizer state from replica
    0 and every replica ends identical."""
    cfg = dict(
        algo="diloco",
        sync_every=4,
        n_frag=2,
        tau=1,
        stop_at=10_000,
        step_sleep=0.03,
        max_inner=2000,
        pg_timeout=4.0,
    )
    ranks = [0, 1] if scenario == "kill" else [0]
    w = replicas(
        TARGET,
        2,
        ranks=ranks,
        configs=[cfg],
        lighthouse=dict(min_replicas=1, heartbeat_timeout_ms=1000, join_timeout_ms=300),
    )
    store = w.store
    if scenario == "kill":
        _wait_key(store, "c0-step/1", 2, 60, w)
        time.sleep(0.05)  # mid-interval
        w.by_rank(1).signal(signal.SIGKILL)
        w.by_rank(1).proc.wait(10)
    else:
        _wait_key(store, "c0-step/0", 3, 60, w)
    base = int(store.get("c0-step/0"))
    store.delete_key("c0-step/1")
    w.spawn(1)
    _wait_key(store, "c0-step/1", base + 1, 60, w)  # healed and committing with 0
    stop = int(store.get("c0-step/0")) + 3
    store.set("stop_at", str(stop))
    r0 = w.join(60, [w.by_rank(0)])[0][0]
    r1 = w.join(60, [w.by_rank(1)])[0][0]
    assert r0["step"] == r1["step"] == stop
    assert_same_global_state(r0, r1, scenario)
    j = min(r1["commits"])  # the step its join round committed
    assert j > base  # the new replica took the healed step
    # It healed before its first inner step, which (tau = 1: the join round's sync is still in
    # flight) starts from the healed backups: replica 0's global state at that step.
    assert r1["inner_before_quorum"] == 0
    assert r1["first_inner"]["step"] == j - 1
    assert r1["first_inner"]["params"] == r0["backups"][j - 1]
    # It contributed nothing to the join round, nor to the other fragment's next sync (it had
    # trained that fragment for less than an interval), and to everything after.
    assert [r0["contributors"][s] for s in (j, j + 1, j + 2)] == [1.0, 1.0, 2.0], r0["contributors"]
    assert [r1["contributors"][s] for s in (j, j + 1, j + 2)] == [1.0, 1.0, 2.0]


def _kill_mid_interval(store, w: Workers, rank: int, sync_every: int, timeout: float) -> int:
    """SIGKILLs child ``rank`` in the middle of an interval: at least two inner steps taken
    since its last sync and at least two to go (``kill_at_counter``); returns its count."""

    def mid(local: int) -> bool:
        return 2 <= local <= sync_every - 2

    local = kill_at_counter(store, w.by_rank(rank), f"c0-local/{rank}", mid, timeout)
    assert local is not None, f"group {rank} never reached the middle of an interval in {timeout}s"
    return local


def _wait_heartbeating(lh, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(r["alive"] for r in lh.status()["replicas"]) < n:
        assert time.monotonic() < deadline, f"the lighthouse did not see {n} heartbeating groups"
        time.sleep(0.02)


def test_kill9_rejoiner_heals_before_training_and_contributes_nothing(replicas):
    """3 groups, DiLoCo with sync_every=6. Group 1 is killed -9 in the middle of an interval
    and restarted with different initial weights. It asks for a quorum before its first inner
    step, heals from a survivor in the survivors' next sync, contributes nothing to that sync
    (its average is the 2 survivors'), and its first inner step starts from the global state
    every group holds at that step. From the next sync on it contributes, and every group ends
    with a bitwise identical model and outer-optimizer state. The three start together: their
    join round syncs nothing, and the first sync is torchft's."""
    H = 6
    cfg = dict(
        algo="diloco",
        sync_every=H,
        stop_at=10**6,
        step_sleep=0.02,
        max_inner=3000,
        pg_timeout=4.0,
        wait_ready=3,
    )
    keys = [f"c0-step/{g}" for g in range(3)]
    survivors = [keys[0], keys[2]]
    # join_timeout: the first quorum waits for all three groups even on a loaded machine (a
    # dead group stops counting once its heartbeat expires, after 1 s)
    w = replicas(
        TARGET,
        3,
        configs=[cfg],
        lighthouse=dict(min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=2000),
    )
    store = w.store
    _wait_heartbeating(w.lh, 3, 60)
    store.set("go", "1")
    wait_progress(store, keys, 2, 60, w)
    _kill_mid_interval(store, w, 1, H, timeout=30)
    base = max_step(store, survivors)
    wait_progress(store, survivors, base + 1, 30, w)  # the survivors sync without it
    store.delete_key(keys[1])
    w.spawn(1, configs=[dict(cfg, seed=1, wait_ready=0)])
    spawned_at = max_step(store, survivors)
    wait_progress(store, keys, spawned_at + 1, 60, w)  # it joined a sync with them
    store.set("stop_at", str(max_step(store, keys) + 2))
    (g0,), (g1,), (g2,) = w.join(60, [w.by_rank(0), w.by_rank(1), w.by_rank(2)])

    # Every group ends bitwise identical: model, backups and outer-optimizer state, step.
    assert g0["step"] == g1["step"] == g2["step"]
    assert g0["model"] == g1["model"] == g2["model"]
    assert g0["final"] == g1["final"] == g2["final"]
    for g in (g1, g2):
        for s in set(g["commits"]) & set(g0["commits"]):
            assert g["commits"][s] == g0["commits"][s], f"global state differs at step {s}"

    # All three started together: their join round was a quorum only, so the job's first
    # sync is torchft's (manager step 0 -> 1 after H inner steps). Its quorum, at step 0,
    # heals the two groups that are not the primary (torchft's init sync, which replaces
    # their models), so it averages the primary's pseudo-gradient alone; the next, all three.
    assert g0["inner_at"][1] == g2["inner_at"][1] == H, g0["inner_at"]
    assert g0["inner_at"][2] == g2["inner_at"][2] == 2 * H
    assert g0["contributors"][1] == g2["contributors"][1] == 1.0, g0["contributors"]
    assert g0["contributors"][2] == g2["contributors"][2] == 3.0, g0["contributors"]

    # The restarted group: a quorum before its first inner step, healed in the join round
    # (which committed on entry, at step j), no inner step before it.
    j = min(g1["commits"])
    assert j > base, (j, base)
    assert g1["inner_before_quorum"] == 0 and g0["inner_before_quorum"] == 0
    # The join round averaged the survivors' pseudo-gradients only, on every group ...
    assert g0["contributors"][j] == g1["contributors"][j] == g2["contributors"][j] == 2.0
    # ... and the next sync all three.
    assert g0["contributors"][j + 1] == g1["contributors"][j + 1] == 3.0
    # Its first inner step started from the global state the survivors hold at that step.
    assert g1["first_inner"]["step"] == j
    assert g1["first_inner"]["params"] == g0["backups"][j] == g2["backups"][j]
    assert g0["failures"] == g1["failures"] == g2["failures"] == 0
