"""A warm standby: a Python process that has already imported torch and ft and waits to become
a rank of a restarted replica group.

Why: most of a restarted rank's recovery happens before its first line of training code.
Starting Python and importing torch take ~2 s on an idle development machine and ~5 s while the
surviving groups train on the same cores (bench/manager_bench.py), against ~0.2 s for ft's own
quorum, checkpoint transfer and load. ``ft-launch`` keeps standbys ready and, when a group must
be restarted, hands each of them a rank's environment and command instead of exec'ing new
processes.

Protocol: the supervisor starts ``python -m ft.launch.standby [DIR]`` with a pipe on stdin (DIR:
what a cold start would put first on ``sys.path``, the script's directory). The standby
imports :data:`PRELOAD`, prints :data:`READY`, then reads one line of JSON, ``{"env": {...}, "argv": [...]}``, where
argv is what would follow the interpreter on a command line (``script.py args`` or
``-m module args``). It replaces its environment with ``env``, points stdin at /dev/null (what a
cold-started rank gets) and runs argv as ``__main__``; it exits as that script would (its
``sys.exit`` status, or 1 with a traceback). End of input before that line: it exits 0.

The supervisor's side is :class:`StandbyPool`: it keeps the standbys, hands one out per
restarted rank, and ends the unused ones.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence

from ft.utils.deadline import Deadline

from .children import reap, spawn_child

__all__ = ["PRELOAD", "READY", "StandbyPool", "activation", "path0", "runnable_argv", "main"]

# The imports that dominate a rank's start; a training script's own imports are not known here.
# torch._dynamo is what building the first optimizer imports (1.5 s on the development machine).
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "ft")
READY = "@ft-standby ready"  # printed once PRELOAD is imported


def runnable_argv(command: Sequence[str]) -> Optional[List[str]]:
    """What a standby can run of ``command``: the arguments after ``python [-u]`` when the
    command runs this very interpreter on a script or ``-m`` module; None for anything else
    (another interpreter, other interpreter flags, a binary), which then starts cold."""
    if not command or command[0] != sys.executable:
        return None
    rest = list(command[1:])
    if rest and rest[0] == "-u":  # the standby runs unbuffered already
        rest = rest[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return rest
    if rest and rest[0].endswith(".py"):
        return rest
    return None


def path0(argv: Sequence[str]) -> str:
    """The first ``sys.path`` entry of a cold ``python`` start of ``argv`` (as runnable_argv
    returns it): the script's directory, or the working directory for ``-m``."""
    if argv and argv[0] != "-m":
        return os.path.dirname(os.path.abspath(argv[0]))
    return os.getcwd()


def activation(env: Dict[str, str], argv: Sequence[str]) -> str:
    """The line that turns a standby into the process ``env`` and ``argv`` describe."""
    return json.dumps({"env": dict(env), "argv": list(argv)}) + "\n"


# An activation line up to this size fits in an empty pipe (Linux: 64 KiB), so writing it never
# blocks the supervisor, even while the standby is still importing.
PIPE_SAFE_BYTES = 60000

# Unused standbys are SIGKILLed, which they cannot ignore; they exit at once unless the kernel
# holds them (a page fault on a slow disk while importing), so seconds are plenty.
STANDBY_REAP_WAIT_S = 5.0

# Of what a standby printed before dying early, the end (its traceback) is shown.
DIED_OUTPUT_TAIL_CHARS = 2000


def _drain(proc: subprocess.Popen) -> str:
    """What an exited standby had printed (without blocking), and its pipes closed."""
    out = ""
    if proc.stdout is not None:
        try:
            os.set_blocking(proc.stdout.fileno(), False)
            out = proc.stdout.read() or ""
        except (OSError, ValueError, TypeError):
            pass
        proc.stdout.close()
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    return out


