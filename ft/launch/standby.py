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
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["PRELOAD", "READY", "activation", "path0", "runnable_argv", "main"]

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


def _become(env: Dict[str, str], argv: List[str]) -> None:
    os.environ.clear()
    os.environ.update(env)
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
