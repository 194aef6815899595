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
import shutil
import signal
import sys
import tempfile
from typing import Any, Dict, List, Optional, Sequence, TextIO

from ft.utils.deadline import Deadline

from . import standby
from .chaos import CHAOS_MODES, STOP_ACTIONS, ChaosConfig, ChaosInjector
from .display import Display, RunOutcome, write_summary
from .group import (
    ChildEnv,
    Group,
    GroupSpawner,
    GroupState,
    GroupStats,
    RankProc,
    RestartPolicy,
    free_port_pair,
    log_tail,
)
from . import placement as placement_mod
from .children import reap
from .placement import describe as describe_placement
from .placement import GroupDevices, parse_gpus, place_groups, sharing_notes, visible_gpus
from .progress import RunProgress
from .worker import PERSISTENT_FAILURE_EXIT
from .standby import StandbyPool

__all__ = [
    "CHAOS_MODES",
    "ChaosConfig",
    "ChildEnv",
    "Group",
    "GroupState",
    "GroupStats",
    "RankProc",
    "RestartPolicy",
    "RunLimits",
    "Supervisor",
    "build_command",
    "build_parser",
    "free_port_pair",
    "main",
]

logger = logging.getLogger("ft.launch")

# How long the supervisor sleeps between looks at its children: a dead rank, a due restart or
# a chaos tick waits at most this long, and 20 looks a second cost next to nothing.
LOOP_INTERVAL_S = 0.05

# A script that knows FT_MAX_STEPS stops by itself; the launcher asks for a stop only once every
# group is this many steps past it, so it never races a script's own stop phase.
MAX_STEPS_SLACK = 5

# At the end of the run nothing else waits on the supervisor, so it gives the ranks it SIGKILLed
# longer than during the run (group.KILL_REAP_WAIT_S) before it warns that one is stuck.
FINAL_KILL_REAP_WAIT_S = 10.0

# After SIGUSR2 at --timeout, how long the ranks get to write their stacks (faulthandler writes
# a few dozen threads' stacks to the log in well under a second) before SIGTERM.
STACK_DUMP_WAIT_S = 1.0

# A rank's output reader ends at the end of its pipe, right after the rank is reaped; a
# grandchild that inherited the pipe may keep it open, and is not waited for longer than this.
READER_JOIN_WAIT_S = 2.0

# Ranks a kill during the run could not reap (group.KILL_REAP_WAIT_S) get this much longer at
# the end before the launcher names them in a warning.
STRAGGLER_REAP_WAIT_S = 5.0


def build_command(cmd: Sequence[str], no_python: bool) -> List[str]:
    """The argv of a rank: ``.py`` files and ``-m module`` run under this Python unless
    ``no_python``."""
    command = list(cmd)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no training command given (put it after --)")
    if no_python:
        return command
    if command[0] == "-m" or command[0].endswith(".py"):
        return [sys.executable, "-u"] + command
    return command


