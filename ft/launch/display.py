"""What ``ft-launch`` prints: timestamped messages, the live status of the groups, the summary.

Contract:
* :meth:`Display.say` prints one line ``[ft-launch   12.3s] message``, the time counted from
  the display's creation (the start of the run).
* On a terminal, :meth:`Display.render` keeps one table of the groups (:func:`table_lines`)
  below the messages, redrawn in place at most every :data:`TTY_REFRESH_S`; anything printed
  erases it first and the next render draws it again. Elsewhere (a pipe, a file, ``--no-tty``)
  it prints one :func:`status_line` every ``status_every`` seconds.
* :func:`write_summary` prints the end-of-run report of a :class:`RunOutcome`, and
  :meth:`RunOutcome.to_json` is the same report for ``--summary-json``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

from ft.utils.deadline import Deadline

from .group import Group, GroupState

# A terminal table redrawn more often than four times a second flickers and costs the
# launcher's CPU (which the ranks share) for changes no one can read.
TTY_REFRESH_S = 0.25

QuorumNumber = Callable[[Any], Optional[int]]


def fmt_num(value: Any, fmt: str, missing: str = "-") -> str:
    """``value`` formatted by ``fmt``; ``missing`` for None, ``str(value)`` when it does not fit."""
    if value is None:
        return missing
    try:
        return format(value, fmt)
    except (TypeError, ValueError):
        return str(value)


def _tty_state(group: Group) -> str:
    if group.state != GroupState.RUNNING:
        return group.state.value
    if group.any_stopped():
        return "STOPPED"
    if group.final:
        return "finishing"
    return "running" if group.progressing else "starting"


def _plain_state(group: Group) -> str:
    if group.any_stopped():
        return "STOP"
    if group.state != GroupState.RUNNING:
        return group.state.value
    return "run" if group.progressing else "start"


# A failing group's cause, cut to what one table row or status entry has room for; the full
# line is announced once when it first appears.
CAUSE_CHARS = 60


def _short(text: str) -> str:
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."


def _devices(group: Group) -> str:
    return ",".join(group.devices) if group.devices else "cpu"


def table_lines(groups: Sequence[Group], quorum_number: QuorumNumber) -> List[str]:
    """The terminal table: a header and one row per group."""
    rows = [
        f"{'group':>5} {'state':<10} {'try':>3} {'step':>6} {'loss':>8} {'part':>4} "
        f"{'quorum':>6} {'qchg':>4} {'heals':>5} {'fails':>5} {'restarts':>8} gpus"
    ]
    for group in groups:
        stats = group.stats
        rows.append(
            f"{group.gid:>5} {_tty_state(group):<10} {group.attempt:>3} "
            f"{fmt_num(group.step, 'd'):>6} {fmt_num(group.loss, '.4f'):>8} "
            f"{fmt_num(group.participants, 'd'):>4} "
            f"{fmt_num(quorum_number(group.quorum_id), 'd'):>6} {stats.quorum_changes:>4} "
            f"{stats.heals:>5} {stats.uncommitted:>5} {stats.restarts:>8} "
            f"{_devices(group)}" + (f"  failing: {_short(group.failing)}" if group.failing else "")
        )
    return rows


def status_line(groups: Sequence[Group], quorum_number: QuorumNumber) -> str:
    """One line of every group's state, for logs."""
    parts = []
    for group in groups:
        parts.append(
            f"g{group.gid}[{_plain_state(group)} step={fmt_num(group.step, 'd')} "
            f"loss={fmt_num(group.loss, '.3f')} part={fmt_num(group.participants, 'd')} "
            f"q=#{fmt_num(quorum_number(group.quorum_id), 'd')}"
            + (f" gpu={_devices(group)}" if group.devices else "")
            + (f" failing={_short(group.failing)!r}" if group.failing else "")
            + "]"
        )
    return "status " + " ".join(parts)


