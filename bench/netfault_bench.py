"""Network-fault benchmark: what each fault costs a job spread over several hosts.

    sudo .venv/bin/python -m bench.netfault_bench [--soak-s 300] [--only NAME]

Simulated hosts (network namespaces on a private bridge, tests/multihost/netns.py): a
lighthouse host and one host per replica group, one rank per group, the MLP of
tests/multihost/worker.py with a 50 ms compute stand-in per step. Heartbeat timeout 2 s,
collective timeout 5 s, quorum_timeout 30 s. Every scenario starts a fresh job and first
measures it fault-free; the fault-free run in the same invocation is the baseline of the
relative numbers.

Per scenario:
- survivors' stall: the longest gap between two commits of a group that was not cut off;
- restore -> first commit: from the network coming back (or the process restart) to the
  cut-off group's first committed step;
- steps lost: survivor iterations that committed nothing, from the fault to 3 steps after it;
- goodput: committed samples per second (participants x batch per commit) from the fault's
  start to 3 steps after its end, relative to the fault-free rate of the same job (not for the
  lighthouse outage, where that window is mostly the pause itself);
- step ratio (packet loss): mean (and median) step time under loss / fault-free.

The soak kills or partitions a random non-first group every 20 s for --soak-s seconds.

Results: docs/benchmarks.md, "Network faults".
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from tests.multihost.job import Job, assert_identical
from tests.multihost.netns import Hosts, unavailable_reason


def make_hosts(names):
    return Hosts(names)


def fault_free_rate(job: Job, steps: int = 20) -> float:
    t0 = time.time()
    job.advance(steps, timeout=120)
    return job.groups[0].goodput(t0, time.time())


def step_times(job: Job, since: float, until: float) -> list:
    times = []
    last = None
    for step, _, t, _ in job.groups[0].records():
        if since <= t <= until and last is not None and step > last[0]:
            times.append(t - last[1])
        last = (step, t)
    return times


def scenario(name: str, groups: int, fault) -> dict:
    job = Job(make_hosts, groups=groups)
    try:
        job.wait_steps({g.name: 3 for g in job.groups}, timeout=180)
        base = fault_free_rate(job)
        out = fault(job)
        out["goodput"] = out.pop("rate") / base if "rate" in out else None
        assert_identical(job.stop_and_collect())
        out["identical"] = True
        return out
    finally:
        job.hosts.close()
        job.cleanup()


def partition_group(seconds: float):
    def run(job: Job) -> dict:
        victim = job.groups[-1]
        survivors = job.groups[:-1]
        t0 = time.time()
        job.hosts.partition(victim.name)
        time.sleep(seconds)
        t_back = time.time()
        job.hosts.restore(victim.name)
        job.advance(3, timeout=120)
        t1 = time.time()
        first = victim.first_commit_after(t_back, above=0)
        return {
            "stall": max(g.longest_stall(t0, t_back) for g in survivors),
            "restore_to_commit": (first - t_back) if first else None,
            "lost": max(g.uncommitted(t0, t1) for g in survivors),
            "rate": survivors[0].goodput(t0, t1),
        }

    return run


def lighthouse_outage(seconds: float):
    def run(job: Job) -> dict:
        t0 = time.time()
        job.hosts.partition("lh")
        time.sleep(seconds)
        t_back = time.time()
        job.hosts.restore("lh")
        job.advance(3, timeout=120)
        t1 = time.time()
        a = job.groups[0]
        first = a.first_commit_after(t_back, above=a.step() - 3)
        # No goodput here: over a window that is mostly outage it only restates the pause.
        return {
            "stall": max(g.longest_stall(t0, t1) for g in job.groups),
            "restore_to_commit": (first - t_back) if first else None,
            "lost": max(g.uncommitted(t0, t1) for g in job.groups),
            "exits": sum(g.proc.poll() is not None for g in job.groups),
        }

    return run


def kill_restart(delay: float):
    def run(job: Job) -> dict:
        victim = job.groups[-1]
        t0 = time.time()
        victim.kill()
        time.sleep(delay)
        t_start = time.time()
        victim.start()
        job.advance(3, timeout=120)
        t1 = time.time()
        first = victim.first_commit_after(t_start, above=0)
        return {
            "stall": max(g.longest_stall(t0, t1) for g in job.groups[:-1]),
            "restore_to_commit": (first - t_start) if first else None,
            "lost": max(g.uncommitted(t0, t1) for g in job.groups[:-1]),
            "rate": job.groups[0].goodput(t0, t1),
        }

    return run


def packet_loss(p: float, steps: int = 20):
    def run(job: Job) -> dict:
        t_before = time.time()
        job.advance(steps, timeout=120)
        t0 = time.time()
        job.drop_packets(job.groups[-1].name, p)
        job.advance(steps, timeout=300)
        t1 = time.time()
        before, during = step_times(job, t_before, t0), step_times(job, t0, t1)
        return {
            "step_ratio": statistics.mean(during) / statistics.mean(before),
            "median_ratio": statistics.median(during) / statistics.median(before),
            "rate": job.groups[0].goodput(t0, t1),
        }

    return run


def soak(seconds: float, every: float = 20.0):
    def run(job: Job) -> dict:
        rng = random.Random(0)
        t0 = time.time()
        faults = []
        while time.time() - t0 < seconds:
            time.sleep(every)
            victim = rng.choice(job.groups[1:])
            if rng.random() < 0.5:
                victim.kill()
                time.sleep(2.0)
                victim.start()
                faults.append("kill")
            else:
                job.hosts.partition(victim.name)
                time.sleep(5.0)
                job.hosts.restore(victim.name)
                faults.append("partition")
        job.advance(3, timeout=180)
        t1 = time.time()
        return {
            "faults": f"{faults.count('kill')} kills, {faults.count('partition')} partitions",
            "rate": job.groups[0].goodput(t0, t1),
        }

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--soak-s", type=float, default=300.0)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        sys.exit(f"netfault_bench needs network namespaces: {reason}")
    scenarios = [
        ("group partitioned 15 s (3 groups)", 3, partition_group(15.0)),
        ("lighthouse unreachable 10 s (2 groups)", 2, lighthouse_outage(10.0)),
        ("kill -9, restart 5 s later (2 groups)", 2, kill_restart(5.0)),
        ("2 % packet loss on one link (2 groups)", 2, packet_loss(0.02)),
        (
            f"soak: kill or partition every 20 s for {args.soak_s:.0f} s (3 groups)",
            3,
            soak(args.soak_s),
        ),
    ]
    for name, groups, fault in scenarios:
        if args.only and args.only not in name:
            continue
        r = scenario(name, groups, fault)
        fields = []
        for k, fmt in (
            ("stall", "survivors' stall {:.2f} s"),
            ("restore_to_commit", "restore -> first commit {:.2f} s"),
            ("lost", "steps lost {}"),
            ("exits", "processes exited {}"),
            ("step_ratio", "mean step time x{:.2f}"),
            ("median_ratio", "median x{:.2f}"),
            ("faults", "{}"),
            ("goodput", "goodput {:.0%}"),
        ):
            if r.get(k) is not None:
                fields.append(fmt.format(r[k]))
        print(f"{name}: " + "; ".join(fields) + "; final state identical", flush=True)


if __name__ == "__main__":
    main()
