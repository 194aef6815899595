"""``ft-launch``: run N replica groups of a training script locally, keep them alive, break them.

Example (the README demo)::

    ft-launch --replicas 3 --chaos kill --every 5 --max-steps 200 -- examples/train_ddp.py

What it does:

* Starts a lighthouse in this process (or uses ``--lighthouse ADDR``).
* Starts ``--replicas`` replica groups of ``--ranks-per-group`` ranks each, running the command
  after ``--`` (a ``.py`` file or ``-m module`` runs under this Python) with a torchrun-style
  environment: ``MASTER_ADDR``/``MASTER_PORT`` (one store per group; ``MASTER_PORT + 1`` is free
  too, for a group-internal process group), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``, ``TORCHFT_LIGHTHOUSE``,
  ``TORCHELASTIC_RESTART_COUNT``, ``OMP_NUM_THREADS=1`` (unless set), and for
  :mod:`ft.launch.worker`: ``FT_LAUNCH_STOP_FILE``, ``FT_LAUNCH_PARENT_PID``, ``FT_MAX_STEPS``.
* When any rank of a group exits with a failure, kills the group's other ranks and restarts the
  whole group (new ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT`` + 1) after ``--restart-delay``.
  Restarted ranks are warm standbys where one is ready (:mod:`ft.launch.standby`: processes that
  imported torch and ft ahead of time; one per rank of a group is kept ready once every group
  trains), which saves the seconds a cold Python + torch start costs; ``--no-standby`` execs
  new processes instead.
  A group whose ranks all exit 0 is done. A group is not restarted once every other group has
  finished (it would have nobody to heal from).
* ``--chaos`` injects one failure every ``--every`` seconds into a random group that has made
  progress, never into the last healthy one, and stops once a group reaches its stop phase:

  - ``kill``: SIGKILL one random rank of the group (the group is then restarted whole);
  - ``stop``: SIGSTOP one random rank for ``--stop-seconds``, then SIGCONT it
    (``--stop-action cont``, default: the group resumes, finds its step failed, rejoins the
    quorum and heals) or SIGKILL it (``--stop-action kill``: it is restarted);
  - ``allreduce``: SIGUSR1 to one random rank; a worker using :mod:`ft.launch.worker` makes its
    next allreduce fail for real (``examples/train_ddp.py`` aborts its process group, so the step
    fails in every participating group and the next quorum recovers).
* Shows live progress per group from the workers' ``@ft-progress`` lines (step, loss,
  participants, quorum id, quorum changes, heals, restarts), and a summary at the end, including
  whether every replica reported the same final state hash.
* Stops when every group is done, or on ``--duration`` / ``--max-steps`` (first by asking the
  workers to finish through ``FT_LAUNCH_STOP_FILE``, then, after ``--stop-grace`` seconds,
  SIGTERM and, ``--kill-grace`` seconds later, SIGKILL). Ctrl-C does the same; a second Ctrl-C
  skips the grace. Every child is reaped before the launcher exits, and it signals only processes
  it started and has not yet reaped.

Exit status: 0 when every group finished and all reported hashes agree, 1 otherwise, 2 for usage
errors, 130 when interrupted. Logs of every rank and attempt go to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from . import standby
from .worker import parse_progress

logger = logging.getLogger("ft.launch")

CHAOS_MODES = ("kill", "stop", "allreduce")


# ---------------------------------------------------------------------------------------------
# helpers


def _port_pair_free(port: int) -> bool:
    for p in (port, port + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_port_pair() -> int:
    """A port p such that p and p + 1 are both free on loopback right now."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535 and _port_pair_free(port):
            return port
    raise OSError("ft-launch: no pair of free ports found")


def build_command(cmd: Sequence[str], no_python: bool) -> List[str]:
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no training command given (put it after --)")
    if no_python:
        return cmd
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return [sys.executable, "-u"] + cmd
    return cmd


# An activation line up to this size fits in an empty pipe (Linux: 64 KiB), so writing it never
# blocks the supervisor, even while the standby is still importing.
_PIPE_SAFE_BYTES = 60000


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


def _fmt_num(v: Any, fmt: str, missing: str = "-") -> str:
    if v is None:
        return missing
    try:
        return format(v, fmt)
    except (TypeError, ValueError):
        return str(v)


# ---------------------------------------------------------------------------------------------
# state


@dataclasses.dataclass
class RankProc:
    rank: int
    attempt: int
    proc: subprocess.Popen
    log_path: str
    reader: Optional[threading.Thread] = None
    stopped_until: Optional[float] = None  # SIGSTOPped by chaos until then

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> bool:
        """Signals the child if it is still ours (not yet reaped). Never any other pid."""
        if self.proc.returncode is not None or self.proc.poll() is not None:
            return False
        try:
            self.proc.send_signal(sig)
            return True
        except ProcessLookupError:
            return False


