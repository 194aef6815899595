"""The parts of ft-launch on their own: restart policy, group counters, progress records, chaos
choices, the status display and the summary (no processes started; a stub stands in for one)."""

from __future__ import annotations

import io
import json
import os
import signal
from typing import List, Optional

import pytest

from ft.launch import cli
from ft.launch.chaos import ChaosConfig, ChaosInjector
from ft.launch.display import Display, RunOutcome, status_line, table_lines, write_summary
from ft.launch.group import (
    MAX_BACKOFF_DOUBLINGS,
    ChildEnv,
    Group,
    GroupState,
    GroupStats,
    RankProc,
    RestartPolicy,
    log_tail,
)
from ft.launch.progress import RunProgress
from ft.launch.standby import StandbyPool
from ft.utils.deadline import Deadline


class StubProc:
    """Enough of a Popen for RankProc: records signals, exits when told."""

    def __init__(self, pid: int, returncode: Optional[int] = None) -> None:
        self.pid = pid
        self.returncode = returncode
        self.signals: List[int] = []

    def poll(self) -> Optional[int]:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


def make_group(
    gid: int,
    ranks: int = 1,
    *,
    state: GroupState = GroupState.RUNNING,
    progressing: bool = True,
    **view,
) -> Group:
    group = Group(gid, ranks, attempt=1, state=state, progressing=progressing, **view)
    group.ranks = [
        RankProc(rank, 1, StubProc(1000 * (gid + 1) + rank), f"/nonexistent/g{gid}r{rank}")
        for rank in range(ranks)
    ]
    return group


# ------------------------------------------------------------------------ restart policy & stats


@pytest.mark.parametrize(
    "crashes, restarts, policy, delay, give_up",
    [
        (0, 0, RestartPolicy(0.5), 0.5, None),
        (1, 1, RestartPolicy(0.5), 1.0, None),
        (2, 2, RestartPolicy(0.5, max_crashes=3), 2.0, None),
        (
            3,
            3,
            RestartPolicy(0.5, max_crashes=3),
            4.0,
            "giving up, 3 tries in a row failed before their first step",
        ),
        (
            MAX_BACKOFF_DOUBLINGS + 3,
            0,
            RestartPolicy(0.5, max_crashes=100),
            0.5 * 2**MAX_BACKOFF_DOUBLINGS,
            None,
        ),
        (0, 4, RestartPolicy(0.1, max_restarts=4), 0.1, "giving up after 4 restart(s)"),
        (0, 3, RestartPolicy(0.1, max_restarts=4), 0.1, None),
        (
            5,
            2,
            RestartPolicy(0.1, max_restarts=2, max_crashes=5),
            1.6,
            "giving up after 2 restart(s)",
        ),
    ],
)
def test_restart_policy(crashes, restarts, policy, delay, give_up):
    stats = GroupStats(restarts=restarts, crashes_in_a_row=crashes)
    assert policy.delay(stats) == pytest.approx(delay)
    assert policy.give_up(stats) == give_up


@pytest.mark.parametrize(
    "before, exit_code, progressed, after",
    [
        (0, 1, False, 1),  # failed by itself before any step: a crash
        (2, 1, False, 3),
        (2, 1, True, 0),  # failed after training: not the repeating kind
        (2, -signal.SIGKILL, False, 0),  # killed (chaos, OOM killer): not a crash
        (2, -signal.SIGTERM, True, 0),
    ],
)
def test_crash_streak(before, exit_code, progressed, after):
    stats = GroupStats(crashes_in_a_row=before)
    stats.count_failure(exit_code, progressed)
    assert stats.crashes_in_a_row == after


@pytest.mark.parametrize(
    "record, committed, counts",
    [
        ({"event": "step"}, True, (1, 0, 0)),
        ({"event": "step", "committed": True}, True, (1, 0, 0)),
        ({"event": "step", "committed": False}, False, (1, 1, 0)),
        ({"event": "step", "committed": False, "injected": True}, False, (1, 1, 1)),
    ],
)
def test_step_counters(record, committed, counts):
    stats = GroupStats()
    assert stats.count_step(record) is committed
    assert (stats.steps_reported, stats.uncommitted, stats.injected) == counts


