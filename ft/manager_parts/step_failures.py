"""Bounded retries of a step that keeps failing the same way (docs/design.md, "Persistent
failures").

A failed step is retried by the next quorum, which is right for a transient fault (a peer died,
a connection broke). A persistent fault (a misconfiguration, tensors that differ across the
groups, a communicator the device refuses) fails every retry identically, and without a bound
the job re-forms quorums at tens per second forever. The rule here decides, from one step's
outcome and the streak before it, whether the Manager backs off before its next quorum and
whether it gives up. Pure: data in, decision out; no I/O, no clock, no threads. The Manager
draws the backoff delays from :func:`ft.utils.retry.backoff_delays` and raises
:class:`PersistentStepFailure`.

Imports nothing outside the standard library (``import ft`` loads neither torch nor this).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, FrozenSet, Mapping, Optional, Tuple

__all__ = [
    "PHASES",
    "MAX_CONSECUTIVE_FAILURES_ENV",
    "BACKOFF_AFTER_ENV",
    "BACKOFF_MAX_SEC_ENV",
    "StepFailurePolicy",
    "StepFailure",
    "FailureStreak",
    "StreakDecision",
    "next_streak",
    "normalize_message",
    "PersistentStepFailure",
]

# Where in a step an error arose. "user": the training code reported it (report_error,
# abort_step).
PHASES = ("quorum", "configure", "heal", "allreduce", "commit", "user")

MAX_CONSECUTIVE_FAILURES_ENV = "FT_MAX_CONSECUTIVE_FAILURES"
BACKOFF_AFTER_ENV = "FT_FAILURE_BACKOFF_AFTER"
BACKOFF_MAX_SEC_ENV = "FT_FAILURE_BACKOFF_MAX_SEC"

# One line of a failure, as logs and progress records show it.
ONE_LINE_CHARS = 200


@dataclass(frozen=True)
class StepFailurePolicy:
    """How the Manager treats identical consecutive failed steps."""

    backoff_after: int = 3
    """Identical consecutive failures after which the Manager waits before each next quorum
    (env ``FT_FAILURE_BACKOFF_AFTER``). Fewer are retried at once: a transient fault costs
    no wait."""
    max_consecutive_failures: int = 20
    """Identical consecutive failures at which ``should_commit`` raises
    :class:`PersistentStepFailure` (the Manager's ``max_consecutive_failures`` keyword, env
    ``FT_MAX_CONSECUTIVE_FAILURES``); 0: never (the backoff still applies)."""
    initial_backoff_s: float = 0.1
    """The first wait, in seconds; each later one doubles, up to ``max_backoff_s``."""
    max_backoff_s: float = 1.0
    """The longest wait, in seconds (env ``FT_FAILURE_BACKOFF_MAX_SEC``). Every group of a
    failing quorum backs off alike, and the waits are jittered by up to half: keep this
    below twice the lighthouse's join timeout, or a group that wakes first forms a quorum
    without the others, which reads as a membership change and restarts every streak."""

    def __post_init__(self) -> None:
        if self.backoff_after < 1:
            raise ValueError(f"backoff_after must be >= 1, got {self.backoff_after}")
        if self.max_consecutive_failures < 0:
            raise ValueError(
                f"max_consecutive_failures must be >= 0 (0: never raise), got "
                f"{self.max_consecutive_failures}"
            )
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"backoff must satisfy 0 < initial ({self.initial_backoff_s}) <= max "
                f"({self.max_backoff_s})"
            )

    @classmethod
    def from_settings(
        cls, max_consecutive_failures: Optional[int], env: Mapping[str, str]
    ) -> "StepFailurePolicy":
        """The policy from the Manager's keyword and the environment ``env``. A variable that
        is set wins over the keyword, as ``TORCHFT_*`` variables do over theirs; None and
        unset keep the default."""
        kw: dict = {}
        if max_consecutive_failures is not None:
            kw["max_consecutive_failures"] = int(max_consecutive_failures)
        for name, field, parse in (
            (MAX_CONSECUTIVE_FAILURES_ENV, "max_consecutive_failures", int),
            (BACKOFF_AFTER_ENV, "backoff_after", int),
            (BACKOFF_MAX_SEC_ENV, "max_backoff_s", float),
        ):
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                kw[field] = parse(raw)
            except ValueError:
                raise ValueError(
                    f"{name} must be {'an integer' if parse is int else 'a number'}, got {raw!r}"
                ) from None
        if "max_backoff_s" in kw:
            kw["initial_backoff_s"] = min(cls.initial_backoff_s, kw["max_backoff_s"])
        return cls(**kw)


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_NUMBER = re.compile(r"\d+")
_SPACE = re.compile(r"\s+")


def normalize_message(message: str) -> str:
    """``message`` without what differs between two occurrences of the same fault: numbers
    (generations, quorum ids, ports, sizes, addresses), hex values and uuids (replica ids)
    become placeholders, and runs of whitespace one space."""
    out = _UUID.sub("<id>", message)
    out = _HEX.sub("0x<n>", out)
    out = _NUMBER.sub("<n>", out)
    return _SPACE.sub(" ", out).strip()


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


@dataclass(frozen=True)
class StepFailure:
    """What failed one step: the phase, the error's type name and the first line of its
    message."""

    phase: str
    error_type: str
    message: str

    @classmethod
    def from_exception(cls, e: BaseException, phase: str) -> "StepFailure":
        """The failure ``e`` caused in ``phase``. An exception that wraps the one reported
        (the Manager's ExceptionWithTraceback) is read through its ``original_exception``:
        its own text carries a traceback."""
        original = getattr(e, "original_exception", None)
        if isinstance(original, BaseException):
            e = original
        return cls(phase=phase, error_type=type(e).__name__, message=_first_line(str(e)))

    @property
    def key(self) -> Tuple[str, str, str]:
        """Two failures with the same key are the same fault."""
        return (self.phase, self.error_type, normalize_message(self.message))

    @property
    def error(self) -> str:
        """``"{type}: {message}"`` (the message alone for a failure without an error type)."""
        return f"{self.error_type}: {self.message}" if self.error_type else self.message

    def one_line(self, limit: int = ONE_LINE_CHARS) -> str:
        """``"{phase}: {type}: {message}"``, cut to ``limit`` characters."""
        text = f"{self.phase}: {self.error}"
        return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class FailureStreak:
    """Consecutive failed steps with one fault and one membership (``count`` 0: none)."""

    count: int = 0
    failure: Optional[StepFailure] = None
    """The fault the streak repeats; None for steps short of replicas (no fault)."""
    members: FrozenSet[str] = frozenset()
    """The replica ids of the quorum the failures happened in."""


@dataclass(frozen=True)
class StreakDecision:
    """What the Manager does after one step."""

    streak: FailureStreak
    """The streak after this step."""
    backoff_attempt: Optional[int]
    """None: the next quorum starts at once. Otherwise the Manager waits before it, for the
    ``backoff_attempt``-th (from 0) delay of this streak's exponential backoff."""
    give_up: bool
    """``should_commit`` raises :class:`PersistentStepFailure`."""


def next_streak(
    policy: StepFailurePolicy,
    streak: FailureStreak,
    *,
    committed: bool,
    failure: Optional[StepFailure],
    members: FrozenSet[str],
) -> StreakDecision:
    """The rule (docs/design.md, "Persistent failures").

    * A committed step ends the streak.
    * A failure with the fault (phase, error type, normalized message) and the members of the
      streak's last one extends it; any other failure starts a new streak of 1: a
      membership change (a replica left, died, or joined) is a new situation, worth a
      retry at once.
    * A step that failed without an error (``failure`` None: too few replicas for
      ``min_replica_size``) is a streak of its own kind, extended by the next such step with
      the same members. Waiting for a replica to come back cures it, so it never gives up;
      it backs off like any other, so that groups short of replicas do not re-form the same
      quorum as fast as they can.
    * From ``backoff_after`` failures on, the Manager backs off before the next quorum; at
      ``max_consecutive_failures`` (when not 0) it gives up.
    """
    if committed:
        return StreakDecision(FailureStreak(), backoff_attempt=None, give_up=False)
    if failure is None:
        same = streak.count > 0 and streak.failure is None and streak.members == members
    else:
        same = (
            streak.count > 0
            and streak.failure is not None
            and streak.failure.key == failure.key
            and streak.members == members
        )
    count = streak.count + 1 if same else 1
    new = FailureStreak(count=count, failure=failure, members=frozenset(members))
    backoff = count - policy.backoff_after if count >= policy.backoff_after else None
    give_up = (
        failure is not None
        and policy.max_consecutive_failures > 0
        and count >= policy.max_consecutive_failures
    )
    return StreakDecision(new, backoff_attempt=backoff, give_up=give_up)


class PersistentStepFailure(RuntimeError):
    """Raised by ``Manager.should_commit`` when ``max_consecutive_failures`` consecutive steps
    failed with the same error while the quorum's members stayed the same: retrying will not
    help, and the cause (named in the message) needs fixing.

    Attributes: ``phase`` and ``error`` (``"Type: message"``) of the last failure,
    ``count`` (consecutive failures) and ``bound`` (the setting that was reached).
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str = "",
        error: str = "",
        count: int = 0,
        bound: int = 0,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.error = error
        self.count = count
        self.bound = bound

    @classmethod
    def of(cls, streak: FailureStreak, policy: StepFailurePolicy, step: int) -> Any:
        """The exception for a streak that reached ``policy.max_consecutive_failures``."""
        failure = streak.failure
        assert failure is not None
        error = failure.error
        return cls(
            f"step {step} failed {streak.count} times in a row in phase {failure.phase} with "
            f"the same error while the quorum's {len(streak.members)} members stayed the same: "
            f"{error} -- a persistent fault, not retried further (max_consecutive_failures="
            f"{policy.max_consecutive_failures}, env {MAX_CONSECUTIVE_FAILURES_ENV}; 0 never "
            f"gives up)",
            phase=failure.phase,
            error=error,
            count=streak.count,
            bound=policy.max_consecutive_failures,
        )
