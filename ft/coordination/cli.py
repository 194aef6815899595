"""``ft-lighthouse``: run the lighthouse (gRPC quorum service + HTTP dashboard).

Example::

    FT_JOB_SECRET_FILE=/etc/ft/secret ft-lighthouse --min_replicas 2 \
        --join_timeout_ms 60000 --quorum_tick_ms 100 --heartbeat_timeout_ms 5000

By default it listens on this host's advertised address (``FT_ADVERTISE_HOST``, else the
address its name resolves to), port 29510, dashboard on 29511. Beyond loopback it refuses to
start without a job secret unless ``--insecure`` is given (docs/security.md).

Defaults: ``--join_timeout_ms 60000`` (60 s; ``LighthouseServer(...)`` built in Python
defaults to 100 ms, as torchft's), ``--quorum_tick_ms 100``, ``--heartbeat_timeout_ms 5000``.

Every flag is accepted in underscore and dash spelling (``--min_replicas`` / ``--min-replicas``).
SIGTERM and SIGINT shut the server down cleanly (exit status 0).

Scripts and benchmarks that need a lighthouse in a process of its own start it with
:func:`start_lighthouse_process`, which waits (bounded) for the ready line and reaps the
process when stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from typing import IO, Any, Dict, Optional, Sequence

from .lighthouse import (
    DEFAULT_DEAD_GRACE_MS,
    DEFAULT_HEARTBEAT_TIMEOUT_MS,
    CLI_DEFAULT_JOIN_TIMEOUT_MS,
    DEFAULT_QUORUM_TICK_MS,
    LighthouseServer,
)
from ..utils import net
from ..utils.auth import SECRET_FILE_ENV, InsecureServerError, resolve_secret
from ..utils.deadline import Deadline

DEFAULT_PORT = 29510

# The one line main() prints once it serves, for scripts and tests.
READY_PREFIX = "ft-lighthouse ready"
# The whole line (a line still being written does not match yet).
_READY = re.compile(rf"^{READY_PREFIX} grpc=(\S+) dashboard=\S*\n", re.MULTILINE)
# The directory that holds the ``ft`` package: a child started there runs this same ft.
_FT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flag(parser: argparse.ArgumentParser, name: str, **kw) -> None:
    names = [f"--{name}"]
    if "_" in name:
        names.append(f"--{name.replace('_', '-')}")
    parser.add_argument(*names, dest=name, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ft-lighthouse",
        description="ft lighthouse: decides which replica groups form each step's quorum.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _flag(
        p,
        "bind",
        default=None,
        help="gRPC address to listen on (default: this host's advertised address, port 29510; "
        "'[::]:29510' listens on every interface)",
    )
    _flag(
        p,
        "min_replicas",
        type=int,
        required=True,
        help="fewest replica groups in a quorum (fast path excepted)",
    )
    _flag(
        p,
        "join_timeout_ms",
        type=int,
        default=CLI_DEFAULT_JOIN_TIMEOUT_MS,
        help="how long to wait for heartbeating replicas to join a quorum (the command's "
        "default; LighthouseServer(...) in Python defaults to 100 ms, as torchft's)",
    )
    _flag(
        p,
        "quorum_tick_ms",
        type=int,
        default=DEFAULT_QUORUM_TICK_MS,
        help="period of quorum evaluation and failure detection",
    )
    _flag(
        p,
        "heartbeat_timeout_ms",
        type=int,
        default=DEFAULT_HEARTBEAT_TIMEOUT_MS,
        help="a replica is dead after this long without a heartbeat",
    )
    _flag(
        p,
        "http_bind",
        default=None,
        help="dashboard address (default: gRPC host, gRPC port + 1; '' disables)",
    )
    _flag(
        p,
        "auth_token",
        default=None,
        help="an operator token for the dashboard (default: env FT_AUTH_TOKEN); with a job "
        "secret, operators sign in with a link from python -m ft.utils.dashboard_login",
    )
    _flag(
        p,
        "secret_file",
        default=None,
        help="file holding the job secret (default: env FT_JOB_SECRET_FILE, then FT_JOB_SECRET); "
        "with it every call must be signed (docs/security.md)",
    )
    _flag(
        p,
        "insecure",
        action="store_true",
        default=False,
        help="serve beyond loopback without a job secret (anyone who reaches the ports can "
        "join or stop the job); logged as a warning at every start",
    )
    _flag(
        p,
        "dead_grace_ms",
        type=int,
        default=DEFAULT_DEAD_GRACE_MS,
        help="dead replicas leave the dashboard this long after their heartbeat expired",
    )
    _flag(
        p,
        "quorum_id_file",
        default=None,
        help="file persisting the last quorum id (ids never repeat across restarts anyway)",
    )
    _flag(p, "hostname", default=None, help="host name to advertise (default: from --bind)")
    _flag(
        p,
        "transport",
        default=os.environ.get("FT_LIGHTHOUSE_TRANSPORT", "auto"),
        choices=["auto", "native", "grpcio"],
        help="gRPC server: native (C++, when built), grpcio, or auto (native when built)",
    )
    _flag(p, "log_level", default=os.environ.get("FT_LOG_LEVEL", "INFO"), help="logging level")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.bind is None:
        args.bind = net.join_hostport(
            net.bind_host_for(net.advertise_host()).strip("[]"), DEFAULT_PORT
        )
    if args.secret_file:
        os.environ[SECRET_FILE_ENV] = args.secret_file  # read by LighthouseServer, never logged
    http_bind = args.http_bind
    if http_bind is None:
        host, port = net.split_hostport(args.bind)
        http_bind = net.join_hostport(host or "::", port + 1 if port else 0)

    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("ft.lighthouse").info(
            "received %s, shutting down", signal.Signals(signum).name
        )
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        secret = resolve_secret()
    except ValueError as e:
        print(f"ft-lighthouse: {e}", file=sys.stderr)
        return 2
    try:
        server = _start(args, http_bind, secret)
    except InsecureServerError as e:
        print(f"ft-lighthouse: {e}", file=sys.stderr)
        return 2
    print(
        f"{READY_PREFIX} grpc={server.address()} dashboard={server.dashboard_address()}",
        flush=True,
    )
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.shutdown()
    return 0


# The options that LighthouseServer takes under their flags' names: ``ft-launch`` passes the
# quorum timings on too.
QUORUM_TIMING_OPTIONS = (
    "min_replicas",
    "join_timeout_ms",
    "quorum_tick_ms",
    "heartbeat_timeout_ms",
)
_SERVER_OPTIONS = ("auth_token", "dead_grace_ms", "quorum_id_file", "hostname", "transport")


def options_named(args: argparse.Namespace, names: Sequence[str]) -> Dict[str, Any]:
    """``{name: args.name}`` for each of ``names``."""
    return {name: getattr(args, name) for name in names}


def _start(args, http_bind: str, secret) -> LighthouseServer:
    return LighthouseServer(
        args.bind,
        http_bind=http_bind,
        secret=secret,
        insecure=args.insecure or None,
        **options_named(args, QUORUM_TIMING_OPTIONS + _SERVER_OPTIONS),
    )


class LighthouseProcess:
    """A lighthouse in a child process, as :func:`start_lighthouse_process` returns it:
    ``address`` (its gRPC address), ``proc`` (the ``subprocess.Popen``), ``log_path`` (the
    file its stdout and stderr go to; None for an unnamed one). ``stop()``, also on leaving a
    ``with`` block, ends and reaps it."""

    def __init__(
        self, proc: subprocess.Popen, log: IO[bytes], log_path: Optional[str], own_group: bool
    ) -> None:
        self.proc = proc
        self.log_path = log_path
        self.address = ""
        self._log = log
        self._own_group = own_group
        self._final_output: Optional[str] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """What the lighthouse wrote so far (all it wrote, once stopped)."""
        if self._final_output is not None:
            return self._final_output
        # pread: the child writes through the same open file, whose offset must not move.
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def stop(self, grace: float = 10.0) -> Optional[int]:
        """SIGTERM to the child (to its process group with ``new_session``; the lighthouse
        shuts down cleanly), SIGKILL if it has not exited ``grace`` seconds later; reaps it.
        Returns its exit status (None if it outlived SIGKILL by ``grace``). Calling it again
        does nothing more."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.returncode is not None:
                break
            # Until the child is reaped, its pid (and the group it leads) is still its own.
            try:
                if self._own_group:
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.returncode is not None and self._final_output is None:
            self._final_output = self.output()
            self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "LighthouseProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_lighthouse_process(
    min_replicas: int,
    *,
    bind: str = "127.0.0.1:0",
    http_bind: str = "",
    ready_timeout: float = 60.0,
    cwd: Any = None,
    env: Optional[dict] = None,
    log_path: Any = None,
    new_session: bool = False,
    **flags: Any,
) -> LighthouseProcess:
    """Starts ``python -m ft.coordination.cli`` (this interpreter) and returns once it printed
    its ready line, with its address. ``flags`` are more of its flags by dest name
    (``heartbeat_timeout_ms=500`` -> ``--heartbeat_timeout_ms 500``; True: the bare flag; None
    or False: left out). Its output goes to ``log_path`` (default: an unnamed temporary file,
    which nothing outlives). It runs in ``cwd`` (default: the directory that holds this
    ``ft`` package) with ``env`` (default: this process's environment). By default it stays in
    the caller's process group, so that whatever kills the caller's group (a terminal's
    Ctrl-C, ``timeout``) ends it too; with ``new_session`` it leads a session of its own, and
    ``stop()`` signals that whole group.

    Raises RuntimeError, with the tail of its output, if it exits or ``ready_timeout`` seconds
    pass before the ready line; it is stopped and reaped first, as it is on any other
    exception while waiting (KeyboardInterrupt included)."""
    argv = [sys.executable, "-m", "ft.coordination.cli", "--bind", bind]
    argv += ["--min_replicas", str(min_replicas), "--http_bind", http_bind]
    for name, value in flags.items():
        if value is True:
            argv.append(f"--{name}")
        elif value is not None and value is not False:
            argv += [f"--{name}", str(value)]
    log: IO[bytes] = tempfile.TemporaryFile() if log_path is None else open(log_path, "w+b")
    try:
        proc = subprocess.Popen(
            argv,
            cwd=str(cwd) if cwd is not None else _FT_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )
    except BaseException:
        log.close()
        raise
    lh = LighthouseProcess(proc, log, None if log_path is None else str(log_path), new_session)
    try:
        deadline = Deadline.after(ready_timeout)
        while True:
            exited = proc.poll() is not None
            m = _READY.search(lh.output())
            if m:
                lh.address = m.group(1)
                return lh
            if exited or deadline.expired:
                break
            deadline.sleep(0.05)
        what = f"exited ({proc.returncode})" if exited else f"not ready in {ready_timeout}s"
        raise RuntimeError(f"the lighthouse did not start: {what}; output:\n{lh.output()[-2000:]}")
    except BaseException:
        lh.stop()
        raise


if __name__ == "__main__":
    sys.exit(main())