def test_group_state():
    assert [state for state in GroupState if state.finished] == [GroupState.DONE, GroupState.FAILED]
    group = make_group(0, ranks=2, step=7, loss=0.5, participants=3)
    group.begin_attempt(master_port=4242, now_s=1.5)
    assert (group.attempt, group.state, group.master_port) == (2, GroupState.RUNNING, 4242)
    assert group.ranks == [] and group.step is None and group.loss is None
    assert not group.progressing and group.start_times == [1.5]


def test_group_health():
    group = make_group(0, ranks=2)
    assert group.healthy() and group.trains()
    group.ranks[1].stopped_until = Deadline.after(10)
    assert group.any_stopped() and not group.healthy()
    group.ranks[1].stopped_until = None
    group.ranks[0].proc.returncode = -9
    assert not group.healthy()
    assert not make_group(1, progressing=False).trains()
    assert make_group(2, state=GroupState.DONE, progressing=False).trains()


def test_rank_proc_signals_only_unreaped_children():
    rank_proc = RankProc(0, 1, StubProc(5), "log")
    assert rank_proc.signal(signal.SIGUSR1) and rank_proc.proc.signals == [signal.SIGUSR1]
    rank_proc.proc.returncode = 0
    assert not rank_proc.signal(signal.SIGKILL) and rank_proc.proc.signals == [signal.SIGUSR1]


def test_child_env(tmp_path):
    env = ChildEnv(
        str(tmp_path / "STOP"),
        str(tmp_path),
        num_groups=3,
        max_steps=50,
        lighthouse="http://127.0.0.1:1",
    )
    group = make_group(2, ranks=2)
    group.master_port = 1234
    rank_env = env.for_rank(group, 1)
    expected = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "REPLICA_GROUP_ID": "2",
        "NUM_REPLICA_GROUPS": "3",
        "TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "FT_LAUNCH_ATTEMPT": "1",
        "FT_MAX_STEPS": "50",
        "FT_LAUNCH_STOP_FILE": str(tmp_path / "STOP"),
        "FT_LAUNCH_LOG_DIR": str(tmp_path),
        "FT_LAUNCH_PARENT_PID": str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    }
    assert {key: rank_env.get(key) for key in expected} == expected
    assert "RANK" not in env.common() and "FT_MAX_STEPS" not in ChildEnv("s", "d", 1).common()


def test_log_tail_skips_progress_records(tmp_path):
    log = tmp_path / "rank.log"
    log.write_text("".join(f"line {i}\n@ft-progress {{}}\n" for i in range(10)))
    assert log_tail(str(log), lines=2) == "    | line 8\n    | line 9"
    assert log_tail(str(tmp_path / "missing.log")) == ""


# ----------------------------------------------------------------------------- progress records


def test_progress_records():
    said: List[str] = []
    progress = RunProgress(said.append, clock=lambda: 3.0)
    group = make_group(0, progressing=False)
    step = {"event": "step", "step": 4, "loss": 0.25, "participants": 2, "quorum_id": 900}
    progress.apply(group, 1, 1, step)  # only rank 0 speaks for a group's steps
    assert group.stats.steps_reported == 0
    progress.apply(group, 1, 0, step)
    assert (group.step, group.loss, group.participants, group.progressing) == (4, 0.25, 2, True)
    assert group.first_step_times == [3.0] and progress.quorum_number(900) == 1 and not said
    progress.apply(group, 1, 0, dict(step, step=5, quorum_id=901))
    assert group.stats.quorum_changes == 1 and progress.quorum_number(901) == 2
    assert said[-1].startswith("new quorum #2 (id 901)") and progress.max_step == 5
    progress.apply(group, 0, 0, dict(step, step=99))  # an older attempt: counted, not shown
    assert group.step == 5 and group.stats.steps_reported == 3
    progress.chaos_injected()
    progress.apply(group, 1, 0, dict(step, step=6, quorum_id=901))
    progress.apply(group, 1, 0, dict(step, step=6, committed=False))
    assert progress.commits_after_last_chaos == 1 and group.stats.uncommitted == 1
    progress.apply(group, 1, 0, {"event": "heal", "from_step": 0, "to_step": 6})
    assert group.stats.heals == 1
    progress.apply(group, 1, 0, {"event": "final", "step": 6})
    assert group.final and progress.finishing and "stop phase" in said[-1]
    progress.apply(group, 1, 1, {"event": "done", "step": 7, "hash": "abc", "accuracy": 0.9})
    assert group.done[1]["hash"] == "abc" and group.step == 7 and group.accuracy == 0.9