@dataclasses.dataclass
class Group:
    gid: int
    world_size: int
    attempt: int = 0
    state: str = "pending"  # pending, running, restarting, done, failed
    ranks: List[RankProc] = dataclasses.field(default_factory=list)
    master_port: int = 0
    started_at: float = 0.0
    restart_at: float = 0.0
    progressing: bool = False  # a step was reported by the current attempt
    final: bool = False  # the current attempt reported its stop phase
    # progress (current view)
    step: Optional[int] = None
    loss: Optional[float] = None
    participants: Optional[int] = None
    quorum_id: Optional[int] = None
    accuracy: Optional[float] = None
    # counters over all attempts
    restarts: int = 0
    heals: int = 0
    quorum_changes: int = 0
    steps_reported: int = 0
    uncommitted: int = 0
    injected: int = 0
    exit_info: str = ""
    done: Dict[int, Dict[str, Any]] = dataclasses.field(default_factory=dict)  # rank -> record
    first_step_time: List[float] = dataclasses.field(default_factory=list)  # per attempt
    crashes_in_a_row: int = 0  # attempts that exited with an error before any progress
    pids: List[List[int]] = dataclasses.field(default_factory=list)  # per attempt
    start_times: List[float] = dataclasses.field(default_factory=list)


class Supervisor:
    def __init__(self, args: argparse.Namespace, command: List[str], out: TextIO = sys.stdout):
        self.args = args
        self.command = command
        self.out = out
        self.rng = random.Random(args.seed)
        self.groups = [Group(g, args.ranks_per_group) for g in range(args.replicas)]
        self.events: "queue.Queue[Tuple[int, int, int, Optional[dict], Optional[str]]]" = queue.Queue()
        self.t0 = time.monotonic()
        self.log_dir = args.log_dir or tempfile.mkdtemp(prefix="ft-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.stop_file = os.path.join(self.log_dir, "STOP")
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        self.lighthouse = None
        self.lighthouse_addr = args.lighthouse
        self.stop_requested_at: Optional[float] = None
        self.stop_reason = ""
        self.terminating = False
        self.interrupted = 0
        self.finishing = False
        self.next_chaos = self.t0 + args.every if args.chaos else None
        self.chaos_log: List[Dict[str, Any]] = []
        self.restart_log: List[Dict[str, Any]] = []
        self.quorum_ids_seen: Dict[Any, int] = {}
        self.global_max_step = 0
        self.commits_after_last_chaos = 0
        self.is_tty = self.out.isatty() and not args.no_tty
        self._table_lines = 0
        self._last_status = 0.0
        self.reaped_late: List[RankProc] = []
        # warm standbys (ft.launch.standby): started once every group trains, consumed by restarts
        self.standby_argv = None if args.no_standby else standby.runnable_argv(command)
        self.standbys: List[subprocess.Popen] = []
        self.standby_pids: List[int] = []  # every standby started, for the summary
        self.warm_starts = 0

    # -- output ---------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def say(self, msg: str) -> None:
        line = f"[ft-launch {self.elapsed():6.1f}s] {msg}"
        if self.is_tty:
            self._clear_table()
        print(line, file=self.out, flush=True)

    def _clear_table(self) -> None:
        if self._table_lines:
            self.out.write(f"\x1b[{self._table_lines}F\x1b[J")
            self._table_lines = 0

    def table(self) -> List[str]:
        hdr = (f"{'group':>5} {'state':<10} {'try':>3} {'step':>6} {'loss':>8} {'part':>4} "
               f"{'quorum':>6} {'qchg':>4} {'heals':>5} {'fails':>5} {'restarts':>8}")
        rows = [hdr]
        for g in self.groups:
            state = g.state
            if g.state == "running":
                if any(r.stopped_until for r in g.ranks):
                    state = "STOPPED"
                elif g.final:
                    state = "finishing"
                elif not g.progressing:
                    state = "starting"
            rows.append(
                f"{g.gid:>5} {state:<10} {g.attempt:>3} {_fmt_num(g.step, 'd'):>6} "
                f"{_fmt_num(g.loss, '.4f'):>8} {_fmt_num(g.participants, 'd'):>4} "
                f"{_fmt_num(self.qnum(g.quorum_id), 'd'):>6} {g.quorum_changes:>4} {g.heals:>5} "
                f"{g.uncommitted:>5} {g.restarts:>8}"
            )
        return rows

    def render(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.is_tty:
            if not force and now - self._last_status < 0.25:
                return
            self._last_status = now
            self._clear_table()
            lines = self.table()
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()
            self._table_lines = len(lines)
        else:
            if not force and now - self._last_status < self.args.status_every:
                return
            self._last_status = now
            parts = []
            for g in self.groups:
                tag = g.state if g.state != "running" else ("run" if g.progressing else "start")
                if any(r.stopped_until for r in g.ranks):
                    tag = "STOP"
                parts.append(
                    f"g{g.gid}[{tag} step={_fmt_num(g.step, 'd')} loss={_fmt_num(g.loss, '.3f')} "
                    f"part={_fmt_num(g.participants, 'd')} q=#{_fmt_num(self.qnum(g.quorum_id), 'd')}]"
                )
            self.say("status " + " ".join(parts))

    # -- lighthouse -----------------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        if self.lighthouse_addr:
            self.say(f"using lighthouse {self.lighthouse_addr}")
            return
        from ft.coordination import LighthouseServer

        a = self.args
        self.lighthouse = LighthouseServer(
            bind=a.lighthouse_bind,
            min_replicas=a.min_replicas,
            join_timeout_ms=a.join_timeout_ms,
            quorum_tick_ms=a.quorum_tick_ms,
            heartbeat_timeout_ms=a.heartbeat_timeout_ms,
        )
        self.lighthouse_addr = self.lighthouse.address()
        dash = self.lighthouse.dashboard_address()
        self.say(f"lighthouse {self.lighthouse_addr} (dashboard {dash}), min_replicas="
                 f"{a.min_replicas}, heartbeat_timeout_ms={a.heartbeat_timeout_ms}, "
                 f"join_timeout_ms={a.join_timeout_ms}")

    # -- children -------------------------------------------------------------------------------

    def _env(self, g: Group, rank: int) -> Dict[str, str]:
        env = self._common_env()
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(g.master_port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(g.world_size),
            LOCAL_WORLD_SIZE=str(g.world_size),
            REPLICA_GROUP_ID=str(g.gid),
            NUM_REPLICA_GROUPS=str(self.args.replicas),
            TORCHFT_LIGHTHOUSE=str(self.lighthouse_addr),
            TORCHELASTIC_RESTART_COUNT=str(g.attempt - 1),
            FT_LAUNCH_ATTEMPT=str(g.attempt),
        )
        return env

    def _common_env(self) -> Dict[str, str]:
        """The environment every child shares (standbys start with it, before they have a rank)."""
        env = dict(os.environ)
        # Let `python examples/x.py` import this very ft even when it is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            PYTHONUNBUFFERED="1",
            FT_LAUNCH="1",
            FT_LAUNCH_STOP_FILE=self.stop_file,
            FT_LAUNCH_PARENT_PID=str(os.getpid()),
            FT_LAUNCH_LOG_DIR=self.log_dir,
        )
        if self.args.max_steps is not None:
            env["FT_MAX_STEPS"] = str(self.args.max_steps)
        return env

    def start_group(self, g: Group) -> None:
        g.attempt += 1
        g.master_port = free_port_pair()
        g.ranks = []
        g.progressing = False
        g.final = False
        g.state = "running"
        g.started_at = time.monotonic()
        g.start_times.append(self.elapsed())
        g.step = g.loss = g.participants = None
        warm = 0
        for rank in range(g.world_size):
            log_path = os.path.join(self.log_dir, f"group{g.gid}_rank{rank}_try{g.attempt}.log")
            env = self._env(g, rank)
            proc = self._activate_standby(env)
            if proc is not None:
                warm += 1
            else:
                proc = subprocess.Popen(
                    self.command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # terminal Ctrl-C goes to the launcher only
                    bufsize=1,
                    text=True,
                    errors="replace",
                )
            rp = RankProc(rank, g.attempt, proc, log_path)
            rp.reader = threading.Thread(
                target=self._read, args=(g.gid, rp), name=f"ft-launch-read-g{g.gid}r{rank}",
                daemon=True,
            )
            rp.reader.start()
            g.ranks.append(rp)
        g.pids.append([r.pid for r in g.ranks])
        pids = ",".join(str(r.pid) for r in g.ranks)
        self.warm_starts += warm
        self.say(f"group {g.gid}: started try {g.attempt} ({g.world_size} rank(s), pids {pids}, "
                 f"MASTER_PORT {g.master_port}"
                 + (f", {warm} from warm standbys" if warm else "") + ")")

    # -- warm standbys ----------------------------------------------------------------------------

    def _spawn_standby(self) -> None:
        assert self.standby_argv is not None
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "ft.launch.standby", standby.path0(self.standby_argv)],
            env=self._common_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            bufsize=1,
            text=True,
            errors="replace",
        )
        self.standbys.append(proc)
        self.standby_pids.append(proc.pid)

    def refill_standbys(self) -> None:
        """Keeps one standby per rank of a group, started only while every group trains: an
        import of torch must not slow down a start or a recovery."""
        if self.standby_argv is None or self.terminating or self.finishing:
            return
        self._reap_dead_standbys()
        if len(self.standbys) >= self.args.ranks_per_group:
            return
        if all(g.state in ("running", "done") and (g.progressing or g.state == "done")
               for g in self.groups):
            self._spawn_standby()

    def _reap_dead_standbys(self) -> None:
        for proc in [p for p in self.standbys if p.poll() is not None]:
            self.standbys.remove(proc)
            out = _drain(proc)
            self.say(f"warm standby pid {proc.pid} exited ({proc.returncode}) before it was "
                     "needed; restarts start cold from now on"
                     + (f":\n{out.strip()[-2000:]}" if out.strip() else ""))
            self.standby_argv = None  # it will not get better: stop trying

    def _activate_standby(self, env: Dict[str, str]) -> Optional[subprocess.Popen]:
        """A ready standby turned into the process ``env`` describes, or None (start cold)."""
        if self.standby_argv is None:
            return None
        self._reap_dead_standbys()
        line = standby.activation(env, self.standby_argv)
        if len(line.encode()) > _PIPE_SAFE_BYTES:
            return None  # a write that may block this loop until the standby reads: go cold
        while self.standbys:
            proc = self.standbys.pop(0)
            try:
                assert proc.stdin is not None
                proc.stdin.write(line)
                proc.stdin.close()
                return proc
            except (OSError, ValueError):
                proc.kill()  # ours and not yet reaped: it was just alive
                proc.wait()
                _drain(proc)
        return None

    def close_standbys(self) -> None:
        """Ends the unused standbys at once: they hold no work, and one still importing would
        take seconds to notice the end of its input (which is how they end if the launcher
        dies)."""
        for proc in self.standbys:
            proc.kill()  # Popen.kill signals only a child it has not reaped
        for proc in self.standbys:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.say(f"warning: standby pid {proc.pid} could not be reaped")
            _drain(proc)
        self.standbys = []

    def _read(self, gid: int, rp: RankProc) -> None:
        assert rp.proc.stdout is not None
        with open(rp.log_path, "w", buffering=1) as log:
            for line in rp.proc.stdout:
                log.write(line)
                rec = parse_progress(line)
                if rec is not None:
                    self.events.put((gid, rp.attempt, rp.rank, rec, None))
                elif self.args.tee:
                    self.events.put((gid, rp.attempt, rp.rank, None, line.rstrip("\n")))
        rp.proc.stdout.close()

    def _kill_ranks(self, ranks: List[RankProc], sig: int = signal.SIGKILL, wait_s: float = 5.0) -> None:
        for r in ranks:
            r.signal(signal.SIGCONT)
            r.signal(sig)
        deadline = time.monotonic() + wait_s
        for r in ranks:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.reaped_late.append(r)
            r.stopped_until = None

    def _tail(self, path: str, n: int = 8) -> str:
        try:
            with open(path, errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if not ln.startswith("@ft-progress")]
        except OSError:
            return ""
        return "\n".join("    | " + ln for ln in lines[-n:])

    # -- progress -------------------------------------------------------------------------------

    def handle_events(self) -> None:
        while True:
            try:
                gid, attempt, rank, rec, line = self.events.get_nowait()
            except queue.Empty:
                return
            g = self.groups[gid]
            if line is not None:
                print(f"[g{gid}r{rank}] {line}", file=self.out, flush=True)
                continue
            assert rec is not None
            self.on_record(g, attempt, rank, rec)

    def on_record(self, g: Group, attempt: int, rank: int, rec: Dict[str, Any]) -> None:
        ev = rec.get("event")
        current = attempt == g.attempt
        if ev == "heal":
            if rank == 0:
                g.heals += 1
                self.say(f"group {g.gid}: healed from a live peer, step {rec.get('from_step')} -> "
                         f"{rec.get('to_step')}")
            return
        if ev == "final":
            if current:
                g.final = True
            if not self.finishing:
                self.finishing = True
                self.say(f"group {g.gid} reached its stop phase at step {rec.get('step')}; "
                         "no more chaos")
            return
        if ev == "done":
            g.done[rank] = rec
            if rec.get("accuracy") is not None:
                g.accuracy = rec.get("accuracy")
            if rec.get("step") is not None:
                g.step = rec.get("step")
            return
        if ev != "step" or rank != 0:
            return
        g.steps_reported += 1
        if rec.get("injected"):
            g.injected += 1
        if not rec.get("committed", True):
            g.uncommitted += 1
        elif self.chaos_log:
            self.commits_after_last_chaos += 1
        if not current:
            return
        if not g.progressing:
            g.progressing = True
            g.first_step_time.append(self.elapsed())
        if rec.get("barrier"):
            return  # stop-phase steps (no update): keep showing the last training step
        g.step = rec.get("step", g.step)
        if isinstance(g.step, int):
            self.global_max_step = max(self.global_max_step, g.step)
        if rec.get("loss") is not None:
            g.loss = rec["loss"]
        g.participants = rec.get("participants", g.participants)
        qid = rec.get("quorum_id")
        if qid is not None and qid != g.quorum_id:
            if g.quorum_id is not None:
                g.quorum_changes += 1
            g.quorum_id = qid
            if qid not in self.quorum_ids_seen:
                self.quorum_ids_seen[qid] = len(self.quorum_ids_seen) + 1
                if len(self.quorum_ids_seen) > 1 or self.args.verbose:
                    self.say(f"new quorum #{self.quorum_ids_seen[qid]} (id {qid}): "
                             f"{g.participants} participant(s), first reported by group {g.gid} "
                             f"at step {g.step}")

    def qnum(self, qid: Any) -> Optional[int]:
        """Quorum ids are large and sparse; show them as #1, #2, ... in order of appearance."""
        return self.quorum_ids_seen.get(qid)

    # -- failures -------------------------------------------------------------------------------

    def check_children(self) -> None:
        now = time.monotonic()
        for g in self.groups:
            if g.state == "restarting" and now >= g.restart_at:
                if self._others_all_finished(g):
                    g.state = "failed"
                    g.exit_info += "; not restarted: every other group has finished"
                    self.say(f"group {g.gid}: not restarted, every other group has finished")
                else:
                    g.restarts += 1
                    self.restart_log.append({"group": g.gid, "time": self.elapsed()})
                    self.start_group(g)
                continue
            if g.state != "running":
                continue
            codes = [r.proc.poll() for r in g.ranks]
            if all(c == 0 for c in codes):
                g.state = "done"
                self.say(f"group {g.gid}: finished (try {g.attempt})")
                continue
            failed = [(r, c) for r, c in zip(g.ranks, codes) if c is not None and c != 0]
            if not failed:
                continue
            r, c = failed[0]
            how = f"killed by {signal.Signals(-c).name}" if c < 0 else f"exit status {c}"
            alive = [x for x in g.ranks if x.alive()]
            msg = (f"group {g.gid}: rank {r.rank} (pid {r.pid}) {how}"
                   + (f"; killing its {len(alive)} other rank(s)" if alive else ""))
            self.say(msg)
            if c > 0:
                tail = self._tail(r.log_path)
                if tail:
                    print(tail, file=self.out, flush=True)
            self._kill_ranks(alive)
            g.exit_info = f"try {g.attempt}: rank {r.rank} {how}"
            # An attempt that fails by itself before any progress is a crash (a bug, a bad
            # argument): back off, and stop after --max-crashes in a row. Kills do not count.
            g.crashes_in_a_row = g.crashes_in_a_row + 1 if (c > 0 and not g.progressing) else 0
            delay = self.args.restart_delay * (2 ** min(g.crashes_in_a_row, 4))
            if self.terminating or self.stop_requested_at is not None and self._others_all_finished(g):
                g.state = "failed"
            elif self.args.max_restarts is not None and g.restarts >= self.args.max_restarts:
                g.state = "failed"
                self.say(f"group {g.gid}: giving up after {g.restarts} restart(s)")
            elif g.crashes_in_a_row >= self.args.max_crashes:
                g.state = "failed"
                self.say(f"group {g.gid}: giving up, {g.crashes_in_a_row} tries in a row failed "
                         f"before their first step (see {r.log_path})")
            else:
                g.state = "restarting"
                g.restart_at = time.monotonic() + delay
                self.say(f"group {g.gid}: restarting in {delay:.1f}s")

    def _others_all_finished(self, g: Group) -> bool:
        others = [o for o in self.groups if o is not g]
        return bool(others) and all(o.state in ("done", "failed") for o in others) and any(
            o.state == "done" for o in others)

    # -- chaos ----------------------------------------------------------------------------------

    def healthy(self) -> List[Group]:
        return [g for g in self.groups
                if g.state == "running" and g.progressing and not g.final
                and not any(r.stopped_until for r in g.ranks) and all(r.alive() for r in g.ranks)]

    def chaos_tick(self) -> None:
        now = time.monotonic()
        # resume / kill stopped ranks whose time is up
        for g in self.groups:
            for r in g.ranks:
                if r.stopped_until is not None and now >= r.stopped_until:
                    r.stopped_until = None
                    if self.args.stop_action == "kill":
                        r.signal(signal.SIGKILL)
                        self.say(f"chaos: SIGKILL stopped group {g.gid} rank {r.rank} (pid {r.pid})")
                    else:
                        r.signal(signal.SIGCONT)
                        self.say(f"chaos: SIGCONT group {g.gid} rank {r.rank} (pid {r.pid})")
        if self.next_chaos is None or now < self.next_chaos:
            return
        if self.finishing or self.stop_requested_at is not None:
            self.next_chaos = None
            return
        healthy = self.healthy()
        if len(healthy) < 2:
            return  # never take down the last healthy group; retry next tick
        g = self.rng.choice(healthy)
        r = self.rng.choice(g.ranks)
        mode = self.args.chaos
        if mode == "kill":
            ok = r.signal(signal.SIGKILL)
            what = "SIGKILL"
        elif mode == "stop":
            ok = r.signal(signal.SIGSTOP)
            if ok:
                r.stopped_until = now + self.args.stop_seconds
            what = f"SIGSTOP for {self.args.stop_seconds:.1f}s then {self.args.stop_action.upper()}"
        else:
            ok = r.signal(signal.SIGUSR1)
            what = "SIGUSR1 (fail the next allreduce)"
        if ok:
            self.chaos_log.append({"mode": mode, "group": g.gid, "rank": r.rank, "pid": r.pid,
                                   "time": self.elapsed(), "step": g.step,
                                   "max_step": self.global_max_step})
            self.commits_after_last_chaos = 0
            self.say(f"chaos: {what} -> group {g.gid} rank {r.rank} (pid {r.pid}) at step {g.step}")
        self.next_chaos = now + self.args.every

    # -- stopping -------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        if self.stop_requested_at is not None:
            return
        self.stop_requested_at = time.monotonic()
        self.stop_reason = reason
        self.finishing = True
        self.close_standbys()
        with open(self.stop_file, "w") as f:
            f.write(reason + "\n")
        self.say(f"stop requested ({reason}); waiting up to {self.args.stop_grace:.0f}s for the "
                 "groups to finish")

    def terminate_all(self, why: str) -> None:
        """SIGTERM every live child, then SIGKILL after --kill-grace; reap them all."""
        self.terminating = True
        live = [r for g in self.groups for r in g.ranks if r.alive()]
        if live:
            self.say(f"{why}: SIGTERM to {len(live)} process(es)")
        for r in live:
            r.signal(signal.SIGCONT)
            r.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.args.kill_grace
        for r in live:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        stubborn = [r for r in live if r.alive()]
        if stubborn:
            self.say(f"SIGKILL to {len(stubborn)} process(es) still alive")
            self._kill_ranks(stubborn, signal.SIGKILL, wait_s=10.0)
        for g in self.groups:
            if g.state in ("running", "restarting", "pending"):
                ok = bool(g.ranks) and all(r.proc.returncode == 0 for r in g.ranks)
                g.state = "done" if ok else "failed"
                if not ok:
                    g.exit_info = f"try {g.attempt}: stopped by the launcher ({why})"

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.interrupted += 1

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> int:
        a = self.args
        old_int = signal.signal(signal.SIGINT, self._on_signal)
        old_term = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            self.say(f"logs in {self.log_dir}")
            self.start_lighthouse()
            cmd = " ".join(self.command)
            self.say(f"{a.replicas} replica group(s) x {a.ranks_per_group} rank(s): {cmd}"
                     + (f"; chaos {a.chaos} every {a.every:g}s" if a.chaos else ""))
            for g in self.groups:
                self.start_group(g)
            handled_interrupts = 0
            while True:
                self.handle_events()
                self.check_children()
                self.refill_standbys()
                self.chaos_tick()
                if all(g.state in ("done", "failed") for g in self.groups):
                    break
                now = time.monotonic()
                if self.interrupted > handled_interrupts:
                    handled_interrupts = self.interrupted
                    if handled_interrupts == 1:
                        self.request_stop("interrupted")
                    else:
                        self.terminate_all("interrupted again")
                        break
                if a.duration is not None and now - self.t0 >= a.duration:
                    self.request_stop(f"--duration {a.duration:g}s reached")
                if (a.max_steps is not None and self.stop_requested_at is None
                        and self._all_live_reached(a.max_steps)):
                    self.request_stop(f"--max-steps {a.max_steps} reached")
                if self.stop_requested_at is not None and now - self.stop_requested_at > a.stop_grace:
                    self.terminate_all("stop grace expired")
                    break
                if a.timeout is not None and now - self.t0 > a.timeout:
                    self.terminate_all(f"--timeout {a.timeout:g}s reached")
                    break
                self.render()
                time.sleep(0.05)
            self.handle_events()
        finally:
            self.shutdown()
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
        return self.summary()

    def _all_live_reached(self, max_steps: int) -> bool:
        live = [g for g in self.groups if g.state == "running"]
        if any(g.final for g in live):
            return False  # the workers handle their stop phase themselves
        # Workers that know FT_MAX_STEPS stop by themselves; this catches scripts that do not.
        return bool(live) and all(isinstance(g.step, int) and g.step >= max_steps + 5 for g in live)

    def shutdown(self) -> None:
        self.close_standbys()
        live = [r for g in self.groups for r in g.ranks if r.alive()]
        if live:
            self.terminate_all("shutting down")
        for g in self.groups:
            for r in g.ranks:
                if r.reader is not None:
                    r.reader.join(timeout=2.0)
        for r in self.reaped_late:
            try:
                r.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self.say(f"warning: pid {r.pid} could not be reaped")
        self.handle_events()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        if self.is_tty:
            self.render(force=True)
            self._table_lines = 0

    # -- summary --------------------------------------------------------------------------------

    def summary(self) -> int:
        elapsed = self.elapsed()
        out = self.out
        hashes = {}
        for g in self.groups:
            for rank, rec in g.done.items():
                if rec.get("hash"):
                    hashes[(g.gid, rank)] = rec["hash"]
        distinct = sorted(set(hashes.values()))
        all_done = all(g.state == "done" for g in self.groups)
        expected = sum(g.world_size for g in self.groups)
        identical = len(distinct) == 1 and len(hashes) == expected
        print("", file=out)
        print(f"== ft-launch summary ({elapsed:.1f}s) ==", file=out)
        print(f"{'group':>5} {'result':<7} {'tries':>5} {'final step':>10} {'heals':>5} "
              f"{'qchg':>4} {'fails':>5} {'accuracy':>8}  hash", file=out)
        for g in self.groups:
            hs = sorted({rec.get("hash", "")[:16] for rec in g.done.values() if rec.get("hash")})
            acc = f"{100 * g.accuracy:.1f}%" if isinstance(g.accuracy, (int, float)) else "-"
            print(f"{g.gid:>5} {g.state:<7} {g.attempt:>5} {_fmt_num(g.step, 'd'):>10} "
                  f"{g.heals:>5} {g.quorum_changes:>4} {g.uncommitted:>5} {acc:>8}  "
                  f"{','.join(hs) or '-'}", file=out)
            if g.state != "done" and g.exit_info:
                print(f"{'':>5} {g.exit_info}", file=out)
        n_chaos = len(self.chaos_log)
        print(f"chaos: {n_chaos} failure(s) injected"
              + (f" ({self.args.chaos})" if self.args.chaos else "")
              + f"; restarts: {sum(g.restarts for g in self.groups)}"
              + (f" ({self.warm_starts} rank(s) from warm standbys)" if self.warm_starts else "")
              + f"; heals: {sum(g.heals for g in self.groups)}"
              + f"; quorums: {len(self.quorum_ids_seen)}"
              + f"; uncommitted steps: {sum(g.uncommitted for g in self.groups)}", file=out)
        if n_chaos:
            last = self.chaos_log[-1]
            after = self.global_max_step - last["max_step"]
            print(f"training went on: {after} step(s) committed after the last injected failure "
                  f"(at {last['time']:.1f}s: step {last['max_step']} -> {self.global_max_step})",
                  file=out)
        if identical:
            print(f"weights: all {len(self.groups)} replica group(s) ({len(hashes)} rank(s)) hold "
                  f"identical model and optimizer state, sha256 {distinct[0]}", file=out)
        elif hashes:
            print(f"weights: MISMATCH, {len(distinct)} distinct hash(es) over {len(hashes)} of "
                  f"{expected} rank(s):", file=out)
            for (gid, rank), h in sorted(hashes.items()):
                print(f"    group {gid} rank {rank}: {h}", file=out)
        else:
            print("weights: no final hashes reported", file=out)
        print(f"logs: {self.log_dir}", file=out)
        out.flush()
        result = {
            "elapsed_s": elapsed,
            "groups": [
                {
                    "group": g.gid, "state": g.state, "tries": g.attempt, "restarts": g.restarts,
                    "final_step": g.step, "heals": g.heals, "quorum_changes": g.quorum_changes,
                    "uncommitted": g.uncommitted, "steps_reported": g.steps_reported,
                    "accuracy": g.accuracy, "exit_info": g.exit_info,
                    "start_times": g.start_times, "first_step_times": g.first_step_time,
                    "done": {str(k): v for k, v in g.done.items()}, "pids": g.pids,
                }
                for g in self.groups
            ],
            "chaos": self.chaos_log,
            "restarts": self.restart_log,
            "quorum_ids": list(self.quorum_ids_seen),
            "commits_after_last_chaos": self.commits_after_last_chaos,
            "steps_after_last_chaos": (self.global_max_step - self.chaos_log[-1]["max_step"]
                                       if self.chaos_log else None),
            "max_step": self.global_max_step,
            "hashes": {f"{gid}/{rank}": h for (gid, rank), h in sorted(hashes.items())},
            "identical": identical,
            "all_done": all_done,
            "stop_reason": self.stop_reason,
            "log_dir": self.log_dir,
            "standby_pids": self.standby_pids,
            "warm_starts": self.warm_starts,
        }
        if self.args.summary_json:
            with open(self.args.summary_json, "w") as f:
                json.dump(result, f, indent=2)
        if self.interrupted:
            return 130
        return 0 if all_done and (identical or not hashes) else 1


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ft-launch",
        usage="ft-launch [options] -- SCRIPT.py [script args]",
        description="Run N fault-tolerant replica groups locally, restart the ones that die, "
                    "optionally inject failures, and show live progress.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--replicas", "--nreplicas", type=int, default=3, help="replica groups")
    p.add_argument("--ranks-per-group", "--nproc-per-group", type=int, default=1,
                   help="ranks (processes) per replica group")
    p.add_argument("--chaos", choices=CHAOS_MODES, default=None, help="failure to inject")
    p.add_argument("--every", type=float, default=5.0, help="seconds between injected failures")
    p.add_argument("--stop-seconds", type=float, default=4.0,
                   help="--chaos stop: how long a rank stays SIGSTOPped")
    p.add_argument("--stop-action", choices=("cont", "kill"), default="cont",
                   help="--chaos stop: SIGCONT the rank afterwards, or SIGKILL it")
    p.add_argument("--seed", type=int, default=None, help="seed of the chaos choices")
    p.add_argument("--max-steps", type=int, default=None,
                   help="steps to train (exported as FT_MAX_STEPS; the run is stopped if a script "
                        "ignores it)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds after which the run is asked to stop")
    p.add_argument("--timeout", type=float, default=None,
                   help="hard limit in seconds: terminate everything after it")
    p.add_argument("--stop-grace", type=float, default=60.0,
                   help="seconds the groups get to finish after a stop request")
    p.add_argument("--kill-grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL at shutdown")
    p.add_argument("--restart-delay", type=float, default=0.5,
                   help="seconds before a failed group is restarted")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restarts per group before giving up (default: unlimited)")
    p.add_argument("--max-crashes", type=int, default=3,
                   help="give a group up after this many tries in a row fail before any step")
    p.add_argument("--lighthouse", default=None,
                   help="address of a running lighthouse (default: start one in-process)")
    p.add_argument("--lighthouse-bind", default="127.0.0.1:0", help="bind of the in-process lighthouse")
    p.add_argument("--min-replicas", type=int, default=1, help="lighthouse min_replicas")
    p.add_argument("--join-timeout-ms", type=int, default=1000, help="lighthouse join_timeout_ms")
    p.add_argument("--quorum-tick-ms", type=int, default=100, help="lighthouse quorum_tick_ms")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=2000,
                   help="lighthouse heartbeat_timeout_ms")
    p.add_argument("--log-dir", default=None, help="per-rank logs (default: a new temp dir)")
    p.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    p.add_argument("--status-every", type=float, default=5.0,
                   help="seconds between status lines when stdout is not a terminal")
    p.add_argument("--no-tty", action="store_true", help="plain status lines even on a terminal")
    p.add_argument("--tee", action="store_true", help="echo the workers' other output")
    p.add_argument("--no-standby", action="store_true",
                   help="restart groups with newly exec'd processes instead of warm standbys "
                        "(processes that imported torch and ft ahead of time)")
    p.add_argument("--no-python", action="store_true",
                   help="run the command as is (default: .py files and -m run under this Python)")
    p.add_argument("-v", "--verbose", action="store_true", help="more launcher and lighthouse logs")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py [args]")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # The in-process lighthouse warns about every missed heartbeat; the launcher reports
        # deaths itself.
        logging.getLogger("ft.lighthouse").setLevel(logging.ERROR)
    if args.replicas < 1 or args.ranks_per_group < 1:
        parser.error("--replicas and --ranks-per-group must be >= 1")
    if args.every <= 0:
        parser.error("--every must be > 0")
    try:
        command = build_command(args.command, args.no_python)
    except ValueError as e:
        parser.error(str(e))
    if not args.no_python and command[0] == sys.executable and command[2].endswith(".py") \
            and not os.path.exists(command[2]):
        parser.error(f"script not found: {command[2]}")
    if args.no_python and shutil.which(command[0]) is None and not os.path.exists(command[0]):
        parser.error(f"command not found: {command[0]}")
    return Supervisor(args, command).run()


if __name__ == "__main__":
    sys.exit(main())
