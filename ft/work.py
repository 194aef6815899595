"""Works that are complete from the start (torchft's ``torchft.work``).

torchft 0.2.0 exports one (private) name here, ``_DummyWork``; ft keeps the name so that code
written against torchft imports it unchanged.

Contract:
* ``_DummyWork(result)`` is a ``torch.distributed.Work`` that has already succeeded:
  ``wait()`` returns True at once, ``is_completed()`` and ``is_success()`` are True, and
  ``get_future()`` is an already completed future whose value is ``result`` (the same object,
  not a copy). It moves no data: it stands in for an op that was skipped (an errored Manager,
  an error-swallowing wrapper after its first error, a dummy process group).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

__all__: list = []  # nothing public, as in torchft


class _DummyWork(dist.Work):
    """A Work that has already completed with ``result``."""

    def __init__(self, result: object) -> None:
        super().__init__()
        self.result_ = result  # torchft's attribute name, kept for code that reads it
        self.future_: torch.futures.Future = torch.futures.Future()
        self.future_.set_result(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future_
