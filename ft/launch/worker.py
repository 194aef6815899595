"""Worker side of the ``ft-launch`` protocol (usable with or without the launcher).

* Progress: :func:`emit` prints one line ``@ft-progress {json}`` on stdout. The launcher parses
  these lines (:func:`parse_progress`) for its live display and summary; everything else a worker
  prints goes to its log file. Records carry ``event`` plus the worker's ``group`` and ``rank``.
  Events the launcher understands:

  ``start``   the worker is up (``attempt``, ``device``)
  ``step``    one step ended: ``step`` (manager step after it), ``loss``, ``participants``,
              ``quorum_id``, ``committed`` (bool), optional ``healed_from_step`` and ``injected``;
              a step that did not commit also has ``error``: why, in one short line
              (``"{phase}: {Type}: {message}"``, e.g. ``"allreduce: DistBackendError: ..."``)
  ``heal``    this worker loaded a peer's live state: ``from_step``, ``to_step``
  ``final``   the worker entered its stop phase (``step``)
  ``gave_up`` the worker's Manager gave up on a persistent fault (``error``); the worker then
              exits with ``PERSISTENT_FAILURE_EXIT`` and is not restarted
  ``done``    the worker finished: ``step``, ``hash`` (sha256 of model + optimizer state),
              optional ``accuracy``, ``loss``

* Stop: :func:`stop_requested` is true once the launcher asks the run to end (it creates the file
  named by ``FT_LAUNCH_STOP_FILE``, e.g. at ``--duration``).
* Chaos: :func:`install_chaos_handlers` makes SIGUSR1 mean "fail your next allreduce";
  the training loop asks :func:`take_injected_allreduce_failure` once per step and, when true,
  makes that step's allreduce fail for real (``examples/train_ddp.py`` aborts its process group).
  It also exits the worker if the launcher that started it disappears, and makes SIGUSR2 write
  every thread's Python stack to stderr (the worker's log): the launcher asks for that before it
  ends a run at ``--timeout``, so that a hang leaves a trace of where each rank was.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, NoReturn, Optional

PROGRESS_PREFIX = "@ft-progress "

# The longest ``error`` a step record carries: a status line has room for one short cause.
ERROR_CHARS = 200

# How often a worker checks that its launcher is still there. An orphaned worker trains on alone
# for at most this long, and a check (one getppid) per second costs nothing.
PARENT_POLL_S = 1.0

_injected = threading.Event()
_installed = False


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def emit(event: str, **fields: Any) -> None:
    """Prints one progress record for the launcher (cheap; safe without a launcher)."""
    record: Dict[str, Any] = {
        "event": event,
        "group": _env_int("REPLICA_GROUP_ID", 0),
        "rank": _env_int("RANK", 0),
        "time": round(time.time(), 3),
    }
    record.update(fields)
    line = PROGRESS_PREFIX + json.dumps(record, separators=(",", ":"), default=str)
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # launcher gone / stdout closed
        pass


def step_error(manager: Any) -> Optional[str]:
    """Why the step ``manager`` has just ended did not commit, in one line of at most
    ``ERROR_CHARS`` characters, or None. An ``ft.Manager`` keeps that line from its vote
    (phase, error type, message: docs/design.md, "Persistent failures"), its
    ``last_step_error()``; for another Manager-like object it is the first line of
    ``errored()``."""
    last = getattr(manager, "last_step_error", None)
    line = last() if callable(last) else None
    if not isinstance(line, str):
        errored = getattr(manager, "errored", None)
        err = errored() if callable(errored) else None
        if err is None:
            return None
        err = getattr(err, "original_exception", err)
        text = next((s.strip() for s in str(err).splitlines() if s.strip()), "")
        line = f"{type(err).__name__}: {text}" if text else type(err).__name__
    line = " ".join(line.split())  # one line, whatever the message held
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


def emit_step(manager: Any, *, loss: float, committed: bool, **fields: Any) -> None:
    """The ``step`` record of the step ``manager`` (an ``ft.Manager``) has just ended: its step
    count after it, the participants and quorum id it ran with, and ``fields``; when it did not
    commit, also ``error`` (:func:`step_error`), so the launcher can show why."""
    if not committed and "error" not in fields:
        error = step_error(manager)
        if error is not None:
            fields["error"] = error
    emit(
        "step",
        step=manager.current_step(),
        loss=round(loss, 5),
        participants=manager.num_participants(),
        quorum_id=manager.quorum_id(),
        committed=committed,
        **fields,
    )


# The exit status of a worker whose steps failed the same way until the Manager gave up
# (``ft.PersistentStepFailure``): a restart would meet the same fault, so the launcher does not
# restart the group. 78 is sysexits' EX_CONFIG, what such a fault usually is.
PERSISTENT_FAILURE_EXIT = 78


def _gave_up_line(error: BaseException) -> str:
    """The cause of a give-up in one line of at most ``ERROR_CHARS`` characters, the cause
    first: ``"{count} consecutive steps failed: {phase}: {Type}: {message}"`` from an
    ``ft.PersistentStepFailure``'s attributes (its message puts the cause after the count and
    the membership, where a cut would lose it), else the exception's own text."""
    count, phase, cause = (getattr(error, k, None) for k in ("count", "phase", "error"))
    if count and phase and cause:
        line = f"{count} consecutive steps failed: {phase}: {cause}"
    else:
        line = str(error) or type(error).__name__
    line = " ".join(line.split())
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


