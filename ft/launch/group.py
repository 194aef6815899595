"""One replica group as ``ft-launch`` runs it: its ranks' processes and environment, their end,
and when a failed group is started again.

Contract:
* :class:`Group` is the launcher's record of one replica group: its :class:`GroupState`, the
  processes of its current attempt, the progress they reported and its :class:`GroupStats`.
* :class:`ChildEnv` is the only place a child's environment is made: every child (standbys
  too) gets :meth:`ChildEnv.common`, a rank gets :meth:`ChildEnv.for_rank` on top of it.
* :class:`GroupSpawner` starts an attempt (a warm standby per rank where the pool has one, a new
  process otherwise), copies each rank's output to its log file, turns its progress lines into
  :class:`ProgressEvent` s, and kills ranks. It signals only processes it started and has not
  reaped.
* :class:`RestartPolicy` says how long a failed group waits before its next attempt, and when
  the launcher gives up on it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import queue
import random
import signal
import socket
import subprocess
import threading
from typing import (
    Any,
    Callable,
    Dict,
    List,
    NamedTuple,
    Optional,
    Protocol,
    Sequence,
    Tuple,
)

from ft.utils.deadline import Deadline

from .children import reap, spawn_child
from .worker import PROGRESS_PREFIX, parse_progress


# SIGKILL cannot be caught, so a killed rank is normally reaped within milliseconds; one stuck
# in an uninterruptible kernel call (a driver, a dead network mount) takes longer. The loop
# waits this long for the ranks it killed and leaves the rest to the end of the run, so a stuck
# rank delays the other groups' restarts by seconds, not for ever.
KILL_REAP_WAIT_S = 5.0

# Random ports tried before giving up on finding p and p + 1 both free: on a loopback with a
# handful of listeners nearly every try succeeds; 200 failures mean the range is exhausted,
# not bad luck.
PORT_PAIR_TRIES = 200

# Lines of a crashed rank's log shown under the news of its death: a Python traceback's last
# frames and its exception, without burying the status lines.
LOG_TAIL_LINES = 8

# Crashes in a row double the restart delay up to 2**4 = 16 times --restart-delay (8 s with
# the default 0.5 s): a broken script is not restarted in a busy loop, and a group that
# crashed for a passing reason is back within seconds.
MAX_BACKOFF_DOUBLINGS = 4


# ---------------------------------------------------------------------------------------------
# processes


def _port_pair_free(port: int) -> bool:
    for candidate in (port, port + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                return False
    return True


# Where a group's store port is drawn from when the kernel's ephemeral range leaves no room
# below it: the registered-port range's upper part, clear of the well-known services.
LOWEST_STORE_PORT = 10000

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_range(path: str = EPHEMERAL_RANGE_FILE) -> Tuple[int, int]:
    """The kernel's range for ports it picks by itself (Linux default 32768-60999)."""
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def store_port_candidates(ephemeral: Tuple[int, int]) -> Tuple[int, int]:
    """The range [lo, hi] a group's MASTER_PORT pair is drawn from: below the ephemeral range.

    Why: a port picked by binding port 0 is an ephemeral one, and between the pick and the
    moment the rank binds it (seconds, while a restarted rank imports its script) any process
    on the host may be given the same port for its own connection or listener. NCCL's
    bootstrap and proxy threads open such listeners by the hundreds while communicators are
    rebuilt; a rank 0 that then cannot host its store connected to one of them and waited
    out its timeout. Ports outside the ephemeral range are only ever taken by an explicit bind.
    """
    low, high = ephemeral
    if low - 2 > LOWEST_STORE_PORT:
        return LOWEST_STORE_PORT, low - 2  # p + 1 stays below the range too
    if high < 65533:
        return high + 1, 65533
    return 1024, 65533  # the whole range is ephemeral: nothing better exists


def free_port_pair(rng: Optional[random.Random] = None) -> int:
    """A port p such that p and p + 1 are both free on loopback right now, both outside the
    kernel's ephemeral range (see :func:`store_port_candidates`)."""
    rng = rng or random.SystemRandom()
    lo, hi = store_port_candidates(ephemeral_port_range())
    for _ in range(PORT_PAIR_TRIES):
        port = rng.randint(lo, hi)
        if _port_pair_free(port):
            return port
    raise OSError(f"ft-launch: no pair of free ports found in {lo}-{hi + 1}")


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a rank's log other than progress records, indented."""
    try:
        with open(path, errors="replace") as log:
            text = [
                line
                for line in log.read().splitlines()
                if not line.startswith(PROGRESS_PREFIX.strip())
            ]
    except OSError:
        return ""
    return "\n".join("    | " + line for line in text[-lines:])


