"""ft.launch.standby: a process that imported torch and ft ahead of time becomes a rank when
it is handed an environment and a command (real processes; each preloads torch for real)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ft.launch import standby

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0],
                      "rank": os.environ.get("RANK"), "leaked": os.environ.get("STANDBY_ONLY"),
                      "stdin": sys.stdin.read(), "torch": "torch" in sys.modules}))
    sys.exit(int(os.environ.get("EXIT_WITH", "0")))
    """
)


def start(cwd: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, STANDBY_ONLY="yes")
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "ft.launch.standby", *extra],
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, line: str = "") -> tuple:
    try:
        out, err = proc.communicate(line, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


def test_runnable_argv() -> None:
    py = sys.executable
    assert standby.runnable_argv([py, "-u", "train.py", "--lr", "1"]) == ["train.py", "--lr", "1"]
    assert standby.runnable_argv([py, "-m", "pkg.mod", "x"]) == ["-m", "pkg.mod", "x"]
    assert standby.runnable_argv([py, "-u", "-m", "pkg.mod"]) == ["-m", "pkg.mod"]
    # anything a standby cannot reproduce starts cold
    assert standby.runnable_argv(["/usr/bin/other-python", "train.py"]) is None
    assert standby.runnable_argv([py, "-O", "train.py"]) is None
    assert standby.runnable_argv([py, "-m"]) is None
    assert standby.runnable_argv(["./train"]) is None
    assert standby.runnable_argv([]) is None


def test_path0_is_what_a_cold_start_puts_first_on_sys_path(tmp_path) -> None:
    assert standby.path0([str(tmp_path / "train.py"), "--x"]) == str(tmp_path)
    assert standby.path0(["-m", "pkg.mod"]) == os.getcwd()


def test_activated_standby_runs_the_script_as_a_cold_start_would(tmp_path) -> None:
    script = tmp_path / "work" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    proc = start(str(tmp_path), standby.path0([str(script)]))  # as ft-launch starts it
    env = {"RANK": "3", "EXIT_WITH": "7", "PATH": os.environ.get("PATH", "")}
    rc, out, err = finish(proc, standby.activation(env, [str(script), "--lr", "0.5"]))
    assert rc == 7, err  # the script's exit status
    lines = out.strip().splitlines()
    assert lines[0] == standby.READY
    rec = json.loads(lines[-1])
    assert rec["name"] == "__main__"
    assert rec["argv"] == [str(script), "--lr", "0.5"]
    assert rec["path0"] == str(script.parent)
    assert rec["rank"] == "3"
    assert rec["leaked"] is None  # the environment is replaced, not merged
    assert rec["stdin"] == ""  # /dev/null, as a cold-started rank
    assert rec["torch"] is True  # preloaded


def test_activated_standby_runs_a_module(tmp_path) -> None:
    (tmp_path / "trainmod.py").write_text(SCRIPT)
    proc = start(str(tmp_path))
    rc, out, err = finish(proc, standby.activation({"RANK": "0"}, ["-m", "trainmod", "a"]))
    assert rc == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    assert rec["name"] == "__main__" and rec["argv"][1:] == ["a"]
    assert rec["argv"][0].endswith("trainmod.py")


def test_failing_script_exits_1_with_its_traceback(tmp_path) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise RuntimeError('boom from the script')\n")
    rc, _, err = finish(start(str(tmp_path)), standby.activation({}, [str(script)]))
    assert rc == 1
    assert "boom from the script" in err


def test_end_of_input_exits_quietly(tmp_path) -> None:
    rc, out, err = finish(start(str(tmp_path)), "")
    assert rc == 0 and out.strip() == standby.READY, err


@pytest.mark.parametrize(
    "line",
    [
        '{"env": {"A": 1}, "argv": ["x.py"]}\n',
        '{"env": {}, "argv": []}\n',
        '{"env": [], "argv": ["x.py"]}\n',
    ],
)
def test_bad_activation_is_refused_with_a_message(tmp_path, line: str) -> None:
    rc, _, err = finish(start(str(tmp_path)), line)
    assert rc == 2 and "bad activation" in err


def test_pool_hands_out_a_ready_standby_and_reaps_the_rest(tmp_path) -> None:
    """StandbyPool, the launcher's side: a standby it started becomes the rank it is given;
    one left over is killed and reaped by close()."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    said = []
    env = dict(os.environ, PYTHONPATH=ROOT)
    pool = standby.StandbyPool([str(script)], size=2, env=lambda: env, say=said.append)
    try:
        pool.refill(everyone_trains=False)
        assert pool.pids == []  # not while a group still starts or recovers
        pool.refill(everyone_trains=True)
        pool.refill(everyone_trains=True)
        pool.refill(everyone_trains=True)  # full: no third
        assert len(pool.pids) == 2
        proc = pool.activate({"RANK": "5", "PATH": os.environ.get("PATH", "")})
        assert proc is not None and pool.activated == 1 and proc.pid == pool.pids[0]
        proc.wait(timeout=120)  # its output is a few lines: the pipe never fills
        out = proc.stdout.read()
        proc.stdout.close()
        assert proc.returncode == 0, out
        rec = json.loads(out.strip().splitlines()[-1])
        assert rec["rank"] == "5" and rec["name"] == "__main__" and rec["argv"] == [str(script)]
        leftover = pool.ready[0]
    finally:
        pool.close()  # even when an assertion failed: no standby outlives the test
    assert leftover.returncode is not None and pool.ready == [] and not said


def test_standby_takes_the_gpus_of_the_rank_it_becomes(tmp_path) -> None:
    script = tmp_path / "gpus.py"
    script.write_text(
        "import json, os, torch\n"
        "print(json.dumps({'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'),"
        " 'cuda_initialized': torch.cuda.is_initialized()}))\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="0,1")
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "ft.launch.standby", str(tmp_path)],
        cwd=str(tmp_path),
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    rank_env = {"CUDA_VISIBLE_DEVICES": "1", "PATH": os.environ.get("PATH", "")}
    rc, out, err = finish(proc, standby.activation(rank_env, [str(script)]))
    assert rc == 0, err
    rec = json.loads(out.strip().splitlines()[-1])
    # Preloading torch and ft made no CUDA context, so the rank's slice is the one CUDA reads.
    assert rec == {"cvd": "1", "cuda_initialized": False}


def test_standby_that_initialized_cuda_refuses_other_gpus(monkeypatch) -> None:
    # No GPU here: a stand-in torch whose CUDA reports itself initialized.
    class FakeCuda:
        @staticmethod
        def is_initialized() -> bool:
            return True

    class FakeTorch:
        cuda = FakeCuda

    monkeypatch.setitem(sys.modules, "torch", FakeTorch)
    standby._adopt_gpus("0", "0")  # the same view: nothing to change
    with pytest.raises(RuntimeError, match="CUDA was initialized before .* '0,1' -> '1'"):
        standby._adopt_gpus("0,1", "1")
