"""A persistent fault is an error, not a storm (docs/design.md, "Persistent failures"): real
replica groups (processes), a real lighthouse, Gloo through the ft backend, and a fault that
fails every step the same way. Every child is reaped by the ``replicas`` fixture; every wait is
bounded.
"""

from __future__ import annotations

from typing import Any, Dict, List

from ft.launch.worker import parse_progress
from tests.procs import free_port

TARGET = "tests.manager.workers:step_faults"
LIGHTHOUSE = dict(min_replicas=1, heartbeat_timeout_ms=2000, join_timeout_ms=1000)


def step_records(child: Any) -> List[Dict[str, Any]]:
    """The ft-launch step records a child printed."""
    records = [parse_progress(line) for line in child.output().splitlines()]
    return [r for r in records if r is not None and r["event"] == "step"]


def test_a_persistent_fault_raises_in_every_group_after_a_bounded_number_of_quorums(
    replicas,
) -> None:
    bound, backoff_after = 6, 2
    w = replicas(
        TARGET,
        2,
        lighthouse=LIGHTHOUSE,
        env={"FT_FAILURE_BACKOFF_AFTER": str(backoff_after)},
        ports=[free_port(), free_port()],
        fault="non_contiguous",
        use_async_quorum=False,
        max_consecutive_failures=bound,
        max_attempts=10 * bound,  # without the bound the loop would run this long
    )
    results = w.join(90)
    expected_error = {0: "DistBackendError", 1: "ValueError"}  # the victim's, the culprit's
    for res, child in zip(results, w.children):
        g = res["group"]
        raised = res["raised"]
        attempts = res["attempts"]
        assert raised is not None, f"group {g} never raised: {attempts}"
        assert raised["type"] == "PersistentStepFailure" and raised["is_runtime_error"]
        assert raised["phase"] == "allreduce" and raised["count"] == bound == raised["bound"]
        msg = raised["message"]
        assert "phase allreduce" in msg and expected_error[g] in msg, msg
        assert f"{bound} times in a row" in msg and f"max_consecutive_failures={bound}" in msg
        if g == 1:
            assert "tensors must be contiguous" in msg, msg
        # Bounded: the first quorum may still miss a group, which then commits alone (the
        # other's joining is a membership change, which starts the streak afresh), hence the
        # slack of 2; a storm would run all 60 attempts.
        quorums = {a["quorum_id"] for a in attempts}
        assert len(attempts) <= bound + 2, attempts
        assert len(quorums) <= bound + 2, sorted(quorums)
        first_failure = [a["committed"] for a in attempts].index(False)
        assert not any(a["committed"] for a in attempts[first_failure:]), attempts
        # The streak is `bound` failures in one membership; a failure in a first quorum that
        # missed the other group (the culprit fails even alone) precedes it, and the other's
        # joining starts the streak afresh.
        assert bound <= len(attempts) - first_failure <= bound + 1, attempts
        # From the streak's backoff_after-th failure on, a wait before every next quorum,
        # logged at ERROR with the error, the phase and what is retried.
        log = child.output()
        backoffs = [line for line in log.splitlines() if "step_failure_backoff" in line]
        assert len(backoffs) >= bound - backoff_after, log[-4000:]
        assert all("phase=allreduce" in b and expected_error[g] in b for b in backoffs)
        # the step the streak retries: 0, or 1 where a lone group committed step 0 first (the
        # last attempt's step, taken before its quorum: no step commits during the streak)
        retried = attempts[-1]["step"]
        assert all(f"retrying step {retried}" in b for b in backoffs), backoffs
        assert "persistent_failure" in log
        # ft-launch's step records say why each step did not commit.
        records = step_records(child)
        assert [r["committed"] for r in records] == [a["committed"] for a in attempts]
        for r in records[first_failure:]:
            assert r["error"].startswith(f"allreduce: {expected_error[g]}: "), r
            assert "\n" not in r["error"] and len(r["error"]) <= 200


def test_transient_failures_between_commits_never_reach_the_bound(replicas) -> None:
    # Three injected failures, each followed by committed steps, under a bound of 3: were
    # failures counted across commits, the third would raise.
    inject_at = [2, 4, 6]
    w = replicas(
        TARGET,
        2,
        lighthouse=LIGHTHOUSE,
        ports=[free_port(), free_port()],
        fault="abort",
        inject_at=inject_at,
        stop_at=9,
        max_consecutive_failures=3,
    )
    results = w.join(90)
    for res, child in zip(results, w.children):
        g = res["group"]
        assert res["raised"] is None, res["raised"]
        assert res["step"] == 9, res["attempts"]
        failed_steps = sorted({a["step"] for a in res["attempts"] if not a["committed"]})
        if g == 0:  # the injector fails them all (group 1 may have joined late, and healed)
            assert set(inject_at) <= set(failed_steps), res["attempts"]
        records = step_records(child)
        assert [r["committed"] for r in records] == [a["committed"] for a in res["attempts"]]
        for r in records:
            if r["committed"]:
                assert "error" not in r, r
            else:
                assert r["error"].split(":")[0] in ("allreduce", "heal", "configure"), r
        if g == 0:
            injected = [r for r in records if r.get("injected")]
            assert len(injected) == len(inject_at)
            assert all(r["error"].startswith("allreduce: ") for r in injected), injected
        log = child.output()
        assert "persistent_failure" not in log and "step_failure_backoff" not in log
