"""Says, at the default log level, why a replica has committed nothing for a long time
(docs/design.md, "Network faults").

A replica that cannot commit (a peer it cannot reach, a lighthouse that is gone, an address
that nobody can dial) otherwise waits silently. :class:`ProgressWatch` records what the Manager
is doing (the phase, the peer it waits on, the last error) and, once no step has committed for
longer than ``stall_after``, logs a warning naming them, again every ``stall_after`` while the
stall lasts. One daemon thread per Manager; it sleeps through healthy training.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

from ft.utils.deadline import Deadline

logger = logging.getLogger("ft.manager")

__all__ = ["ProgressWatch"]


class ProgressWatch:
    def __init__(self, stall_after: float, describe: Callable[[], str]) -> None:
        """``describe()`` adds the Manager's own context (replica, step, quorum)."""
        self._stall_after = max(stall_after, 0.1)
        self._describe = describe
        self._lock = threading.Lock()
        self._last_commit = time.monotonic()
        self._phase = "starting"
        self._peer = ""
        self._last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ft-progress-watch", daemon=True)
        self._thread.start()

    def phase(self, phase: str, peer: str = "") -> None:
        """The Manager now waits in ``phase`` (e.g. "quorum") on ``peer`` (an address)."""
        with self._lock:
            self._phase, self._peer = phase, peer

    def error(self, e: BaseException) -> None:
        with self._lock:
            self._last_error = f"{type(e).__name__}: {e}"

    def committed(self) -> None:
        with self._lock:
            self._last_commit = time.monotonic()
            self._last_error = None

    def report(self) -> Optional[str]:
        """The warning text if the replica is stalled now, else None."""
        with self._lock:
            idle = time.monotonic() - self._last_commit
            if idle < self._stall_after:
                return None
            peer = f" on {self._peer}" if self._peer else ""
            err = self._last_error or "none"
            return (
                f"no step committed for {idle:.1f}s (more than {self._stall_after:.1f}s): "
                f"waiting in {self._phase}{peer}; last error: {err}; {self._describe()}"
            )

    def _run(self) -> None:
        while not Deadline.after(self._stall_after).wait_event(self._stop):
            msg = self.report()
            if msg is not None:
                logger.warning("%s", msg)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
