"""Peers that die or hang: prompt errors, deadlines, abort, no late writes."""

import signal
import time
from datetime import timedelta

from tests.procs import Workers, make_store


def test_kill_9_mid_allreduce_fails_survivor_within_1s():
    store = make_store()
    with Workers("tests.backend.workers:allreduce_until_failure", 2, store=store) as w:
        store.wait(["looping/0", "looping/1"], timedelta(seconds=30))
        time.sleep(0.3)
        w.by_rank(1).signal(signal.SIGKILL)
        (r0,) = w.join(timeout=30, children=[w.by_rank(0)])
    assert r0["error"] is not None
    assert r0["elapsed"] < 1.0, r0
    assert "communication" in r0["errored"] or "Connection" in r0["errored"], r0


def test_stopped_peer_aborts_at_deadline_and_never_writes_after():
    timeout_s = 2.0
    store = make_store()
    with Workers(
        "tests.backend.workers:stuck_then_check_writes", 2, store=store, timeout_s=timeout_s
    ) as w:
        store.wait(["peer_ready"], timedelta(seconds=30))
        peer = w.by_rank(1)
        peer.signal(signal.SIGSTOP)
        store.set("go", "1")
        store.wait(["aborted"], timedelta(seconds=30))
        peer.signal(signal.SIGCONT)  # it now sends its half of the allreduce
        store.set("continued", "1")
        r0, _ = w.join(timeout=30)
    assert r0["error"] is not None and "deadline" in r0["error"], r0
    assert abs(r0["elapsed"] - timeout_s) <= 0.1 * timeout_s, r0
    assert "ProcessGroupTimeout" in r0["errored"], r0
    assert r0["unchanged"], "an aborted op wrote into the caller's tensor"


def test_abort_from_another_thread_fails_pending_works_fast():
    with Workers("tests.backend.workers:abort_latency", 2) as w:
        r0, _ = w.join(timeout=60)
    assert r0["pending_before"] == 4
    assert r0["all_failed"]
    assert r0["latency"] < 0.1, r0
    assert "aborted" in r0["errored"], r0


def test_lane_1_completes_while_lane_0_waits_for_a_peer():
    with Workers("tests.backend.workers:lanes_independent", 2) as w:
        r0, _ = w.join(timeout=60)
    assert r0["lane0_completed_before_peer"] is False
    assert (r0["lane1_result"] == 4.0).all()
    assert (r0["lane0_result"] == 2.0).all()


def test_per_op_timeout_and_set_timeout_reach_the_gloo_transport():
    group_s, op_s, set_s = 30.0, 1.0, 1.5
    with Workers(
        "tests.backend.workers:per_op_deadlines",
        2,
        group_timeout_s=group_s,
        op_timeout_s=op_s,
        set_timeout_s=set_s,
    ) as w:
        r0, _ = w.join(timeout=120)
    # Each op failed at its own deadline, far before the group's creation-time 30 s.
    for key, timeout_s in (("per_op", op_s), ("set_timeout", set_s)):
        error = r0[f"{key}_error"]
        expected = f"missed its deadline of {int(timeout_s * 1000)} ms"
        assert error is not None and expected in error, r0
        assert 0.9 * timeout_s <= r0[f"{key}_elapsed"] < timeout_s + 3.0, r0
        assert "ProcessGroupTimeout" in r0[f"{key}_errored"], r0


def test_a_rank_shutting_down_leaves_other_ranks_in_its_process_connected():
    # torchft's process_group_test (test_collective_with_resiliency, send/recv) runs its ranks
    # as threads of one process: rank 2 shuts down, ranks 0 and 1 must still send/recv. Rank
    # 2's abort once cut every Gloo socket whose epoll instance appeared during its connect,
    # ranks 0's and 1's included ("Connection closed by peer" between the survivors).
    with Workers("tests.backend.workers:ranks_as_threads_one_shuts_down", 1) as w:
        (r,) = w.join(timeout=90)
    assert r["send_error"] is None and r["recv_error"] is None, r
    assert (r["received"] == 7.0).all(), r
    assert all((s == 3.0).all() for s in r["sums"]), r


def test_shutting_a_group_down_leaves_another_group_of_its_process_working():
    # Group B connected while group A's configure was in flight in the same process; shutting A
    # down (a parameter-server session ending, say) must not cut B's sockets.
    with Workers("tests.backend.workers:two_groups_one_shuts_down", 2) as w:
        r0, r1 = w.join(timeout=90)
    # A's peer is gone: rank 1's op on A fails at once, not at the deadline.
    assert r1["a_error"] is not None and r1["a_error_after_s"] < 5.0, r1
    for r, peer in ((r0, 1), (r1, 0)):
        assert r["b_send_recv_error"] is None and r["b_allreduce_error"] is None, r
        assert (r["b_received"] == float(peer + 1)).all(), r
        assert (r["b_sum"] == 3.0).all() and (r["b2_sum"] == 3.0).all(), r
        assert r["b_errored"] == "None", r


def test_gloo_devices_own_no_epoll_instance_another_thread_made_meanwhile(monkeypatch):
    # Another thread's epoll instance appears while a lane's Gloo device is built: the device
    # is built again, and only its own epoll instance is reported (an abort cuts the sockets
    # registered there).
    import select

    import torch.distributed as dist

    import ft.backend.process_group as fpg

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(fpg.net, "chosen_advertise_host", lambda: None)
    real = dist.ProcessGroupGloo.create_default_device
    foreign = []

    def create_default_device():
        if not foreign:
            foreign.append(select.epoll())
        return real()

    monkeypatch.setattr(
        dist.ProcessGroupGloo, "create_default_device", staticmethod(create_default_device)
    )
    try:
        devices, epolls = fpg._gloo_devices()
        assert len(devices) == 1 and len(epolls) == 1, epolls
        assert foreign[0].fileno() not in epolls
        with open(f"/proc/self/fdinfo/{epolls[0]}") as f:
            assert "tfd:" in f.read()  # the device's listener is registered there
    finally:
        for e in foreign:
            e.close()
