"""The Manager's structured log lines: logger ``ft.manager``, one line per quorum, heal, commit
decision and error, each starting with ``replica_id=... rank=... quorum_id=... step=...``; the
same fields (plus the event name) go on the record as ``record.ft`` for structured
handlers."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict

__all__ = ["StepLog", "logger"]

logger = logging.getLogger("ft.manager")


class StepLog:
    """Formats one replica's log lines; ``context()`` gives the fields every line starts
    with, read when the line is written."""

    def __init__(self, context: Callable[[], Dict[str, Any]]) -> None:
        self._context = context

    def _emit(
        self, level: int, event: str, msg: str, exc_info: bool = False, **fields: Any
    ) -> None:
        if not logger.isEnabledFor(level):
            return
        base = {"event": event, **self._context(), **fields}
        text = " ".join(f"{k}={v}" for k, v in base.items() if k != "event")
        logger.log(level, "%s %s: %s", event, text, msg, exc_info=exc_info, extra={"ft": base})

    def info(self, event: str, msg: str = "", **fields: Any) -> None:
        self._emit(logging.INFO, event, msg, **fields)

    def warning(self, event: str, msg: str = "", **fields: Any) -> None:
        self._emit(logging.WARNING, event, msg, **fields)

    def error(self, event: str, msg: str = "", exc_info: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, msg, exc_info=exc_info, **fields)
