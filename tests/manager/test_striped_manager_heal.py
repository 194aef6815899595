"""A Manager's heal striped over every up-to-date replica group (docs/design.md, "Striped
heal"): real lighthouse, ManagerServers, process groups and processes (tests.procs.Replicas).

The groups' checkpoint servers run without the same-host path (a same-host source would be
taken alone) and serve each 1 MiB slice no faster than a pace, so that every donor is still
serving when the others come. The tests assert what the healed group holds (bitwise equal to
the donors' model, optimizer and ballast) and what each donor's checkpoint server sent (its own
count of data bytes), never how long anything took.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

from tests.manager.test_recovery import TARGET, assert_identical
from tests.procs import free_port, max_step, wait_progress

BALLAST_MIB = 4  # several 1 MiB ranges: every donor takes some
# per slice a donor serves (1 MiB, or one smaller tensor): no donor is done before the other comes
PACE_S = 0.03


def _late_joiner(replicas, groups: int, async_quorum: bool) -> List[Dict[str, Any]]:
    """``groups - 1`` groups train from the same initial state (no heal among them); the last
    group joins once they have committed 2 steps, at step 0, and heals. Returns every group's
    result, the late one last."""
    ports = [free_port() for _ in range(groups)]
    keys = [f"step/{g}/0" for g in range(groups)]
    w = replicas(
        TARGET,
        groups,
        ranks=list(range(groups - 1)),
        lighthouse=dict(min_replicas=groups - 1, heartbeat_timeout_ms=2000, join_timeout_ms=1000),
        ports=ports,
        async_quorum=async_quorum,
        init_sync=False,
        seed_per_group=False,
        same_host=False,
        pace_s=PACE_S,
        ballast_mib=BALLAST_MIB,
        wait_ready=groups - 1,
    )
    # the late group imports and builds its model meanwhile, and joins when told
    w.spawn(groups - 1, start_after="join")
    store = w.store
    wait_progress(store, keys[:-1], 2, 90, w)
    store.set("join", "1")
    wait_progress(store, keys, 1, 60, w)  # the late group committed a step
    store.set("stop_at", str(max_step(store, keys) + 2))
    results = w.join(60)
    assert [x["group"] for x in results] == list(range(groups))
    assert_identical(results, 1)
    for x in results[1:]:
        assert torch.equal(x["ballast"], results[0]["ballast"]), "ballast differs"
    assert results[0]["ballast"][0].item() == results[0]["step"]
    late = results[-1]
    assert late["loads"] >= 1, "the late group never loaded a healed state"
    # Right after its heal the late group's model is the donors' of the same step, bit for
    # bit (pre_hash: the model at the start of a step attempt, unchanged by failed attempts).
    healed = next(h["step"] for h in late["history"] if h["step"] > 0)
    donor_hash = {h["step"]: h["pre_hash"] for h in results[0]["history"]}
    for h in late["history"]:
        if h["step"] >= healed:
            assert h["pre_hash"] == donor_hash[h["step"]], (h["step"], late["history"])
    return results


@pytest.mark.parametrize("async_quorum", [False, True], ids=["sync", "async"])
def test_late_group_heals_striped_from_both_up_to_date_groups(replicas, async_quorum) -> None:
    results = _late_joiner(replicas, 3, async_quorum)
    g0, g1, late = results
    assert late["recv_path"] == "http-striped", late["recv_path"]
    # Nobody healed before the late group did: what each donor sent is its part of that heal.
    # Each sent some of it; together at least all of the ballast.
    assert g0["served_bytes"] > 0 and g1["served_bytes"] > 0, (
        g0["served_bytes"],
        g1["served_bytes"],
    )
    assert g0["served_bytes"] + g1["served_bytes"] >= BALLAST_MIB << 20
    assert late["served_bytes"] == 0


def test_single_up_to_date_group_heals_the_late_one_alone(replicas) -> None:
    results = _late_joiner(replicas, 2, async_quorum=False)
    g0, late = results
    assert late["recv_path"] == "http", late["recv_path"]  # one donor: no striping
    assert g0["served_bytes"] >= BALLAST_MIB << 20
    assert late["served_bytes"] == 0
