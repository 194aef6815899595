"""The test suite's one harness for child processes: real processes, every wait bounded, every
child killed by its own pid and reaped, its output captured and shown when a test fails.

Layers, each built on the one before:

``Proc(argv)``
    One child process running a command (``python_argv("tests.x", ...)`` for a module of this
    repository). Its stdout and stderr go to a log file; ``output()`` reads it back and every
    failure message carries it. ``wait(timeout)``, ``wait_for_line(pattern, timeout)``,
    ``signal(sig)``, ``stop()`` (SIGSTOP, until stopped), ``kill()`` (SIGCONT, then SIGKILL by
    pid, then reap; idempotent). A context manager. The child starts in the repository root
    with the source tree first on ``PYTHONPATH`` (``child_env``), so ``import ft`` and
    ``import tests.x`` work in it.
``Procs()``
    A set of ``Proc``s killed and reaped together: on ``__exit__``, or after the test as the
    ``procs`` fixture (tests/conftest.py). ``wait_all(procs, timeout)`` waits for several
    children to exit 0, failing at once, with the output, when one exits otherwise.
``Workers(target, world_size, store, **kwargs)``
    N children that each run a Python function named ``"module:function"``:
    ``function(rank, world_size, store_port, **kwargs)``; its return value (any
    torch.save-able object) comes back through a file (``join``). Children coordinate with the
    test through the TCPStore the test hosts (``make_store``), and the test can ``kill -9``,
    SIGSTOP or SIGCONT them by pid.
``Replicas(target, n, lighthouse={...}, **kwargs)``
    A lighthouse in this process plus N replica processes (``Workers``) that get its address
    as ``lh_addr``; the ``replicas`` fixture (tests/conftest.py) is the same, stopped after the
    test.

``in_threads(fns, timeout)``, ``values(outs)``
    Functions run on threads of this process with a bounded wait (several Managers, or ranks
    of a group, in one process): each one's value or error, then the values or the first error.

Whatever a test leaves running is killed when the session ends (``kill_leftovers``, from
tests/conftest.py). Importing this module imports neither torch nor ft, so a child that must
run without them (tests/coordination) can use it.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Pattern, Sequence, Union

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A late child's stacks in a failure message: gdb gets this long, the message this much of them.
STACKS_TIMEOUT_S = 30.0
STACKS_MAX_CHARS = 12000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(
    pred: Callable[[], Any], timeout: float = 5.0, what: str = "condition", interval: float = 0.01
) -> Any:
    """Polls ``pred`` until it returns something true, and returns that; raises AssertionError
    naming ``what`` once ``timeout`` seconds have passed (``pred`` is tried at least once)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def in_threads(fns: List[Callable[[], Any]], timeout: float = 30) -> List[Dict[str, Any]]:
    """Runs each fn on its own thread; returns [{"value"| "error", "t"}] (bounded wait)."""
    outs: List[Dict[str, Any]] = [{} for _ in fns]

    def run(i: int) -> None:
        t0 = time.monotonic()
        try:
            outs[i]["value"] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            outs[i]["error"] = e
        outs[i]["t"] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "thread did not finish in time"
    return outs


def values(outs: List[Dict[str, Any]]) -> List[Any]:
    for o in outs:
        if "error" in o:
            raise o["error"]
    return [o["value"] for o in outs]


def make_store(timeout_s: float = 30.0):
    """A fresh TCPStore server on loopback (port chosen by the OS)."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def connect_store(port: int, timeout_s: float = 30.0):
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# --- one child process ----------------------------------------------------------------------------
def child_env(
    env: Optional[Dict[str, str]] = None, source_tree: bool = True, **overrides: str
) -> Dict[str, str]:
    """``env`` (default: this process's environment) with ``overrides``, and, unless
    ``source_tree`` is False, this repository first on PYTHONPATH: the one place a child of a
    test learns where ``ft`` and ``tests`` are."""
    out = dict(os.environ if env is None else env)
    out.update(overrides)
    if source_tree:
        out["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [out.get("PYTHONPATH")] if p])
    return out


def python_argv(module: str, *args: Any) -> List[str]:
    """The command line that runs ``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *(str(a) for a in args)]


_LIVE: "set[Proc]" = set()  # started and not yet reaped (kill_leftovers)
_LOG_DIR: Dict[int, str] = {}  # pid of this process -> its directory of default log files


def _default_log(name: str) -> str:
    pid = os.getpid()
    if pid not in _LOG_DIR:
        _LOG_DIR[pid] = tempfile.mkdtemp(prefix="ft-test-logs-")
        atexit.register(shutil.rmtree, _LOG_DIR[pid], True)
    fd, path = tempfile.mkstemp(
        prefix=re.sub(r"[^\w.-]", "_", name)[:40] + "-", suffix=".log", dir=_LOG_DIR[pid]
    )
    os.close(fd)
    return path