class Display:
    """The launcher's output stream (see the module's contract)."""

    def __init__(self, out: TextIO, tty: bool, status_every: float) -> None:
        self.out = out
        self.tty = tty
        self.status_every = status_every
        self.started = time.monotonic()
        self._table_lines = 0  # lines of the table now on screen, below the cursor's line
        self._next_render = Deadline.after(0)

    def elapsed(self) -> float:
        """Seconds since the start of the run."""
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        self.echo(f"[ft-launch {self.elapsed():6.1f}s] {message}")

    def echo(self, text: str) -> None:
        """Prints ``text`` as is (a log tail, a worker's line)."""
        self._clear_table()
        print(text, file=self.out, flush=True)

    def _clear_table(self) -> None:
        if self._table_lines:
            self.out.write(f"\x1b[{self._table_lines}F\x1b[J")
            self._table_lines = 0

    def render(
        self, groups: Sequence[Group], quorum_number: QuorumNumber, force: bool = False
    ) -> None:
        """Shows the groups now if ``force`` or the last showing is old enough."""
        if not force and not self._next_render.expired:
            return
        self._next_render = Deadline.after(TTY_REFRESH_S if self.tty else self.status_every)
        if not self.tty:
            self.say(status_line(groups, quorum_number))
            return
        self._clear_table()
        lines = table_lines(groups, quorum_number)
        self.out.write("\n".join(lines) + "\n")
        self.out.flush()
        self._table_lines = len(lines)

    def leave_table(self) -> None:
        """Keeps the table now on screen: what is printed next goes below it."""
        self._table_lines = 0


# ---------------------------------------------------------------------------------------------
# summary


@dataclasses.dataclass
class RunOutcome:
    """Everything the end-of-run summary reports."""

    elapsed: float
    """Seconds the run took."""
    groups: Sequence[Group]
    chaos_mode: Optional[str]
    """``--chaos``, None without it."""
    chaos_log: List[Dict[str, Any]]
    """One record per injected failure (:class:`ft.launch.chaos.ChaosInjector`)."""
    restart_log: List[Dict[str, Any]]
    """One record per restart: group, time."""
    quorum_ids: Dict[Any, int]
    """Every quorum id reported, in order of appearance."""
    commits_after_last_chaos: int
    max_step: int
    """The highest training step any group reported."""
    stop_reason: str
    log_dir: str
    standby_pids: List[int]
    warm_starts: int
    """Ranks started from warm standbys."""

    def hashes(self) -> Dict[Tuple[int, int], str]:
        """(group, rank) -> the state hash that rank reported at its end."""
        return {
            (group.gid, rank): record["hash"]
            for group in self.groups
            for rank, record in group.done.items()
            if record.get("hash")
        }

    @property
    def all_done(self) -> bool:
        return all(group.state == GroupState.DONE for group in self.groups)

    @property
    def identical(self) -> bool:
        """Every rank of every group reported, and all the same hash."""
        hashes = self.hashes()
        expected = sum(group.world_size for group in self.groups)
        return len(set(hashes.values())) == 1 and len(hashes) == expected

    @property
    def succeeded(self) -> bool:
        """Every group finished, and no two reported hashes differ."""
        return self.all_done and (self.identical or not self.hashes())

    def steps_after_last_chaos(self) -> Optional[int]:
        if not self.chaos_log:
            return None
        return self.max_step - self.chaos_log[-1]["max_step"]

    def to_json(self) -> Dict[str, Any]:
        return {
            "elapsed_s": self.elapsed,
            "groups": [_group_json(group) for group in self.groups],
            "chaos": self.chaos_log,
            "restarts": self.restart_log,
            "quorum_ids": list(self.quorum_ids),
            "commits_after_last_chaos": self.commits_after_last_chaos,
            "steps_after_last_chaos": self.steps_after_last_chaos(),
            "max_step": self.max_step,
            "hashes": {
                f"{gid}/{rank}": digest for (gid, rank), digest in sorted(self.hashes().items())
            },
            "identical": self.identical,
            "all_done": self.all_done,
            "stop_reason": self.stop_reason,
            "log_dir": self.log_dir,
            "standby_pids": self.standby_pids,
            "warm_starts": self.warm_starts,
        }


