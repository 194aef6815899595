"""Multi-host fault tests: a lighthouse and two replica groups on three simulated hosts
(network namespaces on a private bridge, tests/multihost/netns.py), with faults injected by
taking a host's link down.

What a user on many machines needs: a lighthouse outage or a partition shorter than
``quorum_timeout`` ends no process, training resumes by itself, the cut-off group rejoins and
heals without a restart, and every group ends with bitwise identical model and optimizer state.
Nothing but the lighthouse address is configured: the advertised addresses come from the route
to the lighthouse.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Dict, List

import torch

from tests.procs import REPO

LH_PORT = 29510
QUORUM_TIMEOUT_S = 30.0
LIGHTHOUSE_OUTAGE_S = 6.0
PARTITION_S = 8.0


class Group:
    def __init__(self, hosts, name: str, tmp: str, lighthouse: str, seed: int) -> None:
        self.name = name
        self.progress = os.path.join(tmp, f"{name}.progress")
        self.result = os.path.join(tmp, f"{name}.pt")
        self.log = os.path.join(tmp, f"{name}.log")
        self.stop_file = os.path.join(tmp, "stop")
        cfg = {"name": name, "seed": seed, "lighthouse": lighthouse, "timeout": 5.0,
               "quorum_timeout": QUORUM_TIMEOUT_S, "progress": self.progress,
               "stop_file": self.stop_file, "result": self.result, "step_sleep": 0.05}
        self.proc = hosts.popen(name, [sys.executable, "-m", "tests.multihost.worker",
                                       json.dumps(cfg)], self.log,
                                env={"PYTHONPATH": REPO, "FT_ADVERTISE_HOST": ""})

    def lines(self) -> List[List[str]]:
        if not os.path.exists(self.progress):
            return []
        with open(self.progress) as f:
            return [ln.split() for ln in f.read().splitlines() if ln.strip()]

    def step(self) -> int:
        lines = self.lines()
        return int(lines[-1][0]) if lines else -1

    def pids(self) -> set:
        return {ln[1] for ln in self.lines()}

    def tail(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return ""


def wait_steps(groups: List[Group], at_least: Dict[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for g in groups:
            code = g.proc.poll()
            assert code is None or (code == 0 and os.path.exists(g.result)), \
                f"group {g.name} exited with {code}:\n{g.tail()}"
        if all(g.step() >= at_least[g.name] for g in groups):
            return
        time.sleep(0.1)
    logs = "\n".join(f"--- {g.name} (step {g.step()})\n{g.tail()}" for g in groups)
    raise AssertionError(f"no progress to {at_least} within {timeout}s\n{logs}")


def assert_identical(results: List[dict]) -> None:
    ref = results[0]
    for other in results[1:]:
        assert other["step"] == ref["step"]
        for k, v in ref["model"].items():
            assert torch.equal(v, other["model"][k]), f"model {k} differs"
        assert other["optim"]["param_groups"] == ref["optim"]["param_groups"]
        for pid, st in ref["optim"]["state"].items():
            for k, v in st.items():
                ov = other["optim"]["state"][pid][k]
                assert torch.equal(v, ov) if torch.is_tensor(v) else v == ov, (pid, k)


def test_lighthouse_outage_and_group_partition_end_no_process_and_end_identical(hosts_factory):
    hosts = hosts_factory(["lh", "a", "b"])
    tmp = tempfile.mkdtemp(prefix="ft-multihost-")
    lighthouse = f"http://{hosts.addr['lh']}:{LH_PORT}"
    lh_log = os.path.join(tmp, "lighthouse.log")
    lh = hosts.popen("lh", [sys.executable, "-m", "ft.coordination.cli",
                            "--bind", f"{hosts.addr['lh']}:{LH_PORT}", "--min_replicas", "1",
                            "--join_timeout_ms", "1000", "--heartbeat_timeout_ms", "2000",
                            "--http_bind", ""], lh_log, env={"PYTHONPATH": REPO})
    groups = [Group(hosts, "a", tmp, lighthouse, seed=1), Group(hosts, "b", tmp, lighthouse, seed=2)]
    a, b = groups
    wait_steps(groups, {"a": 3, "b": 3}, timeout=120)

    # 1. The lighthouse is unreachable for less than quorum_timeout: nobody exits, and
    #    training resumes by itself once it is back.
    hosts.partition("lh")
    time.sleep(LIGHTHOUSE_OUTAGE_S)
    hosts.restore("lh")
    assert lh.poll() is None
    back = {g.name: g.step() + 3 for g in groups}
    wait_steps(groups, back, timeout=QUORUM_TIMEOUT_S + 30)

    # 2. Group b is cut off from everyone: a trains on alone; b rejoins and heals when the
    #    network returns, in the same process.
    b_pid_before = b.pids()
    hosts.partition("b")
    t_cut = time.monotonic()
    a_at_cut = a.step()
    wait_steps([a], {"a": a_at_cut + 3}, timeout=PARTITION_S + 10)
    time.sleep(max(0.0, PARTITION_S - (time.monotonic() - t_cut)))
    hosts.restore("b")
    a_now = a.step()
    wait_steps(groups, {"a": a_now + 3, "b": a_now + 1}, timeout=QUORUM_TIMEOUT_S + 30)
    assert b.pids() == b_pid_before, "b was restarted instead of rejoining"

    # 3. Stop together and compare every group's full state.
    target = max(g.step() for g in groups) + 3
    with open(os.path.join(tmp, "stop"), "w") as f:
        f.write(str(target))
    for g in groups:
        try:
            code = g.proc.wait(timeout=60)
        except Exception:
            raise AssertionError(f"{g.name} did not stop:\n{g.tail()}") from None
        assert code == 0, f"{g.name} exited with {code}:\n{g.tail()}"
    results = [torch.load(g.result, weights_only=False) for g in groups]
    assert results[0]["step"] == target
    assert_identical(results)