@dataclasses.dataclass
class RankProc:
    """One process of one attempt of a group. It signals its child only until it is reaped."""

    rank: int
    attempt: int
    proc: subprocess.Popen
    log_path: str
    reader: Optional[threading.Thread] = None
    stopped_until: Optional[Deadline] = None
    """Set while chaos holds the rank SIGSTOPped: when it is resumed (or killed)."""

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


# ---------------------------------------------------------------------------------------------
# the group


class GroupState(enum.Enum):
    """Where a replica group is in its life; the value is what the display and summary show."""

    PENDING = "pending"  # not started yet
    RUNNING = "running"  # the ranks of its current attempt were started
    RESTARTING = "restarting"  # its last attempt failed; the next one starts at restart_at
    DONE = "done"  # every rank of an attempt exited 0
    FAILED = "failed"  # given up on, or stopped by the launcher

    @property
    def finished(self) -> bool:
        """Nothing more happens to a group in this state."""
        return self in (GroupState.DONE, GroupState.FAILED)


@dataclasses.dataclass
class GroupStats:
    """Counters of one replica group over all its attempts (the summary adds them up)."""

    restarts: int = 0
    """Attempts started after a failed one."""
    heals: int = 0
    """Times rank 0 loaded a live peer's state."""
    quorum_changes: int = 0
    """Times rank 0 reported a quorum id other than the one before."""
    steps_reported: int = 0
    """Step records of rank 0, committed or not."""
    uncommitted: int = 0
    """Steps rank 0 reported as not committed."""
    injected: int = 0
    """Steps rank 0 reported as failed by an injected allreduce error."""
    crashes_in_a_row: int = 0
    """Latest attempts that each failed by themselves before their first step."""
    gave_up: Optional[str] = None
    """The persistent fault a rank's Manager gave up on (``PERSISTENT_FAILURE_EXIT``): the
    group is not restarted."""

    def count_step(self, record: Dict[str, Any]) -> bool:
        """Counts one step record of rank 0; returns whether the step committed."""
        self.steps_reported += 1
        if record.get("injected"):
            self.injected += 1
        committed = bool(record.get("committed", True))
        if not committed:
            self.uncommitted += 1
        return committed

    def count_failure(self, exit_code: int, progressed: bool) -> None:
        """An attempt ended with ``exit_code`` (negative: killed by that signal).

        A non-zero exit before any step is a crash (a bug, a bad argument), the kind that
        repeats; a signal (chaos, the OOM killer) or a failure after progress ends the streak.
        """
        crashed = exit_code > 0 and not progressed
        self.crashes_in_a_row = self.crashes_in_a_row + 1 if crashed else 0