def test_a_failing_group_shows_its_cause_until_a_step_commits():
    said: List[str] = []
    progress = RunProgress(said.append, clock=lambda: 1.0)
    group = make_group(0, step=3, participants=2, quorum_id=900)
    cause = "allreduce: DistBackendError: NCCL error: invalid usage (duplicate GPU)" + "x" * 40
    failed = {"event": "step", "step": 3, "committed": False, "error": cause, "quorum_id": 900}
    for _ in range(5):  # a storm of identical failures is announced once
        progress.apply(group, 1, 0, failed)
    assert [line for line in said if "failed" in line] == [f"group 0: step 3 failed: {cause}"]
    assert group.failing == cause and group.stats.uncommitted == 5
    row = table_lines([group], QUORUMS)[1]
    assert row.endswith("failing: " + cause[:57] + "...") and len(row) < 160, row
    assert f"failing={cause[:57] + '...'!r}]" in status_line([group], QUORUMS)
    progress.apply(group, 1, 0, {"event": "step", "step": 4, "committed": True, "quorum_id": 900})
    assert group.failing is None and "failing" not in table_lines([group], QUORUMS)[1]
    assert group.last_error == cause  # kept for the summary


# ------------------------------------------------------------------------------------- chaos


def test_chaos_spares_the_last_healthy_group():
    said: List[str] = []
    chaos = ChaosInjector(ChaosConfig(mode="kill", every=0.0, seed=1), said.append, lambda: 1.0)
    groups = [make_group(0), make_group(1, progressing=False)]
    assert not chaos.tick(groups, max_step=3, stopping=False)
    assert not groups[0].ranks[0].proc.signals
    groups[1].progressing = True
    assert chaos.tick(groups, max_step=3, stopping=False)
    victims = [group for group in groups if group.ranks[0].proc.signals == [signal.SIGKILL]]
    assert len(victims) == 1 and chaos.log[0]["group"] == victims[0].gid
    assert chaos.log[0]["mode"] == "kill" and chaos.log[0]["max_step"] == 3
    assert said[-1].startswith("chaos: SIGKILL -> group")


def test_chaos_stop_then_cont_and_no_chaos_once_stopping():
    said: List[str] = []
    chaos = ChaosInjector(
        ChaosConfig(mode="stop", every=0.0, stop_seconds=0.0, seed=0), said.append, lambda: 1.0
    )
    groups = [make_group(0), make_group(1)]
    assert chaos.tick(groups, 0, stopping=False)
    stopped = [rank for group in groups for rank in group.ranks if rank.stopped_until is not None]
    assert len(stopped) == 1 and stopped[0].proc.signals == [signal.SIGSTOP]
    assert not chaos.tick(groups, 0, stopping=True)  # ends the stop, injects nothing more
    assert stopped[0].proc.signals == [signal.SIGSTOP, signal.SIGCONT]
    assert stopped[0].stopped_until is None and chaos.next_at is None and len(chaos.log) == 1


def test_chaos_seed_repeats_choices():
    def victims(seed: int) -> List[int]:
        chaos = ChaosInjector(
            ChaosConfig(mode="allreduce", every=0.0, seed=seed), lambda _: None, lambda: 0.0
        )
        groups = [make_group(gid, ranks=2) for gid in range(4)]
        for _ in range(6):
            chaos.tick(groups, 0, stopping=False)
        return [(record["group"], record["rank"]) for record in chaos.log]

    assert victims(7) == victims(7) and len(victims(7)) == 6


def test_no_chaos_without_a_mode():
    chaos = ChaosInjector(ChaosConfig(mode=None, every=0.0), lambda _: None, lambda: 0.0)
    assert chaos.next_at is None and not chaos.tick([make_group(0), make_group(1)], 0, False)


# ----------------------------------------------------------------------------------- display