class StandbyPool:
    """The supervisor's warm standbys: up to ``size`` ready processes, one per restarted rank.

    Contract:
    * ``argv`` is what a standby runs once activated (:func:`runnable_argv` of the training
      command); None disables the pool: :meth:`activate` always says start cold.
    * :meth:`refill` starts at most one standby per call, and only when the caller says every
      group trains: the import of torch must not slow down a start or a recovery.
    * :meth:`activate` returns a standby that is becoming the process ``env`` describes, or
      None (start the rank cold). It never blocks on a standby that is still importing.
    * A standby that exits before it is used disables the pool for the rest of the run (it would
      not get better), with a message through ``say`` that shows its output.
    * :meth:`close` kills and reaps every unused standby; :attr:`pids` lists every standby
      started, :attr:`activated` counts those that became ranks.
    """

    def __init__(
        self,
        argv: Optional[List[str]],
        size: int,
        env: Callable[[], Dict[str, str]],
        say: Callable[[str], None],
    ) -> None:
        self.argv = argv
        self.size = size
        self.env = env  # the environment a standby starts with, before it has a rank
        self.say = say
        self.ready: List[subprocess.Popen] = []
        self.pids: List[int] = []
        self.activated = 0

    def refill(self, everyone_trains: bool) -> None:
        """Forgets dead standbys; starts one if fewer than ``size`` are ready and
        ``everyone_trains``."""
        if self.argv is None:
            return
        self._reap_dead()
        if len(self.ready) < self.size and everyone_trains:
            proc = spawn_child(
                [sys.executable, "-u", "-m", "ft.launch.standby", path0(self.argv)],
                # A standby does not know its group's GPUs yet: should anything it imports ask
                # torch whether CUDA is there, NVML answers, and no CUDA context is made with
                # the launcher's view of the GPUs (it could not be changed afterwards).
                dict(self.env(), PYTORCH_NVML_BASED_CUDA_CHECK="1"),
                stdin=subprocess.PIPE,
            )
            self.ready.append(proc)
            self.pids.append(proc.pid)

    def _reap_dead(self) -> None:
        for proc in [proc for proc in self.ready if proc.poll() is not None]:
            self.ready.remove(proc)
            out = _drain(proc).strip()
            self.say(
                f"warm standby pid {proc.pid} exited ({proc.returncode}) before it was "
                "needed; restarts start cold from now on"
                + (f":\n{out[-DIED_OUTPUT_TAIL_CHARS:]}" if out else "")
            )
            self.argv = None

    def activate(self, env: Dict[str, str]) -> Optional[subprocess.Popen]:
        """A ready standby turned into the process ``env`` describes, or None (start cold)."""
        if self.argv is None:
            return None
        self._reap_dead()
        line = activation(env, self.argv)
        if len(line.encode()) > PIPE_SAFE_BYTES:
            return None  # a write that may block the supervisor until the standby reads
        while self.ready:
            proc = self.ready.pop(0)
            try:
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.close()
                self.activated += 1
                return proc
            except (OSError, ValueError):
                proc.kill()  # ours and not yet reaped: it was just alive
                proc.wait()
                _drain(proc)
        return None

    def close(self) -> None:
        """Ends the unused standbys at once: they hold no work, and one still importing would
        take seconds to notice the end of its input (which is how they end if the supervisor
        dies)."""
        for proc in self.ready:
            proc.kill()  # Popen.kill signals only a child it has not reaped
        running = reap(self.ready, Deadline.after(STANDBY_REAP_WAIT_S))
        for proc in self.ready:
            if proc in running:
                self.say(f"warning: standby pid {proc.pid} could not be reaped")
            _drain(proc)
        self.ready = []


def _adopt_gpus(before: Optional[str], after: Optional[str]) -> None:
    """Makes torch see the GPUs of the rank this standby becomes (``CUDA_VISIBLE_DEVICES``
    ``after``). CUDA reads that variable once, when it initializes: a standby that initialized
    it with another view cannot take the rank's, and says so rather than train on a GPU that
    belongs to another group."""
    torch = sys.modules.get("torch")
    if torch is None or before == after:
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "ft standby: CUDA was initialized before this process was given its GPUs "
            f"(CUDA_VISIBLE_DEVICES {before!r} -> {after!r}); start ranks cold (--no-standby)"
        )
    cache_clear = getattr(torch.cuda.device_count, "cache_clear", None)
    if cache_clear is not None:  # device_count() memoizes its answer
        cache_clear()


def _become(env: Dict[str, str], argv: List[str]) -> None:
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.clear()
    os.environ.update(env)
    _adopt_gpus(before, env.get("CUDA_VISIBLE_DEVICES"))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()  # as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args:
        # The directory a cold start of the future script would put first on sys.path (its
        # own): preloaded modules resolve as they would there.
        sys.path[0] = os.path.abspath(args[0])
    for name in PRELOAD:
        importlib.import_module(name)
    print(READY, flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # not needed after all
    msg = json.loads(line)
    env, argv = msg["env"], msg["argv"]
    if (
        type(env) is not dict
        or not all(type(k) is str and type(v) is str for k, v in env.items())
        or type(argv) is not list
        or not argv
        or not all(type(x) is str for x in argv)
    ):
        print(f"ft standby: bad activation {line[:200]!r}", file=sys.stderr)
        return 2
    _become(env, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
