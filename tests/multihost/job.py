"""A training job on simulated hosts: one lighthouse host and one host per replica group.

Shared by tests/multihost and bench/netfault_bench.py. Every group runs
``tests.multihost.worker`` (one rank per group); the job reads each group's progress file to
measure steps, stalls and restarts, and compares final states bitwise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import Dict, List, Optional

import torch

from ft.utils.auth import JobSecret
from tests.multihost.netns import Hosts
from tests.procs import REPO, Proc, lighthouse_argv

LH_PORT = 29510


class Group:
    """One replica group's process (restartable) and its progress file."""

    def __init__(self, job: "Job", name: str, seed: int, ranks: int = 1) -> None:
        self.job = job
        self.name = name
        self.seed = seed
        self.ranks = ranks
        self.progress = os.path.join(job.tmp, f"{name}.progress")
        self.result = os.path.join(job.tmp, f"{name}.pt")
        self.proc: Optional[Proc] = None
        self.starts = 0

    @property
    def log(self) -> str:
        return os.path.join(self.job.tmp, f"{self.name}.{self.starts}.log")

    def start(self) -> None:
        self.starts += 1
        cfg = {
            "name": self.name,
            "seed": self.seed,
            "lighthouse": self.job.lighthouse,
            "timeout": self.job.op_timeout,
            "quorum_timeout": self.job.quorum_timeout,
            "progress": self.progress,
            "stop_file": self.job.stop_file,
            "result": self.result,
            "step_sleep": self.job.step_sleep,
        }
        worker = ["-m", "tests.multihost.worker", json.dumps(cfg)]
        if self.job.torchrun:
            # One torchrun per group, as for a real run: it restarts the whole group when a
            # rank dies, and its c10d rendezvous store is the group's store.
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(self.ranks),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "127.0.0.1:29400",
                "--max-restarts",
                "3",
                "--local-addr",
                self.job.hosts.addr[self.name],
                "--monitor-interval",
                "0.2",
                *worker,
            ]
        else:
            argv = [sys.executable, *worker]
        # FT_ADVERTISE_HOST cleared: the test process may carry a loopback one (other tests
        # set it), and these workers must find their address by the route to the lighthouse.
        self.proc = self.job.hosts.popen(
            self.name,
            argv,
            self.log,
            env={**self.job.env, "OMP_NUM_THREADS": "1", "FT_ADVERTISE_HOST": ""},
            label=f"group {self.name}",
        )

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()

    def records(self, rank: int = 0) -> List[tuple]:
        """(committed step, pid, wall time, participants) per iteration of ``rank``."""
        path = f"{self.progress}.{rank}"
        if not os.path.exists(path):
            return []
        with open(path) as f:
            out = []
            for ln in f.read().splitlines():
                parts = ln.split()
                if len(parts) == 4:
                    out.append((int(parts[0]), parts[1], float(parts[2]), int(parts[3])))
            return out

    def step(self) -> int:
        """The group's committed step: its slowest rank's."""
        steps = []
        for r in range(self.ranks):
            recs = self.records(r)
            steps.append(recs[-1][0] if recs else -1)
        return min(steps)

    def pids(self) -> set:
        return {rec[1] for r in range(self.ranks) for rec in self.records(r)}

    def last_pid(self, rank: int) -> int:
        return int(self.records(rank)[-1][1])

    def tail(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def longest_stall(self, since: float, until: float) -> float:
        """Longest wall-clock gap between commits (step changes) within [since, until]."""
        times = [since]
        last_step = None
        for step, _, t, _ in self.records():
            if since <= t <= until and step != last_step:
                times.append(t)
            last_step = step
        times.append(until)
        return max(b - a for a, b in zip(times, times[1:]))

    def goodput(self, since: float, until: float, batch: int = 8) -> float:
        """Committed samples per second across the job in [since, until], from this group's
        view: each commit counts ``participants * batch`` samples."""
        samples, last_step = 0, None
        for step, _, t, n in self.records():
            if since <= t <= until and last_step is not None and step > last_step:
                samples += n * batch
            last_step = step
        return samples / max(until - since, 1e-9)

    def uncommitted(self, since: float, until: float) -> int:
        """Iterations in [since, until] that committed nothing (steps lost to the fault)."""
        lost, last_step = 0, None
        for step, _, t, _ in self.records():
            if since <= t <= until and last_step is not None and step == last_step:
                lost += 1
            last_step = step
        return lost

    def first_commit_after(self, t0: float, above: int) -> Optional[float]:
        for step, _, t, _ in self.records():
            if t >= t0 and step > above:
                return t
        return None


class Job:
    """``Job(hosts_factory, groups=2)``: a lighthouse on host "lh", groups "a", "b", ..."""

    def __init__(
        self,
        make_hosts,
        groups: int = 2,
        quorum_timeout: float = 30.0,
        op_timeout: float = 5.0,
        heartbeat_timeout_ms: int = 2000,
        step_sleep: float = 0.05,
        ranks_per_group: int = 1,
        torchrun: bool = False,
    ) -> None:
        names = [chr(ord("a") + i) for i in range(groups)]
        self.torchrun = torchrun
        self.hosts: Hosts = make_hosts(["lh", *names])
        self.tmp = tempfile.mkdtemp(prefix="ft-multihost-")
        self.quorum_timeout = quorum_timeout
        self.op_timeout = op_timeout
        self.heartbeat_timeout_s = heartbeat_timeout_ms / 1000
        self.step_sleep = step_sleep
        self.stop_file = os.path.join(self.tmp, "stop")
        # The job secret, as a deployment hands it out: a file only its owner reads. Every
        # server here listens on a test-subnet address, where ft refuses to serve without one.
        secret_file = os.path.join(self.tmp, "job-secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(JobSecret.generate().export())
        self.env = {"PYTHONPATH": REPO, "FT_JOB_SECRET_FILE": secret_file, "FT_JOB_SECRET": ""}
        self.lighthouse = f"http://{self.hosts.addr['lh']}:{LH_PORT}"
        self._lh_argv = lighthouse_argv(
            sys.executable,
            "-m",
            "ft.coordination.cli",
            bind=f"{self.hosts.addr['lh']}:{LH_PORT}",
            join_timeout_ms=1000,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self.lh: Optional[Proc] = None
        self.lh_starts = 0
        self.start_lighthouse()
        self.groups = [
            Group(self, n, seed=i + 1, ranks=ranks_per_group) for i, n in enumerate(names)
        ]
        for g in self.groups:
            g.start()

    def start_lighthouse(self) -> None:
        self.lh_starts += 1
        self.lh = self.hosts.popen(
            "lh",
            self._lh_argv,
            os.path.join(self.tmp, f"lighthouse.{self.lh_starts}.log"),
            env=self.env,
            label="lighthouse",
        )

    def kill_lighthouse(self) -> None:
        assert self.lh is not None
        self.lh.kill()

    def group(self, name: str) -> Group:
        return next(g for g in self.groups if g.name == name)

    def check_alive(self, allow_dead: tuple = ()) -> None:
        for g in self.groups:
            code = g.proc.poll() if g.proc is not None else None
            if g.name in allow_dead or code is None:
                continue
            assert code == 0 and os.path.exists(self.stop_file), (
                f"group {g.name} exited with {code}:\n{g.tail()}"
            )

    def wait_steps(self, at_least: Dict[str, int], timeout: float, allow_dead: tuple = ()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive(allow_dead)
            if all(self.group(n).step() >= s for n, s in at_least.items()):
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {g.name} (step {g.step()})\n{g.tail()}" for g in self.groups)
        raise AssertionError(f"no progress to {at_least} within {timeout}s\n{logs}")

    def advance(self, steps: int, timeout: float) -> None:
        """Waits until every group has committed ``steps`` more steps than the furthest now."""
        top = max(g.step() for g in self.groups)
        self.wait_steps({g.name: top + steps for g in self.groups}, timeout)

    def drop_packets(self, name: str, probability: float) -> None:
        """Drops each packet in and out of host ``name`` with ``probability`` (iptables)."""
        for chain in ("INPUT", "OUTPUT"):
            self.hosts.run(
                name,
                [
                    "iptables",
                    "-A",
                    chain,
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    str(probability),
                    "-j",
                    "DROP",
                ],
            )

    def stop_and_collect(self, extra_steps: int = 3, timeout: float = 60.0) -> List[List[dict]]:
        """Stops every group at one step; returns ``results[group][rank]``."""
        target = max(g.step() for g in self.groups) + extra_steps
        with open(self.stop_file, "w") as f:
            f.write(str(target))
        for g in self.groups:
            code = g.proc.wait(timeout)  # AssertionError with its output if it does not stop
            assert code == 0, f"{g.name} exited with {code}:\n{g.tail()}"
        results = [
            [torch.load(f"{g.result}.{r}", weights_only=False) for r in range(g.ranks)]
            for g in self.groups
        ]
        assert {x["step"] for rs in results for x in rs} == {target}
        return results

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def iptables_available() -> bool:
    return shutil.which("iptables") is not None


def assert_identical(results: List[List[dict]]) -> None:
    """Every group's model and optimizer state is bitwise identical, rank by rank."""
    for rank in range(len(results[0])):
        _assert_identical([rs[rank] for rs in results])


def _assert_identical(results: List[dict]) -> None:
    ref = results[0]
    for i, other in enumerate(results[1:], start=1):
        assert other["step"] == ref["step"]
        for k, v in ref["model"].items():
            assert torch.equal(v, other["model"][k]), f"group {i}: model {k} differs"
        assert other["optim"]["param_groups"] == ref["optim"]["param_groups"]
        for pid, st in ref["optim"]["state"].items():
            for k, v in st.items():
                ov = other["optim"]["state"][pid][k]
                assert torch.equal(v, ov) if torch.is_tensor(v) else v == ov, (i, pid, k)