def fixed_groups() -> List[Group]:
    running = make_group(
        0,
        step=12,
        loss=0.123456,
        participants=3,
        quorum_id=77,
        stats=GroupStats(restarts=1, heals=2, quorum_changes=3, uncommitted=4),
    )
    starting = make_group(1, progressing=False)
    stopped = make_group(2, step=11, loss=0.5, participants=3, quorum_id=77)
    stopped.ranks[0].stopped_until = Deadline.after(60)
    finishing = make_group(3, step=12, final=True, quorum_id=78)
    restarting = make_group(4, state=GroupState.RESTARTING, step=None)
    return [running, starting, stopped, finishing, restarting]


QUORUMS = {77: 1, 78: 2}.get


def test_table_lines():
    assert table_lines(fixed_groups(), QUORUMS) == [
        "group state      try   step     loss part quorum qchg heals fails restarts gpus",
        "    0 running      1     12   0.1235    3      1    3     2     4        1 cpu",
        "    1 starting     1      -        -    -      -    0     0     0        0 cpu",
        "    2 STOPPED      1     11   0.5000    3      1    0     0     0        0 cpu",
        "    3 finishing    1     12        -    -      2    0     0     0        0 cpu",
        "    4 restarting   1      -        -    -      -    0     0     0        0 cpu",
    ]


def test_status_line():
    assert status_line(fixed_groups(), QUORUMS) == (
        "status g0[run step=12 loss=0.123 part=3 q=#1] g1[start step=- loss=- part=- q=#-] "
        "g2[STOP step=11 loss=0.500 part=3 q=#1] g3[run step=12 loss=- part=- q=#2] "
        "g4[restarting step=- loss=- part=- q=#-]"
    )


def test_display_plain_status_is_throttled():
    out = io.StringIO()
    display = Display(out, tty=False, status_every=60.0)
    display.render(fixed_groups(), QUORUMS)
    display.render(fixed_groups(), QUORUMS)  # too soon: nothing
    display.render(fixed_groups(), QUORUMS, force=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("[ft-launch ") for line in lines)
    assert lines[0].split("] ", 1)[1].startswith("status g0[run step=12")


def test_display_tty_redraws_the_table_in_place():
    out = io.StringIO()
    display = Display(out, tty=True, status_every=60.0)
    display.render(fixed_groups(), QUORUMS)
    display.say("hello")
    text = out.getvalue()
    table = "\n".join(table_lines(fixed_groups(), QUORUMS)) + "\n"
    assert text.startswith(table)
    # the message first erases the six table lines, then takes their place
    assert text[len(table) :].startswith("\x1b[6F\x1b[J[ft-launch ") and text.endswith("s] hello\n")
    display.leave_table()
    display.say("kept")
    assert "\x1b[" not in out.getvalue()[len(text) :]


def outcome(groups: List[Group], **overrides) -> RunOutcome:
    fields = dict(
        elapsed=12.34,
        groups=groups,
        chaos_mode="kill",
        chaos_log=[
            {"mode": "kill", "group": 1, "rank": 0, "pid": 5, "time": 4.5, "step": 8, "max_step": 9}
        ],
        restart_log=[{"group": 1, "time": 4.7}],
        quorum_ids={77: 1, 78: 2},
        commits_after_last_chaos=6,
        max_step=20,
        stop_reason="",
        log_dir="/tmp/logs",
        standby_pids=[11],
        warm_starts=1,
    )
    fields.update(overrides)
    return RunOutcome(**fields)


def finished_groups(hashes=("h" * 64, "h" * 64)) -> List[Group]:
    groups = []
    for gid, digest in enumerate(hashes):
        group = make_group(
            gid,
            state=GroupState.DONE,
            step=20,
            accuracy=0.875,
            stats=GroupStats(restarts=gid, heals=gid, quorum_changes=1),
        )
        group.done[0] = {"event": "done", "step": 20, "hash": digest}
        groups.append(group)
    return groups