@dataclasses.dataclass(frozen=True)
class RunLimits:
    """When the run ends, and how hard the launcher pushes when it must end it."""

    duration: Optional[float] = None
    """Seconds after which the run is asked to stop (``--duration``); None: no limit."""
    max_steps: Optional[int] = None
    """Steps to train (``--max-steps``); the run is asked to stop if a script ignores it."""
    timeout: Optional[float] = None
    """Hard limit in seconds: everything is terminated after it (``--timeout``), once the ranks
    have written their stacks to their logs (``ft.launch.worker``, SIGUSR2)."""
    stop_grace: float = 60.0
    """Seconds the groups get to finish after a stop request (``--stop-grace``)."""
    kill_grace: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the launcher terminates (``--kill-grace``)."""


class Supervisor:
    """Runs the replica groups of one ``ft-launch`` invocation to their end.

    Contract:
    * :meth:`run` starts the lighthouse (unless ``--lighthouse``) and every group, then loops:
      progress records in, failed groups restarted by the :class:`RestartPolicy`, standbys kept
      ready, chaos injected, stop conditions checked, status shown.
    * It returns the exit status: 0 when every group finished and the reported hashes agree, 1
      otherwise, 130 after an interrupt (SIGINT or SIGTERM; a second one skips the grace).
    * Before it returns, every child it started is reaped (or named in a warning), the
      in-process lighthouse is shut down, and the summary is printed (and written to
      ``--summary-json``).
    """

    def __init__(self, args: argparse.Namespace, command: List[str], out: TextIO = sys.stdout):
        self.args = args
        self.command = command
        self.display = Display(
            out, tty=out.isatty() and not args.no_tty, status_every=args.status_every
        )
        self.say = self.display.say
        # RunLimits' fields are the flags' names.
        self.limits = RunLimits(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(RunLimits)}
        )
        self.duration_deadline = Deadline.after(args.duration)
        self.hard_deadline = Deadline.after(args.timeout)
        self.stop_deadline: Optional[Deadline] = None  # set by the stop request: its grace
        self.stop_reason = ""
        self.terminating = False
        self.interrupted = 0  # SIGINT/SIGTERM received
        self._interrupts_handled = 0

        self.log_dir = args.log_dir or tempfile.mkdtemp(prefix="ft-launch-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.stop_file = os.path.join(self.log_dir, "STOP")
        if os.path.exists(self.stop_file):
            os.unlink(self.stop_file)
        self.lighthouse = None
        self.env = ChildEnv(
            self.stop_file,
            self.log_dir,
            num_groups=args.replicas,
            max_steps=args.max_steps,
            lighthouse=args.lighthouse or "",
        )

        self.placement = resolve_placement(args)
        self.groups = [
            Group(gid, args.ranks_per_group, devices=self.placement[gid].devices)
            for gid in range(args.replicas)
        ]
        self.standbys = StandbyPool(
            None if args.no_standby else standby.runnable_argv(command),
            size=args.ranks_per_group,
            env=self.env.common,
            say=self.say,
        )
        self.spawner = GroupSpawner(
            command, self.log_dir, self.env, self.standbys, tee=args.tee, clock=self.display.elapsed
        )
        self.restart_policy = RestartPolicy(
            restart_delay=args.restart_delay,
            max_restarts=args.max_restarts,
            max_crashes=args.max_crashes,
        )
        self.restart_log: List[Dict[str, Any]] = []
        self.progress = RunProgress(self.say, self.display.elapsed, verbose=args.verbose)
        self.chaos = ChaosInjector(
            ChaosConfig(
                mode=args.chaos,
                every=args.every,
                stop_seconds=args.stop_seconds,
                stop_action=args.stop_action,
                seed=args.seed,
            ),
            self.say,
            self.display.elapsed,
        )

    @property
    def stop_requested(self) -> bool:
        return self.stop_deadline is not None

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            self._start()
            while True:
                self.handle_events()
                self.check_groups()
                self._refill_standbys()
                if self.chaos.tick(
                    self.groups,
                    self.progress.max_step,
                    stopping=self.progress.finishing or self.stop_requested,
                ):
                    self.progress.chaos_injected()
                if all(group.state.finished for group in self.groups) or self._check_limits():
                    break
                self.display.render(self.groups, self.progress.quorum_number)
                self.hard_deadline.sleep(LOOP_INTERVAL_S)
            self.handle_events()
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self.summary()

    def _start(self) -> None:
        args = self.args
        self.say(f"logs in {self.log_dir}")
        self.start_lighthouse()
        self.say(
            f"{args.replicas} replica group(s) x {args.ranks_per_group} rank(s): "
            f"{' '.join(self.command)}"
            + (f"; chaos {args.chaos} every {args.every:g}s" if args.chaos else "")
            + f"; {describe_placement(self.placement)}"
        )
        for note in sharing_notes(self.placement, args.ranks_per_group):
            self.say(f"warning: {note}")
        for group in self.groups:
            self.start_group(group)

    def _check_limits(self) -> bool:
        """Acts on interrupts and the run's limits; returns True once everything was terminated."""
        limits = self.limits
        if self.interrupted > self._interrupts_handled:
            self._interrupts_handled = self.interrupted
            if self._interrupts_handled == 1:
                self.request_stop("interrupted")
            else:
                self.terminate_all("interrupted again")
                return True
        if self.duration_deadline.expired:
            self.request_stop(f"--duration {limits.duration:g}s reached")
        if (
            limits.max_steps is not None
            and not self.stop_requested
            and self._all_live_reached(limits.max_steps)
        ):
            self.request_stop(f"--max-steps {limits.max_steps} reached")
        if self.stop_deadline is not None and self.stop_deadline.expired:
            self.terminate_all("stop grace expired")
            return True
        if self.hard_deadline.expired:
            self.dump_stacks(f"--timeout {limits.timeout:g}s reached")
            self.terminate_all(f"--timeout {limits.timeout:g}s reached")
            return True
        return False

    def _all_live_reached(self, max_steps: int) -> bool:
        live = [group for group in self.groups if group.state == GroupState.RUNNING]
        if any(group.final for group in live):
            return False  # the workers handle their stop phase themselves
        return bool(live) and all(
            isinstance(group.step, int) and group.step >= max_steps + MAX_STEPS_SLACK
            for group in live
        )

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.interrupted += 1

    # -- parts of a tick ------------------------------------------------------------------------

    def start_lighthouse(self) -> None:
        if self.env.lighthouse:
            self.say(f"using lighthouse {self.env.lighthouse}")
            return
        from ft.coordination import LighthouseServer
        from ft.coordination.cli import QUORUM_TIMING_OPTIONS, options_named

        args = self.args
        self.lighthouse = LighthouseServer(
            args.lighthouse_bind, **options_named(args, QUORUM_TIMING_OPTIONS)
        )
        self.env.lighthouse = self.lighthouse.address()
        dashboard = self.lighthouse.dashboard_address()
        self.say(
            f"lighthouse {self.env.lighthouse} (dashboard {dashboard}), min_replicas="
            f"{args.min_replicas}, heartbeat_timeout_ms={args.heartbeat_timeout_ms}, "
            f"join_timeout_ms={args.join_timeout_ms}"
        )

    def start_group(self, group: Group) -> None:
        warm = self.spawner.start(group)
        pids = ",".join(str(rank_proc.pid) for rank_proc in group.ranks)
        self.say(
            f"group {group.gid}: started try {group.attempt} ({group.world_size} rank(s), "
            f"pids {pids}, MASTER_PORT {group.master_port}"
            + (f", {warm} from warm standbys" if warm else "")
            + ")"
        )

    def _refill_standbys(self) -> None:
        if not (self.terminating or self.progress.finishing):
            self.standbys.refill(everyone_trains=all(group.trains() for group in self.groups))

    def handle_events(self) -> None:
        while not self.spawner.events.empty():
            event = self.spawner.events.get_nowait()
            if event.line is not None:
                self.display.echo(f"[g{event.gid}r{event.rank}] {event.line}")
            elif event.record is not None:
                self.progress.apply(self.groups[event.gid], event.attempt, event.rank, event.record)

    def check_groups(self) -> None:
        """Restarts groups whose delay is over; notices finished and failed attempts."""
        for group in self.groups:
            if group.state == GroupState.RESTARTING and group.restart_at.expired:
                self._restart(group)
            elif group.state == GroupState.RUNNING:
                exit_codes = [rank_proc.proc.poll() for rank_proc in group.ranks]
                if all(code == 0 for code in exit_codes):
                    group.state = GroupState.DONE
                    self.say(f"group {group.gid}: finished (try {group.attempt})")
                    continue
                failed = [
                    (rank_proc, code)
                    for rank_proc, code in zip(group.ranks, exit_codes)
                    if code is not None and code != 0
                ]
                if failed:
                    self._attempt_failed(group, *failed[0])

    def _restart(self, group: Group) -> None:
        if self._others_all_finished(group):
            group.state = GroupState.FAILED
            group.exit_info += "; not restarted: every other group has finished"
            self.say(f"group {group.gid}: not restarted, every other group has finished")
            return
        group.stats.restarts += 1
        self.restart_log.append({"group": group.gid, "time": self.display.elapsed()})
        self.start_group(group)

    def _attempt_failed(self, group: Group, culprit: RankProc, exit_code: int) -> None:
        """Kills the rest of the attempt, then restarts the group later or gives it up."""
        how = (
            f"killed by {signal.Signals(-exit_code).name}"
            if exit_code < 0
            else f"exit status {exit_code}"
        )
        alive = [rank_proc for rank_proc in group.ranks if rank_proc.alive()]
        self.say(
            f"group {group.gid}: rank {culprit.rank} (pid {culprit.pid}) {how}"
            + (f"; killing its {len(alive)} other rank(s)" if alive else "")
        )
        if exit_code > 0:
            tail = log_tail(culprit.log_path)
            if tail:
                self.display.echo(tail)
        self.spawner.kill(alive)
        group.exit_info = f"try {group.attempt}: rank {culprit.rank} {how}"
        group.stats.count_failure(exit_code, group.progressing)
        if exit_code == PERSISTENT_FAILURE_EXIT and group.stats.gave_up is None:
            group.stats.gave_up = group.last_error or "(see the rank's log)"
        give_up = self.restart_policy.give_up(group.stats)
        if self.terminating or self.stop_requested and self._others_all_finished(group):
            group.state = GroupState.FAILED
        elif give_up is not None:
            group.state = GroupState.FAILED
            crashing = group.stats.crashes_in_a_row >= self.restart_policy.max_crashes
            self.say(
                f"group {group.gid}: {give_up}" + (f" (see {culprit.log_path})" if crashing else "")
            )
        else:
            delay = self.restart_policy.delay(group.stats)
            group.state = GroupState.RESTARTING
            group.restart_at = Deadline.after(delay)
            self.say(f"group {group.gid}: restarting in {delay:.1f}s")

    def _others_all_finished(self, group: Group) -> bool:
        others = [other for other in self.groups if other is not group]
        return (
            bool(others)
            and all(other.state.finished for other in others)
            and any(other.state == GroupState.DONE for other in others)
        )

    # -- stopping -------------------------------------------------------------------------------

    def request_stop(self, reason: str) -> None:
        """Asks the workers to finish (the stop file); they get --stop-grace seconds."""
        if self.stop_requested:
            return
        self.stop_deadline = Deadline.after(self.limits.stop_grace)
        self.stop_reason = reason
        self.progress.finish()
        self.standbys.close()
        with open(self.stop_file, "w") as stop_file:
            stop_file.write(reason + "\n")
        self.say(
            f"stop requested ({reason}); waiting up to {self.limits.stop_grace:.0f}s for the "
            "groups to finish"
        )

    def dump_stacks(self, why: str) -> None:
        """SIGUSR2 to every live rank (a worker using ft.launch.worker writes every thread's
        stack to its log; one that does not handle it ends), then a moment for them to write."""
        live = [
            rank_proc for group in self.groups for rank_proc in group.ranks if rank_proc.alive()
        ]
        if not live:
            return
        for rank_proc in live:
            rank_proc.signal(signal.SIGCONT)  # a stopped process writes nothing
            rank_proc.signal(signal.SIGUSR2)
        self.say(f"{why}: stacks of {len(live)} process(es) asked for (SIGUSR2, in their logs)")
        Deadline.after(STACK_DUMP_WAIT_S).sleep()

    def terminate_all(self, why: str) -> None:
        """SIGTERM every live child, then SIGKILL after --kill-grace; reap them all."""
        self.terminating = True
        live = [
            rank_proc for group in self.groups for rank_proc in group.ranks if rank_proc.alive()
        ]
        if live:
            self.say(f"{why}: SIGTERM to {len(live)} process(es)")
        for rank_proc in live:
            rank_proc.signal(signal.SIGCONT)
            rank_proc.signal(signal.SIGTERM)
        reap([rank_proc.proc for rank_proc in live], Deadline.after(self.limits.kill_grace))
        stubborn = [rank_proc for rank_proc in live if rank_proc.alive()]
        if stubborn:
            self.say(f"SIGKILL to {len(stubborn)} process(es) still alive")
            self.spawner.kill(stubborn, signal.SIGKILL, wait_s=FINAL_KILL_REAP_WAIT_S)
        for group in self.groups:
            if not group.state.finished:
                ok = bool(group.ranks) and all(
                    rank_proc.proc.returncode == 0 for rank_proc in group.ranks
                )
                group.state = GroupState.DONE if ok else GroupState.FAILED
                if not ok:
                    group.exit_info = f"try {group.attempt}: stopped by the launcher ({why})"

    def shutdown(self) -> None:
        """Ends standbys and ranks, reaps every child, stops the lighthouse."""
        self.standbys.close()
        if any(rank_proc.alive() for group in self.groups for rank_proc in group.ranks):
            self.terminate_all("shutting down")
        readers = Deadline.after(READER_JOIN_WAIT_S)
        for group in self.groups:
            for rank_proc in group.ranks:
                if rank_proc.reader is not None:
                    rank_proc.reader.join(timeout=readers.remaining())
        for rank_proc in self.spawner.reap_stragglers(STRAGGLER_REAP_WAIT_S):
            self.say(f"warning: pid {rank_proc.pid} could not be reaped")
        self.handle_events()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
            self.lighthouse = None
        if self.display.tty:
            self.display.render(self.groups, self.progress.quorum_number, force=True)
            self.display.leave_table()

    def summary(self) -> int:
        """Prints the summary (and writes --summary-json); returns the exit status."""
        outcome = RunOutcome(
            elapsed=self.display.elapsed(),
            groups=self.groups,
            chaos_mode=self.args.chaos,
            chaos_log=self.chaos.log,
            restart_log=self.restart_log,
            quorum_ids=self.progress.quorum_ids,
            commits_after_last_chaos=self.progress.commits_after_last_chaos,
            max_step=self.progress.max_step,
            stop_reason=self.stop_reason,
            log_dir=self.log_dir,
            standby_pids=self.standbys.pids,
            warm_starts=self.standbys.activated,
        )
        write_summary(outcome, self.display.out)
        if self.args.summary_json:
            with open(self.args.summary_json, "w") as summary_file:
                json.dump(outcome.to_json(), summary_file, indent=2)
        if self.interrupted:
            return 130
        return 0 if outcome.succeeded else 1


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ft-launch",
        usage="ft-launch [options] -- SCRIPT.py [script args]",
        description="Run N fault-tolerant replica groups locally, restart the ones that die, "
        "optionally inject failures, and show live progress.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--replicas", "--nreplicas", type=int, default=3, help="replica groups")
    parser.add_argument(
        "--ranks-per-group",
        "--nproc-per-group",
        type=int,
        default=1,
        help="ranks (processes) per replica group",
    )
    parser.add_argument(
        "--gpus",
        type=_gpus_arg,
        default=None,
        help="GPUs to place the groups on, as CUDA_VISIBLE_DEVICES lists them (0,1,3 or "
        "UUIDs), or 'none' for CPU only (default: every GPU the launcher sees)",
    )
    parser.add_argument(
        "--gpus-per-group",
        type=int,
        default=None,
        help="GPUs in each group's slice (exported as its CUDA_VISIBLE_DEVICES; default: the "
        "GPUs split evenly over the groups, groups sharing when there are fewer GPUs than groups)",
    )
    parser.add_argument("--chaos", choices=CHAOS_MODES, default=None, help="failure to inject")
    parser.add_argument(
        "--every", type=float, default=5.0, help="seconds between injected failures"
    )
    parser.add_argument(
        "--stop-seconds",
        type=float,
        default=4.0,
        help="--chaos stop: how long a rank stays SIGSTOPped",
    )
    parser.add_argument(
        "--stop-action",
        choices=STOP_ACTIONS,
        default="cont",
        help="--chaos stop: SIGCONT the rank afterwards, or SIGKILL it",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the chaos choices")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="steps to train (exported as FT_MAX_STEPS; the run is stopped if a script ignores it)",
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds after which the run is asked to stop"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help=(
            "hard limit in seconds: terminate everything after it (ranks that use "
            "ft.launch.worker first write every thread's stack to their logs)"
        ),
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=60.0,
        help="seconds the groups get to finish after a stop request",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=5.0,
        help="seconds between SIGTERM and SIGKILL at shutdown",
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=0.5,
        help="seconds before a failed group is restarted",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        help="restarts per group before giving up (default: unlimited)",
    )
    parser.add_argument(
        "--max-crashes",
        type=int,
        default=3,
        help="give a group up after this many tries in a row fail before any step",
    )
    parser.add_argument(
        "--lighthouse",
        default=None,
        help="address of a running lighthouse (default: start one in-process)",
    )
    parser.add_argument(
        "--lighthouse-bind", default="127.0.0.1:0", help="bind of the in-process lighthouse"
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="lighthouse min_replicas")
    parser.add_argument(
        "--join-timeout-ms", type=int, default=1000, help="lighthouse join_timeout_ms"
    )
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="lighthouse quorum_tick_ms")
    parser.add_argument(
        "--heartbeat-timeout-ms", type=int, default=2000, help="lighthouse heartbeat_timeout_ms"
    )
    parser.add_argument("--log-dir", default=None, help="per-rank logs (default: a new temp dir)")
    parser.add_argument("--summary-json", default=None, help="write the summary as JSON here")
    parser.add_argument(
        "--status-every",
        type=float,
        default=5.0,
        help="seconds between status lines when stdout is not a terminal",
    )
    parser.add_argument(
        "--no-tty", action="store_true", help="plain status lines even on a terminal"
    )
    parser.add_argument("--tee", action="store_true", help="echo the workers' other output")
    parser.add_argument(
        "--no-standby",
        action="store_true",
        help="restart groups with newly exec'd processes instead of warm standbys "
        "(processes that imported torch and ft ahead of time)",
    )
    parser.add_argument(
        "--no-python",
        action="store_true",
        help="run the command as is (default: .py files and -m run under this Python)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="more launcher and lighthouse logs"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT.py [args]")
    return parser


def resolve_placement(args: argparse.Namespace) -> List[GroupDevices]:
    """Each group's GPUs: ``--gpus`` (else the GPUs this process sees) split by
    ``--gpus-per-group``. Raises ValueError for a slice larger than the GPUs there are."""
    gpus = args.gpus
    if gpus is None:
        gpus = visible_gpus(os.environ, placement_mod.nvml_gpu_count)
    return place_groups(gpus, args.replicas, args.gpus_per_group)


def _gpus_arg(text: str) -> List[str]:
    try:
        return parse_gpus(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
        resolve_placement(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        command = build_command(args.command, args.no_python)
    except ValueError as error:
        parser.error(str(error))
    if (
        not args.no_python
        and command[0] == sys.executable
        and command[2].endswith(".py")
        and not os.path.exists(command[2])
    ):
        parser.error(f"script not found: {command[2]}")
    if args.no_python and shutil.which(command[0]) is None and not os.path.exists(command[0]):
        parser.error(f"command not found: {command[0]}")
    return Supervisor(args, command).run()


if __name__ == "__main__":
    sys.exit(main())
