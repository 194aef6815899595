"""The child-process harness itself (tests/procs.py): output captured and shown on failure,
bounded waits, kill by pid, every child reaped. Children are ``python -c`` one-liners."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

from tests.procs import REPO, Proc, Procs, kill_all, python_argv, wait_all


def py(code: str, **kw) -> Proc:
    return Proc([sys.executable, "-c", code], **kw)


def test_output_lines_and_exit_status():
    with py(
        "import sys; print('out', flush=True); print('err', file=sys.stderr); sys.exit(3)"
    ) as p:
        assert p.wait(30) == 3
        assert p.lines == ["out", "err"] and "out\nerr\n" == p.output()


def test_a_child_runs_in_the_repository_with_it_importable():
    with Proc(python_argv("tests.procs_probe_missing")) as p:  # -m resolves from the checkout
        assert p.wait(30) == 1
        assert "No module named tests.procs_probe_missing" in p.output()
    with py("import os, tests.procs; print(os.getcwd()); print(os.environ['PYTHONPATH'])") as p:
        assert p.wait(30) == 0, p.output()
        assert p.lines[0] == REPO and p.lines[1].split(os.pathsep)[0] == REPO


def test_wait_for_line_sees_only_whole_lines_and_fails_with_the_output():
    with py(
        "import sys, time; sys.stdout.write('READY 12'); sys.stdout.flush(); time.sleep(0.5);"
        "print('34', flush=True); time.sleep(60)"
    ) as p:
        assert p.wait_for_line(r"^READY ", 30) == "READY 1234"
    with py("print('something else', flush=True)") as p:
        with pytest.raises(AssertionError, match=r"(?s)exited \(0\) before a line.*something else"):
            p.wait_for_line("^READY", 30)
    with py("import time; print('slow', flush=True); time.sleep(60)") as p:
        with pytest.raises(AssertionError, match=r"(?s)within 0.2s.*slow"):
            p.wait_for_line("^READY", 0.2)


def test_wait_is_bounded_and_kill_reaps_a_stopped_child():
    p = py("import time; print('sleeping', flush=True); time.sleep(60)")
    with pytest.raises(AssertionError, match=r"(?s)did not exit within 0.2s.*sleeping"):
        p.wait(0.2)
    p.stop()
    p.kill()
    assert p.returncode == -signal.SIGKILL
    p.kill()  # again: nothing left to do


def test_wait_all_fails_at_once_on_a_child_that_fails():
    with Procs() as group:
        slow = group.start([sys.executable, "-c", "import time; time.sleep(60)"])
        group.python("tests.procs_probe_missing")
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="exited with 1"):
            wait_all(group.procs, 60)
        assert time.monotonic() - t0 < 30 and slow.poll() is None
    assert slow.returncode == -signal.SIGKILL  # reaped on the way out


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb not installed")
def test_wait_all_says_where_a_late_child_is_stuck():
    with Procs() as group:
        late = group.start([sys.executable, "-c", "import time; time.sleep(60)"])
        with pytest.raises(AssertionError, match="did not finish within") as failed:
            wait_all(group.procs, 0.5)
        assert late.poll() is None  # still running: stacks are read, nothing is killed
    assert "native stacks (gdb)" in str(failed.value) and "sleep" in str(failed.value)


def test_a_process_group_is_killed_whole():
    with py(
        "import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(60)']); print(c.pid, flush=True); time.sleep(60)",
        process_group=True,
    ) as p:
        grandchild = int(p.wait_for_line(r"^\d+$", 30))
    assert p.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while True:  # gone, or a zombie that whoever adopted it reaps
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        assert time.monotonic() < deadline, "the group's other process survived"
        time.sleep(0.05)


def test_procs_fixture_reaps_after_the_test(procs):
    p = procs([sys.executable, "-c", "import time; time.sleep(60)"])
    kill_all([p])
    assert p.returncode == -signal.SIGKILL