def test_summary_identical():
    out = io.StringIO()
    result = outcome(finished_groups())
    write_summary(result, out)
    assert out.getvalue().splitlines() == [
        "",
        "== ft-launch summary (12.3s) ==",
        "group result  tries final step heals qchg fails accuracy  hash",
        "    0 done        1         20     0    1     0    87.5%  hhhhhhhhhhhhhhhh",
        "    1 done        1         20     1    1     0    87.5%  hhhhhhhhhhhhhhhh",
        "chaos: 1 failure(s) injected (kill); restarts: 1 (1 rank(s) from warm standbys); "
        "heals: 1; quorums: 2; uncommitted steps: 0",
        "training went on: 11 step(s) committed after the last injected failure (at 4.5s: step 9 "
        "-> 20)",
        f"weights: all 2 replica group(s) (2 rank(s)) hold identical model and optimizer state, "
        f"sha256 {'h' * 64}",
        "logs: /tmp/logs",
    ]
    assert result.succeeded
    record = json.loads(json.dumps(result.to_json()))
    assert record["identical"] and record["all_done"] and record["steps_after_last_chaos"] == 11
    assert record["hashes"] == {"0/0": "h" * 64, "1/0": "h" * 64}
    assert record["groups"][1]["state"] == "done" and record["groups"][1]["restarts"] == 1
    assert record["quorum_ids"] == [77, 78] and record["warm_starts"] == 1


def test_summary_mismatch_and_failure():
    groups = finished_groups(("a" * 64, "b" * 64))
    groups[1].state = GroupState.FAILED
    groups[1].exit_info = "try 1: rank 0 exit status 1"
    out = io.StringIO()
    result = outcome(groups, chaos_log=[], chaos_mode=None, warm_starts=0)
    write_summary(result, out)
    text = out.getvalue()
    assert "    1 failed  " in text and "\n      try 1: rank 0 exit status 1\n" in text
    assert "chaos: 0 failure(s) injected; restarts: 1; heals" in text
    assert "training went on" not in text
    assert "weights: MISMATCH, 2 distinct hash(es) over 2 of 2 rank(s):" in text
    assert "    group 1 rank 0: " + "b" * 64 in text
    assert not result.succeeded and result.to_json()["steps_after_last_chaos"] is None


def test_summary_without_hashes():
    groups = [make_group(0, state=GroupState.DONE)]
    out = io.StringIO()
    result = outcome(groups)
    write_summary(result, out)
    assert "weights: no final hashes reported" in out.getvalue() and result.succeeded


# ------------------------------------------------------------------------------ standby pool


def test_disabled_standby_pool_starts_nothing():
    pool = StandbyPool(None, size=2, env=dict, say=lambda _: None)
    pool.refill(everyone_trains=True)
    assert pool.activate({"RANK": "0"}) is None and pool.pids == [] and pool.activated == 0
    pool.close()


def test_standby_pool_goes_cold_for_an_oversized_environment():
    pool = StandbyPool(["train.py"], size=1, env=dict, say=lambda _: None)
    assert pool.activate({"BIG": "x" * 100_000}) is None  # would block on the pipe
    assert pool.activate({"RANK": "0"}) is None  # none ready yet
    assert pool.activated == 0


# --------------------------------------------------------------------------------------- cli


def test_cli_reexports_and_parser_defaults():
    args = cli.build_parser().parse_args(["--", "x.py"])
    assert args.chaos is None and args.stop_action == "cont" and args.every == 5.0
    assert args.kill_grace == 5.0 and args.stop_grace == 60.0 and args.restart_delay == 0.5
    assert cli.CHAOS_MODES == ("kill", "stop", "allreduce")
    assert cli.Group is Group and cli.RankProc is RankProc


def test_a_group_that_gave_up_is_not_restarted():
    from ft.launch.group import RestartPolicy

    stats = GroupStats()
    policy = RestartPolicy()
    assert policy.give_up(stats) is None
    stats.gave_up = "allreduce: ValueError: mismatched sizes"
    assert policy.give_up(stats) == (
        "not restarted, its steps failed persistently: allreduce: ValueError: mismatched sizes"
    )


def test_barrier_steps_show_the_step_a_group_healed_into():
    said: List[str] = []
    progress = RunProgress(said.append, clock=lambda: 1.0)
    group = make_group(0, step=None)
    progress.apply(group, 1, 0, {"event": "step", "step": 518, "barrier": True})
    assert group.step == 518
    progress.apply(group, 1, 0, {"event": "step", "step": 519, "barrier": True})
    assert group.step == 518  # the last training step, as before
