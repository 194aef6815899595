"""ft-launch: the supervisor, against a fast fake worker and against the real training example.

Every run is a real `python -m ft.launch` process with a hard `--timeout`, and the test's own wait
on it is bounded too. After each run the test checks that every process the launcher started is
gone.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import List, Sequence, Tuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ft.launch import cli  # noqa: E402
from ft.launch.worker import PROGRESS_PREFIX, emit_step, parse_progress  # noqa: E402
from ft.utils.deadline import Deadline  # noqa: E402
from tests.manager.inproc import reporting_manager  # noqa: E402

FAKE = os.path.join(ROOT, "tests", "launch", "fake_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "train_ddp.py")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # reused by someone else's process: not ours
        return False
    try:  # a zombie that init has not reaped yet counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run_launch(launcher_args: str, worker: List[str], wait_s: float) -> Tuple[int, str, dict]:
    """Runs ``ft-launch <launcher_args> -- <worker>`` (the launcher's options as one string)
    with a log folder and summary of its own; returns its status, output and summary. The
    launcher is interrupted past ``wait_s`` and every child it started must be gone."""
    log_dir = tempfile.mkdtemp(prefix="ft-launch-test-")
    summary = os.path.join(log_dir, "summary.json")
    cmd = [
        sys.executable,
        "-m",
        "ft.launch",
        "--log-dir",
        log_dir,
        "--summary-json",
        summary,
        "--status-every",
        "2",
        "--timeout",
        str(wait_s - 15),
        *shlex.split(launcher_args),
        "--",
        *worker,
    ]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher reaps its children on the way out
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()  # its children notice and exit (parent watch)
            out, _ = proc.communicate(timeout=10)
        raise AssertionError(f"ft-launch overran {wait_s}s:\n{out[-8000:]}") from None
    result = {}
    if os.path.exists(summary):
        with open(summary) as f:
            result = json.load(f)
    pids = [pid for g in result.get("groups", []) for attempt in g["pids"] for pid in attempt]
    pids += result.get("standby_pids", [])  # unused standbys are reaped too
    gone = Deadline.after(5)  # a reaped child's zombie may linger a moment in /proc
    while any(_alive(pid) for pid in pids) and not gone.expired:
        gone.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], f"children left running:\n{out[-4000:]}"
    if proc.returncode != 0:
        out += _log_tails(log_dir)  # what the ranks said, for the failure message
    result["log_dir"] = log_dir
    return proc.returncode, out, result


def _log_tails(log_dir: str, chars: int = 3000) -> str:
    """The end of every rank's log in ``log_dir`` (stacks included, when the launcher asked for
    them at --timeout)."""
    parts = []
    for name in sorted(os.listdir(log_dir)):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                parts.append(f"\n--- {name} (tail) ---\n{f.read()[-chars:]}")
    return "".join(parts)


# -------------------------------------------------------------------------------------- units


def test_parse_progress():
    rec = parse_progress(PROGRESS_PREFIX + '{"event": "step", "step": 3}\n')
    assert rec == {"event": "step", "step": 3}
    assert parse_progress("hello") is None
    assert parse_progress(PROGRESS_PREFIX + "{not json") is None
    assert parse_progress(PROGRESS_PREFIX + '[1, 2]') is None
    assert parse_progress(PROGRESS_PREFIX + '{"no_event": 1}') is None


def test_emit_step_reports_what_the_manager_says(capsys):
    manager = reporting_manager(step=7, participants=3, quorum_id=12)
    emit_step(manager, loss=0.1234567, committed=False, injected=True)
    rec = parse_progress(capsys.readouterr().out)
    assert {k: v for k, v in rec.items() if k not in ("group", "rank", "time")} == {
        "event": "step",
        "step": 7,
        "loss": 0.12346,
        "participants": 3,
        "quorum_id": 12,
        "committed": False,
        "injected": True,
    }


def test_exit_for_restart_names_the_worker_and_exits_1():
    code = (
        "from ft.launch import worker\n"
        "try:\n    raise RuntimeError('peer gone')\n"
        "except RuntimeError as e:\n    worker.exit_for_restart('train: group 1 rank 0', e)\n"
        "print('not reached')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not reached" not in r.stdout
    assert "train: group 1 rank 0: RuntimeError: peer gone" in r.stderr
    assert "Traceback" in r.stderr


def test_build_command():
    assert cli.build_command(["--", "x.py", "--a"], False) == [sys.executable, "-u", "x.py", "--a"]
    assert cli.build_command(["-m", "pkg.mod"], False) == [sys.executable, "-u", "-m", "pkg.mod"]
    assert cli.build_command(["/bin/true"], False) == ["/bin/true"]
    assert cli.build_command(["x.py"], True) == ["x.py"]
    with pytest.raises(ValueError):
        cli.build_command(["--"], False)


def test_free_port_pair_is_outside_the_ephemeral_range_and_bindable():
    from ft.launch import group

    low, high = group.ephemeral_port_range()
    for _ in range(20):
        p = cli.free_port_pair()
        assert not (low <= p <= high) and not (low <= p + 1 <= high), (p, low, high)
        for port in (p, p + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


@pytest.mark.parametrize(
    "ephemeral, expected",
    [
        ((32768, 60999), (10000, 32766)),  # Linux default: below the range
        ((49152, 65535), (10000, 49150)),  # IANA's dynamic range
        ((1024, 60000), (60001, 65533)),  # no room below: above it
        ((1024, 65535), (1024, 65533)),  # all ephemeral: nothing better exists
    ],
)
def test_store_port_candidates_avoid_the_ephemeral_range(ephemeral, expected):
    from ft.launch import group

    assert group.store_port_candidates(ephemeral) == expected


def test_ephemeral_port_range_falls_back_when_unreadable(tmp_path):
    from ft.launch import group

    (tmp_path / "range").write_text("40000\t50000\n")
    assert group.ephemeral_port_range(str(tmp_path / "range")) == (40000, 50000)
    assert group.ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)


def test_usage_errors():
    for argv in (["--replicas", "0", "--", FAKE], ["--", "does_not_exist.py"], []):
        r = subprocess.run(
            [sys.executable, "-m", "ft.launch"] + argv,
            cwd=ROOT,
            timeout=60,
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        assert r.returncode == 2, (argv, r.stdout, r.stderr)


# ---------------------------------------------------------------------- supervisor (fake worker)


def run_fake_ok(launcher_args: str, *fake_args: str, wait_s: float = 90) -> Tuple[str, dict]:
    """``run_launch`` of the fake worker (``fake_args``) that must exit 0; its output and
    summary."""
    rc, out, s = run_launch(launcher_args, [FAKE, *fake_args], wait_s)
    assert rc == 0, out
    return out, s


def test_kill_chaos_restarts_and_finishes():
    out, s = run_fake_ok(
        "--replicas 3 --chaos kill --every 1 --seed 3 --max-steps 100 --restart-delay 0.1"
    )
    assert s["all_done"] and s["identical"], out
    assert len(s["chaos"]) >= 1 and len(s["restarts"]) >= 1, out
    assert all(c["mode"] == "kill" for c in s["chaos"])
    assert s["steps_after_last_chaos"] > 0, out
    assert "training went on" in out and "identical model and optimizer state" in out


def test_restarts_use_warm_standbys():
    """Once every group trains, the launcher keeps a standby per rank (a process that imported
    torch and ft ahead of time); a restarted group's ranks are those standbys, they get the
    rank's environment, and unused standbys are reaped at the end."""
    out, s = run_fake_ok(
        "--replicas 2 --ranks-per-group 2 --chaos kill --every 6 --seed 1 --max-steps 200 --restart-delay 0.1",
        "--dump-env",
        "--step-s",
        "0.05",
        wait_s=120,
    )
    assert s["all_done"] and s["identical"], out
    assert s["warm_starts"] >= 2 and "from warm standbys" in out, out
    restarted = [g for g in s["groups"] if g["tries"] > 1]
    assert restarted, out
    g = restarted[0]
    assert set(g["pids"][1]) <= set(s["standby_pids"]), (g, s["standby_pids"])
    with open(os.path.join(s["log_dir"], f"env_g{g['group']}_r1_t2.json")) as f:
        env = json.load(f)
    assert env["RANK"] == "1" and env["REPLICA_GROUP_ID"] == str(g["group"])
    assert env["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_no_standby_restarts_cold():
    out, s = run_fake_ok(
        "--replicas 2 --chaos kill --every 1 --seed 3 --max-steps 60 --restart-delay 0.1 --no-standby"
    )
    assert s["restarts"] and s["warm_starts"] == 0 and not s["standby_pids"], out


def test_whole_group_restart_and_env():
    out, s = run_fake_ok(
        "--replicas 2 --ranks-per-group 2 --chaos kill --every 1 --seed 1 --max-steps 60 --restart-delay 0.1",
        "--dump-env",
    )
    restarted = [g for g in s["groups"] if g["tries"] > 1]
    assert restarted, out
    for g in restarted:
        # every try of the group started both ranks again
        assert all(len(pids) == 2 for pids in g["pids"]), g
        assert len({pid for pids in g["pids"] for pid in pids}) == 2 * g["tries"]
    envs = {}
    for path in glob.glob(os.path.join(s["log_dir"], "env_g*_r*_t*.json")):
        name = os.path.basename(path)[4:-5]  # g0_r1_t2
        with open(path) as f:
            envs[name] = json.load(f)
    e = envs["g1_r1_t1"]
    assert e["RANK"] == "1" and e["LOCAL_RANK"] == "1" and e["WORLD_SIZE"] == "2"
    assert e["LOCAL_WORLD_SIZE"] == "2" and e["REPLICA_GROUP_ID"] == "1"
    assert e["NUM_REPLICA_GROUPS"] == "2" and e["MASTER_ADDR"] == "127.0.0.1"
    assert e["TORCHFT_LIGHTHOUSE"].startswith("http://127.0.0.1:")
    assert e["TORCHELASTIC_RESTART_COUNT"] == "0" and e["OMP_NUM_THREADS"]
    # one store per group: ranks of a group share MASTER_PORT, groups do not
    assert envs["g0_r0_t1"]["MASTER_PORT"] == envs["g0_r1_t1"]["MASTER_PORT"]
    assert envs["g0_r0_t1"]["MASTER_PORT"] != envs["g1_r0_t1"]["MASTER_PORT"]
    for g in restarted:
        t2 = envs[f"g{g['group']}_r0_t2"]
        assert t2["TORCHELASTIC_RESTART_COUNT"] == "1"


def test_stop_chaos_resumes_without_restart():
    out, s = run_fake_ok(
        "--replicas 2 --chaos stop --every 1 --stop-seconds 0.5 --seed 0 --max-steps 80"
    )
    assert s["chaos"] and not s["restarts"], out
    assert "SIGCONT" in out


def test_stop_action_kill_restarts():
    out, s = run_fake_ok(
        "--replicas 2 --chaos stop --stop-action kill --every 1 --stop-seconds 0.3 --seed 0 --max-steps 80 --restart-delay 0.1"
    )
    assert s["restarts"], out


def test_duration_then_sigterm_then_sigkill():
    """A worker that ignores the stop request and SIGTERM is SIGKILLed within the graces."""
    t0 = time.monotonic()
    rc, out, s = run_launch(
        "--replicas 2 --duration 2 --stop-grace 1 --kill-grace 1",
        [FAKE, '--stubborn'],
        60,
    )
    assert time.monotonic() - t0 < 30, out
    assert rc == 1, out
    assert "SIGTERM" in out and "SIGKILL" in out, out
    assert all(g["state"] == "failed" for g in s["groups"])


def test_duration_graceful():
    out, s = run_fake_ok("--replicas 2 --duration 1.5", wait_s=60)
    assert s["all_done"] and s["identical"] and "--duration" in s["stop_reason"], out


def test_timeout_writes_every_ranks_stack_to_its_log(tmp_path):
    """A run that hangs until --timeout: before it stops them, the launcher has every rank that
    uses ft.launch.worker write its threads' stacks to its log, so the hang can be located."""
    script = tmp_path / "hangs.py"
    script.write_text(
        "import time\n"
        "from ft.launch import worker\n"
        "worker.install_chaos_handlers()\n"
        "worker.emit('start', attempt=0)\n"
        "def stuck_in_a_collective():\n"
        "    time.sleep(3600)\n"
        "stuck_in_a_collective()\n"
    )
    rc, out, s = run_launch("--replicas 2 --kill-grace 2", [str(script)], 23)  # --timeout 8
    assert rc != 0, out
    assert "stacks of 2 process(es) asked for" in out, out
    logs = [n for n in os.listdir(s["log_dir"]) if n.endswith(".log")]
    assert len(logs) == 2, logs
    for name in logs:
        with open(os.path.join(s["log_dir"], name)) as f:
            text = f.read()
        assert "most recent call first" in text and "stuck_in_a_collective" in text, text


def test_crash_loop_gives_up():
    rc, out, s = run_launch(
        "--replicas 2 --restart-delay 0.05 --max-crashes 3",
        [FAKE, '--crash'],
        60,
    )
    assert rc == 1, out
    assert all(g["state"] == "failed" and g["tries"] == 3 for g in s["groups"]), out
    assert "crashing on purpose" in out  # the failed rank's log tail is shown


# ------------------------------------------------------------------- the real training example


def _check_real_run(rc: int, out: str, s: dict, ranks: int) -> None:
    assert rc == 0, out
    assert s["all_done"], out
    kills = [c for c in s["chaos"] if c["mode"] == "kill"]
    assert kills, f"no failure was injected:\n{out}"
    assert s["restarts"], out
    # Training went on after a failure: past the first kill at least. (The last kill may land
    # as the groups reach their final step, when nothing is left to commit after it.)
    assert s["max_step"] > kills[0]["max_step"], f"no step committed after the first kill:\n{out}"
    assert sum(g["heals"] for g in s["groups"]) >= 1, out
    assert s["identical"] and len(s["hashes"]) == ranks, out
    accs = [g["accuracy"] for g in s["groups"]]
    assert all(a is not None and a > 0.6 for a in accs), accs  # chance is 1/3


def check_example_survives(
    example: str,
    launcher_args: str,
    ranks: int,
    wait_s: float,
    example_args: Sequence[str] = (),
    step_sleep: float = 0.02,
) -> None:
    """``example`` (``example_args``, a step sleep and a final wait of 60 s) under ft-launch
    with ``launcher_args`` passes ``_check_real_run`` with ``ranks`` ranks."""
    worker = [example, *example_args, "--step-sleep", str(step_sleep), "--final-wait", "60"]
    rc, out, s = run_launch(launcher_args, worker, wait_s)
    _check_real_run(rc, out, s, ranks=ranks)


def test_train_ddp_survives_kills():
    """3 groups x 1 rank, SIGKILLs every 3 s: training goes on, every replica ends identical."""
    check_example_survives(
        EXAMPLE, "--replicas 3 --chaos kill --every 3 --seed 0 --max-steps 400", 3, 170
    )


def test_train_ddp_async_quorum_survives_kills():
    """The same with async quorums: a restarted group joins the step's collectives while its
    heal arrives (its source sends at its own should_commit), heals, and ends identical."""
    check_example_survives(
        EXAMPLE,
        "--replicas 2 --chaos kill --every 3 --seed 1 --max-steps 250",
        2,
        170,
        ["--async-quorum"],
    )


def test_train_ddp_two_ranks_per_group():
    """2 groups x 2 ranks: a kill takes the whole group down; it heals and ends identical."""
    check_example_survives(
        EXAMPLE,
        "--replicas 2 --ranks-per-group 2 --chaos kill --every 3 --seed 0 --max-steps 300",
        4,
        170,
    )


def test_group_that_gave_up_on_a_persistent_fault_is_not_restarted_and_says_why():
    rc, out, s = run_launch(
        "--replicas 2 --max-steps 30 --restart-delay 0.1",
        [FAKE, "--persistent-fault-group", "1", "--step-s", "0.05"],
        90,
    )
    g1 = s["groups"][1]
    assert rc == 1, out  # the run did not finish whole
    assert g1["tries"] == 1 and g1["state"] == "failed", g1
    assert "ranks 0 and 1 are on one GPU" in g1["last_error"], g1
    # The cause is announced once (not once per failed step), then the give-up.
    assert out.count("group 1: step 0 failed: allreduce: ValueError") == 1, out
    assert "group 1: not restarted, its steps failed persistently: 5 consecutive" in out, out
    assert "last step error: 5 consecutive steps failed" in out, out  # in the summary
    assert s["groups"][0]["state"] == "done", s["groups"][0]