@dataclasses.dataclass
class Group:
    """The launcher's record of one replica group: its current attempt and what it reported."""

    gid: int
    world_size: int
    attempt: int = 0
    """Attempts started so far; the current one's number."""
    state: GroupState = GroupState.PENDING
    ranks: List[RankProc] = dataclasses.field(default_factory=list)
    """The processes of the current attempt, by rank."""
    master_port: int = 0
    devices: Tuple[str, ...] = ()
    """The GPUs its ranks see (``CUDA_VISIBLE_DEVICES``); empty: the launcher's own view."""
    restart_at: Deadline = dataclasses.field(default_factory=Deadline.never)
    """While RESTARTING: when the next attempt starts."""
    progressing: bool = False
    """The current attempt reported a step."""
    final: bool = False
    """The current attempt reported its stop phase."""
    step: Optional[int] = None
    loss: Optional[float] = None
    participants: Optional[int] = None
    quorum_id: Optional[int] = None
    accuracy: Optional[float] = None
    failing: Optional[str] = None
    """Why the current attempt's latest step did not commit (its ``error``); None once one
    commits."""
    last_error: Optional[str] = None
    """The latest step error any attempt reported, kept for the summary."""
    stats: GroupStats = dataclasses.field(default_factory=GroupStats)
    exit_info: str = ""
    """Why the latest attempt ended, for the summary."""
    done: Dict[int, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    """rank -> its ``done`` record (final step, hash, accuracy)."""
    pids: List[List[int]] = dataclasses.field(default_factory=list)
    """Per attempt: the pids of its ranks."""
    start_times: List[float] = dataclasses.field(default_factory=list)
    """Per attempt: seconds into the run it started."""
    first_step_times: List[float] = dataclasses.field(default_factory=list)
    """Per attempt that reported a step: seconds into the run of its first one."""

    def begin_attempt(self, master_port: int, now_s: float) -> None:
        """Forgets the previous attempt's processes and view; the group is RUNNING again."""
        self.attempt += 1
        self.master_port = master_port
        self.ranks = []
        self.progressing = False
        self.final = False
        self.state = GroupState.RUNNING
        self.start_times.append(now_s)
        self.step = self.loss = self.participants = None
        self.failing = None

    def any_stopped(self) -> bool:
        """A rank is held SIGSTOPped by chaos."""
        return any(rank.stopped_until is not None for rank in self.ranks)

    def trains(self) -> bool:
        """Running and past its first step (or finished for good): a standby may be started."""
        return self.state == GroupState.DONE or (
            self.state == GroupState.RUNNING and self.progressing
        )

    def healthy(self) -> bool:
        """Training with every rank alive and running: chaos may pick it."""
        return (
            self.state == GroupState.RUNNING
            and self.progressing
            and not self.final
            and not self.any_stopped()
            and all(rank.alive() for rank in self.ranks)
        )


# ---------------------------------------------------------------------------------------------
# starting and stopping ranks


@dataclasses.dataclass
class ChildEnv:
    """What a child's environment carries beyond the launcher's own."""

    stop_file: str
    """``FT_LAUNCH_STOP_FILE``: created when the run is asked to stop."""
    log_dir: str
    """``FT_LAUNCH_LOG_DIR``: where the rank logs go."""
    num_groups: int
    """``NUM_REPLICA_GROUPS``."""
    max_steps: Optional[int] = None
    """``FT_MAX_STEPS`` when set."""
    lighthouse: str = ""
    """``TORCHFT_LIGHTHOUSE``: known once the lighthouse is up."""

    def common(self) -> Dict[str, str]:
        """The environment every child shares (standbys start with it, before they have a rank)."""
        env = dict(os.environ)
        # Let `python examples/x.py` import this very ft even when it is not installed.
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = pkg_root + (
            os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
        )
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(
            PYTHONUNBUFFERED="1",
            FT_LAUNCH="1",
            FT_LAUNCH_STOP_FILE=self.stop_file,
            FT_LAUNCH_PARENT_PID=str(os.getpid()),
            FT_LAUNCH_LOG_DIR=self.log_dir,
        )
        if self.max_steps is not None:
            env["FT_MAX_STEPS"] = str(self.max_steps)
        return env

    def for_rank(self, group: Group, rank: int) -> Dict[str, str]:
        """The torchrun-style environment of ``rank`` in the current attempt of ``group``."""
        env = self.common()
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(group.master_port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(group.world_size),
            LOCAL_WORLD_SIZE=str(group.world_size),
            REPLICA_GROUP_ID=str(group.gid),
            NUM_REPLICA_GROUPS=str(self.num_groups),
            TORCHFT_LIGHTHOUSE=str(self.lighthouse),
            TORCHELASTIC_RESTART_COUNT=str(group.attempt - 1),
            FT_LAUNCH_ATTEMPT=str(group.attempt),
        )
        if group.devices:
            # The group's slice of the GPUs; LOCAL_RANK indexes into it, as under torchrun.
            env["CUDA_VISIBLE_DEVICES"] = ",".join(group.devices)
        return env


class ProgressEvent(NamedTuple):
    """One line a rank printed that the launcher acts on: a progress record, or (``--tee``) any
    other line."""

    gid: int
    attempt: int
    rank: int
    record: Optional[Dict[str, Any]]
    line: Optional[str]


class WarmStarts(Protocol):
    """Where a rank's process may come from ready-made (:class:`ft.launch.standby.StandbyPool`)."""

    def activate(self, env: Dict[str, str]) -> Optional[subprocess.Popen]:
        """A ready process turned into the rank ``env`` describes, or None: start it cold."""
        ...


class GroupSpawner:
    """Starts and kills the ranks of replica groups, and reads what they print.

    Contract:
    * :meth:`start` begins the group's next attempt on a new ``MASTER_PORT`` pair: one process
      per rank, a warm standby where ``standbys`` has one ready, else a new process of
      ``command``. Every line a rank prints goes to its log file
      (``group{G}_rank{R}_try{T}.log`` in ``log_dir``); progress records, and with ``tee`` every
      other line, are put on :attr:`events`.
    * :meth:`kill` signals ranks it has not reaped and waits (bounded) for them; those it could
      not reap are kept in :attr:`unreaped` for :meth:`reap_stragglers` at the end of the run.
    """

    def __init__(
        self,
        command: Sequence[str],
        log_dir: str,
        env: ChildEnv,
        standbys: "WarmStarts",
        tee: bool,
        clock: Callable[[], float],
    ) -> None:
        self.command = list(command)
        self.log_dir = log_dir
        self.env = env
        self.standbys = standbys
        self.tee = tee
        self.clock = clock  # seconds into the run, for the attempt's start time
        self.events: "queue.Queue[ProgressEvent]" = queue.Queue()
        self.unreaped: List[RankProc] = []

    def start(self, group: Group) -> int:
        """Starts the group's next attempt; returns how many of its ranks are warm standbys."""
        group.begin_attempt(free_port_pair(), self.clock())
        warm = 0
        for rank in range(group.world_size):
            log_path = os.path.join(
                self.log_dir, f"group{group.gid}_rank{rank}_try{group.attempt}.log"
            )
            env = self.env.for_rank(group, rank)
            proc = self.standbys.activate(env)
            if proc is not None:
                warm += 1
            else:
                proc = spawn_child(self.command, env, stdin=subprocess.DEVNULL)
            rank_proc = RankProc(rank, group.attempt, proc, log_path)
            rank_proc.reader = threading.Thread(
                target=self._read,
                args=(group.gid, rank_proc),
                name=f"ft-launch-read-g{group.gid}r{rank}",
                daemon=True,
            )
            rank_proc.reader.start()
            group.ranks.append(rank_proc)
        group.pids.append([rank_proc.pid for rank_proc in group.ranks])
        return warm

    def _read(self, gid: int, rank_proc: RankProc) -> None:
        assert rank_proc.proc.stdout is not None
        with open(rank_proc.log_path, "w", buffering=1) as log:
            for line in rank_proc.proc.stdout:
                log.write(line)
                record = parse_progress(line)
                if record is not None:
                    self.events.put(
                        ProgressEvent(gid, rank_proc.attempt, rank_proc.rank, record, None)
                    )
                elif self.tee:
                    self.events.put(
                        ProgressEvent(
                            gid, rank_proc.attempt, rank_proc.rank, None, line.rstrip("\n")
                        )
                    )
        rank_proc.proc.stdout.close()

    def kill(
        self, ranks: Sequence[RankProc], sig: int = signal.SIGKILL, wait_s: float = KILL_REAP_WAIT_S
    ) -> None:
        """Sends ``sig`` to each rank (SIGCONT first: a stopped process would not act on it)
        and waits up to ``wait_s`` for them all."""
        for rank_proc in ranks:
            rank_proc.signal(signal.SIGCONT)
            rank_proc.signal(sig)
        running = reap([rank_proc.proc for rank_proc in ranks], Deadline.after(wait_s))
        for rank_proc in ranks:
            if rank_proc.proc in running:
                self.unreaped.append(rank_proc)
            rank_proc.stopped_until = None

    def reap_stragglers(self, wait_s: float) -> List[RankProc]:
        """Waits up to ``wait_s`` for the ranks :meth:`kill` could not reap; returns those that
        are still running."""
        running = reap([rank_proc.proc for rank_proc in self.unreaped], Deadline.after(wait_s))
        return [rank_proc for rank_proc in self.unreaped if rank_proc.proc in running]


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a group whose attempt failed starts again, and when the launcher gives up on it."""

    restart_delay: float = 0.5
    """Seconds before a failed group is restarted (``--restart-delay``); doubled per crash in a
    row, up to ``2 ** MAX_BACKOFF_DOUBLINGS`` times."""
    max_restarts: Optional[int] = None
    """Restarts per group before giving up (``--max-restarts``); None: no limit."""
    max_crashes: int = 3
    """Give a group up once this many attempts in a row crashed before their first step
    (``--max-crashes``)."""

    def delay(self, stats: GroupStats) -> float:
        """Seconds to wait before the next attempt."""
        return self.restart_delay * (2 ** min(stats.crashes_in_a_row, MAX_BACKOFF_DOUBLINGS))

    def give_up(self, stats: GroupStats) -> Optional[str]:
        """Why the group is not restarted again, or None: it is."""
        if stats.gave_up is not None:
            return f"not restarted, its steps failed persistently: {stats.gave_up}"
        if self.max_restarts is not None and stats.restarts >= self.max_restarts:
            return f"giving up after {stats.restarts} restart(s)"
        if stats.crashes_in_a_row >= self.max_crashes:
            return (
                f"giving up, {stats.crashes_in_a_row} tries in a row failed before their first step"
            )
        return None