def exit_for_persistent_failure(who: str, error: BaseException) -> NoReturn:
    """Ends a worker whose Manager gave up on a fault that every retry met again: the cause
    goes to stderr and to the launcher (a ``gave_up`` record), then the process exits at once
    with :data:`PERSISTENT_FAILURE_EXIT`, which ft-launch does not restart."""
    emit("gave_up", error=_gave_up_line(error))
    traceback.print_exception(error)
    print(f"{who}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(PERSISTENT_FAILURE_EXIT)  # at once: no interpreter teardown (see above)


def exit_for_restart(who: str, error: BaseException) -> NoReturn:
    """Ends a worker that failed: the traceback and ``who: Type: message`` go to stderr, then
    the process exits at once with status 1. Under ft-launch the group is restarted as a
    whole; a process that lingered in interpreter teardown (joining threads, destroying
    process groups whose peers are gone) would only hold up that restart."""
    traceback.print_exception(error)
    print(f"{who}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # at once: no interpreter teardown (see above)


def parse_progress(line: str) -> Optional[Dict[str, Any]]:
    """The record in a progress line, or None for any other line (never raises)."""
    line = line.strip()
    if not line.startswith(PROGRESS_PREFIX.strip()):
        return None
    try:
        record = json.loads(line[len(PROGRESS_PREFIX.strip()) :])
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("event"), str):
        return None
    return record


def stop_requested() -> bool:
    """True once the launcher asked this run to stop (see module docstring)."""
    path = os.environ.get("FT_LAUNCH_STOP_FILE")
    return bool(path) and os.path.exists(path)


def take_injected_allreduce_failure() -> bool:
    """True (once) after the launcher asked this worker to fail its next allreduce."""
    if _injected.is_set():
        _injected.clear()
        return True
    return False


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            # The launcher died without reaping us: do not train on alone.
            os._exit(3)


def install_chaos_handlers() -> None:
    """SIGUSR1 -> fail the next allreduce; SIGUSR2 -> every thread's stack to stderr; exit when
    the launcher dies. Main thread only."""
    global _installed
    if _installed:
        return
    _installed = True
    signal.signal(signal.SIGUSR1, lambda *_: _injected.set())
    # Written by faulthandler from its own C handler: it works while the main thread is stuck
    # in C code (a collective, a lock) that a Python-level handler would wait behind.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    parent = _env_int("FT_LAUNCH_PARENT_PID", 0)
    if parent > 0 and os.getppid() == parent:
        threading.Thread(
            target=_watch_parent, args=(parent,), name="ft-launch-parent-watch", daemon=True
        ).start()
