"""The participant marks of a fault-tolerant ZeRO parameter exchange (docs/optim.md, "Errors
within a step"): who sent stepped shards, and the vote against an exchange that lacks some."""

from __future__ import annotations

from typing import List

import torch

from ft.protocols import ManagerLike

__all__ = ["missing_senders", "refuse_incomplete_exchange"]


def missing_senders(marks: torch.Tensor) -> List[int]:
    """The participants whose stepped shards an exchange lacks. Each participant that stepped
    its shards sets its own slot of the exchange's marks to 1 (SUM-allreduced with the
    parameters; every other contribution there is 0). A participant whose step failed where
    the group stays usable (``report_error``: a NaN loss it alone saw) still takes part in the
    exchange, so that no group waits for it, but sends zeros, its mark among them: a group
    that committed that exchange would take zeros for the failed participant's shards."""
    return [r for r, v in enumerate(marks.tolist()) if v != 1]


def refuse_incomplete_exchange(manager: ManagerLike, missing: List[int]) -> None:
    """Reports an error (the step commits nowhere) if ``missing`` names any participant."""
    if missing and manager.errored() is None:
        manager.report_error(
            RuntimeError(
                f"ZeRO parameter exchange: participant(s) {missing} sent no stepped shards "
                "(their step failed there); the step commits on no replica group"
            )
        )