def _group_json(group: Group) -> Dict[str, Any]:
    stats = group.stats
    return {
        "group": group.gid,
        "state": group.state.value,
        "tries": group.attempt,
        "restarts": stats.restarts,
        "final_step": group.step,
        "heals": stats.heals,
        "quorum_changes": stats.quorum_changes,
        "uncommitted": stats.uncommitted,
        "steps_reported": stats.steps_reported,
        "accuracy": group.accuracy,
        "exit_info": group.exit_info,
        "start_times": group.start_times,
        "first_step_times": group.first_step_times,
        "done": {str(rank): record for rank, record in group.done.items()},
        "pids": group.pids,
        "devices": list(group.devices),
        "last_error": group.last_error,
    }


def write_summary(outcome: RunOutcome, out: TextIO) -> None:
    """The end-of-run report: a row per group, the chaos and its aftermath, the weights."""
    groups = outcome.groups
    print("", file=out)
    print(f"== ft-launch summary ({outcome.elapsed:.1f}s) ==", file=out)
    print(
        f"{'group':>5} {'result':<7} {'tries':>5} {'final step':>10} {'heals':>5} "
        f"{'qchg':>4} {'fails':>5} {'accuracy':>8}  hash",
        file=out,
    )
    for group in groups:
        digests = sorted(
            {record.get("hash", "")[:16] for record in group.done.values() if record.get("hash")}
        )
        accuracy = (
            f"{100 * group.accuracy:.1f}%" if isinstance(group.accuracy, (int, float)) else "-"
        )
        print(
            f"{group.gid:>5} {group.state.value:<7} {group.attempt:>5} "
            f"{fmt_num(group.step, 'd'):>10} {group.stats.heals:>5} "
            f"{group.stats.quorum_changes:>4} {group.stats.uncommitted:>5} {accuracy:>8}  "
            f"{','.join(digests) or '-'}",
            file=out,
        )
        if group.state != GroupState.DONE and group.exit_info:
            print(f"{'':>5} {group.exit_info}", file=out)
        if group.state != GroupState.DONE and group.last_error:
            print(f"{'':>5} last step error: {group.last_error}", file=out)
    injected = len(outcome.chaos_log)
    print(
        f"chaos: {injected} failure(s) injected"
        + (f" ({outcome.chaos_mode})" if outcome.chaos_mode else "")
        + f"; restarts: {sum(group.stats.restarts for group in groups)}"
        + (f" ({outcome.warm_starts} rank(s) from warm standbys)" if outcome.warm_starts else "")
        + f"; heals: {sum(group.stats.heals for group in groups)}"
        + f"; quorums: {len(outcome.quorum_ids)}"
        + f"; uncommitted steps: {sum(group.stats.uncommitted for group in groups)}",
        file=out,
    )
    if injected:
        last = outcome.chaos_log[-1]
        print(
            f"training went on: {outcome.steps_after_last_chaos()} step(s) committed after the "
            f"last injected failure (at {last['time']:.1f}s: step {last['max_step']} -> "
            f"{outcome.max_step})",
            file=out,
        )
    _write_weights(outcome, out)
    print(f"logs: {outcome.log_dir}", file=out)
    out.flush()


def _write_weights(outcome: RunOutcome, out: TextIO) -> None:
    hashes = outcome.hashes()
    distinct = sorted(set(hashes.values()))
    if outcome.identical:
        print(
            f"weights: all {len(outcome.groups)} replica group(s) ({len(hashes)} rank(s)) hold "
            f"identical model and optimizer state, sha256 {distinct[0]}",
            file=out,
        )
    elif hashes:
        expected = sum(group.world_size for group in outcome.groups)
        print(
            f"weights: MISMATCH, {len(distinct)} distinct hash(es) over {len(hashes)} of "
            f"{expected} rank(s):",
            file=out,
        )
        for (gid, rank), digest in sorted(hashes.items()):
            print(f"    group {gid} rank {rank}: {digest}", file=out)
    else:
        print("weights: no final hashes reported", file=out)
