"""torchft's record loggers: one record per new quorum (``torchft_quorums``), per commit
decision (``torchft_commits``) and per process group abort after an error
(``torchft_errors``), each with torchft's empty message and its extra fields (``job_id`` from
the ``JOB_ID`` environment variable, ``replica_id``, ``rank``, then ``quorum_id``/``step``,
``commit_result`` or ``error``). Handlers and exporters written for torchft's records
(``ft.otel.setup_logger``, which ``import ft`` calls for these three names as ``import
torchft`` does) receive the same records from ft. Stdlib only.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["QUORUMS", "COMMITS", "ERRORS", "NAMES", "record"]

QUORUMS = logging.getLogger("torchft_quorums")
COMMITS = logging.getLogger("torchft_commits")
ERRORS = logging.getLogger("torchft_errors")
NAMES = (QUORUMS.name, COMMITS.name, ERRORS.name)


def record(log: logging.Logger, **fields: Any) -> None:
    """One record on ``log`` with torchft's fields (``job_id`` first)."""
    if log.isEnabledFor(logging.INFO):
        log.info("", extra={"job_id": os.environ.get("JOB_ID", "unknown"), **fields})
