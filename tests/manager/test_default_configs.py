"""torchft's plain loop commits under every Manager configuration a torchft user can pick.

Each case runs real processes, one per replica group, with a real lighthouse and real
ManagerServers, Gloo and HTTP heals, over every combination of ``use_async_quorum`` ×
``init_sync`` × ``min_replica_size`` ∈ {1, 2, 3}. A combination whose ``min_replica_size``
fits in the job commits 3 steps within a bounded time and every group ends bitwise identical
(model and optimizer); one that asks for more replicas than the job has never commits, and
each of its attempts still returns within a bounded time.

The participation rule behind it is table-tested in tests/coordination/test_quorum_rules.py.
"""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch

from tests.manager.inproc import lighthouse
from tests.procs import Workers, make_store

TARGET_STEP = 3
COMBOS = [
    {
        "name": f"async={a},init_sync={s},min={m}",
        "use_async_quorum": a,
        "init_sync": s,
        "min_replica_size": m,
    }
    for a, s, m in itertools.product([True, False], [True, False], [1, 2, 3])
]


def assert_bitwise_equal(states, name):
    ref = states[0]
    for g, other in enumerate(states[1:], start=1):
        for k, v in ref["model"].items():
            assert torch.equal(v, other["model"][k]), f"{name}: model {k} differs (group {g})"
        assert other["optim"]["param_groups"] == ref["optim"]["param_groups"], name
        for pid, st in ref["optim"]["state"].items():
            for k, v in st.items():
                assert torch.equal(v, other["optim"]["state"][pid][k]), (
                    f"{name}: optimizer {pid}.{k} differs (group {g})"
                )


@pytest.mark.parametrize("groups", [2, 3])
def test_every_default_combination_commits_and_ends_identical(groups: int) -> None:
    store = make_store()
    with Workers(
        "tests.manager.workers:default_config_combos",
        groups,
        store,
        combos=COMBOS,
        target_step=TARGET_STEP,
    ) as w:
        for i, combo in enumerate(COMBOS):
            lh = lighthouse(
                min_replicas=min(combo["min_replica_size"], groups),
                heartbeat_timeout_ms=2000,
                join_timeout_ms=500,
            )
            try:
                store.set(f"lh/{i}", lh.address())
                store.wait([f"done/{i}/{g}" for g in range(groups)], timedelta(seconds=60))
            finally:
                lh.shutdown()
        results = w.join(timeout=60)

    for combo in COMBOS:
        name = combo["name"]
        states = [r[name] for r in results]
        if combo["min_replica_size"] <= groups:
            assert [s["step"] for s in states] == [TARGET_STEP] * groups, (
                name,
                [(s["step"], len(s["attempts"])) for s in states],
            )
            assert_bitwise_equal(states, f"{name} {[s['trace'] for s in states]}")
            # No livelock: commits come at once, not after a long run of failed attempts.
            assert max(len(s["attempts"]) for s in states) <= TARGET_STEP + 2, name
        else:
            # min_replica_size above the job's size: nothing may commit, and nothing hangs.
            assert [s["step"] for s in states] == [0] * groups, name
            assert all(len(s["attempts"]) >= 1 for s in states), name
        assert max(max(s["attempts"]) for s in states) < 15.0, name