class Proc:
    """One child process of a test: ``argv`` started in ``cwd`` (the repository root) with
    ``child_env(env, source_tree)``, stdout and stderr into ``log_path`` (a fresh file by
    default), stdin from /dev/null. With ``process_group`` it leads a process group of its own,
    and ``kill`` kills the whole group (a browser and its helpers)."""

    def __init__(
        self,
        argv: Sequence[Any],
        *,
        env: Optional[Dict[str, str]] = None,
        cwd: Any = REPO,
        log_path: Optional[str] = None,
        name: Optional[str] = None,
        process_group: bool = False,
        source_tree: bool = True,
    ) -> None:
        argv = [str(a) for a in argv]
        self.name = name or " ".join(os.path.basename(a) for a in argv[:3])
        self.log_path = str(log_path) if log_path is not None else _default_log(self.name)
        self.process_group = process_group
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                env=child_env(env, source_tree),
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=process_group,
            )
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.proc.returncode

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the child by its pid, if it is still running."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGSTOP, then waits until the kernel reports the child stopped (the signal takes
        effect asynchronously); AssertionError if it does not within ``timeout``."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return
            time.sleep(0.001)
        raise self._failure(f"did not stop within {timeout}s")

    def output(self, tail: Optional[int] = None) -> str:
        """What the child wrote so far (stdout and stderr), or its last ``tail`` characters."""
        try:
            with open(self.log_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return text[-tail:] if tail else text

    @property
    def lines(self) -> List[str]:
        """The complete lines the child wrote so far (while it runs, not a line still being
        written)."""
        text = self.output()
        if self.proc.poll() is None:
            text = text[: text.rfind("\n") + 1]
        return text.splitlines()

    def stacks(self) -> str:
        """Where a child that runs late is stuck, for the failure message: its native threads'
        stacks (gdb, where installed; nothing otherwise). Bounded; the child keeps running."""
        if self.proc.poll() is not None or shutil.which("gdb") is None:
            return ""
        try:
            out = subprocess.run(
                ["gdb", "-batch", "-p", str(self.pid), "-ex", "thread apply all bt 20"],
                capture_output=True,
                text=True,
                timeout=STACKS_TIMEOUT_S,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
        frames = [line for line in out.splitlines() if line.startswith(("Thread ", "#"))]
        return "\n--- native stacks (gdb)\n" + "\n".join(frames)[-STACKS_MAX_CHARS:]

    def _failure(self, what: str) -> AssertionError:
        return AssertionError(f"{self.name} (pid {self.pid}) {what}; output:\n{self.output(6000)}")

    def wait(self, timeout: float) -> int:
        """The child's exit status; AssertionError with its output if it runs past ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self._failure(f"did not exit within {timeout}s") from None

    def wait_for_line(self, pattern: Union[str, Pattern[str]], timeout: float = 15.0) -> str:
        """The first line of output that ``pattern`` (a regular expression) matches, searched;
        AssertionError with the output if the child exits without one or ``timeout`` passes."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            for line in self.lines:
                if regex.search(line):
                    return line
            if exited:
                raise self._failure(
                    f"exited ({self.proc.returncode}) before a line matching {regex.pattern!r}"
                )
            if time.monotonic() > deadline:
                raise self._failure(f"wrote no line matching {regex.pattern!r} within {timeout}s")
            time.sleep(0.01)

    def _send_kill(self) -> None:
        if self.process_group:
            if self.proc.returncode is None:  # the leader is not reaped: the group is still its own
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped child dies at once
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover: a SIGKILL that did not land
            return
        _LIVE.discard(self)

    def kill(self, grace: float = 0.0) -> None:
        """Kills the child by its pid (SIGKILL; with ``grace``, SIGTERM first and that long to
        exit) and reaps it. Does nothing more once it is reaped."""
        if grace and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._send_kill()
        self._reap()

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def kill_all(procs: Iterable[Proc]) -> None:
    """Kills every child first, then reaps them (no child waits for another's turn to die)."""
    procs = list(procs)
    for p in procs:
        p._send_kill()
    for p in procs:
        p._reap()


def kill_leftovers() -> None:
    """Kills and reaps every child this process started and nobody reaped."""
    kill_all(list(_LIVE))


def wait_all(procs: Sequence[Proc], timeout: float) -> None:
    """Waits until every one of ``procs`` has exited 0. Raises AssertionError, with the output,
    as soon as one exits otherwise, or, with every unfinished child's output, once ``timeout``
    has passed. Kills nothing: whoever started them reaps them."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        for p, code in zip(procs, codes):
            if code not in (None, 0):
                raise p._failure(f"exited with {code}")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            late = [p for p, code in zip(procs, codes) if code is None]
            raise AssertionError(
                f"{', '.join(p.name for p in late)} did not finish within "
                f"{timeout}s\n"
                + "\n".join(
                    f"--- {p.name} (pid {p.pid})\n{p.output(4000)}{p.stacks()}" for p in late
                )
            )
        time.sleep(0.02)


class Procs:
    """Children started together and killed and reaped together (``kill_all`` on exit).

    with Procs() as group:
        a = group.start(python_argv("tests.x", "--rank", 0))
        group.add(SomeProcSubclass(...))
    """

    def __init__(self) -> None:
        self.procs: List[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.procs.append(proc)
        return proc

    def start(self, argv: Sequence[Any], **kw: Any) -> Proc:
        """Starts ``Proc(argv, **kw)``, reaped with the rest."""
        return self.add(Proc(argv, **kw))

    def python(self, module: str, *args: Any, **kw: Any) -> Proc:
        """Starts ``python -m module args...``, reaped with the rest."""
        return self.start(python_argv(module, *args), **kw)

    __call__ = start

    def kill_all(self) -> None:
        kill_all(self.procs)

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill_all()


# --- N workers running a Python function ----------------------------------------------------------
class Worker(Proc):
    """A child of ``Workers``: one rank running the target function (``python -m tests.procs``)."""

    def __init__(self, rank: int, result_path: str, log_path: str, env: Dict[str, str]) -> None:
        self.rank = rank
        self.result_path = result_path
        super().__init__(
            python_argv("tests.procs"), env=env, log_path=log_path, name=f"rank {rank}"
        )

    def log(self) -> str:
        return self.output(6000)


class Workers:
    """Starts children, collects results, and always reaps them.

    with Workers("tests.backend.workers:allreduce", 2, store, n=4) as w:
        results = w.join(timeout=30)
    """

    def __init__(
        self,
        target: str,
        world_size: int,
        store: Optional[Any] = None,
        ranks: Optional[List[int]] = None,
        env: Optional[Dict[str, str]] = None,
        **kwargs: Any,
    ) -> None:
        self.target = target
        self.world_size = world_size
        self.store = store if store is not None else make_store()
        self.kwargs = kwargs
        self.env = env or {}
        self.tmp = tempfile.mkdtemp(prefix="ft-test-")
        self.children: List[Worker] = []
        self._ranks = list(range(world_size)) if ranks is None else ranks

    def __enter__(self) -> "Workers":
        try:
            for rank in self._ranks:
                self.spawn(rank)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def spawn(self, rank: int, target: Optional[str] = None, **override: Any) -> Worker:
        """Starts one more child. With `target`, it runs that function with
        only the given kwargs; otherwise the default target and kwargs."""
        kwargs = dict(override) if target else dict(self.kwargs, **override)
        target = target or self.target
        n = len(self.children)
        env = dict(os.environ)
        env.update(self.env)
        env.update(
            FT_TEST_TARGET=target,
            FT_TEST_RANK=str(rank),
            FT_TEST_WORLD_SIZE=str(self.world_size),
            FT_TEST_STORE_PORT=str(self.store.port),
            FT_TEST_KWARGS=json.dumps(kwargs),
            FT_TEST_RESULT=os.path.join(self.tmp, f"result-{rank}-{n}.pt"),
        )
        child = Worker(
            rank, env["FT_TEST_RESULT"], os.path.join(self.tmp, f"log-{rank}-{n}.txt"), env
        )
        self.children.append(child)
        return child

    def by_rank(self, rank: int) -> Worker:
        return [c for c in self.children if c.rank == rank][-1]

    def join(self, timeout: float, children: Optional[List[Worker]] = None) -> List[Any]:
        """Waits for children (default: all) and returns their results in order.

        Raises with the child's log if one fails or overruns the timeout.
        """
        import torch

        children = self.children if children is None else children
        wait_all(children, timeout)
        return [torch.load(c.result_path, weights_only=False) for c in children]

    def __exit__(self, *exc: Any) -> None:
        kill_all(self.children)


def worker_store(store_port: int) -> Any:
    """The start of a Workers target in its child: warnings-only logging, one torch thread,
    and the test store."""
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    return connect_store(store_port)


def wait_progress(store: Any, keys: List[str], at_least: int, timeout: float, w: Workers) -> int:
    """Waits until every key in the test store holds a step >= at_least; returns the max.

    Fails at once (with the child's log) if a child exits with an error; a child killed by
    the test (SIGKILL) is expected. Bounded by ``timeout``, with every child's log tail.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        vals = [int(store.get(k)) if store.check([k]) else -1 for k in keys]
        if min(vals) >= at_least:
            return max(vals)
        for c in w.children:
            code = c.proc.poll()
            if code not in (None, 0, -signal.SIGKILL):
                raise AssertionError(f"child {c.rank} exited with {code}:\n{c.log()}")
        time.sleep(0.02)
    logs = "\n".join(f"--- child {c.rank}\n{c.log()[-3000:]}" for c in w.children)
    raise AssertionError(f"no progress to {at_least} on {keys} within {timeout}s\n{logs}")


def kill_at_counter(
    store: Any, child: Proc, key: str, ready: Callable[[int], bool], timeout: float
) -> Optional[int]:
    """SIGKILLs ``child`` once the counter it keeps at ``key`` in the test store satisfies
    ``ready``. The child is frozen (SIGSTOP) while the counter is read again, so the check
    cannot race with its next step. Returns that counter; None if ``timeout`` passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.check([key]) and ready(int(store.get(key))):
            child.stop(timeout=2.0)
            count = int(store.get(key))
            if ready(count):
                child.signal(signal.SIGKILL)
                child.proc.wait(10)
                return count
            child.signal(signal.SIGCONT)
        time.sleep(0.002)
    return None


def max_step(store: Any, keys: List[str]) -> int:
    """The largest step any of ``keys`` holds in the test store (0 if none is set)."""
    return max(int(store.get(k)) if store.check([k]) else 0 for k in keys)


# --- a lighthouse plus N replica processes --------------------------------------------------------
def lighthouse_argv(*command: Any, bind: str = "127.0.0.1:0", **flags: Any) -> List[Any]:
    """The command line of a lighthouse process: ``command`` (``ft-lighthouse``, or
    ``python -m ft.coordination.cli``) serving on ``bind`` without a dashboard, with ``flags``
    as ``--name value`` (``min_replicas`` 1 unless given)."""
    flags.setdefault("min_replicas", 1)
    argv = [*command, "--bind", bind, "--http_bind", ""]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return argv


def lighthouse(
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = 1000,
    join_timeout_ms: int = 200,
    bind: str = "127.0.0.1:0",
    **kw: Any,
):
    """A real lighthouse in this process on loopback: 20 ms quorum tick, no dashboard (unless
    ``kw`` says otherwise: any other LighthouseServer argument)."""
    from ft.coordination import LighthouseServer

    kw.setdefault("quorum_tick_ms", 20)
    kw.setdefault("http_bind", "")
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        **kw,
    )


class Replicas(Workers):
    """A lighthouse in this process (``lighthouse(**lighthouse)``, started on ``__enter__``,
    as ``.lh``) plus ``Workers`` whose kwargs get its address as ``lh_addr`` (unless given, or
    ``lh_addr_kwarg`` is None). On exit the children are killed and reaped, then the
    lighthouse (``.lh``, which a test may replace) is shut down.

    with Replicas("tests.manager.workers:train", 2, lighthouse=dict(min_replicas=2)) as w:
        results = w.join(timeout=60)
    """

    def __init__(
        self,
        *args: Any,
        lighthouse: Optional[Dict[str, Any]] = None,
        lh_addr_kwarg: Optional[str] = "lh_addr",
        **kwargs: Any,
    ) -> None:
        # args and kwargs: Workers' (target, world_size, store, ranks, env, the target's kwargs)
        super().__init__(*args, **kwargs)
        self._lighthouse_kw = dict(lighthouse or {})
        self._lh_addr_kwarg = lh_addr_kwarg
        self.lh: Any = None

    def __enter__(self) -> "Replicas":
        self.lh = lighthouse(**self._lighthouse_kw)
        if self._lh_addr_kwarg:
            self.kwargs.setdefault(self._lh_addr_kwarg, self.lh.address())
        super().__enter__()  # on an error it runs __exit__, which shuts the lighthouse down
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self.lh is not None:
                self.lh.shutdown()


# --- the child side of Workers --------------------------------------------------------------------
def child_main() -> None:
    import importlib

    import torch

    module_name, func_name = os.environ["FT_TEST_TARGET"].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(
        int(os.environ["FT_TEST_RANK"]),
        int(os.environ["FT_TEST_WORLD_SIZE"]),
        int(os.environ["FT_TEST_STORE_PORT"]),
        **json.loads(os.environ["FT_TEST_KWARGS"]),
    )
    torch.save(result, os.environ["FT_TEST_RESULT"])


if __name__ == "__main__":
    child_main()
